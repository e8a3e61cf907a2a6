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


def logprob_starts(start: int | list[int] | None, prompts: list[list[int]], wanted: bool) -> list[int]:
    """Each prompt's logprob_start_len as SGLang's scheduler resolves it: without return_logprob (`wanted`), or at
    -1 (its default), the prompt's last token (whose logprob is null: only the output's are computed); a start
    inside the prompt asks for its logprobs from there. A start past the prompt is refused by the request checks
    (kiln.scheduler.validate), as SGLang aborts it; one below -1 by SamplingParams.validate."""
    starts = start if isinstance(start, list) else [start] * len(prompts)
    if len(starts) != len(prompts):
        raise InvalidParam("logprob_start_len", f"give one logprob_start_len per prompt ({len(prompts)})")
    return [
        len(ids) - 1 if not wanted or value is None or value == -1 else value
        for value, ids in zip(starts, prompts)
    ]


def _triple(tokenizer, logprob: float | None, token_id: int, with_text: bool) -> list:
    return [logprob, token_id, tokenizer.decode([token_id]) if with_text else None]


def _triples(tokenizer, lps: list[TokenLogprob], shape: LogprobShape) -> list[list]:
    return [_triple(tokenizer, lp.logprob, lp.token_id, shape.with_text) for lp in lps]


def _tops(tokenizer, lps: list[TokenLogprob], shape: LogprobShape) -> list[list[list] | None]:
    """Each token's top logprobs as triples; null for a prompt's first token, which nothing scores."""
    return [
        None
        if lp.logprob is None
        else [_triple(tokenizer, value, token_id, shape.with_text) for token_id, value in (lp.top or [])]
        for lp in lps
    ]


def logprob_fields(
    tokenizer, lps: list[TokenLogprob], shape: LogprobShape, input_lps: list[TokenLogprob] | None = None
) -> dict:
    """meta_info's logprob fields, as SGLang sends them whenever return_logprob is set: the prompt's from its
    logprob_start_len (the first one's logprob null), then the generated tokens'."""
    fields: dict = {
        "input_token_logprobs": _triples(tokenizer, input_lps or [], shape),
        "output_token_logprobs": _triples(tokenizer, lps, shape),
    }
    if shape.top_logprobs_num > 0:
        fields["input_top_logprobs"] = _tops(tokenizer, input_lps or [], shape)
        fields["output_top_logprobs"] = _tops(tokenizer, lps, shape)
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
        meta.update(logprob_fields(tokenizer, result.logprobs, shape, result.input_logprobs))
    return {"text": result.text, "output_ids": result.ids, "meta_info": meta}
