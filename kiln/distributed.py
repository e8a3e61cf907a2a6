"""Tensor-parallel group state. tp_size == 1 is the path used on one device; collectives are no-ops there."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1


_TP = TPGroup()


def init_tp(rank: int, size: int, backend: str = "gloo", init_method: str | None = None) -> None:
    """Join the tensor-parallel group (one process per rank)."""
    global _TP
    if size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    _TP = TPGroup(rank=rank, size=size)


def tp_rank() -> int:
    return _TP.rank


def tp_size() -> int:
    return _TP.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank holds: its share of them, rounded up, and one replicated head when there are more ranks
    than KV heads. The layers shard by it and the memory ledger sizes the KV pool by it, so they agree."""
    return max(1, -(-num_kv_heads // tp))


def divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by tp_size {d}")
    return n // d
