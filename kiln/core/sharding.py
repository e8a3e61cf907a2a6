"""How a model's dimensions split across tensor-parallel ranks: pure arithmetic, without torch, shared by the
layers (which shard by it) and the memory ledger (which sizes by it), so the two always agree."""

from __future__ import annotations


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank holds: its share of them, rounded up, and one replicated head when there are more ranks
    than KV heads. The layers shard by it and the memory ledger sizes the KV pool by it, so they agree."""
    return max(1, -(-num_kv_heads // tp))


def divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by tp_size {d}")
    return n // d


def expert_split(tp_rank: int, tp: int, ep: int) -> tuple[int, int, int, int]:
    """(ep rank, ep size, moe-tp rank, moe-tp size) of a rank, SGLang's layout: the tp ranks form ep groups of
    tp / ep consecutive ranks; group g holds experts [g E / ep, (g + 1) E / ep), each of them split over the
    group's tp / ep ranks. ep 1 is plain tensor parallelism: a slice of every expert on every rank."""
    moe_tp = tp // ep
    return tp_rank // moe_tp, ep, tp_rank % moe_tp, moe_tp
