"""SiLU-and-multiply over a merged gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.layers import fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernels = fused.kernels(gate_up)
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
