"""y = x W^T with W held in FP8 blocks: DeepSeek-V3's and Kimi-K2's block-quantized weights multiplied as stored.

W is float8_e4m3fn [N, K] with one float32 factor per block of it (`scale_inv` [ceil(N / bn), ceil(K / bk)],
weight = fp8 value x factor). Each program computes a [BM, BN] tile of y: it walks K one weight block at a time,
converts the block's fp8 values to x's dtype (exact: every e4m3 value is a bfloat16, float16 and float32 value),
takes the dot in that dtype with float32 accumulation (dot_dtype: float32 for bfloat16 in the interpreter), and
scales the block's partial sum by the block's factor, as SGLang's block FP8 kernels scale theirs. So the weights
cross HBM at one byte each, half of bfloat16's, which is what a decode step's time is made of, and never exist
dequantized in memory: DeepSeek-V3 fits where its bfloat16 copy would not.

The activation stays in its own dtype (weight-only FP8): the dots run on the bfloat16 tensor cores every
architecture with Triton's e4m3 conversion has. A float32 activation (the exact mode) takes IEEE float32 dots.
Without a GPU the kernel runs in Triton's interpreter, for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.layers.triton_import import available, dot_dtype, tl, tl_dtype, triton

__all__ = [
    "GroupedRows",
    "available",
    "expert_blocks",
    "fp8_block_linear",
    "fp8_grouped_linear",
    "group_rows",
]

MIN_BLOCK_M = 16  # the smallest tile tl.dot takes: decode's few rows pad to it
MAX_BLOCK_M = 64  # a prefill's rows: each weight tile is read once per 64 rows, within Ada's shared memory


if triton is not None:

    @triton.jit
    def _fp8_block_matmul_kernel(
        X, W, S, Y, BlockExpert, BlockRow, BlockRows, M, N, K,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
        NUM_EXPERTS, BLOCK_N_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, GROUPED: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        if GROUPED:  # this block's rows are consecutive rows of one expert's, which the tables name
            expert = tl.load(BlockExpert + pid_m)
            if expert >= NUM_EXPERTS:  # a block past the last expert's rows (the grid is sized for the most)
                return
            first, count = tl.load(BlockRow + pid_m), tl.load(BlockRows + pid_m)
            W += expert.to(tl.int64) * stride_we
            S += expert.to(tl.int64) * stride_se
        else:
            first, count = pid_m * BLOCK_M, M - pid_m * BLOCK_M
        offs = tl.arange(0, BLOCK_M)
        rows = first.to(tl.int64) + offs  # row * stride passes 2**31 in a long prefill
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_in, col_in = offs < count, cols < N
        x_ptrs = X + rows[:, None] * stride_xm + ks[None, :]
        w_ptrs = W + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]  # W^T's tile: [BLOCK_K, BLOCK_N]
        # BLOCK_N divides the scale block's rows, so each column of the tile has its own row of factors
        s_ptrs = S + (cols // BLOCK_N_SCALE) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_in = ks < K - kb * BLOCK_K
            x = tl.load(x_ptrs, mask=row_in[:, None] & k_in[None, :], other=0.0).to(DOT)
            w = tl.load(w_ptrs, mask=k_in[:, None] & col_in[None, :], other=0.0).to(DOT)
            partial = tl.dot(x, w, input_precision=PRECISION)
            acc += partial * tl.load(s_ptrs + kb, mask=col_in, other=0.0)[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y_ptrs = Y + rows[:, None] * stride_ym + cols[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


def _block_m(rows: int, dot: torch.dtype) -> int:
    """The tile's rows: as many as the input has up to 64, in half precision; float32 (the exact mode, whose
    operands are twice as wide) keeps 16."""
    if dot == torch.float32:
        return MIN_BLOCK_M
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, 1 << (rows - 1).bit_length()))


def _block_n(block_rows: int) -> int:
    """The tile's output columns: 64 where the scale block allows (a tile within one block of factors)."""
    for n in (64, 32, 16):
        if block_rows % n == 0:
            return n
    raise ValueError(f"FP8 weight blocks of {block_rows} rows: Kiln's kernel takes a multiple of 16")


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
    bias: torch.Tensor | None = None, dot: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [..., K] (bfloat16, float16 or float32) times the fp8 weight [N, K] with its block factors -> [..., N]
    in x's dtype. `dot` overrides dot_dtype's choice."""
    flat = _rows(x, weight.shape[-1])
    y = torch.empty((flat.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    if flat.shape[0]:
        dot = dot or dot_dtype(x.dtype, x.is_cuda)
        block_m = _block_m(flat.shape[0], dot)
        _launch(flat, weight.unsqueeze(0), scale_inv.unsqueeze(0), y, block, block_m, dot, None)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y


@dataclass(frozen=True)
class GroupedRows:
    """Rows sorted by expert, cut into blocks within one expert each (`expert_blocks`), and the dot dtype their
    products take: laid out once for a step's routed experts, read by both their projections."""

    block_m: int
    dot: torch.dtype
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # each block's expert, first row, row count


def group_rows(
    expert_ids: torch.Tensor, experts: int, x: torch.Tensor, dot: torch.dtype | None = None
) -> GroupedRows:
    """The layout of x's rows, sorted by expert (expert_ids [T] ascending; ids >= experts: another rank's
    expert), for fp8_grouped_linear. `dot` overrides dot_dtype's choice."""
    dot = dot or dot_dtype(x.dtype, x.is_cuda)
    block_m = _block_m(max(1, x.shape[0]), dot)
    return GroupedRows(block_m, dot, expert_blocks(expert_ids, experts, block_m))


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    groups: GroupedRows,
) -> torch.Tensor:
    """Rows sorted by expert, each times its own expert's fp8 weight: x [T, K], weight [E, N, K] with factors
    [E, ceil(N / bn), ceil(K / bk)], laid out by `group_rows` -> [T, N] (other ranks' experts' rows zero). The
    blocks of rows were cut on the device (SGLang's moe_align_block_size), so nothing is read back to the host and
    a CUDA graph can hold it."""
    flat = _rows(x, weight.shape[-1])
    y = torch.zeros((flat.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
    if flat.shape[0]:
        _launch(flat, weight, scale_inv, y, block, groups.block_m, groups.dot, groups.tables)
    return y


def expert_blocks(expert_ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """For rows sorted by expert: each block's expert (`experts` for a block past the last one), first row and
    row count, every block within one expert's rows, for as many blocks as the rows could ever need (one part
    block per expert at most): static shapes, computed on the device."""
    ids = expert_ids.to(torch.int64)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids.clamp(max=experts), torch.ones_like(ids))
    counts = counts[:experts]
    starts = counts.cumsum(0) - counts  # each expert's first row
    blocks = (counts + block_m - 1) // block_m
    block_ends = blocks.cumsum(0)  # each expert's blocks end here
    most = triton.cdiv(ids.shape[0], block_m) + min(experts, ids.shape[0])
    index = torch.arange(most, device=ids.device)
    expert = torch.searchsorted(block_ends, index, right=True)
    mine = expert.clamp(max=experts - 1)
    within = index - (block_ends[mine] - blocks[mine])  # the block's place among its expert's
    first = starts[mine] + within * block_m
    rows = (counts[mine] - within * block_m).clamp(0, block_m)
    return expert.to(torch.int32), first.to(torch.int32), rows.to(torch.int32)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"input of {x.shape[-1]} features for an FP8 weight of {k}")
    flat = x.reshape(-1, k)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _launch(x, weight, scale_inv, y, block, block_m, dot, tables) -> None:
    """One launch over x's rows (blocks of block_m rows, or the tables' blocks) and y's columns."""
    block_rows, block_k = block
    block_n = _block_n(block_rows)
    blocks = triton.cdiv(x.shape[0], block_m) if tables is None else tables[0].shape[0]
    experts, n, k = weight.shape
    expert_of, first, count = tables if tables is not None else (x, x, x)  # unread when not grouped
    _fp8_block_matmul_kernel[(blocks, triton.cdiv(n, block_n))](
        x, weight, scale_inv, y, expert_of, first, count, x.shape[0], n, k,
        x.stride(0), weight.stride(0), weight.stride(1), scale_inv.stride(0), scale_inv.stride(1), y.stride(0),
        experts, BLOCK_N_SCALE=block_rows, BLOCK_K=block_k, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT=tl_dtype(dot), PRECISION="ieee" if dot == torch.float32 else "tf32", GROUPED=tables is not None,
    )  # fmt: skip
