"""Which tensor-parallel (and expert-parallel) sizes split a model, from its HF config dict alone: each dimension
the layers divide by tp that a size does not divide, as SGLang refuses it. Read through kiln.models.spec.ModelSpec."""

from __future__ import annotations

from kiln.models.shapes import has_linear_attention


def num_routed_experts(hf_config: dict) -> int:
    return int(
        hf_config.get("n_routed_experts")
        or hf_config.get("num_experts")
        or hf_config.get("num_local_experts")
        or 0
    )


def tp_size_problems(
    hf_config: dict, tp: int, ep: int = 1, fp8_block: tuple[int, int] | None = None
) -> list[str]:
    """Why these ranks cannot split this model: each dimension the layers divide by tp (the experts by ep, their
    intermediate size by tp / ep) that it does not divide, or (fp8_block: FP8 weights kept in their blocks) whose
    per-rank part cuts a block, as SGLang refuses it. Empty when tp and ep fit."""
    heads = hf_config.get("num_attention_heads") or 0
    kv_heads = hf_config.get("num_key_value_heads") or heads
    moe_tp = tp // ep if ep and tp % ep == 0 else tp
    # Mixtral's experts are intermediate_size wide (no moe_intermediate_size): split over tp / ep ranks like
    # other experts, since it has no dense MLP
    experts_only = bool(hf_config.get("num_local_experts")) and not hf_config.get("moe_intermediate_size")
    dims = {
        "num_attention_heads": (heads, tp),
        "intermediate_size": (hf_config.get("intermediate_size") or 0, moe_tp if experts_only else tp),
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
