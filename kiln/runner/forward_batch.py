"""What one forward pass needs to know about its batch: token positions, KV slots, attention layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill (possibly on top of a cached prefix, possibly one chunk)
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 KV slots the new tokens are written to
    logits_index: torch.Tensor  # rows of the hidden states whose logits are wanted
    # EXTEND: per request, the extend length, the prefix length and the slots of the whole sequence
    extend_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    seq_slots: list[torch.Tensor] = field(default_factory=list)
    # DECODE: [B, L] slots of every sequence, padded with slot 0, and the [B, 1, 1, L] validity mask
    kv_table: torch.Tensor | None = None
    kv_mask: torch.Tensor | None = None
    # DECODE: the batch's distinct KV slots and a [1, 1, B * group, U] mask, or False when not worth it;
    # worked out by the attention backend at the first layer and reused by the others
    shared_kv: tuple[torch.Tensor, torch.Tensor] | bool | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens) if self.mode == ForwardMode.EXTEND else int(self.input_ids.shape[0])
