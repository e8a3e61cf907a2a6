"""Integer CPU matmuls for quantized weights, as llama.cpp computes them.

Each activation row is rounded to int8 in blocks (32 weights for Q4_0, Q4_1, Q8_0 and I8; 256 for the K-quants,
whose integer sub-block scales need one activation scale across the super-block), the dot products of a block
accumulate exactly in int32 and the weight and activation scales apply in float32. The integer instructions do two
to four times the work of a float32 FMA per instruction, which is what quantized checkpoints' users already accept
from llama.cpp; the exact float32 path stays in kiln/layers/cpu_gemm.py.

Weight formats (QTYPES): GGUF's Q4_0, Q4_1, Q8_0, Q4_K and Q6_K raw rows, and I8: int8 weights with one float32
scale per output row (per channel), each raw row K int8 bytes followed by the scale's 4 bytes (little-endian), as
quantize_int8_rows() makes them from a float32 weight.

`pack()` re-lays the rows once, at load, into Kiln's layout (uint8 [ceil(N / 16), bytes per 16 rows]): for each
16 output rows, per block of K, the 16 rows' scales and then their quants in 64-byte vectors, each 32-bit lane one
row's 4 consecutive K values, so one vpdpbusd (or vpmaddubsw + vpmaddwd) gives 16 rows' (8 on AVX2) partial sums
against 4 broadcast activation bytes. Every float32 operation is then one per output and in the same order on every
instruction set, so all of them (csrc/int_gemm.cpp: AVX-512 VNNI, AVX-VNNI, AVX2, scalar; chosen at call time from
what the CPU has) give the same bits, and `reference_linear()` does exactly that arithmetic in torch.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kiln.layers.extension_loader import load_extension

logger = logging.getLogger("kiln")

QTYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "I8")
ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni")  # slowest first: the last one the CPU has is the default
ROWS = 16  # output rows (features) per packed block
BLOCK = 32  # weights per block of Q4_0, Q4_1, Q8_0 and of I8's activations
SUPER = 256  # weights per K-quant super-block
# weights per block along K (of the weights' scales and of the activations') and raw bytes per block
WEIGHTS_PER_BLOCK = {"Q4_0": BLOCK, "Q4_1": BLOCK, "Q8_0": BLOCK, "Q4_K": SUPER, "Q6_K": SUPER, "I8": BLOCK}
RAW_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "int_gemm.cpp")


# ---- the raw rows, unpacked into integers and float32 scales ----


@dataclass(frozen=True)
class Unpacked:
    """A quantized matrix's integers and scales: w[n, k] is a function of these (see dequantize_unpacked)."""

    qtype: str
    q: torch.Tensor  # int32 [N, K]: the stored integers (0..15, 0..63 or -128..127)
    d: torch.Tensor  # float32 [N, K / block]: the scale of each block (I8: [N, 1], the row's)
    m: torch.Tensor | None = None  # float32 [N, K / block]: Q4_1's min, the K-quants' dmin
    sub_scales: torch.Tensor | None = None  # int32 [N, K / sub-block]: Q4_K's 6-bit scales, Q6_K's int8 ones
    sub_mins: torch.Tensor | None = None  # int32 [N, K / 32]: Q4_K's 6-bit mins


def _half(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 -> float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """GGML's packed nibbles [..., 16] -> [..., 32]: byte j holds value j (low) and value j + 16 (high)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1).int()


def _blocks(rows: torch.Tensor, qtype: str) -> torch.Tensor:
    if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.shape[1] % RAW_BYTES[qtype]:
        raise ValueError(
            f"{qtype} rows: expected a 2-D uint8 tensor of whole {RAW_BYTES[qtype]}-byte blocks, got "
            f"{rows.dtype} of shape {tuple(rows.shape)}"
        )
    return rows.reshape(rows.shape[0], -1, RAW_BYTES[qtype])


def _q4_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes of 6-bit scales and mins [..., 12] -> scales [..., 8], mins [..., 8] (ggml's
    get_scale_min_k4)."""
    s = scales.int()
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], -1), torch.cat([low_m, high_m], -1)


def _q6_k_quants(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Q6_K's low nibbles [..., 128] and high bit pairs [..., 64] -> the 256 6-bit values (ggml's order: per half
    of 128, four runs of 32 from ql's low nibbles, ql's upper 32 bytes' low nibbles, then the high nibbles, with
    bit pairs 0-1, 2-3, 4-5, 6-7 of qh)."""
    ql, qh = ql.int(), qh.int()
    halves = []
    for h in range(2):
        low, high = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
        runs = [low[..., :32] & 0xF, low[..., 32:] & 0xF, low[..., :32] >> 4, low[..., 32:] >> 4]
        halves += [run | (((high >> (2 * i)) & 3) << 4) for i, run in enumerate(runs)]
    return torch.cat(halves, -1)


def unpack_rows(rows: torch.Tensor, qtype: str) -> Unpacked:
    """Raw rows (GGUF blocks, or I8's) -> their integers and float32 scales."""
    if qtype == "I8":
        n, k = rows.shape[0], rows.shape[1] - 4
        q = rows[:, :k].contiguous().view(torch.int8).int()
        return Unpacked(qtype, q, rows[:, k:].contiguous().view(torch.float32).reshape(n, 1))
    blocks = _blocks(rows, qtype)
    n = blocks.shape[0]
    if qtype == "Q4_0":
        return Unpacked(qtype, _nibbles(blocks[..., 2:]).reshape(n, -1), _half(blocks[..., 0:2]))
    if qtype == "Q4_1":
        q = _nibbles(blocks[..., 4:]).reshape(n, -1)
        return Unpacked(qtype, q, _half(blocks[..., 0:2]), _half(blocks[..., 2:4]))
    if qtype == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).int().reshape(n, -1)
        return Unpacked(qtype, q, _half(blocks[..., 0:2]))
    if qtype == "Q4_K":
        scales, mins = _q4_k_scales(blocks[..., 4:16])
        qs = blocks[..., 16:].reshape(n, -1, 4, 32)  # four runs of 64: 32 low nibbles, then their high ones
        q = torch.cat([qs & 0xF, qs >> 4], -1).int().reshape(n, -1)
        return Unpacked(
            qtype,
            q,
            _half(blocks[..., 0:2]),
            _half(blocks[..., 2:4]),
            scales.reshape(n, -1),
            mins.reshape(n, -1),
        )
    if qtype == "Q6_K":
        q = _q6_k_quants(blocks[..., 0:128], blocks[..., 128:192]).reshape(n, -1)
        scales = blocks[..., 192:208].contiguous().view(torch.int8).int().reshape(n, -1)
        return Unpacked(qtype, q, _half(blocks[..., 208:210]), sub_scales=scales)
    raise ValueError(f"unknown quantized type {qtype!r}: expected one of {', '.join(QTYPES)}")


def _per_weight(values: torch.Tensor, k: int) -> torch.Tensor:
    """[N, K / width] -> [N, K], each value repeated over its block."""
    return values.repeat_interleave(k // values.shape[1], dim=1).float()


def dequantize_unpacked(u: Unpacked) -> torch.Tensor:
    k = u.q.shape[1]
    q, d = u.q.float(), _per_weight(u.d, k)
    if u.qtype == "Q4_0":
        return d * (q - 8)
    if u.qtype == "Q4_1":
        return d * q + _per_weight(u.m, k)
    if u.qtype == "Q4_K":
        scale = d * _per_weight(u.sub_scales, k)
        return scale * q - _per_weight(u.m, k) * _per_weight(u.sub_mins, k)
    if u.qtype == "Q6_K":
        return d * _per_weight(u.sub_scales, k) * (q - 32)
    return d * q  # Q8_0, I8


def dequantize(rows: torch.Tensor, qtype: str) -> torch.Tensor:
    """The float32 weight [N, K] of raw rows: gguf-py's dequantize for GGUF types (what transformers loads), the
    int8 values times the row's scale for I8."""
    if qtype == "I8":
        return dequantize_unpacked(unpack_rows(rows, qtype))
    import gguf

    array = gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def quantize_int8_rows(weight: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> I8 raw rows uint8 [N, K + 4]: each row rounded to int8 against its largest magnitude
    (symmetric, -127..127), followed by the float32 scale that multiplies it back."""
    weight = weight.detach().float()
    amax = weight.abs().amax(dim=1, keepdim=True)
    scale = amax / torch.full_like(amax, 127.0)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(weight * inverse).clamp(-127, 127).to(torch.int8)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1).contiguous()


# ---- the activations ----


@dataclass(frozen=True)
class Activations:
    """Rows of x rounded to int8 in blocks: x[m, k] ~ d[m, k / block] * q[m, k]."""

    q: torch.Tensor  # int32 [M, K], -127..127
    d: torch.Tensor  # float32 [M, K / block]
    sums: torch.Tensor  # int32 [M, K / 16]: sums of q over runs of 16 (the offsets' and mins' terms)


def quantize_activations(x: torch.Tensor, block: int) -> Activations:
    """Each block of `block` values of x [M, K] as int8 against its largest magnitude: d = amax / 127, q =
    round-half-even(x * (127 / amax)), all zeros for a block of zeros. The kernel computes the same, operation for
    operation (a division, not a reciprocal multiply)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // block, block)
    amax = blocks.abs().amax(dim=-1)
    d = amax / torch.full_like(amax, 127.0)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse[..., None]).int().reshape(m, k)
    return Activations(q, d, q.reshape(m, k // 16, 16).sum(-1, dtype=torch.int32))


# ---- the reference: the kernels' arithmetic in torch ----


def _dots(q: torch.Tensor, a: torch.Tensor, width: int) -> torch.Tensor:
    """Exact integer dot products per run of `width` along K: q [N, K], a [M, K] -> int64 [M, N, K / width]
    (float64 holds every such sum exactly)."""
    n, k = q.shape
    qa = q.double().reshape(n, k // width, width)
    aa = a.double().reshape(a.shape[0], k // width, width)
    return torch.einsum("nbw,mbw->mnb", qa, aa).round().long()


def _run_sums(sums16: torch.Tensor, width: int) -> torch.Tensor:
    """int32 [M, K / 16] -> int64 [M, K / width]."""
    return sums16.long().reshape(sums16.shape[0], -1, width // 16).sum(-1)


def _block_terms(u: Unpacked, act: Activations) -> Callable[[int], torch.Tensor]:
    """For block b along K, the float32 [M, N] term each output adds, computed as the kernel does."""
    d_w, d_a = u.d, act.d
    if u.qtype in ("Q4_0", "Q4_1", "Q8_0", "I8"):
        dots = _dots(u.q, act.q, BLOCK)
        sums = _run_sums(act.sums, BLOCK)[:, None, :]
        isum = (dots - 8 * sums if u.qtype == "Q4_0" else dots).int().float()

        def term(b: int) -> torch.Tensor:
            scale = d_w[:, 0 if u.qtype == "I8" else b][None, :] * d_a[:, b][:, None]
            product = isum[..., b] * scale
            if u.qtype != "Q4_1":
                return product
            sum_a = d_a[:, b] * sums[:, 0, b].int().float()
            return product + u.m[:, b][None, :] * sum_a[:, None]

        return term
    if u.qtype == "Q4_K":
        dots = _dots(u.q, act.q, BLOCK)  # [M, N, K / 32]
        scaled = (dots * u.sub_scales.long()[None]).reshape(*dots.shape[:2], -1, 8).sum(-1).int().float()
        sums = _run_sums(act.sums, BLOCK)
        mins = (sums[:, None, :] * u.sub_mins.long()[None]).reshape(*dots.shape[:2], -1, 8).sum(-1)
        mins = mins.int().float()
        return lambda b: (
            scaled[..., b] * (d_w[:, b][None, :] * d_a[:, b][:, None])
            - mins[..., b] * (u.m[:, b][None, :] * d_a[:, b][:, None])
        )
    dots = _dots(u.q, act.q, 16) - 32 * act.sums.long()[:, None, :]  # Q6_K
    scaled = (dots * u.sub_scales.long()[None]).reshape(*dots.shape[:2], -1, 16).sum(-1).int().float()
    return lambda b: scaled[..., b] * (d_w[:, b][None, :] * d_a[:, b][:, None])


def reference_linear(x: torch.Tensor, rows: torch.Tensor, qtype: str) -> torch.Tensor:
    """x [..., K] float32 against raw rows (N outputs) -> [..., N]: the integer kernels' arithmetic in torch, the
    float32 block terms added in K order (the kernels give these bits)."""
    u = unpack_rows(rows, qtype)
    n, k = u.q.shape
    x2 = x.reshape(-1, k).float()
    act = quantize_activations(x2, WEIGHTS_PER_BLOCK[qtype])
    term = _block_terms(u, act)
    y = torch.zeros(x2.shape[0], n)
    for b in range(k // WEIGHTS_PER_BLOCK[qtype]):
        y = y + term(b)
    return y.reshape(*x.shape[:-1], n)


# ---- Kiln's packed layout ----


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [ceil(N / 16) * 16, ...], zero rows added (their outputs are dropped)."""
    extra = -t.shape[0] % ROWS
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def _grouped(q: torch.Tensor, width: int) -> torch.Tensor:
    """int [N, K] (N a multiple of 16) -> [N / 16, K / width, width / 4, 16, 4]: per block of 16 rows and run of
    `width` K values, vectors of 16 lanes of 4 consecutive K values."""
    n, k = q.shape
    return q.reshape(n // ROWS, ROWS, k // width, width // 4, 4).permute(0, 2, 3, 1, 4)


def _nibble_vectors(q: torch.Tensor) -> torch.Tensor:
    """4-bit values [N, K] -> uint8 [N / 16, K / 32, 256]: vector v's lane holds K values 8v..8v+3 in its low
    nibbles and 8v+4..8v+7 in its high ones."""
    g = _grouped(q, BLOCK)  # [Nb, K/32, 8, 16, 4]
    packed = g[:, :, 0::2] | (g[:, :, 1::2] << 4)
    return packed.to(torch.uint8).reshape(*g.shape[:2], -1)


def _byte_vectors(q: torch.Tensor) -> torch.Tensor:
    """8-bit values [N, K] -> uint8 [N / 16, K / 32, 512], vector v's lanes holding K values 4v..4v+3."""
    g = _grouped(q, BLOCK)
    return (g & 0xFF).to(torch.uint8).reshape(*g.shape[:2], -1)


def _crumb_vectors(q: torch.Tensor) -> torch.Tensor:
    """The top two bits of 6-bit values [N, K] -> uint8 [N / 16, K / 32, 128]: vector h's byte holds, in bits
    2t..2t+1, the value of K group 4h + t (K values 4(4h + t) + j, j the byte's place in its lane)."""
    g = (_grouped(q, BLOCK) >> 4).reshape(q.shape[0] // ROWS, q.shape[1] // BLOCK, 2, 4, ROWS, 4)
    packed = g[:, :, :, 0] | (g[:, :, :, 1] << 2) | (g[:, :, :, 2] << 4) | (g[:, :, :, 3] << 6)
    return packed.to(torch.uint8).reshape(*g.shape[:2], -1)


def _lanes(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, B] per row and block -> uint8 [N / 16, B, 16 * itemsize]: each block's 16 rows' values."""
    n, b = values.shape
    v = values.to(dtype).reshape(n // ROWS, ROWS, b).transpose(1, 2).contiguous()
    return v.view(torch.uint8).reshape(n // ROWS, b, -1)


def _by_super_block(t: torch.Tensor, supers: int) -> torch.Tensor:
    """[Nb, K / 32 or K / 16 ..., bytes] -> [Nb, K / 256, rest]: what each super-block's chunk holds."""
    return t.reshape(t.shape[0], supers, -1)


def pack(qtype: str, rows: torch.Tensor) -> torch.Tensor:
    """Raw rows (GGUF blocks [N, K / block * bytes]; I8 rows from quantize_int8_rows) -> Kiln's packed layout,
    uint8 [ceil(N / 16), bytes per 16 rows]. Per 16 rows, block by block along K (I8: the 16 row scales, float32,
    first): the scales as fp16 (Q4_1 then its mins; Q4_K d, dmin, then the 8 sub-block scales and 8 mins as
    bytes; Q6_K d then the 16 int8 sub-block scales), then the quants in 64-byte vectors (_nibble_vectors,
    _byte_vectors; Q6_K's low nibbles then _crumb_vectors per 32 K values)."""
    u = unpack_rows(rows, qtype)
    if not fits(qtype, u.q.shape[1]):
        raise ValueError(f"{qtype} pack: K ({u.q.shape[1]}) must be a multiple of {WEIGHTS_PER_BLOCK[qtype]}")
    q = _pad_rows(u.q)
    half = torch.float16
    if qtype == "I8":
        scales = _lanes(_pad_rows(u.d), torch.float32).reshape(q.shape[0] // ROWS, -1)
        return torch.cat([scales, _byte_vectors(q).reshape(scales.shape[0], -1)], 1).contiguous()
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        parts = [_lanes(_pad_rows(u.d), half)]
        parts += [_lanes(_pad_rows(u.m), half)] if qtype == "Q4_1" else []
        parts += [_byte_vectors(q) if qtype == "Q8_0" else _nibble_vectors(q)]
    elif qtype == "Q4_K":
        supers = q.shape[1] // SUPER
        parts = [_lanes(_pad_rows(u.d), half), _lanes(_pad_rows(u.m), half)]
        parts += [
            _by_super_block(_lanes(_pad_rows(s), torch.uint8), supers) for s in (u.sub_scales, u.sub_mins)
        ]
        parts += [_by_super_block(_nibble_vectors(q), supers)]
    else:  # Q6_K
        supers = q.shape[1] // SUPER
        parts = [
            _lanes(_pad_rows(u.d), half),
            _by_super_block(_lanes(_pad_rows(u.sub_scales), torch.int8), supers),
        ]
        quants = torch.cat([_nibble_vectors(q & 0xF), _crumb_vectors(q)], -1)
        parts += [_by_super_block(quants, supers)]
    return torch.cat(parts, -1).reshape(q.shape[0] // ROWS, -1).contiguous()


def fits(qtype: str, k: int) -> bool:
    """Whether the kernels take a matrix of `qtype` with k inputs: K whole blocks of the type (and of the int8
    activations' blocks, for I8)."""
    return qtype in WEIGHTS_PER_BLOCK and k > 0 and k % WEIGHTS_PER_BLOCK[qtype] == 0


def packed_bytes_per_row_block(qtype: str, k: int) -> int:
    """Bytes pack() gives per 16 rows of k weights (the memory a packed matrix holds: ceil(N / 16) times this)."""
    per_block = {"Q4_0": 288, "Q4_1": 320, "Q8_0": 544, "Q4_K": 2368, "Q6_K": 3360, "I8": 512}[qtype]
    return k // WEIGHTS_PER_BLOCK[qtype] * per_block + (64 if qtype == "I8" else 0)


# ---- the kernel ----


@functools.cache
def kernel():
    """The integer kernels' extension (built on first use, then loaded from torch's extension cache), or None
    where the build fails (a warning says why). Built without instruction-set flags: each ISA's code path carries
    its own target, so one build runs on any x86-64 CPU."""
    t0 = time.perf_counter()
    try:
        ext = load_extension("kiln_int_gemm", [_SOURCE], flags=["-O3", "-ffp-contract=off", "-fopenmp"])
    except Exception as e:  # no compiler, no ninja
        logger.warning(f"Kiln's integer CPU matmul kernel could not be built: {e}")
        return None
    logger.info(f"Kiln's integer CPU matmul kernel loaded in {time.perf_counter() - t0:.1f} s.")
    return ext


def _detected_isas() -> tuple[str, ...]:
    """The instruction sets this CPU runs, from the kernel's cpuid check (scalar alone where it is not built)."""
    ext = kernel()
    return tuple(ext.cpu_isas()) if ext is not None else ("scalar",)


_isa: str | None = None  # set_isa(): None = the best this CPU has
# the path's index in ISAS, resolved once: a decode step makes hundreds of calls
_isa_index: int | None = None
_FORMATS = {qtype: index for index, qtype in enumerate(QTYPES)}  # the kernel's number for each type


def available_isas() -> list[str]:
    """The instruction-set paths this CPU can run, slowest first."""
    detected = _detected_isas()
    return [isa for isa in ISAS if isa in detected]


def set_isa(name: str | None) -> None:
    """Pin the code path the kernels take (tests, benchmarks); None goes back to the best this CPU has. A
    ValueError names an unknown path or one this CPU lacks."""
    global _isa, _isa_index
    if name is not None and name not in available_isas():
        known = "unknown" if name not in ISAS else "not supported by this CPU"
        raise ValueError(
            f"instruction set {name!r} is {known}: this CPU runs {', '.join(available_isas())} (of {', '.join(ISAS)})"
        )
    _isa, _isa_index = name, None
    ext = kernel()
    if ext is not None:  # kiln::int_linear's C++ kernel (a compiled step's calls) takes the same path
        ext.set_isa(ISAS.index(current_isa()))


def current_isa() -> str:
    """The path the kernels take now."""
    return _isa if _isa is not None else available_isas()[-1]


def _linear(x: torch.Tensor, packed: torch.Tensor, qtype: str, n: int, k: int) -> torch.Tensor:
    """The kernel's call; it checks the weight's bytes against K and n (a RuntimeError) and x's dtype."""
    global _isa_index
    if qtype not in _FORMATS:
        raise ValueError(f"unknown quantized type {qtype!r}: expected one of {', '.join(QTYPES)}")
    if x.shape[-1] != k:
        raise ValueError(f"{qtype} linear: the input's K {x.shape[-1]} is not the weight's {k}")
    ext = kernel()
    if ext is None:
        raise RuntimeError("Kiln's integer CPU matmul kernel is not built here (the warning above says why)")
    if _isa_index is None:
        _isa_index = ISAS.index(current_isa())
    return ext.linear(x, packed, _FORMATS[qtype], n, _isa_index)


# Registered with the dispatcher directly (as cpu_gemm's ops are), so a compiled step calls the kernel as it is;
# the extension registers its C++ function as the CPU kernel, which the dispatcher prefers to this Python one (a
# Python frame per matmul cost several microseconds, hundreds of times a step), and this one serves until the
# extension is loaded.
_lib = torch.library.Library("kiln", "FRAGMENT")
_lib.define("int_linear(Tensor x, Tensor packed, str qtype, int n, int k) -> Tensor")
_lib.impl("int_linear", _linear, "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::int_linear")
def _(x: torch.Tensor, packed: torch.Tensor, qtype: str, n: int, k: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


def linear(x: torch.Tensor, packed: torch.Tensor, qtype: str, n: int, k: int) -> torch.Tensor:
    """x float32 [..., K] against a weight from pack(qtype, rows) with n outputs -> float32 [..., n]: the opaque op
    inside a compiled step, the kernel itself eagerly."""
    if torch.compiler.is_compiling():
        return torch.ops.kiln.int_linear(x, packed, qtype, n, k)
    return _linear(x, packed, qtype, n, k)
