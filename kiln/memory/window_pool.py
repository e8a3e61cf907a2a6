"""The request-slot -> window-ring pool of hybrid sliding-window models (Gemma 2/3, GPT-OSS).

A windowed layer's query at position p reads only the keys at p - window + 1 .. p, so a request need not keep its
windowed layers' KV for every token: per windowed layer it keeps a ring of the last `tokens` positions' K and V
(position p at index p % tokens), in its request-table row's slot, and the token pool keeps the full-attention
layers alone. A 4k-token conversation then holds `window` rows per windowed layer, not 4k.

To the prefix cache a ring is a per-request state like a linear layer's (kiln.memory.state_checkpoints): the radix
tree keeps copies of rings at checkpoints and a match restarts from the deepest one, the tokens past it
recomputed: both pools are kiln.memory.state_pool.SlotPools."""

from __future__ import annotations

import torch

from kiln.memory.kv_pool import pool_tensor
from kiln.memory.state_pool import SlotPool


class WindowPool(SlotPool):
    """k and v: [windowed layers, slots, tokens, kv heads, head dim], in the KV cache dtype."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        tokens: int,
        kv_heads: int,
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ):
        self.num_slots, self.num_layers, self.tokens = num_slots, num_layers, tokens
        self.k = pool_tensor((num_layers, num_slots, tokens, kv_heads, k_dim), dtype, device, slots_dim=1)
        self.v = pool_tensor((num_layers, num_slots, tokens, kv_heads, v_dim), dtype, device, slots_dim=1)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v

    def write(self, layer: int, slot: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The K and V rows [n, heads, dim] of positions first .. first + n - 1 (n <= tokens) into `slot`'s ring."""
        index = torch.arange(first, first + k.shape[0], device=self.k.device) % self.tokens
        self.k[layer, slot, index] = k.to(self.k.dtype)
        self.v[layer, slot, index] = v.to(self.v.dtype)

    def read(
        self, layer: int, slot: int, first: int, end: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, ...]:
        """The K and V rows of positions first .. end - 1 (at most `tokens` of them, still in the ring), in order."""
        index = torch.arange(first, end, device=self.k.device) % self.tokens
        return self.k[layer, slot, index].to(dtype), self.v[layer, slot, index].to(dtype)
