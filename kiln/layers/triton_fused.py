"""The step's elementwise work fused into single Triton kernels: RMSNorm (with the residual add before it),
SiLU-and-multiply, and rotary embedding of q and k.

Unfused, a bf16 RMSNorm is eight kernels (upcast, square, mean, add eps, rsqrt, scale, downcast, weight), each
reading and writing the whole activation; on a GPU at decode sizes the launches, not the arithmetic, are the cost,
and they are what a captured graph replays. Each kernel here reads its input once and writes its output once, with
the arithmetic in float32 and rounding to the activation's dtype where the unfused torch code rounds, so it
computes what that code computes. They serve half-precision activations on CUDA; float32 (the exact mode, compared
token for token with transformers) keeps torch's own ops. Without a GPU, tests run them in Triton's interpreter.
"""

from __future__ import annotations

import torch

from kiln.layers.triton_import import available, tl, triton

__all__ = ["add_rms_norm", "available", "rms_norm", "rotary", "silu_and_mul"]


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        X, R, W, Y, Sum, stride_x, stride_r, stride_y, stride_s, n, eps,
        BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in a long prefill
        col = tl.arange(0, BLOCK)
        inside = col < n
        x = tl.load(X + row * stride_x + col, mask=inside, other=0.0)
        if HAS_RESIDUAL:  # the residual stream's add, rounded as the unfused `h + out` rounds it
            x = (
                x.to(tl.float32) + tl.load(R + row * stride_r + col, mask=inside, other=0.0).to(tl.float32)
            ).to(Sum.dtype.element_ty)
            tl.store(Sum + row * stride_s + col, x, mask=inside)
        x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
        normed = (x * rstd).to(Y.dtype.element_ty).to(tl.float32)
        w = tl.load(W + col, mask=inside, other=0.0).to(tl.float32)
        tl.store(Y + row * stride_y + col, (normed * w).to(Y.dtype.element_ty), mask=inside)

    @triton.jit
    def _silu_mul_kernel(GU, Out, stride_gu, stride_out, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in a long prefill
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = col < n
        gate = tl.load(GU + row * stride_gu + col, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(GU + row * stride_gu + n + col, mask=inside, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
        tl.store(Out + row * stride_out + col, (silu * up).to(Out.dtype.element_ty), mask=inside)

    @triton.jit
    def _rotary_kernel(
        X, CosSin, Out, stride_xt, stride_xh, stride_ct, stride_cs, stride_ot, stride_oh,
        HALF: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, BLOCK)
        inside = i < HALF
        x = X + t * stride_xt + h * stride_xh
        lo = tl.load(x + i, mask=inside, other=0.0).to(tl.float32)
        hi = tl.load(x + HALF + i, mask=inside, other=0.0).to(tl.float32)
        cos = CosSin + t * stride_ct
        sin = cos + stride_cs  # the table's sine has its first half negated: rotate_half folded in
        cos_lo = tl.load(cos + i, mask=inside, other=0.0).to(tl.float32)
        cos_hi = tl.load(cos + HALF + i, mask=inside, other=0.0).to(tl.float32)
        sin_lo = tl.load(sin + i, mask=inside, other=0.0).to(tl.float32)
        sin_hi = tl.load(sin + HALF + i, mask=inside, other=0.0).to(tl.float32)
        out = Out + t * stride_ot + h * stride_oh
        tl.store(out + i, (lo * cos_lo + hi * sin_lo).to(Out.dtype.element_ty), mask=inside)
        tl.store(out + HALF + i, (hi * cos_hi + lo * sin_hi).to(Out.dtype.element_ty), mask=inside)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with unit stride along the last dimension (a copy only where no such view exists)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    xs = _rows(x)
    n = xs.shape[1]
    out = torch.empty(xs.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    rs = _rows(residual) if residual is not None else xs
    _rms_norm_kernel[(xs.shape[0],)](
        xs, rs, weight, out, total, xs.stride(0), rs.stride(0), out.stride(0), total.stride(0), n, eps,
        BLOCK=_pow2(n), HAS_RESIDUAL=residual is not None,
    )  # fmt: skip
    return out.view(x.shape), total.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's last dimension: normed in float32, rounded to x's dtype, times weight."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)) in one pass: the residual stream and what the next block reads."""
    normed, total = _norm(x, residual, weight, eps)
    return total, normed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over [..., 2n] holding gate then up."""
    gu = _rows(gate_up)
    n = gu.shape[1] // 2
    out = torch.empty((gu.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(n))
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(n, block))](
        gu, out, gu.stride(0), out.stride(0), n, BLOCK=block
    )
    return out.view(*gate_up.shape[:-1], n)


def rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated: x * cos + roll(x, D/2) * sin_signed, with cos_sin [2, T, 1, D] (RotaryEmbedding's)."""
    t, h, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    table = cos_sin.reshape(2, -1, d)
    if table.stride(-1) != 1:
        table = table.contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    half = d // 2
    _rotary_kernel[(t, h)](
        x, table, out, x.stride(0), x.stride(1), table.stride(1), table.stride(0), out.stride(0), out.stride(1),
        HALF=half, BLOCK=_pow2(half),
    )  # fmt: skip
    return out
