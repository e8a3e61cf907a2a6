"""Attention over the paged KV pool with torch's scaled_dot_product_attention (runs on every device). The rows it
gathers from the pool are converted to the queries' dtype (a bfloat16 or fp8 KV cache under float32 compute); a
fresh prompt attends to its own K and V as computed (the pool's rounding applies to what later steps read)."""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from kiln.core.forward_batch import AttentionMetadata, DistinctSlots, ForwardBatch, ForwardMode
from kiln.runner.attention.base import AttentionBackend

# fresh prompts of one batch share a padded SDPA call while padding adds at most this factor of work
MAX_PAD_FACTOR = 1.25

# a decode batch runs over its distinct KV slots (see distinct_slots) while they number at most this many times
# its longest sequence
SHARED_KV_FACTOR = 4


class TorchSdpaBackend(AttentionBackend):
    """Decode gathers each request's KV rows, or reads the batch's distinct slots once when requests share a
    prefix; extends run one SDPA call per request, fresh prompts of similar lengths together."""

    def prepare_metadata(self, fb: ForwardBatch) -> AttentionMetadata:
        if fb.mode != ForwardMode.DECODE or fb.kv_table.shape[0] == 1:
            return AttentionMetadata()
        if not fb.shared_kv and fb.kv_table.device.type != "cpu":
            # the distinct slots' count is read back to the host (a wait for the step before, which the overlap
            # schedule launches this one behind): on a GPU only where rows can share a prefix
            return AttentionMetadata()
        slots, inverse = torch.unique(fb.kv_table, return_inverse=True)
        entries = kv_entries(fb)
        return AttentionMetadata(
            distinct=distinct_slots(fb, slots, inverse, self.group),
            mostly_shared=2 * slots.numel() <= entries,
            repeated_entries=max(entries - slots.numel(), 0),
        )

    def decode(
        self, layer: int, q: torch.Tensor, fb: ForwardBatch, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if meta.distinct is not None:
            return self._decode_over_distinct(layer, q, meta.distinct, scale)
        kc, vc = self.kv_pool.gather_as(layer, fb.kv_table, q.dtype)  # [B, L, Hk, D]
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)  # [B, Hk, L, D]
        qb = q.unsqueeze(2)  # [B, Hq, 1, D]
        out = F.scaled_dot_product_attention(qb, kc, vc, attn_mask=fb.kv_mask, scale=scale, enable_gqa=True)
        return out.squeeze(2)

    def _decode_over_distinct(self, layer: int, q: torch.Tensor, distinct: DistinctSlots, scale: float):
        """One SDPA call for the whole batch over its distinct slots: rows are (kv head, request, group member),
        the mask keeps each request to its own slots. Shared rows are read once instead of once per request."""
        group = self.group
        k, v = self.kv_pool.gather_as(layer, distinct.slots, q.dtype)  # [U, Hk, D]
        b, hq, d = q.shape
        hk = hq // group
        qg = q.view(b, hk, group, d).transpose(0, 1).reshape(1, hk, b * group, d)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, Hk, U, D]
        o = F.scaled_dot_product_attention(
            qg, k, v, attn_mask=distinct.mask, scale=scale
        )  # [1, Hk, B * group, D]
        return o.view(hk, b, group, d).transpose(0, 1).reshape(b, hq, d)

    def extend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        lens, starts = fb.extend_lens, list(accumulate(fb.extend_lens, initial=0))
        if len(lens) == 1 and meta.short_extends is None:
            return self._one(layer, q, k, v, fb.prefix_lens[0], fb.seq_slots[0], scale)
        out = q.new_empty(q.shape)
        fresh = [i for i, prefix in enumerate(fb.prefix_lens) if prefix == 0]
        padded = len(fresh) * max((lens[i] for i in fresh), default=0)
        if len(fresh) < 2 or padded > MAX_PAD_FACTOR * sum(lens[i] for i in fresh):
            fresh = []
        if fresh:
            self._fresh_together(q, k, v, [(starts[i], lens[i]) for i in fresh], scale, out)
        done = set(fresh) | self._run_short_extends(layer, q, meta, scale, out)
        for i, (prefix, slots) in enumerate(zip(fb.prefix_lens, fb.seq_slots)):
            if i not in done:
                a, b = starts[i], starts[i + 1]
                out[a:b] = self._one(layer, q[a:b], k[a:b], v[a:b], prefix, slots, scale)
        return out

    def _run_short_extends(
        self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
    ) -> set[int]:
        """The requests of an extend batch this backend runs outside SDPA, their rows written to `out`: none."""
        return set()

    def _one(self, layer: int, q, k, v, prefix: int, slots: torch.Tensor, scale: float) -> torch.Tensor:
        """One request's extend: [T, Hq, D] -> [T, Hq, D], attending to its cached prefix, if any."""
        ext = q.shape[0]
        qi = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        if prefix == 0:
            ki, vi = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kc, vc = self.kv_pool.gather_as(layer, slots, q.dtype)  # [prefix + ext, Hk, D]
            ki, vi = (
                kc.transpose(0, 1).unsqueeze(0),
                vc.transpose(0, 1).unsqueeze(0),
            )  # [1, Hk, prefix + ext, D]
            rows = torch.arange(ext, device=q.device).unsqueeze(1) + prefix
            mask = torch.arange(prefix + ext, device=q.device).unsqueeze(0) <= rows
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


def distinct_slots(
    fb: ForwardBatch, slots: torch.Tensor, inverse: torch.Tensor, group: int
) -> DistinctSlots | None:
    """The batch's distinct slots (torch.unique of its table: `slots`, `inverse`) and the [1, 1, B * group, U]
    mask of which belong to which request, when requests share enough of their KV (a common prefix) that one
    call over the distinct slots is cheaper than gathering every request's rows: at most SHARED_KV_FACTOR x the
    longest sequence. None otherwise."""
    b, longest = fb.kv_table.shape
    if slots.numel() > SHARED_KV_FACTOR * longest:
        return None
    valid = (
        fb.kv_mask.view(b, longest)
        if fb.kv_mask is not None
        else torch.ones(b, longest, dtype=torch.bool, device=slots.device)
    )
    # padding entries all point at slot 0, never a real slot, and write False
    mask = torch.zeros(b, slots.numel(), dtype=torch.bool, device=slots.device).scatter_(1, inverse, valid)
    return DistinctSlots(slots, mask.repeat_interleave(group, dim=0).view(1, 1, b * group, -1))


def kv_entries(fb: ForwardBatch) -> int:
    """The KV entries a decode batch's rows read, all rows together (at least half of them slots another row also
    reads: the batch is mostly shared, a common prefix)."""
    return int(fb.kv_mask.sum()) if fb.kv_mask is not None else fb.kv_table.numel()
