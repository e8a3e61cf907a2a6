"""The work behind SGLang's (and vLLM's) utility routes: /v1/tokenize, /v1/detokenize, /health_generate,
/model_info and the SGLang half of /server_info. The routes themselves live in app.py."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from dataclasses import asdict
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from pydantic import Field

from kiln.config import ServerArgs
from kiln.loader.model_config import read_model_spec
from kiln.models.spec import ModelSpec
from kiln.sampling_params import MODEL_DEFAULT_FIELDS, InvalidParam, SamplingParams
from kiln.scheduler.io import EngineState, PoolSpec
from kiln.server.engine_client import EngineClient
from kiln.server.openai_api import OpenAIServing
from kiln.server.protocol import ChatMessage, _Strict
from kiln.server.tool_calls import template_messages
from kiln.text.tokenizer import apply_chat_template

# SGLang's HEALTH_CHECK_TIMEOUT: how long /health_generate waits for its token (or any other output)
HEALTH_CHECK_TIMEOUT = 20.0
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


class TokenizeRequest(_Strict):
    """/v1/tokenize's body: SGLang's (and vLLM's) fields; exactly one of prompt and messages."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # vLLM's: the tokens' strings beside their ids


class DetokenizeRequest(_Strict):
    """/v1/detokenize's body (SGLang's): one list of token ids, or a batch of them."""

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


def tokenize(serving: OpenAIServing, body: TokenizeRequest) -> dict:
    """{tokens, count, max_model_len} as SGLang answers: a list of prompts gives lists of both; messages are
    rendered by the chat template, as a chat completion's are."""
    serving.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidParam("prompt", "give exactly one of prompt and messages")
    tokenizer = serving.tokenizer
    for text in [body.prompt] if isinstance(body.prompt, str) else body.prompt or []:
        _check_utf8(text)  # a lone surrogate would fail inside the tokenizer
    if body.messages is not None:
        tokens: list[int] | list[list[int]] = _chat_tokens(tokenizer, body)
        count: int | list[int] = len(tokens)
    elif isinstance(body.prompt, str):
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        count = len(tokens)
    else:
        tokens = [tokenizer.encode(text, add_special_tokens=body.add_special_tokens) for text in body.prompt]
        count = [len(ids) for ids in tokens]
    answer: dict[str, Any] = {"tokens": tokens, "count": count, "max_model_len": _max_model_len(serving)}
    if body.return_token_strs:
        answer["token_strs"] = (
            tokenizer.convert_ids_to_tokens(tokens)
            if isinstance(count, int)
            else [tokenizer.convert_ids_to_tokens(ids) for ids in tokens]
        )
    return answer


def _chat_tokens(tokenizer, body: TokenizeRequest) -> list[int]:
    """The messages rendered by the chat template with the generation prompt, as a chat completion's prompt."""
    messages = template_messages(body.messages or [])  # rendered as a chat completion renders them
    for message in messages:
        _check_utf8(message["content"], "messages")
    try:
        return apply_chat_template(tokenizer, messages, **(body.chat_template_kwargs or {}))
    except (
        ValueError,
        TypeError,
        TemplateError,
    ) as e:  # the template's own refusal (raise_exception) included
        raise InvalidParam("messages", str(e)) from None


def _check_utf8(text: str, param: str = "prompt") -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParam(
            param, f"{param} is not valid UTF-8 text: {e.reason} at position {e.start}"
        ) from None


def _max_model_len(serving: OpenAIServing) -> int:
    """The tokenizer's model_max_length, as SGLang reports it; where the tokenizer sets none (its huge
    placeholder), the served context length."""
    declared = getattr(serving.tokenizer, "model_max_length", None)
    if isinstance(declared, int) and 0 < declared < 2**63:
        return declared
    return serving.limits.context_len


def detokenize(serving: OpenAIServing, body: DetokenizeRequest) -> dict:
    serving.check_model(body.model)
    batch = bool(body.tokens) and isinstance(body.tokens[0], list)
    lists: list[list[int]] = body.tokens if batch else [body.tokens]  # type: ignore[assignment, list-item]
    size = max(len(serving.tokenizer), serving.limits.vocab_size)
    for ids in lists:
        bad = next((t for t in ids if not 0 <= t < size), None)
        if bad is not None:
            raise InvalidParam("tokens", f"token id {bad} is outside the vocabulary (0 to {size - 1})")
    texts = [serving.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in lists]
    return {"text": texts if batch else texts[0]}


async def health_generate(
    client: EngineClient, timeout: float = HEALTH_CHECK_TIMEOUT, pool: PoolSpec | None = None
) -> bool:
    """SGLang's /health_generate: a one-token greedy generation (an embedding server's `pool`: one token's
    embedding); healthy when it gives its token, or when the engine sends any other output meanwhile (a busy engine
    shows it is alive without the probe's turn)."""
    start = time.time()
    probe = asyncio.ensure_future(_one_token(client, pool))
    try:
        while time.time() < start + timeout:
            done, _ = await asyncio.wait({probe}, timeout=0.05)
            if done:
                return probe.exception() is None and probe.result()
            if client.last_output_time > start:
                return True
        return False
    finally:
        probe.cancel()  # aborts the probe in the engine if it is still running


async def _one_token(client: EngineClient, pool: PoolSpec | None = None) -> bool:
    params = SamplingParams(max_new_tokens=0 if pool else 1, temperature=0.0)
    rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
    async for out in client.generate([0], params, rid=rid, observe=False, pool=pool):
        if out.error is not None:
            return False
        if out.new_ids or out.finished:
            return bool(out.new_ids) or out.embedding is not None
    return False


@lru_cache(maxsize=4)
def _model(model_path: str) -> ModelSpec | None:
    try:
        return read_model_spec(model_path)
    except (ValueError, OSError):
        return None


def default_sampling_params(defaults: dict[str, float]) -> dict[str, float]:
    """What a request that sends none of MODEL_DEFAULT_FIELDS samples with: the model's `defaults` over
    SamplingParams' own (OpenAI's)."""
    plain = SamplingParams()
    return {name: defaults.get(name, getattr(plain, name)) for name in MODEL_DEFAULT_FIELDS}


def model_info(
    args: ServerArgs,
    served_model_name: str,
    sampling_defaults: dict[str, float] | None = None,
    is_generation: bool = True,
) -> dict:
    """SGLang's /model_info fields, with Kiln's values; then Kiln's own: --sampling-defaults and the defaults it
    gives (SGLang reports neither; `sampling_defaults` are the model's, as the server read them at startup)."""
    model = _model(args.model_path) if args.model_path else None
    return {
        "model_path": args.model_path,
        "served_model_name": served_model_name,
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "is_generation": is_generation,  # False on an embedding server (--is-embedding)
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": getattr(args, "load_format", "auto"),
        "reasoning_parser": args.reasoning_parser,
        "tool_call_parser": args.tool_call_parser,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": model.model_type if model else None,
        "architectures": [model.architecture] if model else None,
        "sampling_defaults": args.sampling_defaults,
        "default_sampling_params": default_sampling_params(sampling_defaults or {}),
    }


def sglang_server_info(args: ServerArgs, engine: EngineState) -> dict:
    """SGLang's /server_info layout: every server argument at the top level, the scheduler's figures, one
    internal state per data-parallel rank (a Kiln server is one) and the version. Kiln's own fields are laid
    over it by the route, so where a name is in both, Kiln's value (the resolved one) is the answer."""
    info = engine.info
    gib = 1 << 30
    return {
        **asdict(args),
        "max_total_num_tokens": info.max_total_num_tokens,
        # resolved, as SGLang's ServerArgs resolves it before serving (None here only when the flag was not given)
        "mem_fraction_static": (info.ledger or {}).get("mem_fraction_static", args.mem_fraction_static),
        "max_req_input_len": min(info.context_len, info.max_total_num_tokens) - 1,
        "internal_states": [
            {
                "memory_usage": {
                    "weight": info.measured.get("weights", 0) / gib,
                    "kvcache": info.measured.get("kv_pool", 0) / gib,
                    "token_capacity": info.max_total_num_tokens,
                    "graph": 0,
                },
                # None without speculative decoding, as SGLang; `kiln bench` prints "Accept length" from it
                "avg_spec_accept_length": engine.stats.spec_accept_length
                if engine.stats.spec_verify_ct
                else None,
            }
        ],
        "version": kiln_version(),
    }


def kiln_version() -> str:
    """The root package's __version__: loaded before any module of the package, and above this layer, so
    read rather than imported."""
    return sys.modules["kiln"].__version__
