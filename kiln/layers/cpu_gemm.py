"""Prepacked weights for CPU matmuls.

oneDNN can reorder a linear layer's weight once, at load, into its blocked layout; the matmul then skips the
per-call reorder and, on this project's CPUs, runs 1.5-1.9x faster than `F.linear` (MKL) at decode batch sizes
(docs/benchmarks.md). This is the weight prepacking that inductor's `freezing` does, applied in eager mode.
Only float32 is packed: oneDNN's bf16 path needs AVX-512 BF16 or AVX-NE-CONVERT, which these CPUs may lack.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger("kiln")

# the batch size oneDNN picks its blocking for: decode batches are what prepacking speeds up
PACK_BATCH_HINT = 32


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where that is unavailable (non-CPU, non-fp32)."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)
    except RuntimeError as e:  # an oneDNN build without this path
        logger.warning(f"weight prepacking unavailable, using F.linear: {e}")
        return None


# The prepacked matmul as one opaque op, so a compiled step calls it as it is instead of decomposing it into an
# `mm` that cannot read oneDNN's layout. Registered with the dispatcher directly: `torch.library.custom_op`
# wraps it in autograd machinery that cost ~62 us a call from compiled code (this: ~13 us).
_lib = torch.library.Library("kiln", "DEF")
_lib.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.impl(
    "packed_linear",
    lambda x, weight, bias: torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], ""),
    "CompositeExplicitAutograd",
)


@torch.library.register_fake("kiln::packed_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


packed_linear = torch.ops.kiln.packed_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> torch.Tensor:
    """`packed` comes from the layer (a traced weight does not report its layout)."""
    if not packed:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return packed_linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def prepack_module_weights(model: torch.nn.Module) -> int:
    """Calls `prepack_weights()` on every layer that has one; returns how many weights were packed."""
    return sum(int(m.prepack_weights()) for m in model.modules() if hasattr(m, "prepack_weights"))
