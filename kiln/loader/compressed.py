"""compressed-tensors checkpoints (quantization_config quant_method compressed-tensors, what llm-compressor writes):
W8A8 int8 (`int-quantized`), FP8 (`float-quantized`), low-bit weights packed in int32 (`pack-quantized`, W4A16),
per tensor, channel or group. Each quantized linear's tensors (`X.weight` in int8 / FP8 or `X.weight_packed` and
`X.weight_shape`, `X.weight_scale`, an asymmetric scheme's `X.weight_zero_point`) are decompressed at load by the
format's own library into the `X.weight` a float checkpoint holds; activation quantization parameters
(`X.input_scale`, ...) are dropped, since Kiln runs the activations unquantized. A module's scheme is its config
group's (a `re:` target matched on its name, else the group that targets `Linear`); the ledger counts these linears
at the serving dtype (kiln.models.shapes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

QUANTIZED_STORAGE = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
WEIGHT_PARTS = (
    "weight",
    "weight_packed",
    "weight_shape",
    "weight_scale",
    "weight_zero_point",
    "weight_g_idx",
)
ACTIVATION_PARAMS = (
    "input_scale",
    "input_zero_point",
    "output_scale",
    "output_zero_point",
    "k_scale",
    "v_scale",
)
FORMATS = ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized")


def is_compressed_tensors(quant: dict | None) -> bool:
    return bool(quant) and str(quant.get("quant_method", "")).lower() == "compressed-tensors"


def read_config(quant: dict) -> Any:
    """The library's QuantizationConfig; refuses, naming the field, a format Kiln does not decompress (NVFP4,
    MXFP4, sparse 2:4) and a config that quantizes no weights."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(quant)
    for name, scheme in config.config_groups.items():
        fmt = scheme.format or config.format
        if fmt not in FORMATS:
            raise ValueError(
                f"model config quantization_config format {fmt!r} (config group {name}) is not read by Kiln: it "
                f"reads compressed-tensors' {', '.join(FORMATS)}"
            )
        if scheme.weights is None:
            raise ValueError(
                f"model config quantization_config config_groups {name} quantizes no weights (activations only): "
                "Kiln reads weight-quantized compressed-tensors checkpoints"
            )
    return config


def _scheme_for(module: str, config: Any) -> Any:
    """The config group that quantizes `module` (by a `re:` target or its exact name, else the `Linear` one)."""
    from compressed_tensors.utils import match_name

    groups = list(config.config_groups.values())
    named = [s for s in groups if any(t != "Linear" and match_name(module, t) for t in s.targets)]
    return (named or [s for s in groups if "Linear" in s.targets] or [None])[0]


def dequantized_stream(
    weights: Iterator[tuple[str, torch.Tensor]], quant: dict
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with each quantized linear's tensors (in any order, across shards) replaced by its
    decompressed float32 `X.weight`; other tensors pass through, activation parameters are dropped. Raises naming
    a linear whose tensors never all came."""
    from compressed_tensors.compressors.base import BaseCompressor

    config = read_config(quant)
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if part in ACTIVATION_PARAMS:
            continue
        plain_weight = part == "weight" and tensor.dtype not in QUANTIZED_STORAGE
        if part not in WEIGHT_PARTS or plain_weight:
            yield name, tensor  # a norm, an embedding, a bias, a module the config ignores
            continue
        scheme = _scheme_for(module, config)
        if scheme is None:
            raise ValueError(f"compressed-tensors checkpoint: {name} matches no config group's targets")
        compressor = BaseCompressor.get_value_from_registry(scheme.format or config.format)
        parts = waiting.setdefault(module, {})
        parts[part] = tensor
        if set(compressor.compression_param_names(scheme)) <= parts.keys():
            del waiting[module]
            yield f"{module}.weight", compressor.decompress(parts, scheme)["weight"].float()
    if waiting:
        module, parts = next(iter(waiting.items()))
        raise ValueError(
            f"compressed-tensors checkpoint: {module} has only {', '.join(sorted(parts))} "
            f"({len(waiting)} linears incomplete)"
        )
