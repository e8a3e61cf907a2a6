"""Attention through Kiln's CPU float32 decode kernel (kiln.layers.cpu_gemm.cpu_decode_attention), which reads
each request's slots straight from the KV pool, no gathers, and a prefix the batch shares once per chunk of
requests; a bfloat16, float16 or fp8 pool is read at its own width, converted in registers. Decode runs on it
entirely, a sliding window's too (as its mask); extends run short extends on cached prefixes on it as decode rows
and the rest through torch SDPA. Softcapped layers and windowed extends run through kiln.runner.attention.windowed."""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from kiln.core.forward_batch import AttentionMetadata, ForwardBatch, ForwardMode, ShortExtends
from kiln.layers.cpu_gemm import cpu_decode_attention, cpu_decode_attention_sinks
from kiln.runner.attention import windowed
from kiln.runner.attention.torch_sdpa import TorchSdpaBackend

_NO_MASK = torch.empty(0, dtype=torch.bool)  # the CPU decode kernel's "every slot is valid"

# an extend of at most this many tokens on a cached prefix runs through the CPU decode kernel, one row per token
MAX_KERNEL_EXTEND = 64

# the kernel walks KV slots in tiles of this many; a shared prefix is read once per chunk in whole tiles
KERNEL_TILE = 8


class CpuKernelBackend(TorchSdpaBackend):
    reads_shared_prefix_once = True
    runs_short_extends = True

    def prepare_metadata(self, fb: ForwardBatch) -> AttentionMetadata:
        if fb.mode == ForwardMode.DECODE:
            return AttentionMetadata(shared_prefix=common_prefix(fb.kv_table, fb.kv_mask))
        return AttentionMetadata(short_extends=short_extends(fb))

    def decode(
        self, layer: int, q: torch.Tensor, fb: ForwardBatch, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        mask = fb.kv_mask if fb.kv_mask is not None else _NO_MASK
        k, v = self.kv_pool.k[layer], self.kv_pool.v[layer]
        return cpu_decode_attention()(q, k, v, fb.kv_table, mask, scale, meta.shared_prefix)

    def decode_windowed(
        self,
        layer: int,
        q: torch.Tensor,
        fb: ForwardBatch,
        scale: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A window is the kernel's mask narrowed to each row's last `window` slots (no prefix is then shared by
        every row); sinks are the kernel's too, eagerly (a compiled step takes them in torch ops); softcapped scores
        the kernel does not compute."""
        compiling = torch.compiler.is_compiling()
        if softcap is not None or (sinks is not None and compiling):
            return super().decode_windowed(layer, q, fb, scale, window, softcap, sinks)
        k, v = self.kv_pool.k[layer], self.kv_pool.v[layer]
        mask = windowed.decode_mask(fb, window)
        if sinks is not None:
            return cpu_decode_attention_sinks(q, k, v, fb.kv_table, mask, scale, sinks)
        # the compiled op takes the shared width as a tensor (an input of the step elsewhere)
        none_shared = torch.zeros(1, dtype=torch.int64) if compiling else 0
        return cpu_decode_attention()(q, k, v, fb.kv_table, mask, scale, none_shared)

    def _run_short_extends(
        self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
    ) -> set[int]:
        short = meta.short_extends
        if short is None:
            return set()
        k, v = self.kv_pool.k[layer], self.kv_pool.v[layer]
        rows = short.rows
        out[rows] = cpu_decode_attention()(q[rows], k, v, short.table, short.mask, scale, short.shared_prefix)
        return set(short.picked)


def is_short_extend(prefix: int, extend: int) -> bool:
    """An extend the CPU kernel runs as decode rows: a few tokens on a cached prefix."""
    return prefix > 0 and extend <= MAX_KERNEL_EXTEND


def short_extends(fb: ForwardBatch) -> ShortExtends | None:
    """The batch's short extends (is_short_extend) as decode rows for the CPU kernel, or None when there are none.
    A few tokens on a long prefix, as each question after a shared system prompt: the prefix is read once per
    chunk of rows, not once per request."""
    picked = [i for i, prefix in enumerate(fb.prefix_lens) if is_short_extend(prefix, fb.extend_lens[i])]
    if not picked:
        return None
    starts = list(accumulate(fb.extend_lens, initial=0))
    width = max(fb.prefix_lens[i] + fb.extend_lens[i] for i in picked)
    device = fb.seq_slots[picked[0]].device
    tables, masks, rows = [], [], []
    cols = torch.arange(width, device=device)
    for i in picked:
        prefix, ext, slots = fb.prefix_lens[i], fb.extend_lens[i], fb.seq_slots[i]
        tables.append(F.pad(slots, (0, width - slots.numel())).expand(ext, width))
        masks.append(cols.unsqueeze(0) <= torch.arange(prefix, prefix + ext, device=device).unsqueeze(1))
        rows.append(torch.arange(starts[i], starts[i] + ext, device=device))
    table, mask = torch.cat(tables), torch.cat(masks)
    return ShortExtends(tuple(picked), torch.cat(rows), table, mask, common_prefix(table, mask))


def common_prefix(table: torch.Tensor, mask: torch.Tensor | None, tile: int = KERNEL_TILE) -> int:
    """How many leading columns of a [B, L] KV table are the same valid slots in every row (a prefix the requests
    share through the radix cache), rounded down to the CPU kernel's tile; 0 for one row, where there is nothing
    to share."""
    if table.shape[0] == 1:
        return 0
    same = (table == table[:1]).all(0)
    if mask is not None:
        same &= mask.view(table.shape).all(0)
    differ = (~same).nonzero()
    common = int(differ[0]) if differ.numel() else table.shape[1]
    return common // tile * tile
