"""Prompt logprobs in the step cycle (SGLang's input logprobs, from logprob_start_len): a prefill plan names the
rows that score prompt tokens (`prompt_rows`, each row of position p scoring token p + 1), the forward keeps their
hidden states (ForwardBatch.hidden_index), `execute` scores them into the StepResult, and `update` records them
on their requests. A prompt split over prefill chunks gets each chunk's rows in turn; a prefix-cache hit never
covers the scored part (Req.prefix_limit), so every scored row is computed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.scheduler.io import TokenLogprob
from kiln.scheduler.req import Req

if TYPE_CHECKING:
    from kiln.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class PromptRows:
    """One request's rows of a prefill that score its prompt: `index`, its place in the plan; `first`, the position
    of the first prompt token they score; `targets`, the tokens scored, one a row in order; `top_n`, how many top
    logprobs it asked for."""

    index: int
    first: int
    targets: tuple[int, ...]
    top_n: int


def plan_rows(reqs: list[Req]) -> tuple[list[int], tuple[PromptRows, ...]]:
    """The batch rows to keep (ForwardBatch.hidden_index) and each request's share, for requests about to extend
    tokens [kv_len, kv_len + extend_len): the rows of positions from their start to the prompt's last but one (the
    last one's logits give the first output token, as for any request)."""
    index: list[int] = []
    shares: list[PromptRows] = []
    row = 0
    for i, r in enumerate(reqs):
        start = r.prompt_logprob_start
        if start is not None:
            first, end = max(start, r.kv_len), min(r.kv_len + r.extend_len, len(r.input_ids) - 1)
            if end > first:
                index.extend(range(row + first - r.kv_len, row + end - r.kv_len))
                targets = tuple(r.input_ids[first + 1 : end + 1])
                shares.append(PromptRows(i, first + 1, targets, r.params.top_logprobs_num))
        row += r.extend_len
    return index, tuple(shares)


def score(runner: ModelRunner, shares: tuple[PromptRows, ...]) -> tuple[list[TokenLogprob], ...]:
    """Each share's scored tokens, from the forward just run (top logprobs None where none were asked, as the
    sampler's)."""
    if not shares:
        return ()
    targets = torch.tensor([t for s in shares for t in s.targets], dtype=torch.int64)
    scores = runner.score_prompt(targets, max(s.top_n for s in shares))
    out, k = [], 0
    for s in shares:
        out.append(
            [
                TokenLogprob(t, scores.logprobs[k + j], scores.top[k + j][: s.top_n] if s.top_n else None)
                for j, t in enumerate(s.targets)
            ]
        )
        k += len(s.targets)
    return tuple(out)


def record(
    reqs: tuple[Req, ...], shares: tuple[PromptRows, ...], scored: tuple[list[TokenLogprob], ...]
) -> None:
    """After a prefill step: each share's tokens in their places of its request's list; a request whose prompt is
    now computed gets the whole list to send, SGLang's shape: its start token first, with a null logprob (SGLang
    scores from the token after the start, whose row is the first one computed)."""
    for s, entries in zip(shares, scored, strict=True):
        r = reqs[s.index]
        offset = s.first - r.params.logprob_start_len - 1  # the list holds the tokens after the start
        r.input_logprobs[offset:] = (
            entries  # a chunk computed again (after a failed admission) replaces its own
        )
    for r in reqs:
        start = r.prompt_logprob_start
        if start is not None and r.kv_len >= len(r.input_ids):
            r.pending_input_logprobs = [TokenLogprob(r.input_ids[start], None), *r.input_logprobs]
            r.input_logprobs, r.input_logprobs_done = [], True
