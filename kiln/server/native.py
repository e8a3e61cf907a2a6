"""The native /generate response in SGLang's shape (managers/tokenizer_manager.py): text, output_ids and
meta_info, with logprobs as [logprob, token id, token text or null] triples."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.sampling_params import InvalidParam
from kiln.scheduler.io import OutputAccumulator, TokenLogprob


@dataclass(frozen=True)
class LogprobShape:
    """What a /generate request asked of its logprobs."""

    top_logprobs_num: int = 0
    with_text: bool = False  # return_text_in_logprobs: each triple's third item is the token's text


def check_logprob_start(start: int | list[int] | None, prompts: list[list[int]]) -> None:
    """SGLang's logprob_start_len: -1 (its default) asks for the output's logprobs only; a start inside a prompt
    asks for that prompt's own logprobs from there, which Kiln's engine does not compute. A start at or past
    the prompt's end asks for none of it, as -1 does."""
    starts = start if isinstance(start, list) else [start] * len(prompts)
    if len(starts) != len(prompts):
        raise InvalidParam("logprob_start_len", f"give one logprob_start_len per prompt ({len(prompts)})")
    for value, ids in zip(starts, prompts):
        if value is not None and value != -1 and value < len(ids):
            raise InvalidParam(
                "logprob_start_len",
                f"logprob_start_len={value}: Kiln does not compute the logprobs of prompt tokens; send -1 (the "
                "default) for the generated tokens' logprobs",
            )


def _triple(tokenizer, logprob: float, token_id: int, with_text: bool) -> list:
    return [logprob, token_id, tokenizer.decode([token_id]) if with_text else None]


def logprob_fields(tokenizer, lps: list[TokenLogprob], shape: LogprobShape) -> dict:
    """meta_info's logprob fields, as SGLang sends them whenever return_logprob is set (the prompt's lists are
    empty: only the generated tokens' logprobs are computed)."""
    fields: dict = {
        "input_token_logprobs": [],
        "output_token_logprobs": [_triple(tokenizer, lp.logprob, lp.token_id, shape.with_text) for lp in lps],
    }
    if shape.top_logprobs_num > 0:
        fields["input_top_logprobs"] = []
        fields["output_top_logprobs"] = [
            [_triple(tokenizer, value, token_id, shape.with_text) for token_id, value in (lp.top or [])]
            for lp in lps
        ]
    return fields


def native_body(tokenizer, result: OutputAccumulator, shape: LogprobShape | None) -> dict:
    """The /generate body of one generation, from its outputs so far; `shape` None when no logprobs were
    asked."""
    last = result.output
    meta = {
        "id": last.rid,
        "finish_reason": last.finish_reason if last.finished else None,
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "cached_tokens": last.cached_tokens,
        "num_retractions": last.num_retractions,
        **last.spec_meta(),
    }
    if shape is not None:
        meta.update(logprob_fields(tokenizer, result.logprobs, shape))
    return {"text": result.text, "output_ids": result.ids, "meta_info": meta}
