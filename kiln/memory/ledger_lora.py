"""The LoRA slot pool's line of the ledger: what kiln.runner.lora allocates on the model's projections for
--max-loras-per-batch slots of --max-lora-rank."""

from __future__ import annotations

from kiln.core.dtypes import dtype_bytes
from kiln.layers.lora import MERGED_PARTS, TARGET_MODULES, part_shard
from kiln.models.spec import ModelSpec


def projection_groups(modules: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The projections holding slots: a merged one (qkv, gate_up) holds all its parts once any is targeted."""
    groups = [parts for parts in MERGED_PARTS.values() if set(parts) & set(modules)]
    merged = {m for parts in MERGED_PARTS.values() for m in parts}
    return groups + [(m,) for m in TARGET_MODULES if m in modules and m not in merged]


def lora_slot_bytes(
    model: ModelSpec, slots: int, rank: int, modules: tuple[str, ...], dtype: str, tp: int = 1
) -> int:
    """Per layer and projection A [slots, parts x rank, in] and B [slots, rank, out] per part, in the model's
    dtype, one rank's share (kiln.layers.lora.part_shard); and a float32 scaling per slot."""
    if slots <= 0:
        return 0
    shapes, element = model.projection_shapes(), dtype_bytes(dtype)
    per_layer = 0
    for parts in projection_groups(modules):
        shards = [part_shard(p, shapes[p], model.num_kv_heads, model.head_dim, tp, 0) for p in parts]
        in_features = shards[0].in_size
        per_layer += slots * rank * (len(parts) * in_features + sum(s.out_size for s in shards)) * element
    return per_layer * model.num_layers + slots * 4


def lora_text(slots: int, rank: int, modules: tuple[str, ...], layers: int) -> str:
    return (
        f"--max-loras-per-batch {slots} slots x --max-lora-rank {rank} x {layers} layers x "
        f"({' '.join(modules)}): A and B per projection"
    )
