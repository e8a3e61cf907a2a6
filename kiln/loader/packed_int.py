"""GPTQ and AWQ checkpoints (quantization_config quant_method gptq | awq): each quantized linear is stored as
`X.qweight` (int32 words of 32 / bits low-bit values), `X.qzeros` (the groups' zero points, packed the same way),
`X.scales` (fp16, a group of input columns by an output row) and, for GPTQ, `X.g_idx` (each input column's group:
act-order puts columns of one group anywhere). The layouts are the published ones: GPTQ packs qweight along the input
dimension and qzeros along the output one, and its v1 format (`checkpoint_format` gptq, the default) stores each
zero point less one; AWQ's GEMM format packs both along the output dimension in the interleaved order
[0, 2, 4, 6, 1, 3, 5, 7] and stores zero points as they are.

The stream dequantizes each linear at load into the `X.weight` a float checkpoint holds: small integers times an
fp16 scale are exact in float32, so exact mode gives the same products as the dequantized weights. A symmetric 4-bit
GPTQ linear without act-order is exactly GGML's Q4_0, so it also carries those blocks (`gguf_rows`), which Kiln's
integer kernels multiply under --cpu-gemm auto as they do a GGUF's; the other layouts stay in float32 (no packed
low-bit kernel for them yet). The ledger counts both so (kiln.models.shapes)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kiln.layers.quant_rows import QUANT_BLOCK, GGUFRows
from kiln.models.shapes import gptq_q4_0_blocks

PARTS = ("qweight", "qzeros", "scales", "g_idx")
# column c of each group of 8 sits in nibble AWQ_COLUMN_NIBBLE[c] (AWQ packs column order[i] into nibble i)
AWQ_COLUMN_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
BITS = (2, 4, 8)  # whole values a 32-bit word (3-bit GPTQ packs across words)


@dataclass(frozen=True)
class PackedFormat:
    method: str  # gptq | awq
    bits: int
    group_size: int  # input columns a scale covers; -1: all of them
    zero_offset: int  # added to each stored zero point: 1 for GPTQ's v1 format
    desc_act: bool  # GPTQ act-order: wait for g_idx before dequantizing
    q4_0: bool = False  # each linear also as Q4_0 blocks (kiln.models.shapes.gptq_q4_0_blocks)


def packed_format(quant: dict | None) -> PackedFormat | None:
    """The checkpoint's GPTQ / AWQ layout, None for another quant_method; refuses, naming the field, a variant Kiln
    does not read (AWQ's GEMV or Marlin layouts, 3-bit GPTQ, a GPTQ checkpoint_format other than v1 / v2)."""
    method = str((quant or {}).get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        return None
    assert quant is not None
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    if bits not in BITS or (method == "awq" and bits != 4):
        raise ValueError(
            f"model config quantization_config bits {bits} ({method}) is not read by Kiln: it reads "
            f"{'4-bit AWQ' if method == 'awq' else 'GPTQ of 2, 4 or 8 bits'}"
        )
    if group != -1 and group <= 0:
        raise ValueError(f"model config quantization_config group_size {group} must be positive or -1")
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"model config quantization_config version {version!r} (AWQ) is not read by Kiln: it reads AWQ's "
                "GEMM layout (version gemm, what AutoAWQ writes by default)"
            )
        if quant.get("zero_point", True) is False:
            raise ValueError("model config quantization_config zero_point false (AWQ) is not read by Kiln")
        return PackedFormat("awq", bits, group, 0, False)
    fmt = str(quant.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"model config quantization_config checkpoint_format {fmt!r} is not read by Kiln: it reads gptq "
            "(v1) and gptq_v2"
        )
    offset, desc_act = 1 if fmt == "gptq" else 0, bool(quant.get("desc_act", False))
    return PackedFormat("gptq", bits, group, offset, desc_act, gptq_q4_0_blocks(quant))


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their values (low bits first), the values of one word consecutive along `dim` (0 or 1)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        values = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask  # [rows, per word, cols]
        return values.reshape(-1, words.shape[1])
    values = (words.unsqueeze(-1) >> shifts) & mask  # [rows, cols, per word]
    return values.reshape(words.shape[0], -1)


def dequantize(fmt: PackedFormat, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """One linear's [out, in] float32 weight from its qweight, qzeros, scales (and g_idx); a symmetric 4-bit GPTQ
    linear's carries its Q4_0 blocks too (`gguf_rows`, see q4_0_rows)."""
    q, zeros, scales, groups = _integers(fmt, parts)
    weight = ((q - zeros[groups]).float() * scales.float()[groups]).t().contiguous()
    rows = q4_0_rows(fmt, q, zeros, scales, groups)
    if rows is not None:
        weight.gguf_rows = rows  # type: ignore[attr-defined]
    return weight


def q4_0_rows(
    fmt: PackedFormat, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor
) -> GGUFRows | None:
    """A symmetric 4-bit GPTQ linear as GGML Q4_0 blocks (per 32 input columns an fp16 scale d and 16 bytes of
    nibbles, a weight d x (q - 8)), the very values dequantize gives, for Kiln's integer kernels (--cpu-gemm auto)
    to multiply in place of the float32 weight; None where the config's layout is not that (gptq_q4_0_layout) or
    the scales are not fp16. Raises where the config promises it and the linear's integers break it."""
    k, n = q.shape
    if not gptq_q4_0_layout(fmt) or k % QUANT_BLOCK or scales.dtype != torch.float16:
        return None
    if not bool((zeros == 8).all()) or not torch.equal(groups, _plain_groups(k, fmt.group_size)):
        raise ValueError(
            "GPTQ checkpoint: quantization_config says sym true and desc_act false, and a linear has zero points "
            "other than 8 or reordered columns"
        )
    blocks = q.t().reshape(n, k // QUANT_BLOCK, QUANT_BLOCK)
    nibbles = (blocks[..., :16] | (blocks[..., 16:] << 4)).to(torch.uint8)  # ggml: low nibbles the first 16
    d = scales.t()[:, groups[::QUANT_BLOCK]].contiguous()  # [N, K / 32] fp16, one per block
    raw = torch.cat((d.view(torch.uint8).view(n, k // QUANT_BLOCK, 2), nibbles), dim=-1)
    return GGUFRows("Q4_0", raw.reshape(n, -1).contiguous())


def gptq_q4_0_layout(fmt: PackedFormat) -> bool:
    """Whether a config's linears are Q4_0 blocks: kiln.models.shapes.gptq_q4_0_blocks, which the ledger counts by."""
    return fmt.q4_0


def _plain_groups(k: int, group_size: int) -> torch.Tensor:
    return torch.arange(k) // (k if group_size == -1 else group_size)


def _integers(
    fmt: PackedFormat, parts: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The linear's integers: q [in, out], zero points [groups, out], scales [groups, out] as stored, and each
    input column's group."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if fmt.method == "gptq":
        q = _unpack(qweight, fmt.bits, 0)  # [in, out]
        zeros = _unpack(qzeros, fmt.bits, 1) + fmt.zero_offset  # [groups, out]
    else:
        order = torch.tensor(AWQ_COLUMN_NIBBLE)

        def columns(words: torch.Tensor) -> torch.Tensor:
            values = _unpack(words, fmt.bits, 1)
            return values.view(values.shape[0], -1, 8)[:, :, order].reshape(values.shape[0], -1)

        q, zeros = columns(qweight), columns(qzeros)
    g_idx = parts.get("g_idx")
    groups = g_idx.long() if g_idx is not None else _plain_groups(q.shape[0], fmt.group_size)
    if scales.shape != zeros.shape or q.shape[1] != scales.shape[1] or int(groups.max()) >= scales.shape[0]:
        raise ValueError(
            f"{fmt.method} linear: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
            f"{tuple(scales.shape)} do not fit together at {fmt.bits} bits, group {fmt.group_size}"
        )
    return q, zeros, scales, groups


def dequantized_stream(
    weights: Iterator[tuple[str, torch.Tensor]], fmt: PackedFormat
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with each linear's parts (in any order, across shards) replaced by its dequantized
    `X.weight`; other tensors pass through. A g_idx that comes after its linear was dequantized must be the plain
    grouping; raises naming a linear whose parts never all came."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    done: dict[str, None] = {}
    needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if fmt.desc_act else set())
    for name, tensor in weights:
        base, _, part = name.rpartition(".")
        if part not in PARTS or (part == "g_idx" and fmt.method == "awq"):
            yield name, tensor
            continue
        if base in done:  # a late g_idx (no act-order)
            if not torch.equal(tensor.long(), _plain_groups(tensor.shape[0], fmt.group_size)):
                raise ValueError(
                    f"{name} reorders the input columns while desc_act is false in quantization_config"
                )
            continue
        parts = waiting.setdefault(base, {})
        parts[part] = tensor
        if needed <= parts.keys():
            del waiting[base]
            done[base] = None
            yield f"{base}.weight", dequantize(fmt, parts)
    if waiting:
        base, parts = next(iter(waiting.items()))
        missing = sorted(needed - parts.keys())
        raise ValueError(
            f"{fmt.method} checkpoint: {base}.{missing[0]} is missing ({len(waiting)} linears incomplete)"
        )
