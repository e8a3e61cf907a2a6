"""GGUF's quantized rows kept beside a float32 weight while it loads, for Kiln's quantized CPU matmuls.

The GGUF loader dequantizes every tensor to float32 (what transformers computes with on the same file) and, for
matrices of a type in BYTES_PER_BLOCK, attaches the raw blocks to the tensor it yields (`gguf_rows`). A weight
loader that copies a shard of the float32 tensor calls `keep_rows` with the same rows (or columns aligned to the
type's block); after loading, `pop_rows` gives the weight's raw blocks when every row came from one quantized
type. Which kernel then reads them is the --cpu-gemm mode's choice (kiln/layers/cpu_gemm.py): the integer
kernels (kiln/layers/int_gemm.py) take every type here; the exact float32 kernel takes Q4_1 and Q8_0, which it
dequantizes exactly as gguf does (d x q + m in float32), so its outputs equal the float32 kernel's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

QUANT_BLOCK = 32  # weights per GGML block of the 32-wide types, along the input dimension
SUPER_BLOCK = 256  # weights per K-quant super-block: a column shard of a K-quant matrix aligns to it
# GGML types whose blocks a load keeps (those some --cpu-gemm mode multiplies in them): bytes per block (gguf's
# GGML_QUANT_SIZES) and weights per block
BYTES_PER_BLOCK = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
WEIGHTS_PER_BLOCK = {"Q4_0": QUANT_BLOCK, "Q4_1": QUANT_BLOCK, "Q8_0": QUANT_BLOCK}
WEIGHTS_PER_BLOCK |= {"Q4_K": SUPER_BLOCK, "Q6_K": SUPER_BLOCK}


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of k weights in `qtype`'s blocks (k a multiple of the type's block)."""
    return k // WEIGHTS_PER_BLOCK[qtype] * BYTES_PER_BLOCK[qtype]


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
    dst_row, beside the float32 copy the caller made of the same slice. A column slice keeps its blocks only
    where it starts and ends on a block of the type (256 weights for the K-quants)."""
    got: _Gathered = param.__dict__.setdefault("_kiln_gguf_rows", _Gathered())
    src: GGUFRows | None = getattr(loaded, "gguf_rows", None)
    width = WEIGHTS_PER_BLOCK[src.qtype] if src is not None else QUANT_BLOCK
    aligned = k_start % width == 0 and (k_len or 0) % width == 0
    if src is None or not aligned or got.qtype not in (None, src.qtype):
        got.complete = False
        return
    raw = src.rows[src_row : src_row + rows]
    if k_len is not None:
        raw = raw[:, row_bytes(src.qtype, k_start) : row_bytes(src.qtype, k_start + k_len)]
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
