"""What one forward pass needs to know about its batch: token positions, KV slots, and the attention metadata
the attention backend works out once per step before the model runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum

import torch
import torch.nn.functional as F

from kiln.core.transfer import to_device


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


@dataclass(frozen=True)
class DistinctSlots:
    """A decode batch's distinct KV slots, for one SDPA call over them all: requests that share a prefix read its
    rows once instead of once each."""

    slots: torch.Tensor  # [U] int64, ascending
    mask: torch.Tensor  # [1, 1, B * group, U] bool: which slots each (request, query head of a group) reads


@dataclass(frozen=True)
class ShortExtends:
    """Short extends on cached prefixes run through the CPU decode kernel as decode rows: one row per new token,
    holding the slots it attends to (its prefix, then its own extend up to itself)."""

    picked: tuple[int, ...]  # their indices in the batch
    rows: torch.Tensor  # [R] int64: their query rows
    table: torch.Tensor  # [R, L] int64 KV slots per row, padded with slot 0
    mask: torch.Tensor  # [R, L] bool: the causal validity of each row's slots
    shared_prefix: int  # the table's leading columns every row shares, in whole tiles of the kernel


@dataclass(frozen=True)
class ExtendSpans:
    """An extend batch as flat tensors, for a kernel that runs every request in one launch (Triton): request r's
    new tokens are rows ext_start[r] .. + ext_lens[r] of the batch, its cached prefix the pool slots
    prefix_slots[prefix_start[r] .. + prefix_lens[r]]."""

    prefix_slots: torch.Tensor  # [sum of prefix lengths] int64
    prefix_start: torch.Tensor  # [R] int64
    prefix_lens: torch.Tensor  # [R] int64
    ext_start: torch.Tensor  # [R] int64
    ext_lens: torch.Tensor  # [R] int64
    max_ext: int


@dataclass(frozen=True)
class AttentionMetadata:
    """What every layer's attention reads about the batch. The attention backend builds it once per step
    (prepare_metadata) before graphs or the model run, so that no layer works it out again and captured steps
    can be given a static one (graph_metadata). Fields a backend does not use keep their defaults."""

    # DECODE: how many leading KV-table columns every request shares, rounded down to the CPU kernel's tile (0:
    # none); a one-element tensor inside a compiled CPU step, where it is an input that changes from step to step
    shared_prefix: int | torch.Tensor = 0
    # DECODE on torch SDPA: the batch's distinct slots when one call over them is cheaper than a gather per
    # request (None: gather each request's rows)
    distinct: DistinctSlots | None = None
    # DECODE on torch SDPA: at least half of the batch's KV entries are slots another request also reads; a
    # captured step that gathers each request's rows loses to the eager distinct-slot call there
    mostly_shared: bool = False
    # DECODE on torch SDPA: the KV entries beyond the batch's distinct slots (each one a row a per-request gather
    # copies again), which is what a captured step pays more than the distinct-slot call
    repeated_entries: int = 0
    # EXTEND on the CPU kernel: the batch's short extends on cached prefixes (None: there are none)
    short_extends: ShortExtends | None = None
    # DECODE on Triton: how many chunks each row's KV is cut into (split-K), fixed per captured shape
    kv_splits: int = 1
    # EXTEND on Triton: the batch's requests as flat tensors
    spans: ExtendSpans | None = None


@dataclass(frozen=True)
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 KV slots the new tokens are written to
    logits_index: torch.Tensor | None  # rows of the hidden states whose logits are wanted (None: all)
    # EXTEND: rows whose normed hidden states the model keeps (`prompt_hidden`) for prompt logprobs, whose logits
    # are computed afterwards a chunk at a time (None: none)
    hidden_index: torch.Tensor | None = None
    # EXTEND: per request, the extend length, the prefix length and the slots of the whole sequence
    extend_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    # EXTEND: each request's whole sequence as this prefill knows it (a chunk's request runs on past it), for the
    # layers that depend on it (LongRoPE's factors follow the sequence's length, not the chunk's)
    fill_lens: list[int] = field(default_factory=list)
    seq_slots: list[torch.Tensor] = field(default_factory=list)
    # DECODE: [B, L] slots of every sequence, padded with slot 0, and the [B, 1, 1, L] validity mask
    kv_table: torch.Tensor | None = None
    kv_mask: torch.Tensor | None = None
    # DECODE: whether rows may read the same KV slots (a cached prefix in common), as the scheduler knows it from the
    # radix tree without reading the table; False spares the attention backend looking for shared slots
    shared_kv: bool = True
    # both modes, hybrid models: [B] int64, each request's slot in the linear layers' state pool (its table row)
    state_slots: torch.Tensor | None = None
    # LoRA: [T] int64, each row's adapter slot (-1: the base model); None when no row has an adapter
    lora_slots: torch.Tensor | None = None
    # set by the model runner (AttentionBackend.prepare_metadata) once the batch is on its device
    attn: AttentionMetadata | None = None

    def to(self, device) -> ForwardBatch:
        """The batch with its tensors on `device` (the scheduler builds them on the host), copied without waiting
        for the device (kiln.core.transfer). Attention metadata is built on the device afterwards, so none is carried
        over."""

        def move(t):
            return to_device(t, device) if isinstance(t, torch.Tensor) else t

        return replace(
            self,
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            out_cache_loc=move(self.out_cache_loc),
            logits_index=move(self.logits_index),
            hidden_index=move(self.hidden_index),
            seq_slots=[move(t) for t in self.seq_slots],
            kv_table=move(self.kv_table),
            kv_mask=move(self.kv_mask),
            state_slots=move(self.state_slots),
            lora_slots=self.lora_slots,  # read on the host (kiln.layers.lora.LoraBatch.set_rows)
            attn=None,
        )

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens) if self.mode == ForwardMode.EXTEND else int(self.input_ids.shape[0])
