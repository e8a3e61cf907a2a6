"""Prompt logprobs (SGLang's input logprobs): the log-softmax of a prefill's kept rows' logits
(ForwardBatch.hidden_index) at each row's target, the prompt's next token, with the row's top ids. The logits are
computed a chunk of rows at a time, so that a long prompt never holds [tokens x vocab] float32 logits at once (a
32k-token prompt of a 150k vocabulary would be 19 GiB); they are raw, as the sampler's logprobs are (no temperature,
no penalties)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.core.graph_shapes import PROMPT_LOGPROB_ROWS as CHUNK_ROWS  # the ledger reserves for it


@dataclass(frozen=True)
class RowScores:
    """Per kept row: its target's logprob, and its top `top_n` (token id, logprob), best first."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]


def score_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    top_n: int,
    chunk: int = CHUNK_ROWS,
) -> RowScores:
    """`hidden` [R, width] normed hidden states, `targets` [R] token ids; `compute_logits` the model's head. The
    results come back in one float64 tensor (ids and float32 logprobs are exact there): one host sync."""
    targets = targets.to(hidden.device)
    parts: list[torch.Tensor] = []
    for start in range(0, hidden.shape[0], chunk):
        lp = torch.log_softmax(compute_logits(hidden[start : start + chunk]).float(), dim=-1)
        picked = lp.gather(1, targets[start : start + chunk].unsqueeze(-1)).double()
        if top_n > 0:
            values, ids = lp.topk(top_n, dim=-1)
            picked = torch.cat([picked, ids.double(), values.double()], dim=1)
        parts.append(picked)
    rows = torch.cat(parts).tolist() if parts else []
    top = [[(int(i), v) for i, v in zip(row[1 : 1 + top_n], row[1 + top_n :], strict=True)] for row in rows]
    return RowScores([row[0] for row in rows], top)
