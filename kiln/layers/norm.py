"""RMSNorm, computed in float32 as the reference implementation does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers import fused
from kiln.layers.cpu_gemm import cpu_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; the same arithmetic as below
            # one call instead of F.rms_norm's chain of ATen ops, whose per-op overhead outweighs the arithmetic
            # at decode sizes (docs/benchmarks.md); compiled steps call it too, for the eager step's bits
            kernel = cpu_rms_norm(x)
            if kernel is not None:
                return kernel(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        kernels = fused.kernels(x)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, the norm of that sum): the residual stream's add and the norm after it, one kernel where
        the fused kernels serve x."""
        kernels = fused.kernels(x)
        if kernels is not None:
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)
        total = residual + x
        return total, self(total)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint's weight is an offset from 1, and the normed x is scaled by (1 + weight) in
    float32 before the cast back to x's dtype (transformers' Gemma2RMSNorm / Gemma3RMSNorm), where Llama's rounds
    the normed x first."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__(hidden, eps)
        self.weight.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        if x.dtype == torch.float32:  # Llama's float32 arithmetic with (1 + weight) for its weight
            kernel = cpu_rms_norm(x)
            if kernel is not None:
                return kernel(x, scale, self.eps)
            return F.rms_norm(x, scale.shape, scale, self.eps)
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * scale).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + x  # the fused kernels scale by the weight itself, not by 1 + weight
        return total, self(total)
