"""FP8 block-quantized checkpoints (DeepSeek-V3, Kimi-K2: quantization_config quant_method fp8, fmt e4m3,
weight_block_size [128, 128]): kept in FP8, or dequantized at load on the CPU.

Each quantized `X.weight` is float8_e4m3fn and comes with `X.weight_scale_inv`, one float32 factor per block of
the weight (weight = fp8 value x scale_inv of its block; edge blocks are partial). The stream pairs the two
whichever comes first, even across shards, and hands the model one `X.weight`: dequantized to float32, so every
layer loads it as it would an unquantized checkpoint's; or, where FP8 weights are kept (kiln.platform.
fp8_weights_kept), the fp8 tensor with its factors attached as `fp8_blocks`, for the layers that hold FP8
(kiln.layers.fp8_linear) to copy their shards of both. A parameter held in another dtype takes such a tensor
dequantized (kiln.layers.fp8_linear.as_dtype)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kiln.layers.fp8_linear import SCALE_SUFFIX, Fp8Blocks, check_scales, dequantize_blocks
from kiln.layers.rotary import check_choice

__all__ = ["block_size", "block_stream", "dequantize_blocks", "is_fp8_config"]

FP8_DTYPES = (torch.float8_e4m3fn,)


def is_fp8_config(quant: dict | None) -> bool:
    return bool(quant) and str(quant.get("quant_method", "")).lower() == "fp8"


def block_size(quant: dict) -> tuple[int, int]:
    """The (rows, columns) of one scale block of an fp8 quantization_config; refuses, naming the field, what Kiln
    does not dequantize."""
    check_choice("quantization_config fmt", quant.get("fmt", "e4m3"), ("e4m3",))
    block = quant.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise ValueError(
            f"model config quantization_config weight_block_size {block!r} is not implemented by Kiln (accepted: "
            f"two positive block sides, e.g. [128, 128]: per-tensor FP8 has no block scales to read)"
        )
    return int(block[0]), int(block[1])


def _paired(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], keep: bool
) -> torch.Tensor:
    if not keep:
        return dequantize_blocks(weight, scale_inv, block)
    check_scales(weight, scale_inv, block)
    weight.fp8_blocks = Fp8Blocks(scale_inv.float(), block)  # type: ignore[attr-defined]
    return weight


def block_stream(
    weights: Iterator[tuple[str, torch.Tensor]], block: tuple[int, int], keep: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with every fp8 weight and its scales replaced by one tensor: the float32 weight, or
    (keep) the fp8 weight with its `fp8_blocks`; every other tensor passes through unchanged. Raises naming a
    weight whose scales never came (or scales without their weight)."""
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            owner = name.removesuffix(SCALE_SUFFIX)
            if owner in waiting_weights:
                yield owner, _paired(waiting_weights.pop(owner), tensor, block, keep)
            else:
                waiting_scales[owner] = tensor
        elif tensor.dtype in FP8_DTYPES:
            if name in waiting_scales:
                yield name, _paired(tensor, waiting_scales.pop(name), block, keep)
            else:
                waiting_weights[name] = tensor
        else:
            yield name, tensor
    if waiting_weights:
        raise ValueError(
            f"checkpoint lacks the block scales of {len(waiting_weights)} fp8 tensors, e.g. "
            f"{sorted(waiting_weights)[0] + SCALE_SUFFIX}"
        )
    if waiting_scales:
        raise ValueError(
            f"checkpoint has block scales without their fp8 tensor, e.g. {sorted(waiting_scales)[0] + SCALE_SUFFIX}"
        )
