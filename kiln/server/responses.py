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


def logprobs_completion(tokenizer, lps: list[TokenLogprob], start: int = 0) -> dict:
    """Legacy completions' logprobs; a stream's chunk starts at `start`, the length of the tokens' text before
    it, so that its chunks' text_offset lists join into the whole response's."""
    tokens, offsets, offset = [], [], start
    for lp in lps:
        piece = _piece(tokenizer, lp.token_id)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_piece(tokenizer, t): v for t, v in (lp.top or [])} for lp in lps],
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
