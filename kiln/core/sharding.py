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


def tp_size_problems(hf_config: dict, tp: int) -> list[str]:
    """Why these ranks cannot split this model: each dimension the layers divide by tp that tp does not divide.
    Empty when tp fits."""
    heads = hf_config.get("num_attention_heads") or 0
    kv_heads = hf_config.get("num_key_value_heads") or heads
    dims = {
        "num_attention_heads": heads,
        "intermediate_size": hf_config.get("intermediate_size") or 0,
        "moe_intermediate_size": hf_config.get("moe_intermediate_size") or 0,
    }
    problems = [f"{name} {value}" for name, value in dims.items() if value and value % tp]
    if kv_heads and kv_heads % tp and tp % kv_heads:  # split evenly, or each head replicated on tp / kv ranks
        problems.append(f"num_key_value_heads {kv_heads}")
    return problems


def valid_tp_sizes(hf_config: dict, limit: int = 64) -> list[int]:
    return [tp for tp in range(1, limit + 1) if not tp_size_problems(hf_config, tp)]
