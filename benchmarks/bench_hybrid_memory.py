"""Memory per request of a hybrid linear-attention model against a full-attention model of the same width: why
hybrids exist. The hybrid is Qwen3-Next-80B-A3B's shape (48 layers, a full-attention layer every fourth, gated
DeltaNet in the rest); the full-attention model is the same config with every layer full attention.

Per request at --context tokens: the KV its tokens take (only the full-attention layers keep KV) plus the state
slots it accounts for (the working slot, and with the radix cache the prefix cache's checkpoint slots), from the
memory ledger (`kiln plan`'s arithmetic, --requests running requests at that context), and measured: the bytes of
a KV pool and a state pool allocated for one request at that context with Kiln's own pool classes, on the CPU.

    python benchmarks/bench_hybrid_memory.py [--context 8192] [--requests 8] [--tp 1] [--dtype bfloat16]
                                             [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln.core.dtypes import dtype_bytes, torch_dtype  # noqa: E402
from kiln.core.sharding import kv_heads_per_rank  # noqa: E402
from kiln.core.units import GIB, human  # noqa: E402
from kiln.memory.kv_pool import KVPool  # noqa: E402
from kiln.memory.ledger import compute_ledger  # noqa: E402
from kiln.memory.ledger_types import Ledger, LedgerInputs  # noqa: E402
from kiln.memory.state_pool import StatePool  # noqa: E402
from kiln.models.spec import ModelSpec  # noqa: E402

# Qwen3-Next-80B-A3B-Instruct's config.json (the fields the ledger reads)
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "num_hidden_layers": 48, "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "partial_rotary_factor": 0.25, "intermediate_size": 5120, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 151936,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
FULL_ATTENTION = {**QWEN3_NEXT_80B, "layer_types": ["full_attention"] * 48}


def ledger_for(config: dict, args: argparse.Namespace, radix_cache: bool = True) -> Ledger:
    """`kiln plan --max-running-requests R --context-length C` on a machine large enough for the weights."""
    memory = 1024 * GIB
    inputs = LedgerInputs(
        model=ModelSpec.from_config(config),
        device="cpu",
        device_memory_bytes=memory,
        available_memory_bytes=memory,
        tp_size=args.tp,
        dtype=args.dtype,
        max_running_requests=args.requests,
        context_length=args.context,
        disable_cuda_graph=True,
        disable_radix_cache=not radix_cache,
    )
    ledger = compute_ledger(inputs)
    assert ledger.fits and not ledger.running_clamp, ledger.failure
    return ledger


def ledger_per_request(ledger: Ledger, context: int) -> dict:
    """KV bytes of `context` tokens and the state bytes one running request accounts for, from the ledger."""
    kv = context * ledger.kv_bytes_per_token
    states = 0
    if ledger.state_slots:
        states = ledger.state_slots * ledger.state_slot_bytes // ledger.max_running_requests
    return {"kv": kv, "states": states, "total": kv + states}


def measured_per_request(config: dict, args: argparse.Namespace, slots: int) -> dict:
    """Bytes of the pools Kiln allocates for one request at the context (the padding page left out)."""
    dtype = torch_dtype(args.dtype)
    heads = kv_heads_per_rank(config["num_key_value_heads"], args.tp)
    pool = KVPool(args.context, 1, ModelSpec.from_config(config).kv_layers, heads, config["head_dim"], dtype)
    per_row = (pool.k_bytes + pool.v_bytes) // (args.context + 1)
    kv = per_row * args.context
    del pool
    state = ModelSpec.from_config(config).linear_state(args.tp, dtype_bytes(args.dtype))
    states = 0
    if state is not None:
        states_pool = StatePool(
            slots, state.layers, state.conv_shape, state.ssm_shape, dtype, ssm_dtype=torch.float32
        )
        states = states_pool.nbytes
    return {"kv": kv, "states": states, "total": kv + states}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = {}
    models = (
        ("hybrid", QWEN3_NEXT_80B, True),
        ("hybrid, no radix", QWEN3_NEXT_80B, False),  # the working slot alone: no checkpoint slots
        ("full attention", FULL_ATTENTION, True),
    )
    for name, config, radix_cache in models:
        ledger = ledger_for(config, args, radix_cache)
        slots = ledger.state_slots // ledger.max_running_requests if ledger.state_slots else 0
        rows[name] = {
            "ledger": ledger_per_request(ledger, args.context),
            "measured": measured_per_request(config, args, slots),
            "kv_layers": ModelSpec.from_config(config).kv_layers,
            "state_slots_per_request": slots,
        }
    print(f"memory per request at a {args.context:,}-token context, tp {args.tp}, {args.dtype} (per rank)")
    for name, row in rows.items():
        led, got = row["ledger"], row["measured"]
        print(
            f"  {name:<16} KV {human(led['kv']):>10} ({row['kv_layers']} layers) + states {human(led['states']):>10} "
            f"({row['state_slots_per_request']} slots) = {human(led['total']):>10}; measured {human(got['total']):>10}"
        )
    full = rows["full attention"]["ledger"]["total"]
    for name in ("hybrid", "hybrid, no radix"):
        print(f"  full attention / {name} = {full / rows[name]['ledger']['total']:.2f}x")
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
