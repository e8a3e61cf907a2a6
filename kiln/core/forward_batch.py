"""What one forward pass needs to know about its batch: token positions, KV slots, attention layout."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Pieces:
    """A prefill run on shapes captured at a fixed token count: each layer's attention-free halves go through
    `before` / `after` on `padded` rows; attention sees only the batch's real rows."""

    before: Callable
    after: Callable
    padded: int

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """Rows (dim 0) padded with zeros up to `padded`."""
        return F.pad(t, (0, 0) * (t.dim() - 1) + (0, self.padded - t.shape[0]))


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill (possibly on top of a cached prefix, possibly one chunk)
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 KV slots the new tokens are written to
    logits_index: torch.Tensor | None  # rows of the hidden states whose logits are wanted (None: all)
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
    # DECODE on the CPU kernel: how many leading table columns every request shares (see attention.common_prefix);
    # a one-element tensor in a compiled step
    shared_prefix: int | torch.Tensor | None = None
    # EXTEND on the CPU kernel: short extends on cached prefixes as decode rows (see attention._short_extends)
    short_extends: tuple | bool | None = None

    def to(self, device) -> ForwardBatch:
        """The batch with its tensors on `device` (the scheduler builds them on the host)."""

        def move(t):
            return t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t

        return replace(
            self,
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            out_cache_loc=move(self.out_cache_loc),
            logits_index=move(self.logits_index),
            seq_slots=[move(t) for t in self.seq_slots],
            kv_table=move(self.kv_table),
            kv_mask=move(self.kv_mask),
        )

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens) if self.mode == ForwardMode.EXTEND else int(self.input_ids.shape[0])
