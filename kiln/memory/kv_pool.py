"""The token -> KV pool: per layer, K and V rows indexed by token slot (slot 0's page is padding)."""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_tokens: int,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ):
        self.num_tokens = num_tokens
        self.page_size = page_size
        rows = num_tokens + page_size  # plus the reserved padding page
        shape = (rows, kv_heads, head_dim)
        # zeros, not empty: the pool's memory is committed at startup, as the ledger says, instead of growing
        # page by page as slots are first used (a 10-minute soak showed +35% RSS from exactly that)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of `slots` (any shape), shaped [*slots.shape, heads, dim]. index_select on the flat
        slot list is ~3x faster on CPU than advanced indexing with a 2-D index."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, *self.k[layer].shape[1:])
        return (
            self.k[layer].index_select(0, flat).view(shape),
            self.v[layer].index_select(0, flat).view(shape),
        )

    @property
    def k_bytes(self) -> int:
        return sum(t.nbytes for t in self.k)

    @property
    def v_bytes(self) -> int:
        return sum(t.nbytes for t in self.v)


class LatentKVPool:
    """The token -> KV pool of multi-head latent attention: per layer one row per token slot holding the
    compressed KV latent (kv_lora_rank) and the rotated rope key (qk_rope_head_dim) every head shares, and no V
    half, since values come out of the same latent. Its bytes are the ledger's MLA cell, (lora + rope) x layers
    x element bytes per token. Rows are shaped [slots, 1, width]: one KV head, which every query head reads."""

    def __init__(
        self,
        num_tokens: int,
        page_size: int,
        num_layers: int,
        width: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ):
        self.num_tokens = num_tokens
        self.page_size = page_size
        shape = (num_tokens + page_size, 1, width)  # plus the reserved padding page
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = []

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """latent: [T, width] rows of the new tokens."""
        self.k[layer][slots] = latent.unsqueeze(1).to(self.k[layer].dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The latent rows of `slots` (any shape), shaped [*slots.shape, width]."""
        rows = self.k[layer].index_select(0, slots.reshape(-1))
        return rows.view(*slots.shape, rows.shape[-1])

    @property
    def k_bytes(self) -> int:
        return sum(t.nbytes for t in self.k)

    @property
    def v_bytes(self) -> int:
        return 0
