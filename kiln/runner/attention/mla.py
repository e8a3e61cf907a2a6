"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over the latent KV pool.

The pool holds one row per token: the compressed KV latent and the rotated rope key every head shares. Decode
runs in the absorbed form, as SGLang's MLA decode: each head's no-rope query goes through the key half of the
layer's up-projection (kv_b_proj) into latent space, attention runs over the latent rows themselves (one KV head
that every query head reads, the latent doubling as the value), and the result goes out through the value half.
Nothing is decompressed per cached token, which is what makes decode cheap. Extends run in the plain form: the
request's latent rows, its cached prefix included, are decompressed into per-head keys and values, so prefill
costs what transformers' attention costs and its arithmetic matches it."""

from __future__ import annotations

from itertools import accumulate
from typing import Protocol

import torch
import torch.nn.functional as F

from kiln.core.forward_batch import AttentionMetadata, ForwardBatch, ForwardMode
from kiln.memory.kv_pool import LatentKVPool
from kiln.runner.attention.base import AttentionBackend


class LatentProjection(Protocol):
    """What a latent attention layer lends the backend: its up-projection (kv_b_proj) in both forms."""

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> [T, H, kv_lora_rank]: queries moved into latent space through the key weights."""
        ...

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, lora + rope] latent rows -> per-head keys [S, H, nope + rope] and values [S, H, v]."""
        ...

    def value_output(self, latent_out: torch.Tensor) -> torch.Tensor:
        """[T, H, kv_lora_rank] attention output in latent space -> [T, H, v] through the value weights."""
        ...


class MlaBackend(AttentionBackend):
    """Attention for a model whose KV pool is a LatentKVPool. Layers call forward_latent; the K/V forward of
    the other backends does not apply, since keys and values exist only inside the layer's up-projection."""

    kv_pool: LatentKVPool

    def __init__(self, kv_pool: LatentKVPool, q_heads: int, kv_lora_rank: int):
        """kv_lora_rank: the latent's width in each pool row, before the rope key; the value part of a row."""
        super().__init__(kv_pool, q_heads)
        self.kv_lora_rank = kv_lora_rank

    def prepare_metadata(self, fb: ForwardBatch) -> AttentionMetadata:
        return AttentionMetadata()

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise TypeError("latent attention has no K and V of its own: the layer calls forward_latent")

    def forward_latent(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        fb: ForwardBatch,
        proj: LatentProjection,
        scale: float,
    ) -> torch.Tensor:
        """q_nope [T, H, nope] and q_rope [T, H, rope] (rotated); latent [T, lora + rope] of the new tokens, written
        to the pool first. Returns [T, H * v]."""
        meta = fb.attn
        if meta is None:
            raise ValueError(
                "the batch has no attention metadata: prepare_metadata builds it before the model runs"
            )
        self.kv_pool.write(layer, fb.out_cache_loc, latent)
        if fb.mode == ForwardMode.DECODE:
            q = torch.cat((proj.absorb_query(q_nope), q_rope), dim=-1)
            out = proj.value_output(self.decode(layer, q, fb, meta, scale))
        else:
            out = self._extend_plain(layer, torch.cat((q_nope, q_rope), dim=-1), latent, fb, proj, scale)
        return out.reshape(q_nope.shape[0], -1)

    def decode(
        self, layer: int, q: torch.Tensor, fb: ForwardBatch, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: absorbed queries [B, H, lora + rope] -> [B, H, lora]. The heads are the query rows of one SDPA call
        per request over its latent rows; the value is the latent part of each row."""
        rows = self.kv_pool.gather_as(layer, fb.kv_table, q.dtype)  # [B, L, lora + rope]
        k = rows.unsqueeze(1)  # [B, 1, L, W]
        v = k[..., : self.kv_lora_rank]
        out = F.scaled_dot_product_attention(q.unsqueeze(1), k, v, attn_mask=fb.kv_mask, scale=scale)
        return out.squeeze(1)  # [B, H, lora]

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
        raise TypeError("latent attention extends run through forward_latent, which decompresses the latent")

    def _extend_plain(
        self,
        layer: int,
        q: torch.Tensor,
        latent: torch.Tensor,
        fb: ForwardBatch,
        proj: LatentProjection,
        scale: float,
    ) -> torch.Tensor:
        """Each request's new tokens over its cached prefix and themselves (causal), keys and values decompressed
        from the latent rows: q [T, H, nope + rope] -> [T, H, v]."""
        starts = list(accumulate(fb.extend_lens, initial=0))
        outs = []
        for i, prefix in enumerate(fb.prefix_lens):
            a, b = starts[i], starts[i + 1]
            rows = latent[a:b] if prefix == 0 else self.kv_pool.gather_as(layer, fb.seq_slots[i], q.dtype)
            k, v = proj.expand(rows)  # [S, H, nope + rope], [S, H, v]
            qi = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
            ki, vi = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            if prefix == 0:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
            else:
                ext = b - a
                positions = torch.arange(ext, device=q.device).unsqueeze(1) + prefix
                mask = torch.arange(prefix + ext, device=q.device).unsqueeze(0) <= positions
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            outs.append(o.squeeze(0).transpose(0, 1))
        return torch.cat(outs)
