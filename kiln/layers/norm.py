"""RMSNorm, computed in float32 as the reference implementation does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers.cpu_gemm import eager_cpu_kernel


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; the same arithmetic as below
            kernel = eager_cpu_kernel(x)
            # one call instead of F.rms_norm's chain of ATen ops, whose per-op overhead outweighs the arithmetic
            # at decode sizes (docs/benchmarks.md)
            if kernel is not None:
                return kernel.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
