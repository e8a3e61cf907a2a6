"""Pooled outputs in the step cycle (a request's PoolSpec: embeddings under --is-embedding, label-token scores for
/v1/score and /v1/rerank), as prompt logprobs travel: a prefill plan names the rows each such request pools
(`pool_rows`), the forward keeps their normed hidden states (ForwardBatch.hidden_index, after the prompt-logprob
rows), `execute` reduces them (kiln.runner.pooling) and `update` records them on their requests; a request whose
prompt is now computed gets its result, which its one output carries. A prompt split over chunks pools each
chunk's rows in turn: the last token's row in the chunk that ends the prompt, the first token's in the first,
mean pooling every row (Req.prefix_limit keeps a cached prefix from covering any of them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.runner.pooling import RowSpan, pool_rows
from kiln.scheduler.req import Req

if TYPE_CHECKING:
    from kiln.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class PoolRows:
    """One request's pooled rows of a prefill: `index`, its place in the plan; `first`, the prompt position of the
    first row; `span`, the rows among the kept hidden states and how they reduce."""

    index: int
    first: int
    span: RowSpan


def plan_rows(reqs: list[Req], offset: int) -> tuple[list[int], tuple[PoolRows, ...]]:
    """The batch rows to keep for pooling and each request's share, for requests about to extend tokens
    [kv_len, kv_len + extend_len); `offset`: the kept rows before these (prompt logprobs')."""
    index: list[int] = []
    shares: list[PoolRows] = []
    row = 0
    for i, r in enumerate(reqs):
        spec, start, end = r.pool, r.kv_len, r.kv_len + r.extend_len
        if spec is not None:
            if spec.mode == "mean":
                first, count, reduce = start, r.extend_len, "sum"
            elif spec.mode == "cls":
                first, count, reduce = 0, int(start == 0), "row"
            else:  # last, labels: the prompt's last token, in the chunk that computes it
                first, count = len(r.input_ids) - 1, int(end >= len(r.input_ids))
                reduce = "labels" if spec.mode == "labels" else "row"
            if count:
                span = RowSpan(offset + len(index), count, reduce, spec.label_ids)
                index.extend(range(row + first - start, row + first - start + count))
                shares.append(PoolRows(i, first, span))
        row += r.extend_len
    return index, tuple(shares)


def compute(runner: ModelRunner, shares: tuple[PoolRows, ...]) -> tuple[torch.Tensor, ...]:
    """Each share's vector, from the forward just run."""
    if not shares:
        return ()
    if runner.prompt_hidden is None:
        raise RuntimeError(f"{type(runner.model).__name__} kept no hidden states to pool")
    with torch.inference_mode():
        return tuple(pool_rows(runner.model.compute_logits, runner.prompt_hidden, [s.span for s in shares]))


def record(reqs: tuple[Req, ...], shares: tuple[PoolRows, ...], vectors: tuple[torch.Tensor, ...]) -> None:
    """After a prefill step: each share's part on its request (a chunk computed again replaces its own); a request
    whose prompt is now computed gets its result (Req.embedding)."""
    for s, vector in zip(shares, vectors, strict=True):
        reqs[s.index].pool_parts[s.first] = vector
    for r in reqs:
        if r.pool is not None and r.embedding is None and r.kv_len >= len(r.input_ids):
            r.embedding = finish(r)


def finish(r: Req) -> list[float]:
    """The request's result from its parts: label logprobs as they are; an embedding averaged (mean pooling), cut
    to its `dimensions` and then normalised, as SGLang's Pooler does."""
    spec = r.pool
    assert spec is not None
    vector = torch.stack(list(r.pool_parts.values())).sum(dim=0)
    r.pool_parts = {}
    if spec.mode == "mean":
        vector = vector / len(r.input_ids)
    if spec.dimensions is not None:
        vector = vector[: spec.dimensions]
    if spec.normalize:
        vector = torch.nn.functional.normalize(vector, p=2, dim=0)
    return vector.tolist()
