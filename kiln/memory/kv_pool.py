"""The token -> KV pool: per layer, K and V rows indexed by token slot (slot 0's page is padding).

The pool stores its rows in the KV cache dtype (--kv-cache-dtype), which may be narrower than the model's compute
dtype (bfloat16 or fp8 under a float32 model): writes convert the new rows on store, and readers convert what they
read (gather_as), or read the stored rows themselves (Kiln's CPU decode kernel converts each element in registers,
so a narrow pool is never copied out at the compute width)."""

from __future__ import annotations

import torch

# dtypes whose rows the tiers copy as bytes: torch has no CPU index_copy_ for them
_BYTE_COPIED = (torch.float8_e4m3fn, torch.float8_e5m2)


def copyable(rows: torch.Tensor) -> torch.Tensor:
    """A pool tensor as the host and storage tiers copy it: itself, or for fp8 a uint8 view of the same memory
    (torch's CPU index_copy_ has no fp8 kernel; the tiers move rows bit for bit either way)."""
    return rows.view(torch.uint8) if rows.dtype in _BYTE_COPIED else rows


def token_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes one token's rows take across `tensors` (a pool's per-layer K and V, or a tier's copies of them)."""
    return sum(t[0].nbytes for t in tensors)


def pool_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device, slots_dim: int = 0
) -> torch.Tensor:
    """A pool's tensor, zeroed (its memory committed at startup, as the ledger says, rather than page by page as
    slots are first used: a 10-minute soak showed +35% RSS from exactly that). Its slot count is marked dynamic
    for torch.compile: the pool is sized from the memory free at each start, and a compiled step that
    specialised on it would miss the compile cache at every start (the default model recompiled for ~25 s)."""
    tensor = torch.zeros(shape, dtype=dtype, device=device)
    torch._dynamo.maybe_mark_dynamic(tensor, slots_dim)
    return tensor


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
        self.k = [pool_tensor(shape, dtype, device) for _ in range(num_layers)]
        self.v = [pool_tensor(shape, dtype, device) for _ in range(num_layers)]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the rows are stored in."""
        return self.k[0].dtype if self.k else torch.float32

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, heads, dim] rows of the new tokens, in any floating dtype: stored converted to the pool's."""
        self.k[layer][slots] = k.to(self.k[layer].dtype)
        self.v[layer][slots] = v.to(self.v[layer].dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of `slots` (any shape), shaped [*slots.shape, heads, dim]. index_select on the flat
        slot list is ~3x faster on CPU than advanced indexing with a 2-D index."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, *self.k[layer].shape[1:])
        return (
            self.k[layer].index_select(0, flat).view(shape),
            self.v[layer].index_select(0, flat).view(shape),
        )

    def gather_as(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """gather's rows converted to `dtype` (the queries' dtype); no copy beyond the gather when they match."""
        k, v = self.gather(layer, slots)
        return k.to(dtype), v.to(dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K and V rows of `src` slots into `dst` slots (a tree verify moves the accepted path's
        KV to the columns plain decoding would have written); bit for bit, whatever the dtype."""
        _copy_rows(self.k + self.v, src, dst)

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
        self.k = [pool_tensor(shape, dtype, device) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = []

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the rows are stored in."""
        return self.k[0].dtype if self.k else torch.float32

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """latent: [T, width] rows of the new tokens, stored converted to the pool's dtype."""
        self.k[layer][slots] = latent.unsqueeze(1).to(self.k[layer].dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The latent rows of `slots` (any shape), shaped [*slots.shape, width], in the pool's dtype."""
        rows = self.k[layer].index_select(0, slots.reshape(-1))
        return rows.view(*slots.shape, rows.shape[-1])

    def gather_as(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """gather's rows converted to `dtype` (the queries' dtype)."""
        return self.gather(layer, slots).to(dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's latent rows of `src` slots into `dst` slots (see KVPool.copy_slots)."""
        _copy_rows(self.k, src, dst)

    @property
    def k_bytes(self) -> int:
        return sum(t.nbytes for t in self.k)

    @property
    def v_bytes(self) -> int:
        return 0


def _copy_rows(tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """rows[dst] = rows[src] in each tensor; the source rows are read before any is written."""
    for rows in tensors:
        src_here, dst_here = src.to(rows.device), dst.to(rows.device)
        view = copyable(rows)
        view[dst_here] = view[src_here]
