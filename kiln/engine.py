"""The in-process engine: the same scheduler as the server, driven synchronously. For tests, benchmarks and
offline batches.

    eng = kiln.Engine(model_path=..., max_total_tokens=4096)
    eng.generate(["Hello"], {"max_new_tokens": 16, "temperature": 0})
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
import typing
import weakref
from collections.abc import Iterator
from typing import Any

from pydantic import TypeAdapter, ValidationError

from kiln.config import ServerArgs
from kiln.sampling_params import InvalidParam, SamplingParams
from kiln.scheduler.fanout import fan_out, prefill_only_params
from kiln.scheduler.io import AbortReq, GenerateReq, OutputAccumulator, embedding_spec
from kiln.scheduler.launch import build_engine
from kiln.scheduler.validate import validate_request

_ids = itertools.count()


def output_dict(result: OutputAccumulator, t0: float) -> dict:
    last, logprobs = result.output, result.logprobs
    meta: dict[str, Any] = {
        "id": last.rid,
        "finish_reason": last.finish_reason,
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "cached_tokens": last.cached_tokens,
        "num_retractions": last.num_retractions,
        "e2e_latency": time.time() - t0,
        **last.spec_meta(),
    }
    if logprobs:
        meta["output_token_logprobs"] = [(lp.logprob, lp.token_id) for lp in logprobs]
        meta["output_top_logprobs"] = [lp.top for lp in logprobs]
    if result.input_logprobs:  # sampling param logprob_start_len: the prompt's, the first one's logprob None
        meta["input_token_logprobs"] = [(lp.logprob, lp.token_id) for lp in result.input_logprobs]
        meta["input_top_logprobs"] = [lp.top for lp in result.input_logprobs]
    if last.error:
        meta["error"] = last.error
    if last.embedding is not None:  # a pooled request's (encode)
        meta["embedding"] = last.embedding
    # a copy: a stream's chunks must not all show the accumulator's latest ids
    return {"text": result.text, "output_ids": list(result.ids), "meta_info": meta}


def _encode_dict(out: dict, t0: float) -> dict:
    """SGLang's /encode body of one prompt from its generate-shaped output: the embedding and its meta_info."""
    meta = out["meta_info"]
    if meta.get("error"):
        raise RuntimeError(f"encoding failed in the engine: {meta['error']}")
    info = {k: meta[k] for k in ("id", "finish_reason", "prompt_tokens")}  # SGLang's embedding meta_info
    return {"embedding": meta["embedding"], "meta_info": {**info, "e2e_latency": time.time() - t0}}


class Engine:
    def __init__(self, **kwargs: Any):
        self.parts = build_engine(ServerArgs(**kwargs))
        self.scheduler = self.parts.scheduler
        self.tokenizer = self.parts.tokenizer
        # the stream not yet read to its end or closed; weak, so that one dropped unread is collected (and closed)
        self._open: weakref.ref[EngineStream] | None = None
        self._busy = False  # a call's requests are in the scheduler

    def _outputs(self, reqs: list[GenerateReq]) -> Iterator[tuple[str, OutputAccumulator]]:
        """Each output of `reqs` as it arrives, with its request's outputs so far. A caller that stops early (a
        stream closed before its end) aborts the requests still running, so their pages come back."""
        acc = {r.rid: OutputAccumulator() for r in reqs}
        pending = set(acc)
        for r in reqs:
            self.scheduler.add_request(r)
        try:
            while pending:
                outs = self.scheduler.step()
                if not outs and not self.scheduler.has_work:
                    break
                for o in outs:
                    acc[o.rid].add(o)
                    if o.finished:
                        pending.discard(o.rid)
                    yield o.rid, acc[o.rid]
        finally:
            for rid in pending:
                self.scheduler.abort(AbortReq(rid=rid, message="the caller closed the stream"))
            self.scheduler.drain()  # the overlap's step in flight: the extra rows of requests that already ended
            if pending:
                self.scheduler.take_outputs()  # the aborts' outputs: nobody is left to read them

    def _run(self, reqs: list[GenerateReq]) -> dict[str, dict]:
        t0 = time.time()
        return {rid: output_dict(r, t0) for rid, r in self._outputs(reqs) if r.output.finished}

    def _stream(self, warm: list[GenerateReq], reqs: list[GenerateReq], single: bool) -> Iterator[dict]:
        if warm:
            self._run(warm)
        index = {r.rid: k for k, r in enumerate(reqs)}
        t0 = time.time()
        with contextlib.closing(self._outputs(reqs)) as outputs:  # closed early, it aborts at once
            for rid, result in outputs:
                chunk = output_dict(result, t0)
                if not single:
                    chunk["index"] = index[rid]
                yield chunk

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        lora_path: str | list[str | None] | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """As SGLang's Engine.generate. With stream=True it checks the call at once and returns an iterator of
        chunks: each holds its generation's text and ids so far, and `index` (its place among the call's
        generations) when the call has more than one; closing the iterator early aborts what is still running."""
        self._check_ready()
        if self.parts.pooling is not None:
            raise InvalidParam("prompt", "this Engine runs an embedding model (is_embedding): use encode()")
        single, ids_list = self._prompt_ids(prompt, input_ids)
        sp = sampling_params or {}
        sps = sp if isinstance(sp, list) else [sp] * len(ids_list)
        params = [_sampling_params(p) for p in sps]
        for ids, p in zip(
            ids_list, params
        ):  # raised to the caller, as SGLang's Engine does, not an abort result
            validate_request(ids, p, self.scheduler.limits)
        loras = self._lora_paths(lora_path, len(ids_list))
        plan = fan_out(ids_list, params)
        warm_loras = [lora for lora, p in zip(loras, params) if p.n > 1]
        warm = [
            GenerateReq(f"warm-{next(_ids)}", ids, prefill_only_params(), lora_path=lora)
            for ids, lora in zip(plan.warm, warm_loras)
        ]
        groups = [
            [
                GenerateReq(
                    f"req-{next(_ids)}", list(s.input_ids), s.params, stream, lora_path=loras[s.index]
                )
                for s in g
            ]
            for g in plan.groups()
        ]
        reqs = [r for group in groups for r in group]
        if stream:
            opened = EngineStream(self, self._stream(warm, reqs, single and len(reqs) == 1))
            self._open = weakref.ref(opened)
            return opened
        self._busy = True
        try:
            if warm:
                self._run(warm)
            done = self._run(reqs)
        finally:
            self._busy = False
        results = [done[g[0].rid] if len(g) == 1 else [done[r.rid] for r in g] for g in groups]
        return results[0] if single else results

    def _lora_paths(self, lora_path: str | list[str | None] | None, prompts: int) -> list[str | None]:
        """Each prompt's adapter (None: the base model), each one checked to be loaded."""
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * prompts
        if len(loras) != prompts:
            raise InvalidParam("lora_path", f"got {len(loras)} lora_path entries for {prompts} prompts")
        for name in loras:
            problem = self.scheduler.lora_slots.name_problem(name) if name is not None else None
            if problem:
                raise InvalidParam("lora_path", problem)
        return loras

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """SGLang's Engine.load_lora_adapter: {success, error_message, loaded_adapters}."""
        return self._lora_control("load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._lora_control("unload_lora_adapter", {"lora_name": lora_name})

    def _lora_control(self, kind: str, args: dict) -> dict:
        ok, data = self.scheduler.lora_control(kind, args)
        listing = self.scheduler.lora_slots.listing()
        return {"success": ok, "error_message": data.get("error", ""), "loaded_adapters": listing}

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        dimensions: int | None = None,
    ) -> dict | list[dict]:
        """As SGLang's Engine.encode: each prompt's embedding, {"embedding": [...], "meta_info": {...}} (a list for
        a list of prompts), on an embedding model (is_embedding, or a sentence-transformers pooling config)."""
        self._check_ready()
        pooling = self.parts.pooling
        if pooling is None:
            raise InvalidParam(
                "prompt", "this Engine runs a generation model: start it with is_embedding=True"
            )
        single, ids_list = self._prompt_ids(prompt, input_ids)
        pool = embedding_spec(pooling, dimensions, self.parts.model_config.hidden_size)
        params = SamplingParams(max_new_tokens=0)
        for ids in ids_list:
            validate_request(ids, params, self.scheduler.limits)
        reqs = [GenerateReq(f"embd-{next(_ids)}", list(ids), params, pool=pool) for ids in ids_list]
        self._busy = True
        try:
            t0, done = time.time(), self._run(reqs)
        finally:
            self._busy = False
        results = [_encode_dict(done[r.rid], t0) for r in reqs]
        return results[0] if single else results

    def _prompt_ids(
        self, prompt: str | list[str] | None, input_ids: list[int] | list[list[int]] | None
    ) -> tuple[bool, list[list[int]]]:
        """Whether the call names one prompt, and each prompt's token ids (texts tokenized)."""
        single = isinstance(prompt, str) or (bool(input_ids) and isinstance(input_ids[0], int))
        if prompt is not None:
            ids_list = [self.tokenizer.encode(p) for p in ([prompt] if isinstance(prompt, str) else prompt)]
        else:
            ids_list = [input_ids] if single else list(input_ids or [])
        if not ids_list:  # as SGLang's Engine: a call without a prompt is an error, not an empty answer
            raise InvalidParam("prompt", "either a prompt or input_ids should be given")
        return single, ids_list

    def _check_ready(self) -> None:
        if self.scheduler is None:
            raise RuntimeError("this kiln.Engine is shut down: create another")
        if self._busy:  # one scheduler, stepped by whoever reads: two readers would take each other's outputs
            raise RuntimeError("this kiln.Engine has a stream open: read it to its end or close() it first")

    def _close_stream(self) -> None:
        opened = self._open() if self._open is not None else None
        if opened is not None:
            opened.close()  # which aborts its requests; its reader sees the stream end

    def abort_all(self) -> None:
        self._close_stream()
        self.scheduler.abort(AbortReq(abort_all=True))
        self.scheduler.step()

    def check_integrity(self) -> dict:
        return self.scheduler.check_integrity()

    def shutdown(self) -> None:
        self._close_stream()
        if self.scheduler is not None:
            self.scheduler.close()  # the step in flight and the forward thread (overlap)
        self.scheduler = None  # type: ignore[assignment]


class EngineStream:
    """generate(stream=True)'s iterator. It holds the Engine from the call on, so that a second call is refused
    even before this one's first chunk is read, and lets go when read to its end or closed (closing aborts what
    still runs, as does dropping it)."""

    def __init__(self, engine: Engine, chunks: Iterator[dict]):
        self.engine, self.chunks = engine, chunks
        engine._busy = True

    def __iter__(self) -> EngineStream:
        return self

    def __next__(self) -> dict:
        if self.chunks is None:
            raise StopIteration
        try:
            return next(self.chunks)
        except BaseException:  # its end, or a failure inside the step: either way the Engine is free again
            self.close()
            raise

    def close(self) -> None:
        if self.chunks is None:
            return
        chunks, self.chunks = self.chunks, None
        try:
            chunks.close()
        finally:
            self.engine._busy = False
            self.engine._open = None

    def __del__(self) -> None:
        self.close()


# what SamplingParams takes besides its own types (normalize() turns them into those)
_ALSO_ACCEPTED = {"stop": str | list[str] | None, "stop_token_ids": list[int] | None}


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(SamplingParams)


@functools.cache
def _field_type(name: str) -> TypeAdapter:
    return TypeAdapter(_ALSO_ACCEPTED.get(name) or _field_types()[name])


def _sampling_params(given: dict) -> SamplingParams:
    """A request's sampling params; a key SamplingParams does not have, or a value not of its type, is refused by
    its name (as /generate's 400 names it), never left to fail inside a comparison."""
    unknown = sorted(set(given) - set(_field_types()))
    if unknown:
        raise InvalidParam(unknown[0], f"{unknown[0]!r} is not a sampling parameter")
    values = {}
    for key, value in given.items():
        try:
            values[key] = _field_type(key).validate_python(value)
        except ValidationError as e:
            raise InvalidParam(key, f"{key!r}: {e.errors()[0]['msg']}") from None
    return SamplingParams(**values).normalize()
