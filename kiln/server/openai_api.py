"""/v1/completions, /v1/chat/completions and /generate: turn bodies into engine requests, and engine outputs
into OpenAI-shaped JSON or SSE streams. A client that goes away aborts its requests."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable, Mapping
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from starlette.requests import ClientDisconnect

from kiln.sampling_params import InvalidParam, SamplingParams
from kiln.scheduler.fanout import FanOut, Sample, fan_out
from kiln.scheduler.io import OutputAccumulator, ReqOutput
from kiln.scheduler.validate import Limits, validate_request
from kiln.server.constraints import check_constraint, check_tool_parameters, response_format_schema
from kiln.server.engine_client import EngineClient
from kiln.server.lora_routes import LoraNames
from kiln.server.native import LogprobShape, logprob_starts, native_body
from kiln.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from kiln.server.responses import (
    QueueFull,
    completion_chars,
    echo_prefixes,
    finish_fields,
    logprobs_chat,
    logprobs_completion,
    stream_error_event,
    usage,
)
from kiln.server.sglang_fields import check_model_name
from kiln.server.tool_calls import ChatTools, ChoiceReader, template_messages
from kiln.text.tokenizer import apply_chat_template, chat_template_options, longest_token_bytes


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServing:
    def __init__(
        self,
        client: EngineClient,
        tokenizer,
        limits: Limits,
        model_name: str,
        request_timeout: float | None = None,
        max_in_flight: int | None = None,
        grammar_backend: str = "llguidance",
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        sampling_defaults: Mapping[str, float] | None = None,
    ):
        # what a request's unset temperature, top_p, ... take (--sampling-defaults; the model's, or none)
        self.sampling_defaults = dict(sampling_defaults or {})
        self.grammar_backend = grammar_backend
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.max_in_flight = max_in_flight
        self.client = client
        self.tokenizer = tokenizer
        self.limits = limits
        self.model_name = model_name
        self.request_timeout = request_timeout
        self.token_bytes = longest_token_bytes(tokenizer)
        self.lora = LoraNames(False)  # the adapters loaded, set by the launch when LoRA is served

    def check_model(self, name: str | None, lora_path: str | None = None) -> str | None:
        """The LoRA adapter a request names by its model ("BASE:ADAPTER") or lora_path, or None (the base)."""
        if self.lora.enabled:
            return self.lora.of_model(name, self.model_name, lora_path)
        check_model_name(name, self.model_name)
        return None

    # ------------------------------------------------------------------ building the plan
    def encode(self, text: str, param: str = "prompt") -> list[int]:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise InvalidParam(
                param, f"{param} is not valid UTF-8 text: {e.reason} at position {e.start}"
            ) from None
        self.refuse_beyond_context(size, param)
        return list(self.tokenizer.encode(text))

    def refuse_beyond_context(self, size: int, param: str) -> None:
        """Refuses a text of `size` UTF-8 bytes that cannot fit before tokenizing it: where no token of the
        tokenizer stands for more than `token_bytes` bytes, it has at least size / token_bytes tokens. Where
        the tokenizer gives no such bound, nothing is refused here (the token count decides, exactly)."""
        if self.token_bytes is None:
            return
        fits = min(self.limits.context_len, self.limits.max_total_tokens)
        least = -(-size // self.token_bytes)
        if least < fits:
            return
        where = (
            f"this model's context length is {self.limits.context_len}"
            if self.limits.context_len <= self.limits.max_total_tokens
            else f"the KV pool holds {self.limits.max_total_tokens} tokens"
        )
        raise InvalidParam(
            param,
            f"the prompt has at least {least} tokens ({size} bytes of text, and no token of this tokenizer "
            f"covers more than {self.token_bytes}); {where} (at most {fits - 1} prompt tokens)",
        )

    def _plan(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        default_max: int | None,
        rid: str | list[str] | None = None,
        batch_param: tuple[str, str] = ("prompt", "n"),
        logprob_starts: list[int] | None = None,
        loras: list[str | None] | None = None,
    ) -> FanOut:
        """Every prompt's own params (its own logprob_start_len where given), validated against the limits,
        fanned out into its n samples; refused when a client's request id is in use or the queue has no room for
        them all."""
        if not prompts:
            raise InvalidParam("prompt", "the prompt is empty: send at least one prompt")
        per_prompt = []
        for i, ids in enumerate(prompts):
            p = SamplingParams(**{**params.__dict__})
            if logprob_starts is not None:
                p.logprob_start_len = logprob_starts[i]
            if default_max is None:  # "as many as fit": the context or the pool, whichever is smaller
                p.max_new_tokens = max(
                    1, min(self.limits.context_len, self.limits.max_total_tokens) - len(ids)
                )
            validate_request(ids, p, self.limits)
            per_prompt.append(p)
        plan = fan_out(prompts, per_prompt, _client_rids(rid, sum(p.n for p in per_prompt)))
        for sample in plan.samples:
            if sample.rid is not None and sample.rid in self.client.queues:
                raise InvalidParam("rid", f"request id {sample.rid!r} is already in use")
        self.refuse_never_admitted(len(prompts), len(plan.samples), batch_param)
        active = self.client.num_active
        if self.max_in_flight is not None and active + len(plan.samples) > self.max_in_flight:
            raise QueueFull(active, self.max_in_flight)  # it fits once others finish: waiting helps
        return replace(plan, loras=tuple(loras)) if loras else plan

    def refuse_never_admitted(self, prompts: int, samples: int, batch_param: tuple[str, str]) -> None:
        """A request of more generations than the in-flight limit can never be admitted, however long its
        client waits: 400 naming both numbers, with the prompts (or n) as the parameter, never a 429. Checked
        again before tokenizing a batch of texts, so that a batch this large costs no tokenization."""
        if self.max_in_flight is not None and samples > self.max_in_flight:
            raise InvalidParam(
                batch_param[0] if prompts > 1 else batch_param[1],
                f"the request asks for {samples} generations ({prompts} prompts, n samples each) but this server "
                f"holds at most {self.max_in_flight} requests at once (--max-running-requests + "
                f"--max-queued-requests): send at most {self.max_in_flight}",
            )

    def _completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.encode(prompt)]
        if not prompt:
            raise InvalidParam("prompt", "the prompt is empty")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], str):
            return [self.encode(p) for p in prompt]
        return [list(p) for p in prompt]

    # ------------------------------------------------------------------ running the samples
    def request_deadline(self) -> float | None:
        return time.time() + self.request_timeout if self.request_timeout else None

    async def _warm_prefixes(self, plan: FanOut) -> None:
        for ids, lora in zip(plan.warm, plan.warm_loras()):
            await self.client.prefill_only(ids, lora)

    async def _run_all(self, plan: FanOut, raw: Request) -> list[OutputAccumulator]:
        """Runs every sample to the end; a client disconnect cancels (and so aborts) them all."""
        await self._warm_prefixes(plan)
        deadline = self.request_deadline()
        return await until_done(
            (
                self.client.collect(s.input_ids, s.params, s.rid, deadline, lora_path=plan.lora(s.index))
                for s in plan.samples
            ),
            raw,
        )

    async def _stream_all(self, plan: FanOut) -> AsyncIterator[tuple[int, ReqOutput]]:
        await self._warm_prefixes(plan)
        queue: asyncio.Queue = asyncio.Queue()
        deadline = self.request_deadline()

        async def pump(k: int, sample: Sample) -> None:
            async for out in self.client.generate(
                sample.input_ids, sample.params, True, sample.rid, deadline, lora_path=plan.lora(sample.index)
            ):
                queue.put_nowait((k, out))

        tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(plan.samples)]
        remaining = len(plan.samples)
        try:
            while remaining:
                k, out = await queue.get()
                self._raise_engine_error(out)  # ends the stream with an error event (see _sse)
                remaining -= out.finished
                yield k, out
        finally:
            for t in tasks:
                t.cancel()

    # ------------------------------------------------------------------ endpoints
    async def completions(self, req: CompletionRequest, raw: Request):
        lora = self.check_model(req.model, req.lora_path)
        if req.best_of not in (None, 1, req.n):
            raise InvalidParam("best_of", "best_of is not supported (only best_of == n)")
        if req.suffix is not None:
            raise InvalidParam(
                "suffix", "suffix (fill-in-the-middle) is not supported by Kiln: send a prompt only"
            )
        want_lp = req.logprobs is not None
        params = req.sampling_params(
            req.max_tokens if req.max_tokens is not None else 16,
            want_lp,
            req.logprobs or 0,
            self.sampling_defaults,
        )
        if req.echo and want_lp:  # the prompt's logprobs first, its first token's null (as OpenAI, SGLang)
            params.logprob_start_len = 0
        if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
            self.refuse_never_admitted(len(req.prompt), len(req.prompt) * params.n, ("prompt", "n"))
        prompts = self._completion_prompts(req.prompt)
        with req.own_names():
            max_tokens = req.max_tokens if req.max_tokens is not None else 16
            plan = self._plan(
                prompts, params, max_tokens, req.rid, loras=[lora] * len(prompts) if lora else None
            )
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        echoes = echo_prefixes(self.tokenizer, req.prompt, plan.samples) if req.echo else None
        if req.stream:
            return self._sse(self._completion_stream(plan, base, req, want_lp, echoes))
        results = await self._run_all(plan, raw)
        choices = self._final_choices(
            results,
            lambda text, lps, input_lps: {
                "text": text,
                "logprobs": logprobs_completion(self.tokenizer, input_lps + lps) if want_lp else None,
            },
        )
        for choice, echo in zip(choices, echoes or []):
            choice["text"] = echo + choice["text"]
        return JSONResponse(
            {**base, "choices": choices, "usage": usage(plan.samples, [r.output for r in results])}
        )

    async def _completion_stream(self, plan: FanOut, base, req, want_lp, echoes) -> AsyncIterator[str]:
        lasts, offsets = {}, {}
        async for k, out in self._stream_all(plan):
            text = out.text_delta if echoes is None or k in lasts else echoes[k] + out.text_delta
            lasts[k] = out
            # with echo, the prompt's logprobs come once, before the first output token's
            lps = (out.input_logprobs or []) + (out.logprobs or []) if want_lp else []
            logprobs = None
            if want_lp:
                logprobs = logprobs_completion(self.tokenizer, lps, offsets.get(k, 0))
                offsets[k] = offsets.get(k, 0) + completion_chars(self.tokenizer, lps)
            choice = {"index": k, "text": text, **finish_fields(out), "logprobs": logprobs}
            if text or out.finished or lps:
                yield sse({**base, "choices": [choice]})
        if req.stream_options and req.stream_options.include_usage:
            yield sse(
                {**base, "choices": [], "usage": usage(plan.samples, [lasts[k] for k in sorted(lasts)])}
            )
        yield "data: [DONE]\n\n"

    def _chat_prompt(self, req: ChatCompletionRequest, tools: ChatTools) -> list[int]:
        msgs = template_messages(req.messages)
        size = 0
        for i, m in enumerate(msgs):
            try:
                size += len(m["content"].encode("utf-8"))
            except UnicodeEncodeError as e:
                raise InvalidParam(f"messages.{i}.content", f"not valid UTF-8 text: {e.reason}") from None
        kwargs = tools.template_kwargs(req.chat_template_kwargs)
        # the field, or the same key in chat_template_kwargs (which wins, as every key there does)
        continue_final = bool(kwargs.pop("continue_final_message", req.continue_final_message))
        if continue_final and msgs[-1]["role"] != "assistant":
            raise InvalidParam(
                "continue_final_message",
                "continue_final_message continues the last message, which must be from the assistant "
                f"(it is from the {msgs[-1]['role']})",
            )
        try:
            if self.token_bytes is not None:
                self._refuse_rendered_beyond_context(msgs, size, kwargs, continue_final)
            return apply_chat_template(self.tokenizer, msgs, continue_final, **kwargs)
        except (ValueError, TemplateError) as e:  # the template's own refusal (raise_exception) included
            raise InvalidParam("messages", str(e)) from None
        except TypeError as e:  # a chat_template_kwargs key the call cannot take, or the template's own
            param = "chat_template_kwargs" if req.chat_template_kwargs else "messages"
            raise InvalidParam(param, str(e)) from None

    def _refuse_rendered_beyond_context(
        self, msgs: list[dict], size: int, kwargs: dict, continue_final: bool = False
    ) -> None:
        """The byte bound on the text the template renders (a template may drop or trim messages, so the
        messages' own bytes prove nothing); rendered only when the messages alone are long enough to matter."""
        fits = min(self.limits.context_len, self.limits.max_total_tokens)
        if -(-size // self.token_bytes) < fits:
            return
        if not getattr(self.tokenizer, "chat_template", None):
            return  # apply_chat_template refuses it with its own message
        options = chat_template_options(continue_final, **kwargs)
        text = self.tokenizer.apply_chat_template(msgs, **{**options, "tokenize": False})
        self.refuse_beyond_context(len(str(text).encode("utf-8")), "messages")

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        lora = self.check_model(req.model, req.lora_path)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise InvalidParam("top_logprobs", "top_logprobs needs logprobs: true")
        params = req.sampling_params(max_tokens or 1, req.logprobs, top, self.sampling_defaults)
        params.json_schema = response_format_schema(req.response_format) or params.json_schema
        check_tool_parameters(req.tools)
        tools = ChatTools.of(req, self.tool_call_parser, self.reasoning_parser)
        check_constraint(params, self.grammar_backend, tools.constrain(params))
        prompt = self._chat_prompt(req, tools)
        with req.own_names():
            plan = self._plan([prompt], params, max_tokens, req.rid, loras=[lora] if lora else None)
        readers = [tools.reader(self.tokenizer, prompt) for _ in plan.samples]
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            return self._sse(self._chat_stream(plan, base, req, readers))
        results = await self._run_all(plan, raw)
        choices = self._final_choices(
            results,
            lambda text, lps, _: {
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs_chat(self.tokenizer, lps) if req.logprobs else None,
            },
        )
        for reader, choice in zip(readers, choices):
            reader.rewrite_choice(choice)
        body = {
            **base,
            "object": "chat.completion",
            "choices": choices,
            "usage": usage(plan.samples, [r.output for r in results]),
        }
        return JSONResponse(body)

    async def _chat_stream(self, plan: FanOut, base, req, readers: list[ChoiceReader]) -> AsyncIterator[str]:
        base = {**base, "object": "chat.completion.chunk"}
        lasts = {}
        async for k, out in self._stream_all(plan):
            lasts[k] = out
            logprobs = logprobs_chat(self.tokenizer, out.logprobs or []) if req.logprobs else None
            finish = finish_fields(out)
            for choice in readers[k].chunk_choices(
                k, out.text_delta, out.finished, finish["finish_reason"], logprobs
            ):
                # only the finishing choice names the stop, and not once a tool call turned it into "tool_calls"
                # (as rewrite_choice does for the non-streamed choice)
                same = (
                    choice["finish_reason"] is not None and choice["finish_reason"] == finish["finish_reason"]
                )
                choice["matched_stop"] = finish["matched_stop"] if same else None
                yield sse({**base, "choices": [choice]})
        if req.stream_options and req.stream_options.include_usage:
            yield sse(
                {**base, "choices": [], "usage": usage(plan.samples, [lasts[k] for k in sorted(lasts)])}
            )
        yield "data: [DONE]\n\n"

    async def generate(self, req: GenerateRequest, raw: Request):
        if (req.text is None) == (req.input_ids is None):
            raise InvalidParam("text", "give exactly one of text or input_ids")
        single = isinstance(req.text, str) or (
            req.input_ids is not None and req.input_ids and isinstance(req.input_ids[0], int)
        )
        params = req.params(self.sampling_defaults)
        params.validate_constraint()  # at most one of json_schema / regex / ebnf
        check_constraint(params, self.grammar_backend)
        batch_param = ("text" if req.text is not None else "input_ids", "sampling_params.n")
        if req.text is not None:
            texts = [req.text] if isinstance(req.text, str) else req.text
            self.refuse_never_admitted(len(texts), len(texts) * params.n, batch_param)
            prompts = [self.encode(t, "text") for t in texts]
        else:
            prompts = [req.input_ids] if single else [list(p) for p in req.input_ids]
        starts = logprob_starts(req.logprob_start_len, prompts, req.return_logprob)
        shape = (
            LogprobShape(req.top_logprobs_num, req.return_text_in_logprobs) if req.return_logprob else None
        )
        loras = self.lora.per_prompt(req.lora_path, len(prompts))
        plan = self._plan(prompts, params, params.max_new_tokens, req.rid, batch_param, starts, loras)
        if req.stream:
            return self._sse(self._generate_stream(plan, shape))
        results = await self._run_all(plan, raw)
        bodies = []
        for result in results:
            self._raise_engine_error(result.output)
            bodies.append(self._native_body(result, shape))
        return JSONResponse(bodies[0] if single and len(bodies) == 1 else bodies)

    async def _generate_stream(self, plan: FanOut, shape: LogprobShape | None) -> AsyncIterator[str]:
        acc: dict[int, OutputAccumulator] = {}
        async for k, out in self._stream_all(plan):
            result = acc.setdefault(k, OutputAccumulator())
            result.add(out)
            body = self._native_body(result, shape)
            body["index"] = k
            yield sse(body)
        yield "data: [DONE]\n\n"

    def _final_choices(self, results: list[OutputAccumulator], body) -> list[dict]:
        """One choice per finished generation; `body(text, logprobs, prompt logprobs)` gives the endpoint's own
        fields."""
        choices = []
        for k, result in enumerate(results):
            last = result.output
            self._raise_engine_error(last)
            choices.append(
                {
                    "index": k,
                    **body(result.text, result.logprobs, result.input_logprobs),
                    **finish_fields(last),
                }
            )
        return choices

    def _native_body(self, result: OutputAccumulator, shape: LogprobShape | None) -> dict:
        """The native /generate body of one generation, from its outputs so far (SGLang's shape)."""
        return native_body(self.tokenizer, result, shape)

    @staticmethod
    def _raise_engine_error(last: ReqOutput) -> None:
        if last.error:
            raise EngineRequestError(last.error)

    @staticmethod
    def _sse(gen: AsyncGenerator[str, None]) -> StreamingResponse:
        return StreamingResponse(_error_event_on_failure(gen), media_type="text/event-stream")


class EngineRequestError(RuntimeError):
    """The engine failed this one request."""


async def _error_event_on_failure(gen: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """A stream whose request fails in the engine ends with an SSE error event, then [DONE], as SGLang's does."""
    try:
        async for chunk in gen:
            yield chunk
    except EngineRequestError as e:
        yield stream_error_event(str(e))
        yield "data: [DONE]\n\n"
    finally:
        await gen.aclose()  # at once, so that a client who leaves has its requests aborted at once


async def until_done(
    requests: Iterable[Awaitable[OutputAccumulator]], raw: Request
) -> list[OutputAccumulator]:
    """Every request run to its end; a client disconnect cancels (and so aborts) them all."""
    gather = asyncio.ensure_future(asyncio.gather(*requests))
    while not gather.done():
        done, _ = await asyncio.wait({gather}, timeout=0.25)
        if not done and await raw.is_disconnected():
            gather.cancel()
            gather.add_done_callback(_retrieve)  # its CancelledError is expected: never logged
            raise ClientDisconnect()  # answered quietly: a client that leaves is no server error
    return gather.result()


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _client_rids(rid: str | list[str] | None, count: int) -> list[str] | None:
    """A client's request id names its request (for /abort_request); several generations get -k suffixes."""
    if rid is None:
        return None
    rids = [rid] if isinstance(rid, str) else list(rid)
    if len(rids) == 1 and count > 1:
        rids = [f"{rids[0]}-{k}" for k in range(count)]
    return rids
