"""Attention kernels in Triton that read the paged KV pool in place, in the manner of SGLang's Triton backend.

Decode is split-K: each (request, KV head) has its KV slots cut into `splits` chunks, a first kernel computes each
chunk's softmax-weighted sum of V and its log-sum-exp for all the query heads that share the KV head (tiles of up
to 16 of them, so a K or V row is read once per tile, SGLang's grouped decode), and a second merges the chunks, so
a long context spreads over many programs rather than one. Extend runs each request's new tokens in blocks of rows
over its cached prefix (read from the pool through its slots) and then over its own new K and V, causally, with
an online softmax.

Dots take q's dtype (dot_dtype): half precision on tensor cores, float32 in IEEE float32; everything accumulates in
float32 whatever the pool's dtype. The kernels take plain tensors and integers only, no
host-side work between launches, so a captured step can replay them. On a machine without a GPU, tests run them in
Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) on CPU tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kiln.layers.triton_import import available, check_runnable, dot_dtype, tl, tl_dtype, triton

__all__ = [
    "available",
    "check_runnable",
    "decode_attention",
    "decode_splits",
    "extend_attention",
    "ExtendPlan",
    "dot_dtype",
    "extend_plan",
    "row_ends",
    "store_kv",
]


# the most query heads of a group one decode program takes (SGLang's cap): a larger group (MQA-like models with 32
# or more query heads a KV head) is spread over more programs rather than one tall tile
MAX_BLOCK_H = 16


def _pow2(n: int) -> int:
    return max(16, 1 << (max(1, n) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _attend(q, k_ptrs, v_ptrs, rows, keep, dmask, scale, top, total, acc, DOT: tl.constexpr):
        """A block of keys and values ([N, D] at k_ptrs / v_ptrs, row n read where rows[n]) folded into q's rows'
        running max, sum and weighted sum, each query row seeing the keys `keep` ([M, N]) allows."""
        both = rows[:, None] & dmask[None, :]
        k = tl.load(k_ptrs, mask=both, other=0.0).to(DOT)
        v = tl.load(v_ptrs, mask=both, other=0.0).to(DOT)
        score = tl.where(keep, tl.dot(q, tl.trans(k), input_precision="ieee") * scale, -float("inf"))
        new_top = tl.maximum(top, tl.max(score, 1))
        shift = tl.where(new_top == -float("inf"), 0.0, new_top)
        p = tl.exp(score - shift[:, None])
        alpha = tl.exp(top - shift)
        # the weights rounded to v's dtype for the tensor cores, as flash attention rounds them
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        total = total * alpha + tl.sum(p, 1)
        return new_top, total, acc

    @triton.jit
    def _decode_split_kernel(
        Q, K, V, Table, Mask, Ends, MidO, MidLse, scale,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb, stride_mb,
        width, num_heads,
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ENDS: tl.constexpr,
        DOT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        # a KV head's query heads in tiles of BLOCK_H: one tile for a group up to 16 (the usual), more beyond
        tiles = tl.cdiv(GROUP, BLOCK_H)
        kvh, tile = tl.program_id(1) // tiles, tl.program_id(1) % tiles
        s = tl.program_id(2)
        # the row's columns in use, not the table's width: a captured step's table is as wide as its graph
        row_end = tl.load(Ends + b).to(tl.int32) if HAS_ENDS else width
        per_split = tl.cdiv(row_end, SPLITS)
        start = s * per_split
        end = tl.minimum(start + per_split, row_end)
        # the GROUP query heads that share KV head kvh, as rows of one tile (padded to BLOCK_H, at least a dot's
        # 16): each K and V row is read once for all of them, not once per query head
        g = tile * BLOCK_H + tl.arange(0, BLOCK_H)
        heads = kvh * GROUP + g
        hmask = g < GROUP
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=hmask[:, None] & dmask[None, :],
            other=0.0,
        ).to(DOT)
        top = tl.full([BLOCK_H], -float("inf"), tl.float32)
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            if HAS_MASK:
                valid = valid & (tl.load(Mask + b * stride_mb + n, mask=valid, other=0) != 0)
            slot = tl.load(Table + b * stride_tb + n, mask=valid, other=0)
            top, total, acc = _attend(
                q, K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                V + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                valid, valid[None, :], dmask, scale, top, total, acc, DOT,
            )  # fmt: skip
        rows = (b * num_heads + heads) * SPLITS + s
        safe = tl.where(total > 0, total, 1.0)
        tl.store(MidO + rows[:, None] * BLOCK_D + d[None, :], acc / safe[:, None], mask=hmask[:, None])
        tl.store(MidLse + rows, tl.where(total > 0, top + tl.log(safe), -float("inf")), mask=hmask)

    @triton.jit
    def _decode_merge_kernel(
        MidO, MidLse, Out, Sinks, stride_ob, stride_oh,
        D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        row0 = (b * tl.num_programs(1) + h) * SPLITS
        s = tl.arange(0, SPLITS_P2)
        d = tl.arange(0, BLOCK_D)
        lse = tl.load(MidLse + row0 + s, mask=s < SPLITS, other=-float("inf"))
        top = tl.max(lse, 0)
        if HAS_SINKS:  # the head's sink logit joins the softmax as one more split holding no value
            sink = tl.load(Sinks + h).to(tl.float32)
            top = tl.maximum(top, sink)
        top = tl.where(top == -float("inf"), 0.0, top)
        w = tl.exp(lse - top)
        parts = tl.load(
            MidO + (row0 + s[:, None]) * BLOCK_D + d[None, :], mask=(s < SPLITS)[:, None], other=0.0
        )
        total = tl.sum(w, 0)
        if HAS_SINKS:
            total += tl.exp(sink - top)
        out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
        tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < D)

    @triton.jit
    def _extend_kernel(
        Q, Knew, Vnew, Out, K, V, PrefixSlots, PrefixStart, PrefixLen, ExtStart, ExtLen, Sinks, scale, window,
        stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh,
        stride_ks, stride_kh, stride_vs, stride_vh,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, DOT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0)
        h = tl.program_id(1)
        blk = tl.program_id(2)
        kvh = h // GROUP
        ext = tl.load(ExtLen + r)
        if blk * BLOCK_M >= ext:
            return
        first = tl.load(ExtStart + r)
        prefix = tl.load(PrefixLen + r)
        slots0 = tl.load(PrefixStart + r)
        m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        mvalid = m < ext
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        # the dots take DOT, q's dtype (K and V rows are converted to it, as a bfloat16 or fp8 pool under another
        # dtype needs): half precision runs on tensor cores accumulating in float32, float32 in IEEE float32 (the
        # exact mode's arithmetic)
        q = tl.load(
            Q + (first + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
            mask=mvalid[:, None] & dmask[None, :],
            other=0.0,
        ).to(DOT)
        top = tl.full([BLOCK_M], -float("inf"), tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # the cached prefix, through its slots in the pool: every new token sees all of it, or with a sliding
        # window the keys less than `window` positions before it (its own position is prefix + m)
        for n0 in range(0, prefix, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nvalid = n < prefix
            keep = nvalid[None, :]
            if HAS_WINDOW:
                keep = keep & (n[None, :] > prefix + m[:, None] - window)
            slot = tl.load(PrefixSlots + slots0 + n, mask=nvalid, other=0)
            top, total, acc = _attend(
                q, K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                V + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                nvalid, keep, dmask, scale, top, total, acc, DOT,
            )  # fmt: skip
        # the request's own new tokens, causally, as computed (the pool's rounding is for later steps)
        for n0 in range(0, (blk + 1) * BLOCK_M, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nvalid = n < ext
            keep = nvalid[None, :] & (n[None, :] <= m[:, None])
            if HAS_WINDOW:
                keep = keep & (n[None, :] > m[:, None] - window)
            rows = first + n
            top, total, acc = _attend(
                q, Knew + rows[:, None] * stride_knt + kvh * stride_knh + d[None, :],
                Vnew + rows[:, None] * stride_vnt + kvh * stride_vnh + d[None, :],
                nvalid, keep, dmask, scale, top, total, acc, DOT,
            )  # fmt: skip
        if HAS_SINKS:  # the head's sink logit in each row's softmax, holding no value (every row sees itself)
            total += tl.exp(tl.load(Sinks + h).to(tl.float32) - top)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(
            Out + (first + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=mvalid[:, None] & dmask[None, :],
        )

    @triton.jit
    def _store_kv_kernel(
        K, V, Slots, KPool, VPool, stride_k, stride_v, stride_kp, stride_vp, n, BLOCK: tl.constexpr
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(Slots + t).to(tl.int64)
        col = tl.arange(0, BLOCK)
        inside = col < n
        tl.store(KPool + slot * stride_kp + col, tl.load(K + t * stride_k + col, mask=inside), mask=inside)
        tl.store(VPool + slot * stride_vp + col, tl.load(V + t * stride_v + col, mask=inside), mask=inside)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> bool:
    """k and v [T, Hk, D] into the pool's rows `slots` [T] in one launch (torch's indexing takes one per tensor).
    False, with nothing written, where a row of k or v is not one contiguous run of the pool's dtype: the caller
    then stores them itself."""
    rows = (k, v, k_cache, v_cache)
    if (
        any(x.dtype != k_cache.dtype or x.stride(-1) != 1 or x.stride(-2) != x.shape[-1] for x in rows)
        or any(x.shape[1:] != k_cache.shape[1:] for x in rows)
        or slots.dim() != 1 or slots.stride(0) != 1 or slots.device != k_cache.device
        or not k.shape[0] == v.shape[0] == slots.shape[0]
    ):  # fmt: skip
        return False
    n = k.shape[1] * k.shape[2]
    if slots.shape[0]:
        _store_kv_kernel[(slots.shape[0],)](
            k, v, slots, k_cache, v_cache, k.stride(0), v.stride(0), k_cache.stride(0), v_cache.stride(0), n,
            BLOCK=_pow2(n),
        )  # fmt: skip
    return True


def decode_splits(width: int, max_splits: int, per_split: int) -> int:
    """How many chunks a decode row's KV is cut into: one per `per_split` slots of the table, at most
    max_splits."""
    return max(1, min(max_splits, -(-width // per_split)))


def row_ends(mask: torch.Tensor) -> torch.Tensor:
    """[B] int32: one past each row's last valid column of a [B, L] mask, where its KV chunks end (a decode step
    computes it once for every layer)."""
    columns = torch.arange(1, mask.shape[1] + 1, dtype=torch.int32, device=mask.device)
    return torch.where(mask != 0, columns, 0).amax(1).to(torch.int32)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    splits: int,
    dot: torch.dtype | None = None,
    ends: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] over each row's KV slots `table` [B, L] (valid where `mask` [B, L], all when None) in the pool
    k_cache / v_cache [S, Hk, D] -> [B, Hq, D] in q's dtype. `dot` overrides dot_dtype's choice. `ends` (row_ends
    of the mask) bounds each row's chunks by its columns in use rather than by L. `sinks` [Hq]: a logit per query
    head in every row's softmax whose share goes to no slot (GPT-OSS); a sliding window is the mask's."""
    b, hq, dim = q.shape
    hk = k_cache.shape[1]
    group = hq // hk
    block_d = _pow2(dim)
    mid_o = torch.empty(b, hq, splits, block_d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    has_mask = mask is not None
    mask_arg = mask if has_mask else table
    block_h = min(MAX_BLOCK_H, _pow2(group))
    _decode_split_kernel[(b, hk * triton.cdiv(group, block_h), splits)](
        q, k_cache, v_cache, table, mask_arg, ends if ends is not None else table, mid_o, mid_lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        table.stride(0), mask_arg.stride(0), table.shape[1], hq,
        GROUP=group, BLOCK_H=block_h, D=dim, BLOCK_D=block_d, BLOCK_N=32, SPLITS=splits, HAS_MASK=has_mask,
        HAS_ENDS=ends is not None, DOT=tl_dtype(dot or dot_dtype(q.dtype, q.is_cuda)),
    )  # fmt: skip
    _decode_merge_kernel[(b, hq)](
        mid_o, mid_lse, out, sinks if sinks is not None else mid_lse, out.stride(0), out.stride(1),
        D=dim, BLOCK_D=block_d, SPLITS=splits, SPLITS_P2=_pow2(splits), HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class ExtendPlan:
    """How the extend kernel is launched: its tiles (BLOCK_M query rows by BLOCK_N keys), warps, and the dtype its
    dots take."""

    block_m: int
    block_n: int
    warps: int
    dot: torch.dtype


def extend_plan(dtype: torch.dtype, head_dim: int, capability: tuple[int, int] | None) -> ExtendPlan:
    """The launch for q in `dtype` on a GPU of compute `capability`, or in Triton's interpreter (None).

    On a GPU, half precision takes SGLang's tiles for the architecture (tensor-core dots want large ones; each must
    fit the architecture's shared memory: 99 KiB a block on 8.6 and 8.9, 163 KiB on 8.0, 227 KiB on Hopper), 8
    warps past head dim 64; float32 keeps small tiles (IEEE dots hold more registers), and so does the interpreter
    (its speed). Dots take dot_dtype's."""
    if capability is None or dtype not in (torch.float16, torch.bfloat16):
        return ExtendPlan(32, 32, 4, dot_dtype(dtype, capability is not None))
    major, minor = capability
    if major >= 12:  # workstation Blackwell: about 100 KiB of shared memory
        tiles = (64, 128) if head_dim <= 128 else (64, 64) if head_dim <= 256 else (32, 32)
    elif major >= 10:
        tiles = (64, 64) if head_dim <= 256 else (16, 64)
    elif major == 9:
        tiles = (128, 64) if head_dim <= 256 else (32, 64)
    elif major == 8 and minor in (6, 9):
        tiles = (64, 128) if head_dim <= 128 else (64, 64) if head_dim <= 256 else (32, 32)
    elif major == 8:
        tiles = (128, 128) if head_dim <= 128 else (64, 64) if head_dim <= 256 else (32, 64)
    else:
        tiles = (64, 64) if head_dim <= 128 else (32, 32)
    return ExtendPlan(*tiles, 8 if head_dim > 64 else 4, dtype)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_slots: torch.Tensor,
    prefix_start: torch.Tensor,
    prefix_lens: torch.Tensor,
    ext_start: torch.Tensor,
    ext_lens: torch.Tensor,
    max_ext: int,
    scale: float,
    plan: ExtendPlan | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each request's new tokens (rows ext_start[r] .. + ext_lens[r] of q [T, Hq, D], k, v [T, Hk, D]) over its
    cached prefix (pool slots prefix_slots[prefix_start[r] .. + prefix_lens[r]]) and themselves, causally ->
    [T, Hq, D] in q's dtype. `plan` overrides extend_plan's (tests run the GPU's tiles in the interpreter).
    `window`: each token sees its last `window` keys, itself included; `sinks` [Hq]: a logit per query head in
    every row's softmax whose share goes to no key."""
    t, hq, dim = q.shape
    out = torch.empty_like(q)
    if t == 0:
        return out
    plan = plan or extend_plan(q.dtype, dim, _capability(q.device.index or 0) if q.is_cuda else None)
    grid = (ext_lens.shape[0], hq, -(-max_ext // plan.block_m))
    _extend_kernel[grid](
        q, k, v, out, k_cache, v_cache, prefix_slots, prefix_start, prefix_lens, ext_start, ext_lens,
        sinks if sinks is not None else prefix_start, scale, window or 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        GROUP=hq // k.shape[1], D=dim, BLOCK_D=_pow2(dim), BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        DOT=tl_dtype(plan.dot), HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        num_warps=plan.warps, num_stages=1,
    )  # fmt: skip
    return out
