"""A prefill's pooled rows (kiln.scheduler.pooling plans them): each request's share of the normed hidden states the
model kept (ForwardBatch.hidden_index), reduced to one float32 vector: a row as it is (last-token and first-token
pooling), the sum of rows (mean pooling, summed over the prompt's chunks by the scheduler), or the log-softmax of
the row's logits at given token ids (label scores: the model's own head on one row, never [rows x vocab])."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowSpan:
    """Rows [start, start + count) of the kept hidden states; `reduce`: "row" | "sum" | "labels" (then over the
    one row, `label_ids`' logprobs)."""

    start: int
    count: int
    reduce: str
    label_ids: tuple[int, ...] = ()


def pool_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, spans: list[RowSpan]
) -> list[torch.Tensor]:
    """Each span's float32 vector, on the host."""
    out: list[torch.Tensor] = []
    for span in spans:
        rows = hidden[span.start : span.start + span.count]
        if span.reduce == "labels":
            logprobs = torch.log_softmax(compute_logits(rows[-1:]).float(), dim=-1)[0]
            vector = logprobs[torch.tensor(span.label_ids, dtype=torch.int64, device=logprobs.device)]
        elif span.reduce == "sum":
            vector = rows.float().sum(dim=0)  # float32 however many rows: a half-precision sum would overflow
        else:
            vector = rows[0].float()
        out.append(vector.cpu())
    return out
