"""MXFP4 checkpoints (GPT-OSS: quantization_config quant_method mxfp4): the experts' projections are stored as
`X_blocks` (uint8, two FP4 e2m1 values a byte, [.., rows, blocks, 16]) and `X_scales` (uint8 e8m0 exponents, one
per block of 32 values), everything else in bf16. Kiln has no MXFP4 kernel, so the stream dequantizes each pair at
load (transformers' own conversion, exact in bfloat16) into the tensor a bf16 checkpoint holds under the name `X`;
the ledger counts the experts at the serving dtype (kiln.models.shapes)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4_config(quant: dict | None) -> bool:
    return bool(quant) and str(quant.get("quant_method", "")).lower() == "mxfp4"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, rows, blocks, 16] and [E, rows, blocks] -> [E, blocks x 32, rows] in bfloat16: transformers' layout
    of a bf16 GPT-OSS checkpoint's expert tensors."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match their scales {tuple(scales.shape)}"
        )
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)


def dequantized_stream(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with each `X_blocks` and `X_scales` pair (in any order, across shards) replaced by
    the dequantized `X`; other tensors pass through. Raises naming a half whose other half never came."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in (BLOCKS, SCALES) if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        halves = waiting.setdefault(base, {})
        halves[suffix] = tensor
        if len(halves) == 2:
            del waiting[base]
            yield base, dequantize(halves[BLOCKS], halves[SCALES])
    if waiting:
        name, halves = next(iter(waiting.items()))
        missing = SCALES if BLOCKS in halves else BLOCKS
        raise ValueError(f"MXFP4 checkpoint: {name}{missing} is missing ({len(waiting)} tensors incomplete)")
