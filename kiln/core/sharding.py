"""How a model's dimensions split across tensor-parallel ranks: pure arithmetic, without torch, shared by the
layers (which shard by it) and the memory ledger (which sizes by it), so the two always agree."""

from __future__ import annotations

from kiln.core.layer_kinds import has_linear_attention


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank holds: its share of them, rounded up, and one replicated head when there are more ranks
    than KV heads. The layers shard by it and the memory ledger sizes the KV pool by it, so they agree."""
    return max(1, -(-num_kv_heads // tp))


def divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by tp_size {d}")
    return n // d


def num_routed_experts(hf_config: dict) -> int:
    return int(
        hf_config.get("n_routed_experts")
        or hf_config.get("num_experts")
        or hf_config.get("num_local_experts")
        or 0
    )


def expert_split(tp_rank: int, tp: int, ep: int) -> tuple[int, int, int, int]:
    """(ep rank, ep size, moe-tp rank, moe-tp size) of a rank, SGLang's layout: the tp ranks form ep groups of
    tp / ep consecutive ranks; group g holds experts [g E / ep, (g + 1) E / ep), each of them split over the
    group's tp / ep ranks. ep 1 is plain tensor parallelism: a slice of every expert on every rank."""
    moe_tp = tp // ep
    return tp_rank // moe_tp, ep, tp_rank % moe_tp, moe_tp


def tp_size_problems(
    hf_config: dict, tp: int, ep: int = 1, fp8_block: tuple[int, int] | None = None
) -> list[str]:
    """Why these ranks cannot split this model: each dimension the layers divide by tp (the experts by ep, their
    intermediate size by tp / ep) that it does not divide, or (fp8_block: FP8 weights kept in their blocks) whose
    per-rank part cuts a block, as SGLang refuses it. Empty when tp and ep fit."""
    heads = hf_config.get("num_attention_heads") or 0
    kv_heads = hf_config.get("num_key_value_heads") or heads
    moe_tp = tp // ep if ep and tp % ep == 0 else tp
    dims = {
        "num_attention_heads": (heads, tp),
        "intermediate_size": (hf_config.get("intermediate_size") or 0, tp),
        "moe_intermediate_size": (hf_config.get("moe_intermediate_size") or 0, moe_tp),
    }
    problems = [f"{name} {value}" for name, (value, by) in dims.items() if value and value % by]
    if fp8_block is not None and not problems:
        problems += _fp8_block_problems(hf_config, dims, tp, max(fp8_block))
    if kv_heads and kv_heads % tp and tp % kv_heads:  # split evenly, or each head replicated on tp / kv ranks
        problems.append(f"num_key_value_heads {kv_heads}")
    if (tp > 1 or ep > 1) and has_linear_attention(hf_config):  # their conv and recurrent states are whole
        problems.append("linear-attention layers (Kiln runs them on one rank only)")
    if ep > 1:
        experts = num_routed_experts(hf_config)
        if not experts:
            problems.append("routed experts: none (--ep-size splits experts; this model is dense)")
        elif experts % ep:
            problems.append(f"routed experts {experts} (by --ep-size {ep})")
    return problems


def _fp8_block_problems(hf_config: dict, dims: dict[str, tuple[int, int]], tp: int, side: int) -> list[str]:
    """The per-rank parts of FP8-held weights that cut a block of `side`: the MLP's and each expert's
    intermediate rows (gate / up) and columns (down), the attention's query (and key / value) rows and its output
    columns. Latent attention's kv_b_proj is held dequantized and the latent down-projections replicated. `dims`:
    tp_size_problems' dimensions (value, ranks splitting it)."""
    heads = hf_config.get("num_attention_heads") or 0
    parts = {name: split for name, split in dims.items() if name.endswith("intermediate_size")}
    if heads:
        if hf_config.get("kv_lora_rank"):  # q_b_proj (or q_proj) rows, o_proj columns
            nope, rope = hf_config.get("qk_nope_head_dim") or 0, hf_config.get("qk_rope_head_dim") or 0
            parts["query rows (heads x qk head dim)"] = (heads * (nope + rope), tp)
            parts["o_proj columns (heads x v_head_dim)"] = (heads * (hf_config.get("v_head_dim") or nope), tp)
        else:  # the merged q / k / v rows: each part starts on a block
            head_dim = hf_config.get("head_dim") or (hf_config.get("hidden_size") or 0) // heads
            kv = hf_config.get("num_key_value_heads") or heads
            parts["query rows (heads x head_dim)"] = (heads * head_dim, tp)
            parts["key / value rows (kv heads x head_dim)"] = (kv * head_dim, min(tp, kv))
    return [
        f"{name} {value} (/ {by} = {value // by} per rank, not a multiple of the FP8 weight block {side})"
        for name, (value, by) in parts.items()
        if value and not value % by and (value // by) % side
    ]


def valid_tp_sizes(hf_config: dict, limit: int = 64, fp8_block: tuple[int, int] | None = None) -> list[int]:
    return [tp for tp in range(1, limit + 1) if not tp_size_problems(hf_config, tp, fp8_block=fp8_block)]
