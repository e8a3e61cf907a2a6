"""Which activations the step's fused Triton kernels (kiln.layers.triton_fused) serve: half-precision ones on CUDA.
The check runs before Triton is imported, so a CPU process never imports it for them."""

from __future__ import annotations

from types import ModuleType

import torch

from kiln.core import envs

HALF_DTYPES = (torch.bfloat16, torch.float16)
# envs.KILN_TRITON_FUSED: "auto" (CUDA), "all" (the CPU too, in Triton's interpreter), "off"; read once, at import
MODE = envs.triton_fused()


def kernels(x: torch.Tensor) -> ModuleType | None:
    """kiln.layers.triton_fused when it serves x, else None (the caller's torch code runs)."""
    if x.dtype not in HALF_DTYPES or MODE == "off" or not (x.is_cuda or MODE == "all"):
        return None
    from kiln.layers import triton_fused

    return triton_fused if triton_fused.available() else None
