"""Multi-LoRA serving on one rank: the adapters in host memory (by name), the slot pool on the device (a LoraWeights
on each targeted projection of the model, kiln.layers.lora) and which adapter each slot holds (SlotTable). The
scheduler pins a request's adapter into a slot at admission (acquire) and unpins it at the request's end
(release); a slot's weights are written only while no running request reads it, so loading an adapter never
disturbs the batch."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from kiln.core.units import gib
from kiln.distributed import tp_rank, tp_size
from kiln.layers.linear import _PrepackableLinear
from kiln.layers.lora import MERGED_PARTS, LoraBatch, LoraWeights, PartShard, part_shard
from kiln.loader.lora_adapter import AdapterError, LoraAdapter, load_adapter
from kiln.memory.lora_slots import SlotTable
from kiln.models.spec import ModelSpec

logger = logging.getLogger("kiln")


@dataclass(frozen=True)
class LoraSettings:
    """The resolved LoRA flags (kiln.scheduler.resolve)."""

    max_loras_per_batch: int
    max_lora_rank: int
    target_modules: tuple[str, ...]
    max_loaded_loras: int | None
    backend: str  # torch | dense | grouped | triton (the delta's method, kiln.layers.lora)
    paths: tuple[tuple[str, str], ...]  # (name, path) loaded at startup


def _projections(
    model: nn.Module, targets: tuple[str, ...]
) -> list[tuple[int, _PrepackableLinear, list[str]]]:
    """(layer index, projection, its sub-projections' PEFT names) of each projection a target covers."""
    found = []
    for i, layer in enumerate(model.model.layers):
        for owner in (getattr(layer, "self_attn", None), getattr(layer, "mlp", None)):
            for attr, linear in owner.named_children() if owner is not None else ():
                parts = list(MERGED_PARTS.get(attr, (attr,)))
                if isinstance(linear, _PrepackableLinear) and set(parts) & set(targets):
                    found.append((i, linear, parts))
    return found


def _shards(spec: ModelSpec, parts: list[str]) -> list[PartShard]:
    """This rank's share of each sub-projection (kiln.layers.lora.part_shard)."""
    shapes = spec.projection_shapes()
    return [part_shard(m, shapes[m], spec.num_kv_heads, spec.head_dim, tp_size(), tp_rank()) for m in parts]


def _part_sizes(shards: list[PartShard], parts: list[str]) -> list[tuple[str, int, int]]:
    """(name, output offset, output size) of each sub-projection on this rank, stacked in order."""
    out, offset = [], 0
    for name, shard in zip(parts, shards):
        out.append((name, offset, shard.out_size))
        offset += shard.out_size
    return out


class LoraManager:
    def __init__(
        self, model: nn.Module, spec: ModelSpec, settings: LoraSettings, max_rows: int, dtype, device: str
    ):
        self.spec, self.settings, self.dtype = spec, settings, dtype
        s, r = settings.max_loras_per_batch, settings.max_lora_rank
        self.batch = LoraBatch(s, r, max_rows, device, settings.backend)
        self.slots = SlotTable(s)
        self.layers: list[tuple[int, LoraWeights]] = []
        self.shards: list[list[PartShard]] = []  # each LoRA'd projection's parts' shares on this rank
        for layer, linear, parts in (
            _projections(model, settings.target_modules) if hasattr(model, "model") else ()
        ):
            shards = _shards(spec, parts)
            weights = LoraWeights(self.batch, shards[0].in_size, _part_sizes(shards, parts), dtype, device)
            linear.lora = weights
            self.layers.append((layer, weights))
            self.shards.append(shards)
        if not self.layers:  # a model class whose layers name their projections otherwise: no silent no-op
            raise AdapterError(
                f"{spec.architecture}: no projection named {', '.join(settings.target_modules)} in its layers for "
                "the LoRA slots"
            )
        self.adapters: dict[str, LoraAdapter] = {}
        self.retiring: dict[
            int, LoraAdapter
        ] = {}  # unloaded, by uid, until the requests accepted on them end
        self._uids = itertools.count(1)
        logger.info(
            f"LoRA slots are allocated. #slots: {s}, max rank: {r}, modules: {' '.join(settings.target_modules)}, "
            f"size: {gib(self.nbytes)}"
        )

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for _, w in self.layers) + self.batch.scaling.nbytes

    # ---- adapters in host memory
    def load(self, name: str, path: str) -> LoraAdapter:
        """Read, check and register adapter `name` (its slot is written when a request first needs it). Raises
        AdapterError naming the problem."""
        if name in self.adapters:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        limit = self.settings.max_loaded_loras
        if limit is not None and len(self.adapters) >= limit:
            raise AdapterError(
                f"LoRA adapter {name!r}: --max-loaded-loras {limit} adapters are loaded already; unload one first"
            )
        adapter = load_adapter(
            name, path, self.spec, self.settings.max_lora_rank, self.settings.target_modules
        )
        adapter.uid = next(self._uids)
        self.adapters[name] = adapter
        logger.info(
            f"LoRA adapter {name!r} loaded from {path}: rank {adapter.config.rank}, scaling "
            f"{adapter.config.scaling:g}, modules {' '.join(adapter.modules)}"
        )
        return adapter

    def unload(self, name: str, referenced: set[int]) -> None:
        """Unload adapter `name`: new requests can no longer name it. Requests already accepted on it
        (`referenced`: the uids live requests hold) still run on it: it is retired, kept until they end (retire)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded")
        self.retiring[adapter.uid] = adapter
        self.retire(referenced)
        logger.info(f"LoRA adapter {name!r} unloaded")

    def retire(self, referenced: set[int]) -> None:
        """Forget the unloaded adapters no live request holds (`referenced`), emptying their slots."""
        for uid in [u for u in self.retiring if u not in referenced]:
            del self.retiring[uid]
            slot = self.slots.drop(uid)
            if slot is not None:
                self._clear(slot)

    def uid_of(self, name: str) -> int:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded")
        return adapter.uid

    def listing(self) -> list[dict]:
        return [
            {
                "lora_name": a.name,
                "lora_path": a.config.path,
                "rank": a.config.rank,
                "modules": list(a.modules),
            }
            for a in self.adapters.values()
        ]

    # ---- slots
    def acquire(self, uid: int) -> int | None:
        """Pin adapter `uid` into a slot, writing its weights there if they are not: the slot, or None when every
        slot is pinned by other adapters (the request waits). Raises AdapterError for an adapter unloaded since."""
        adapter = next((a for a in self.adapters.values() if a.uid == uid), None) or self.retiring.get(uid)
        if adapter is None and self.slots.slot_of(uid) is None:
            raise AdapterError("its LoRA adapter was unloaded before the request started")
        taken = self.slots.take(uid)
        if taken is None:
            return None
        slot, fresh = taken
        if fresh:
            assert adapter is not None
            self._write(slot, adapter)
        return slot

    def release(self, slot: int) -> None:
        self.slots.release(slot)

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        with torch.inference_mode():
            for (layer, weights), shards in zip(self.layers, self.shards):
                for part, ((module, _, _), shard) in enumerate(zip(weights.parts, shards)):
                    a, b = adapter.weights.get((layer, module), (None, None))
                    if a is not None and b is not None:  # this rank's share, as the base weight is split
                        a = a.narrow(1, shard.in_start, shard.in_size)
                        b = b.narrow(0, shard.out_start, shard.out_size)
                    weights.write(slot, part, a, b)
            self.batch.scaling[slot] = adapter.config.scaling

    def _clear(self, slot: int) -> None:
        with torch.inference_mode():
            for _, weights in self.layers:
                weights.clear(slot)
            self.batch.scaling[slot] = 0.0

    def set_batch(self, row_slots: torch.Tensor | None) -> None:
        with torch.inference_mode():
            self.batch.set_rows(row_slots)


__all__ = ["AdapterError", "LoraManager", "LoraSettings"]
