"""Layers holding FP8 block weights as the checkpoint stores them (DeepSeek-V3, Kimi-K2), where
kiln.platform.fp8_weights_kept says so: one byte a weight instead of bfloat16's two, so the model fits on half the
memory and a decode step reads half the bytes.

The model is built on `meta`; `convert_to_fp8` then turns each weight a layer names in `fp8_weight_names` (every
linear layer's `weight`, the routed experts' stacked projections) into float8_e4m3fn and registers its block
factors beside it as a buffer `<name>_scale_inv` (a leading expert dimension kept), before anything is allocated.
A weight loader copies its shard of the fp8 values as it would any weight's and calls `copy_blocks` for the same
shard of the factors: a shard must start and end on a block (or at the tensor's end), so a tensor-parallel split
that cuts a block is refused with the numbers. Buffers start as NaN (`materialize`), so `check_blocks_loaded`
finds a weight whose factors no loader copied. The layers multiply with kiln.layers.triton_fp8's kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # an fp8 weight's block factors: `X.weight` -> `X.weight_scale_inv`
FIX = "or start with KILN_FP8_WEIGHTS=dequantize (bfloat16 weights, twice the memory)"


@dataclass(frozen=True)
class Fp8Blocks:
    """The block factors of an fp8 checkpoint tensor, attached to it as `fp8_blocks` by a stream that keeps FP8."""

    scale_inv: torch.Tensor  # float32 [ceil(R / br), ceil(C / bc)]
    block: tuple[int, int]  # (br, bc)


def check_scales(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"fp8 weight {tuple(weight.shape)} with blocks {block} needs scales {expected}, "
            f"got {tuple(scale_inv.shape)}"
        )


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[R, C] fp8 values and [ceil(R / br), ceil(C / bc)] block scales -> the float32 weight."""
    check_scales(weight, scale_inv, block)
    rows, cols = weight.shape
    br, bc = block
    full = scale_inv.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return weight.float() * full[:rows, :cols]


def as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as a parameter of `dtype` takes it: an fp8 tensor with its blocks stays as it is for an
    fp8 parameter and is dequantized for any other; every other tensor is converted."""
    blocks: Fp8Blocks | None = getattr(tensor, "fp8_blocks", None)
    if blocks is not None:
        return (
            tensor
            if dtype == tensor.dtype
            else dequantize_blocks(tensor, blocks.scale_inv, blocks.block).to(dtype)
        )
    if FP8 in (dtype, tensor.dtype):  # a cast would saturate or drop the factors: a weight read as noise
        raise ValueError(
            f"a {tensor.dtype} checkpoint tensor of shape {tuple(tensor.shape)} for a {dtype} parameter, without "
            "FP8 block scales: Kiln holds in FP8 only what an FP8 block-quantized checkpoint (quantization_config "
            f"quant_method fp8, X.weight with X.weight_scale_inv) stores so; {FIX}"
        )
    return tensor.to(dtype)


def convert_to_fp8(model: nn.Module, block: tuple[int, int]) -> None:
    """On meta: every weight a module names in `fp8_weight_names` becomes fp8 with a factors buffer. Sets each such
    module's `fp8_block`, which its forward reads."""
    for module in model.modules():
        for name in getattr(module, "fp8_weight_names", ()):
            old: nn.Parameter = getattr(module, name)
            new = nn.Parameter(torch.empty(old.shape, dtype=FP8, device="meta"), requires_grad=False)
            new.__dict__.update(old.__dict__)  # the weight_loader
            setattr(module, name, new)
            *lead, rows, cols = old.shape
            factors = (*lead, -(-rows // block[0]), -(-cols // block[1]))
            scale = torch.empty(factors, dtype=torch.float32, device="meta")
            module.register_buffer(name + SCALE_SUFFIX, scale, persistent=False)
            module.fp8_block = block


def copy_blocks(
    module: nn.Module, name: str, loaded: torch.Tensor, dim: int, dst: int, src: int, length: int,
    expert: int | None = None,
) -> None:  # fmt: skip
    """The factors of loaded's `length` rows (dim 0) or columns (dim 1) from `src` into module's `<name>` factors
    from `dst` (of `expert`'s, for stacked experts), beside the caller's copy of the same fp8 values. Nothing for
    a weight held in another dtype."""
    scale: torch.Tensor | None = getattr(module, name + SCALE_SUFFIX, None)
    if scale is None:
        return
    what = f"{type(module).__name__}.{name}"
    blocks: Fp8Blocks | None = getattr(loaded, "fp8_blocks", None)
    if blocks is None:
        raise ValueError(
            f"{what} holds FP8 blocks, and its checkpoint tensor is {loaded.dtype} without block scales: "
            f"the checkpoint does not quantize every layer this model holds in FP8; {FIX}"
        )
    side = blocks.block[dim]
    whole = loaded.shape[dim]
    if dst % side or src % side or (length % side and src + length != whole):
        axis = "rows" if dim == 0 else "columns"
        raise ValueError(
            f"{what}: this rank's shard of {length} {axis} (from {src} of {whole}) cuts the FP8 weight blocks of "
            f"{side}: each rank's part must be a multiple of {side}. Use a --tp-size (or --ep-size) that splits "
            f"{whole} {axis} into multiples of {side}, {FIX}"
        )
    n = -(-length // side)
    target = scale if expert is None else scale[expert]
    target.narrow(dim, dst // side, n).copy_(blocks.scale_inv.narrow(dim, src // side, n))


def check_blocks_loaded(model: nn.Module) -> None:
    """Raises naming the first FP8 weight some of whose block factors no loader copied (still NaN)."""
    for name, buffer in model.named_buffers():
        if name.endswith(SCALE_SUFFIX) and torch.isnan(buffer).any():
            raise ValueError(f"{name}: the load copied no block factors for part of this FP8 weight")


def block_factor_bytes(model: nn.Module) -> int:
    """The bytes of the FP8 weights' block factors (buffers, so not among the parameters)."""
    return sum(b.nbytes for name, b in model.named_buffers() if name.endswith(SCALE_SUFFIX))
