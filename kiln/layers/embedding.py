"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size
from kiln.layers.cpu_gemm import linear, prepack
from kiln.layers.quant_rows import keep_rows, pop_rows


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.per_rank = (vocab_size + tp_size() - 1) // tp_size()
        self.start = tp_rank() * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = max(0, min(self.per_rank, loaded.shape[0] - self.start))
        param.data[:rows].copy_(loaded[self.start : self.start + rows])
        param.data[rows:].zero_()
        keep_rows(param, loaded, 0, self.start, rows)  # a tied LM head reads these blocks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0.0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding (`tied`)."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__(vocab_size, hidden)
        self.tied = False
        self.packed_weight: nn.Parameter | None = None
        self.packed = False

    def prepack_weights(self) -> bool:
        """Untied: the weight is swapped for its prepacked layout. Tied: the embedding still needs plain rows,
        so the packed layout is a second copy (the ledger's "packed lm head" line), quantized when the weight
        came from GGUF Q8_0 / Q4_1 blocks (multiplied in float32: kiln.layers.cpu_gemm.prepack says why)."""
        packed = prepack(self.weight, pop_rows(self.weight), head=True)
        if packed is None:
            return False
        if self.tied:
            self.packed_weight = nn.Parameter(packed, requires_grad=False)
        else:
            self.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = True
        return True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        weight = self.weight if self.packed_weight is None else self.packed_weight
        logits = linear(hidden, weight, None, self.packed)
        return all_gather_last_dim(logits)[..., : self.vocab_size]
