"""GGUF's quantized rows kept beside a float32 weight while it loads, for Kiln's quantized CPU matmul.

The GGUF loader dequantizes every tensor to float32 (what transformers computes with on the same file) and, for
Q4_1 and Q8_0 matrices, attaches the raw blocks to the tensor it yields (`gguf_rows`). A weight loader that copies
a shard of the float32 tensor calls `keep_rows` with the same rows (or block-aligned columns); after loading,
`pop_rows` gives the weight's raw blocks when every row came from one quantized type. The kernel dequantizes
them exactly as gguf does (d x q + m in float32), so its outputs equal the float32 kernel's bit for bit while a
decode step reads 0.625 (Q4_1) or 1.06 (Q8_0) bytes per weight instead of 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

QUANT_BLOCK = 32  # weights per GGML block, along the input dimension
BYTES_PER_BLOCK = {"Q4_1": 20, "Q8_0": 34}  # fp16 scale (+ fp16 min) + the quants


@dataclass(frozen=True)
class GGUFRows:
    """Raw GGML blocks of a matrix: rows are output features, each K / 32 blocks."""

    qtype: str  # a key of BYTES_PER_BLOCK
    rows: torch.Tensor  # uint8 [N, K / 32 * bytes per block]


@dataclass
class _Gathered:
    qtype: str | None = None
    parts: dict[int, torch.Tensor] = field(default_factory=dict)  # first destination row -> raw rows
    complete: bool = True  # False once a shard came without raw blocks (or unaligned, or another type)


def keep_rows(
    param: torch.nn.Parameter, loaded: torch.Tensor, dst_row: int, src_row: int, rows: int,
    k_start: int = 0, k_len: int | None = None,
) -> None:  # fmt: skip
    """Record the raw blocks of loaded[src_row : src_row + rows, k_start : k_start + k_len] as param's rows from
    dst_row, beside the float32 copy the caller made of the same slice."""
    got: _Gathered = param.__dict__.setdefault("_kiln_gguf_rows", _Gathered())
    src: GGUFRows | None = getattr(loaded, "gguf_rows", None)
    aligned = k_start % QUANT_BLOCK == 0 and (k_len or 0) % QUANT_BLOCK == 0
    if src is None or not aligned or got.qtype not in (None, src.qtype):
        got.complete = False
        return
    raw = src.rows[src_row : src_row + rows]
    if k_len is not None:
        per_block = BYTES_PER_BLOCK[src.qtype]
        raw = raw[:, k_start // QUANT_BLOCK * per_block : (k_start + k_len) // QUANT_BLOCK * per_block]
    got.qtype = src.qtype
    got.parts[dst_row] = raw


def pop_rows(param: torch.nn.Parameter) -> GGUFRows | None:
    """The raw blocks of every row of param, in order, or None where some rows have none; forgets them."""
    got: _Gathered | None = param.__dict__.pop("_kiln_gguf_rows", None)
    if got is None or not got.complete or not got.parts or got.qtype is None:
        return None
    row, parts = 0, []
    for start in sorted(got.parts):
        if start != row:
            return None
        parts.append(got.parts[start])
        row += parts[-1].shape[0]
    if row != param.shape[0]:
        return None
    return GGUFRows(got.qtype, torch.cat(parts).contiguous())
