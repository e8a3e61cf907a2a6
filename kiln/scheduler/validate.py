"""Request checks shared by the HTTP front and the scheduler: each names the parameter and the limit."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.sampling_params import InvalidParam, SamplingParams
from kiln.scheduler.io import PoolSpec


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_len: int
    max_total_tokens: int


def validate_request(input_ids: list[int], params: SamplingParams, limits: Limits) -> None:
    n = len(input_ids)
    if n == 0:
        raise InvalidParam("prompt", "the prompt is empty: send at least one token")
    bad = next((t for t in input_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidParam("prompt", f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    params.validate(limits.vocab_size)
    if params.logprob_start_len >= n:  # SGLang aborts it: "is higher than the number of input tokens"
        raise InvalidParam(
            "logprob_start_len",
            f"logprob_start_len={params.logprob_start_len} is not inside the {n}-token prompt: use -1 (no "
            f"prompt logprobs) or 0 .. {n - 1}",
        )
    if n >= limits.context_len:
        raise InvalidParam(
            "prompt",
            f"the prompt has {n} tokens; this model's context length is {limits.context_len} "
            f"(at most {limits.context_len - 1} prompt tokens)",
        )
    if n + params.max_new_tokens > limits.context_len:
        raise InvalidParam(
            "max_tokens",
            f"max_tokens={params.max_new_tokens} with a {n}-token prompt exceeds the context length "
            f"{limits.context_len}: use max_tokens <= {limits.context_len - n}",
        )
    if n >= limits.max_total_tokens:
        raise InvalidParam(
            "prompt",
            f"the prompt has {n} tokens but the KV pool holds {limits.max_total_tokens} tokens: "
            f"shorten the prompt or start the server with a larger --max-total-tokens / --mem-fraction-static",
        )
    if n + params.max_new_tokens > limits.max_total_tokens:
        raise InvalidParam(
            "max_tokens",
            f"the request needs {n} prompt + {params.max_new_tokens} new tokens = "
            f"{n + params.max_new_tokens} KV slots but the KV pool holds {limits.max_total_tokens} tokens: "
            f"use max_tokens <= {max(0, limits.max_total_tokens - n)} or start the server with a larger "
            f"--max-total-tokens / --mem-fraction-static",
        )


def validate_pool(pool: PoolSpec | None, params: SamplingParams, limits: Limits) -> None:
    """A pooled request (kiln.scheduler.pooling) computes its prompt and nothing more; its label ids index the
    vocabulary."""
    if pool is None:
        return
    if params.max_new_tokens != 0:
        raise InvalidParam("max_new_tokens", "a pooled request (an embedding, a score) generates no token")
    bad = next((t for t in pool.label_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidParam(
            "label_token_ids", f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})"
        )
