"""The LoRA delta on CUDA as two Triton kernels over the batch's rows, each row reading its own slot's weights (a
segmented gathered matmul: SGLang's and Punica's BGMV shape). Shrink: xa = scaling[slot] * A[slot] x, every
sub-projection's rank at once; expand: y[:, part] += B_part[slot]^T xa_part. A row of slot -1 (the base model)
computes and writes nothing. The slot ids are read on the device, so a captured graph replays any batch's adapters.
Without a GPU, tests run them in Triton's interpreter."""

from __future__ import annotations

import torch

from kiln.layers.triton_import import tl, triton


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


if triton is not None:

    @triton.jit
    def _shrink_kernel(
        X, A, Slots, Scaling, XA, stride_x, stride_as, stride_an, stride_xa, K, N,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        slot = tl.load(Slots + row)
        if slot >= 0:
            n = tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(X + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
                a = tl.load(
                    A + slot * stride_as + n[:, None] * stride_an + k[None, :],
                    mask=(n[:, None] < N) & (k[None, :] < K),
                    other=0.0,
                ).to(tl.float32)
                acc += tl.sum(a * x[None, :], axis=1)
            scale = tl.load(Scaling + slot)
            tl.store(XA + row * stride_xa + n, acc * scale, mask=n < N)

    @triton.jit
    def _expand_kernel(
        XA, B, Slots, Y, stride_xa, xa_offset, stride_bs, stride_br, stride_y, y_offset, R, OUT,
        BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        slot = tl.load(Slots + row)
        if slot >= 0:
            r = tl.arange(0, BLOCK_R)
            o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
            xa = tl.load(XA + row * stride_xa + xa_offset + r, mask=r < R, other=0.0)
            b = tl.load(
                B + slot * stride_bs + r[:, None] * stride_br + o[None, :],
                mask=(r[:, None] < R) & (o[None, :] < OUT),
                other=0.0,
            ).to(tl.float32)
            delta = tl.sum(xa[:, None] * b, axis=0)
            ptr = Y + row * stride_y + y_offset + o
            y = tl.load(ptr, mask=o < OUT, other=0.0).to(tl.float32)
            tl.store(ptr, (y + delta).to(Y.dtype.element_ty), mask=o < OUT)


def lora_delta_triton(x: torch.Tensor, y: torch.Tensor, w) -> torch.Tensor:
    """y (updated in place) plus each row's delta under its slot (kiln.layers.lora.LoraWeights `w`)."""
    batch = w.batch
    x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    t = x2.shape[0]
    if t == 0:
        return y
    x2 = x2.contiguous()
    slots = batch.slot_ids[:t]
    n, k, r = w.a.shape[1], w.a.shape[2], batch.max_rank
    xa = torch.empty(t, n, dtype=torch.float32, device=x.device)
    _shrink_kernel[(t,)](
        x2, w.a, slots, batch.scaling, xa, x2.stride(0), w.a.stride(0), w.a.stride(1), xa.stride(0), k, n,
        BLOCK_N=_pow2(n), BLOCK_K=min(128, _pow2(k)),
    )  # fmt: skip
    for i, (_, offset, size) in enumerate(w.parts):
        b = w.b[i]
        block_o = min(128, _pow2(size))
        _expand_kernel[(t, triton.cdiv(size, block_o))](
            xa, b, slots, y2, xa.stride(0), i * r, b.stride(0), b.stride(1), y2.stride(0), offset, r, size,
            BLOCK_R=_pow2(r), BLOCK_O=block_o,
        )  # fmt: skip
    return y
