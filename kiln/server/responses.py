"""Pieces of OpenAI-shaped responses: finish reasons, usage, logprobs."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.scheduler.fanout import Sample
from kiln.scheduler.io import ReqOutput, TokenLogprob
from kiln.server.protocol import error_body
from kiln.server.token_bytes import token_bytes_for

logger = logging.getLogger("kiln")


class ModelNotFound(Exception):
    def __init__(self, asked: str, served: str):
        super().__init__(f"The model `{asked}` does not exist. This server serves `{served}`.")


class QueueFull(Exception):
    def __init__(self, active: int, limit: int, retry_after: int = 1):
        super().__init__(
            f"the request queue is full: {active} requests in flight, the limit is {limit} "
            f"(--max-running-requests + --max-queued-requests); retry after {retry_after} s"
        )
        self.retry_after = retry_after


class BodyTooLarge(Exception):
    """413: a request body beyond --max-request-bytes (declared or as read so far); reading stops there."""

    def __init__(self, size: int, limit: int, declared: bool):
        how = "declares" if declared else "runs past"
        super().__init__(
            f"the request body {how} {size} bytes; this server takes at most {limit} (--max-request-bytes)"
        )


class BodyReadTimeout(Exception):
    """408: the client did not send its whole body within --request-read-timeout."""

    def __init__(self, received: int, timeout: float):
        super().__init__(
            f"the request body did not arrive within {timeout:g} s (--request-read-timeout); "
            f"{received} bytes came"
        )


@dataclass
class ChoiceState:
    sent_role: bool = False


def finish_name(out: ReqOutput) -> str | None:
    if not out.finish_reason:
        return None
    return out.finish_reason["type"]


def finish_fields(out: ReqOutput) -> dict:
    """A choice's finish_reason and matched_stop (SGLang's: the stop string or token id that ended it), both
    null until the generation finishes: the non-streamed choices and every stream chunk's choice carry them."""
    if not out.finished:
        return {"finish_reason": None, "matched_stop": None}
    return {"finish_reason": finish_name(out), "matched_stop": (out.finish_reason or {}).get("matched")}


def usage(samples: Sequence[Sample], lasts: list[ReqOutput]) -> dict:
    """Each distinct prompt counts once, however many samples it had."""
    prompt, cached, seen = 0, 0, set()
    for sample, last in zip(samples, lasts):
        if sample.index not in seen:
            seen.add(sample.index)
            prompt += last.prompt_tokens
            cached += last.cached_tokens
    completion = sum(last.completion_tokens for last in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _piece(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _completion_token(tokenizer, token_id: int) -> str:
    """A legacy completions token as OpenAI spells it: its text, or, where its bytes are not UTF-8 on their own
    (part of a character), "bytes:" and the bytes as Python writes them (printable ASCII as is, others \\xNN,
    as OpenAI's "bytes:\\xe5"), so that such tokens stay distinct (as top_logprobs keys too) rather than all
    reading U+FFFD."""
    raw = bytes(token_bytes_for(tokenizer)(token_id))
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw)
    return _piece(tokenizer, token_id)


def _is_continuation(byte: int) -> bool:
    return byte & 0xC0 == 0x80


def _chars_started(raw: Sequence[int]) -> int:
    return sum(not _is_continuation(b) for b in raw)


def completion_chars(tokenizer, lps: Sequence[TokenLogprob]) -> int:
    """How many characters of the text the tokens start (a character split over tokens counts in the token
    holding its first byte): a stream's next chunk's text_offset starts there."""
    token_bytes = token_bytes_for(tokenizer)
    return sum(_chars_started(token_bytes(lp.token_id)) for lp in lps)


def logprobs_completion(tokenizer, lps: list[TokenLogprob], start: int = 0) -> dict:
    """Legacy completions' logprobs; a stream's chunk starts at `start`, the characters its earlier chunks'
    tokens started (completion_chars), so that its chunks' text_offset lists join into the whole response's.
    A token's text_offset is the character where its first byte lies: one that begins inside a character split
    over tokens gets that character's offset, never one past the text."""
    token_bytes = token_bytes_for(tokenizer)
    offsets, started = [], start
    for lp in lps:
        raw = token_bytes(lp.token_id)
        offsets.append(max(0, started - (1 if raw and _is_continuation(raw[0]) else 0)))
        started += _chars_started(raw)
    return {
        "tokens": [_completion_token(tokenizer, lp.token_id) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        # an echoed prompt's first token has neither a logprob nor top logprobs: null, as OpenAI sends them
        "top_logprobs": [
            None if lp.logprob is None else {_completion_token(tokenizer, t): v for t, v in (lp.top or [])}
            for lp in lps
        ],
        "text_offset": offsets,
    }


def logprobs_chat(tokenizer, lps: list[TokenLogprob]) -> dict:
    token_bytes = token_bytes_for(tokenizer)

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": _piece(tokenizer, token_id), "logprob": logprob, "bytes": token_bytes(token_id)}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in (lp.top or [])]}
            for lp in lps
        ]
    }


def stream_error_event(error: str) -> str:
    """The SSE event that ends a stream whose request failed in the engine: `data: {"error": {...}}`, which the
    OpenAI SDK's stream raises as an APIError (a stream that merely ended with finish_reason "abort" would read
    as a complete answer). The engine's own words go to the log under an error id, never to the client."""
    eid = uuid.uuid4().hex[:12]
    logger.error(f"request failed in the engine during its stream (error id {eid}): {error}")
    message = f"internal error while processing the request (error id {eid})"
    return f"data: {json.dumps(error_body(message, None, 'internal_error', 500))}\n\n"


def echo_prefixes(tokenizer, prompt: str | list, samples: Sequence[Sample]) -> list[str]:
    """/v1/completions' echo: each sample's prompt text, to go before its completion; a prompt given as token
    ids is decoded as SGLang decodes it (special tokens skipped)."""
    if isinstance(prompt, str):
        texts = [prompt]
    elif prompt and isinstance(prompt[0], int):
        texts = [tokenizer.decode(prompt, skip_special_tokens=True)]
    else:
        texts = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=True) for p in prompt]
    return [texts[sample.index] for sample in samples]
