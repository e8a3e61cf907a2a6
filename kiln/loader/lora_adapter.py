"""LoRA adapters in PEFT's layout: a directory with adapter_config.json and adapter_model.safetensors (or
adapter_model.bin). An adapter is read whole into host memory and checked against the base model and the server's
limits (rank, target modules, shapes) before any slot sees it; every refusal is an AdapterError naming the adapter,
the file or tensor, and the limit."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.layers.lora import TARGET_MODULES
from kiln.models.spec import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT's tensor names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """An adapter Kiln does not serve, with why."""


@dataclass(frozen=True)
class AdapterConfig:
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # as the config names them, where it lists them

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) under rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass
class LoraAdapter:
    """An adapter in host memory: per (layer, module) its A [r, in] and B [out, r]."""

    name: str
    config: AdapterConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    uid: int = (
        0  # set when registered: a fresh one per load, so a reload under the same name is a new adapter
    )

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(sorted({m for _, m in self.weights}))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter_config(name: str, path: str) -> AdapterConfig:
    """The adapter's config: its rank, alpha and targets (no weights read: `kiln plan` sizes slots from these)."""
    file = Path(path) / CONFIG_FILE
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path} (PEFT's layout)") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"LoRA adapter {name!r}: {file} is not readable JSON ({e})") from None
    if not isinstance(raw, dict) or str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: {file} is not a LoRA adapter config (peft_type LORA)")
    unsupported = [
        (key, raw.get(key))
        for key, empty in (("use_dora", False), ("rank_pattern", {}), ("alpha_pattern", {}), ("bias", "none"))
        if raw.get(key) not in (None, empty)
    ]
    if raw.get("modules_to_save"):
        unsupported.append(("modules_to_save", raw["modules_to_save"]))
    if unsupported:
        key, value = unsupported[0]
        raise AdapterError(f"LoRA adapter {name!r}: {key}={value!r} is not served by Kiln (plain LoRA only)")
    try:
        rank, alpha = int(raw["r"]), float(raw.get("lora_alpha", raw["r"]))
    except (KeyError, TypeError, ValueError):
        raise AdapterError(f"LoRA adapter {name!r}: {file} has no valid rank `r`") from None
    if rank < 1:
        raise AdapterError(f"LoRA adapter {name!r}: rank r={rank} must be >= 1")
    targets = raw.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    return AdapterConfig(str(path), rank, alpha, bool(raw.get("use_rslora", False)), targets)


def _read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    for file in WEIGHT_FILES:
        if (path / file).exists():
            break
    else:
        raise AdapterError(f"LoRA adapter {name!r}: no {' or '.join(WEIGHT_FILES)} in {path}")
    try:
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(path / file))
        return torch.load(path / file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or corrupt file: safetensors and torch raise their own kinds
        raise AdapterError(
            f"LoRA adapter {name!r}: {path / file} could not be read ({type(e).__name__}: {e})"
        ) from None


def load_adapter(
    name: str, path: str, model: ModelSpec, max_rank: int, targets: tuple[str, ...]
) -> LoraAdapter:
    """The adapter at `path`, read into host memory and checked: rank <= max_rank, each tensor a projection of
    the base model that `targets` (--lora-target-modules) covers, of the base's shapes. Raises AdapterError."""
    config = read_adapter_config(name, path)
    if config.rank > max_rank:
        raise AdapterError(
            f"LoRA adapter {name!r}: rank {config.rank} is above --max-lora-rank {max_rank} (the slots' size)"
        )
    shapes, layers = model.projection_shapes(), model.num_layers
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(name, Path(path)).items():
        m = _TENSOR.search(key)
        if m is None:
            raise AdapterError(
                f"LoRA adapter {name!r}: tensor {key} is not a LoRA weight of a projection Kiln serves "
                f"({', '.join(TARGET_MODULES)})"
            )
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in shapes or layer >= layers:
            raise AdapterError(
                f"LoRA adapter {name!r}: target module {module} (layer {layer}) is not in the base model "
                f"{model.architecture} ({layers} layers of {', '.join(shapes)})"
            )
        if module not in targets:
            raise AdapterError(
                f"LoRA adapter {name!r}: target module {module} is not among --lora-target-modules "
                f"{' '.join(targets)}"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        weights[(layer, module)] = _checked_pair(name, layer, module, pair, shapes[module], config.rank)
    if not weights:
        raise AdapterError(f"LoRA adapter {name!r}: {path} holds no LoRA weights")
    return LoraAdapter(name, config, weights)


def _checked_pair(
    name: str, layer: int, module: str, pair: dict[str, torch.Tensor], shape: tuple[int, int], rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"LoRA adapter {name!r}: layer {layer} {module}"
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{where} has lora_{''.join(pair)} without lora_{'B' if 'A' in pair else 'A'}")
    a, b = pair["A"], pair["B"]
    (in_features, out_features), r = shape, a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, r):
        raise AdapterError(
            f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base's "
            f"[{out_features}, {in_features}] projection at rank {r}"
        )
    if r != rank:
        raise AdapterError(f"{where}: rank {r} differs from the config's r={rank}")
    return a.float().contiguous(), b.float().contiguous()
