"""Attention over the paged KV pool with torch's scaled_dot_product_attention (runs on every device)."""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.layers.cpu_gemm import cpu_decode_attention, has_cpu_decode_attention
from kiln.memory.kv_pool import KVPool

# fresh prompts of one batch share a padded SDPA call while padding adds at most this factor of work
MAX_PAD_FACTOR = 1.25


_NO_MASK = torch.empty(0, dtype=torch.bool)  # the CPU decode kernel's "every slot is valid"

# an extend of at most this many tokens on a cached prefix runs through the CPU decode kernel, one row per token
MAX_KERNEL_EXTEND = 64

# a decode batch runs over its distinct KV slots (see _distinct_slots) while they number at most this many times
# its longest sequence
SHARED_KV_FACTOR = 4


class TorchAttentionBackend:
    def __init__(self, kv_pool: KVPool):
        self.kv_pool = kv_pool
        self.cpu_kernel = has_cpu_decode_attention(kv_pool.k[0]) if kv_pool.k else False

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, scale: float
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] for the new tokens. Returns [T, Hq * D]."""
        self.kv_pool.write(layer, fb.out_cache_loc, k, v)
        if fb.mode == ForwardMode.DECODE:
            out = self._decode(layer, q, fb, scale)
        else:
            out = self._extend(layer, q, k, v, fb, scale)
        return out.reshape(q.shape[0], -1)

    def _kernel_serves(self, q: torch.Tensor) -> bool:
        return self.cpu_kernel and q.dtype == torch.float32

    def _decode(self, layer: int, q: torch.Tensor, fb: ForwardBatch, scale: float) -> torch.Tensor:
        group = q.shape[1] // self.kv_pool.k[layer].shape[1]
        if self._kernel_serves(q):  # each request's slots read in the pool, no gathers
            if fb.shared_prefix is None:
                fb.shared_prefix = common_prefix(fb.kv_table, fb.kv_mask)
            mask = fb.kv_mask if fb.kv_mask is not None else _NO_MASK
            kernel = cpu_decode_attention()
            k, v = self.kv_pool.k[layer], self.kv_pool.v[layer]
            return kernel(q, k, v, fb.kv_table, mask, scale, fb.shared_prefix)
        if fb.shared_kv is None:
            fb.shared_kv = _distinct_slots(fb, group)
        if fb.shared_kv:
            return self._decode_over_distinct(layer, q, fb.shared_kv, group, scale)
        kc, vc = self.kv_pool.gather(layer, fb.kv_table)  # [B, L, Hk, D]
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)  # [B, Hk, L, D]
        qb = q.unsqueeze(2)  # [B, Hq, 1, D]
        out = F.scaled_dot_product_attention(qb, kc, vc, attn_mask=fb.kv_mask, scale=scale, enable_gqa=True)
        return out.squeeze(2)

    def _decode_over_distinct(self, layer: int, q, shared, group: int, scale: float) -> torch.Tensor:
        """One SDPA call for the whole batch over its distinct slots: rows are (kv head, request, group member),
        the mask keeps each request to its own slots. Shared rows are read once instead of once per request."""
        slots, mask = shared
        k, v = self.kv_pool.gather(layer, slots)  # [U, Hk, D]
        b, hq, d = q.shape
        hk = hq // group
        qg = q.view(b, hk, group, d).transpose(0, 1).reshape(1, hk, b * group, d)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, Hk, U, D]
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [1, Hk, B * group, D]
        return o.view(hk, b, group, d).transpose(0, 1).reshape(b, hq, d)

    def _extend(self, layer: int, q, k, v, fb: ForwardBatch, scale: float) -> torch.Tensor:
        lens, starts = fb.extend_lens, list(accumulate(fb.extend_lens, initial=0))
        kernel = self._kernel_serves(q)
        if len(lens) == 1 and not (kernel and _short_extend(fb.prefix_lens[0], lens[0])):
            return self._one(layer, q, k, v, fb.prefix_lens[0], fb.seq_slots[0], scale)
        out = q.new_empty(q.shape)
        fresh = [i for i, pre in enumerate(fb.prefix_lens) if pre == 0]
        padded = len(fresh) * max((lens[i] for i in fresh), default=0)
        if len(fresh) < 2 or padded > MAX_PAD_FACTOR * sum(lens[i] for i in fresh):
            fresh = []
        if fresh:
            self._fresh_together(q, k, v, [(starts[i], lens[i]) for i in fresh], scale, out)
        batched = set(fresh)
        if kernel:
            if fb.short_extends is None:
                fb.short_extends = _short_extends(fb, starts)
            if fb.short_extends:
                picked, rows, table, mask, shared = fb.short_extends
                k_pool, v_pool = self.kv_pool.k[layer], self.kv_pool.v[layer]
                out[rows] = cpu_decode_attention()(q[rows], k_pool, v_pool, table, mask, scale, shared)
                batched.update(picked)
        for i, (pre, slots) in enumerate(zip(fb.prefix_lens, fb.seq_slots)):
            if i not in batched:
                a, b = starts[i], starts[i + 1]
                out[a:b] = self._one(layer, q[a:b], k[a:b], v[a:b], pre, slots, scale)
        return out

    def _one(self, layer: int, q, k, v, pre: int, slots: torch.Tensor, scale: float) -> torch.Tensor:
        """One request's extend: [T, Hq, D] -> [T, Hq, D], attending to its cached prefix, if any."""
        ext = q.shape[0]
        qi = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        if pre == 0:
            ki, vi = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kc, vc = self.kv_pool.gather(layer, slots)  # [pre+ext, Hk, D]
            ki, vi = kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0)  # [1, Hk, pre+ext, D]
            rows = torch.arange(ext, device=q.device).unsqueeze(1) + pre
            mask = torch.arange(pre + ext, device=q.device).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    @staticmethod
    def _fresh_together(q, k, v, spans: list[tuple[int, int]], scale: float, out: torch.Tensor) -> None:
        """Prompts without a cached prefix as one causal SDPA call over a zero-padded batch: padding sits after
        each prompt's last token, so under the causal mask no real row ever attends to it."""
        longest = max(n for _, n in spans)

        def padded(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [N, H, longest, D]
            buf = x.new_zeros(len(spans), longest, *x.shape[1:])
            for j, (a, n) in enumerate(spans):
                buf[j, :n] = x[a : a + n]
            return buf.transpose(1, 2)

        o = F.scaled_dot_product_attention(
            padded(q), padded(k), padded(v), is_causal=True, scale=scale, enable_gqa=True
        ).transpose(1, 2)  # [N, longest, Hq, D]
        for j, (a, n) in enumerate(spans):
            out[a : a + n] = o[j, :n]


def _short_extend(prefix: int, extend: int) -> bool:
    """An extend the CPU kernel runs as decode rows: a few tokens on a cached prefix."""
    return prefix > 0 and extend <= MAX_KERNEL_EXTEND


def _short_extends(fb: ForwardBatch, starts: list[int]):
    """The batch's short extends (_short_extend) as decode rows for the CPU kernel, one row per new token holding
    the slots it attends to (its prefix, then its own extend up to itself): (their indices in the batch, their
    query rows, [R, L] table, mask, common prefix), or False when there are none. A few tokens on a long prefix, as
    each question after a shared system prompt: the prefix is read once per chunk of rows, not once per request."""
    picked = [i for i, pre in enumerate(fb.prefix_lens) if _short_extend(pre, fb.extend_lens[i])]
    if not picked:
        return False
    width = max(fb.prefix_lens[i] + fb.extend_lens[i] for i in picked)
    device = fb.seq_slots[picked[0]].device
    tables, masks, rows = [], [], []
    cols = torch.arange(width, device=device)
    for i in picked:
        pre, ext, slots = fb.prefix_lens[i], fb.extend_lens[i], fb.seq_slots[i]
        tables.append(F.pad(slots, (0, width - slots.numel())).expand(ext, width))
        masks.append(cols.unsqueeze(0) <= torch.arange(pre, pre + ext, device=device).unsqueeze(1))
        rows.append(torch.arange(starts[i], starts[i] + ext, device=device))
    table, mask = torch.cat(tables), torch.cat(masks)
    return picked, torch.cat(rows), table, mask, common_prefix(table, mask)


def common_prefix(table: torch.Tensor, mask: torch.Tensor | None, tile: int = 8) -> int:
    """How many leading columns of a [B, L] KV table are the same valid slots in every row (a prefix the requests
    share through the radix cache), rounded down to the CPU kernel's tile of 8 slots; 0 for one row, where there
    is nothing to share."""
    if table.shape[0] == 1:
        return 0
    same = (table == table[:1]).all(0)
    if mask is not None:
        same &= mask.view(table.shape).all(0)
    differ = (~same).nonzero()
    common = int(differ[0]) if differ.numel() else table.shape[1]
    return common // tile * tile


def _distinct_slots(fb: ForwardBatch, group: int) -> tuple[torch.Tensor, torch.Tensor] | bool:
    """The batch's distinct slots and the [1, 1, B * group, U] mask of which belong to which request, when
    requests share enough of their KV (a common prefix, n > 1) that one call over the distinct slots is cheaper
    than gathering every request's rows: at most SHARED_KV_FACTOR x the longest sequence."""
    b, longest = fb.kv_table.shape
    if b == 1:
        return False
    slots, inverse = torch.unique(fb.kv_table, return_inverse=True)
    if slots.numel() > SHARED_KV_FACTOR * longest:
        return False
    valid = (
        fb.kv_mask.view(b, longest)
        if fb.kv_mask is not None
        else torch.ones(b, longest, dtype=torch.bool, device=slots.device)
    )
    # padding entries all point at slot 0, never a real slot, and write False
    mask = torch.zeros(b, slots.numel(), dtype=torch.bool, device=slots.device).scatter_(1, inverse, valid)
    return slots, mask.repeat_interleave(group, dim=0).view(1, 1, b * group, -1)
