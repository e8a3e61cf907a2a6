"""Attention over the paged KV pool with torch's scaled_dot_product_attention (runs on every device)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.memory.kv_pool import KVPool
from kiln.runner.forward_batch import ForwardBatch, ForwardMode


class TorchAttentionBackend:
    def __init__(self, kv_pool: KVPool):
        self.kv_pool = kv_pool

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

    def _decode(self, layer: int, q: torch.Tensor, fb: ForwardBatch, scale: float) -> torch.Tensor:
        kc = self.kv_pool.k[layer][fb.kv_table].transpose(1, 2)  # [B, Hk, L, D]
        vc = self.kv_pool.v[layer][fb.kv_table].transpose(1, 2)
        qb = q.unsqueeze(2)  # [B, Hq, 1, D]
        out = F.scaled_dot_product_attention(qb, kc, vc, attn_mask=fb.kv_mask, scale=scale, enable_gqa=True)
        return out.squeeze(2)

    def _extend(self, layer: int, q, k, v, fb: ForwardBatch, scale: float) -> torch.Tensor:
        outs = []
        start = 0
        for ext, pre, slots in zip(fb.extend_lens, fb.prefix_lens, fb.seq_slots):
            qi = q[start : start + ext].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
            if pre == 0:
                ki = k[start : start + ext].transpose(0, 1).unsqueeze(0)
                vi = v[start : start + ext].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:
                ki = self.kv_pool.k[layer][slots].transpose(0, 1).unsqueeze(0)  # [1, Hk, pre+ext, D]
                vi = self.kv_pool.v[layer][slots].transpose(0, 1).unsqueeze(0)
                rows = torch.arange(ext, device=q.device).unsqueeze(1) + pre
                mask = torch.arange(pre + ext, device=q.device).unsqueeze(0) <= rows
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
            outs.append(o.squeeze(0).transpose(0, 1))
            start += ext
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
