"""Triton, imported the one way Kiln's kernels need it.

Without a GPU the kernels run in Triton's interpreter, which must be chosen (TRITON_INTERPRET=1) before Triton is
first imported: kernels are decorated at import. Every Kiln module with Triton kernels imports Triton from here.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Triton 3.9 warns at every first compile that its default (fused multiply-adds) is about to change; Kiln keeps
# them, as torch's own CUDA kernels are compiled with them
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

try:
    import triton
    import triton.language as tl
except ImportError:  # Kiln runs without Triton; what needs it says how to get it
    triton = None
    tl = None


def dot_dtype(dtype: torch.dtype, gpu: bool) -> torch.dtype:
    """The dtype a kernel's dots take for operands in `dtype`: its own (half precision on tensor cores,
    accumulating in float32; float32 in IEEE float32, the exact mode's arithmetic), except bfloat16 in Triton's
    interpreter, which multiplies bfloat16 dot operands wrongly (Triton 3.9): float32 there, which holds the same
    values and their exact products."""
    return torch.float32 if dtype == torch.bfloat16 and not gpu else dtype


def tl_dtype(dtype: torch.dtype):
    """Triton's dtype for a torch dtype (a constexpr argument of a kernel)."""
    return getattr(tl, str(dtype).removeprefix("torch."))


def available() -> bool:
    return triton is not None


def check_runnable(what: str) -> None:
    """Raises where Triton kernels cannot run: without a GPU they need Triton's interpreter, which is chosen when
    Triton is first imported (importing a transformers model class imports it too), so a process that imported it
    before Kiln could choose must be started with TRITON_INTERPRET=1."""
    if torch.cuda.is_available() or not isinstance(tl.zeros, triton.runtime.jit.JITFunction):
        return
    raise RuntimeError(
        f"{what} without a GPU runs Triton's interpreter, but Triton was imported before Kiln could choose it: "
        "start with TRITON_INTERPRET=1"
    )
