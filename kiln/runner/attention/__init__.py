"""Attention backends over the paged KV pool (base.py states their contract) and the choice of one for a pool."""

from __future__ import annotations

import torch

from kiln.layers.cpu_gemm import has_cpu_decode_attention
from kiln.memory.kv_pool import KVPool, LatentKVPool
from kiln.runner.attention.base import AttentionBackend
from kiln.runner.attention.cpu_kernel import CpuKernelBackend, common_prefix
from kiln.runner.attention.mla import LatentProjection, MlaBackend
from kiln.runner.attention.torch_sdpa import TorchSdpaBackend

__all__ = [
    "AttentionBackend",
    "CpuKernelBackend",
    "LatentProjection",
    "MlaBackend",
    "TorchSdpaBackend",
    "common_prefix",
    "make_attention_backend",
]


def make_attention_backend(
    kv_pool: KVPool | LatentKVPool,
    q_heads: int,
    dtype: torch.dtype,
    kv_lora_rank: int = 0,
    choice: str | None = None,
) -> AttentionBackend:
    """Latent attention for a latent pool (kv_lora_rank: the latent's width in its rows); otherwise `choice`
    (--attention-backend) where one is given: triton, or torch_native (torch SDPA); by default (or intel_amx)
    Kiln's CPU kernel where it serves the pool (on the CPU, a KV dtype it reads, the kernel built) and the model
    computes in float32, which its queries then are; torch SDPA everywhere else."""
    if isinstance(kv_pool, LatentKVPool):
        return MlaBackend(kv_pool, q_heads, kv_lora_rank)
    if choice == "triton":
        from kiln.runner.attention.triton_backend import TritonBackend  # imports Triton, only when asked for

        return TritonBackend(kv_pool, q_heads)
    if choice == "torch_native":
        return TorchSdpaBackend(kv_pool, q_heads)
    if kv_pool.k and dtype == torch.float32 and has_cpu_decode_attention(kv_pool.k[0]):
        return CpuKernelBackend(kv_pool, q_heads)
    return TorchSdpaBackend(kv_pool, q_heads)
