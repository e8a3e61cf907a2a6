"""Kiln's CPU matmul on GGML-quantized weights (Q4_1, Q8_0) kept quantized: the raw GGML rows re-laid by 16-column
block (pack_q4_1 / pack_q8_0) and dequantized inside the kernel give products bit-identical to the float32 kernel on
the weight gguf dequantizes, at every row count (the decode path that expands in registers and the prefill path that
expands each block into a buffer)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.layers import cpu_gemm

Q = gguf.GGMLQuantizationType
AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
# Skipped only where the kernel cannot exist; on an AVX2 CPU a failed build fails the `kernel` fixture. The kernel
# is asked for directly, so --cpu-gemm (which only decides what a model load packs into) does not matter here.
pytestmark = [pytest.mark.unit, pytest.mark.skipif(not AVX2, reason="Kiln's CPU kernel needs AVX2 and FMA")]

FORMATS = {Q.Q4_1: ("pack_q4_1", "linear_q4_1", 20, 320), Q.Q8_0: ("pack_q8_0", "linear_q8_0", 34, 544)}


@pytest.fixture(scope="module")
def kernel():
    k = cpu_gemm.blocked_kernel()
    assert k is not None, "the CPU has AVX2 but Kiln's CPU kernel failed to build (see the logged warning)"
    return k


def quantized(qtype: Q, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Raw GGML rows of a random [n, k] weight whose rows span many magnitudes (fp16 subnormal scales included), a
    constant row (d = 0) and a zero row; and the float32 weight gguf dequantizes from them."""
    rng = np.random.default_rng(seed)
    magnitudes = (10.0 ** rng.uniform(-7, 3, (n, 1))).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32) * magnitudes
    w[0] = 0.5
    w[-1] = 0.0
    raw = gguf.quants.quantize(w, qtype)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())


def reference_pack(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """The packed layout, spelled out in numpy (blocked_gemm.cpp documents it)."""
    _, _, block_bytes, chunk_bytes = FORMATS[qtype]
    n = raw.shape[0]
    blocks = raw.reshape(n // 16, 16, -1, block_bytes).transpose(0, 2, 1, 3)  # [N/16, K/32, col, GGML block]
    scales = blocks[..., :2].reshape(*blocks.shape[:2], 32)  # d[16]
    if qtype == Q.Q4_1:
        mins = blocks[..., 2:4].reshape(*blocks.shape[:2], 32)  # m[16]
        qs = blocks[..., 4:]  # [.., col, j]: k = j low nibble, k = j + 16 high nibble
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).swapaxes(-1, -2)  # [.., k, col]
        rows = q[..., :8] | (q[..., 8:] << 4)  # byte i: col i low, col i + 8 high
        out = np.concatenate([scales, mins, rows.reshape(*blocks.shape[:2], 256)], axis=-1)
    else:
        q = blocks[..., 2:].swapaxes(-1, -2)  # [.., k, col]
        out = np.concatenate([scales, q.reshape(*blocks.shape[:2], 512)], axis=-1)
    assert out.shape[-1] == chunk_bytes
    return out


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("n, k", [(16, 32), (48, 576), (1536, 1536)])
def test_quantized_linear_is_bit_identical_to_float32(kernel, qtype, n, k):
    """Every row count of both paths: 1-4 rows expand in registers (one row over two blocks at a time, an odd block
    left over at N = 48), 5+ rows expand each block into a buffer (4-row tiles and every remainder)."""
    pack, linear, _, _ = FORMATS[qtype]
    raw, w = quantized(qtype, n, k, seed=n + k)
    packed = getattr(kernel, pack)(torch.from_numpy(raw))
    fp32 = kernel.pack(w)
    for m in [1, 2, 3, 4, 5, 6, 7, 8, 33]:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = getattr(kernel, linear)(x, packed)
        assert torch.equal(got, kernel.linear(x, fp32)), f"{m} rows"
        ref = F.linear(x.double(), w.double()).float()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * float(w.abs().max()) * k**0.5)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_packed_layout(kernel, qtype):
    pack, _, _, chunk_bytes = FORMATS[qtype]
    raw, _ = quantized(qtype, 48, 96, seed=1)
    packed = getattr(kernel, pack)(torch.from_numpy(raw))
    assert packed.dtype == torch.uint8 and packed.shape == (3, 3, chunk_bytes)
    np.testing.assert_array_equal(packed.numpy(), reference_pack(raw, qtype))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_empty_input_and_non_contiguous_input(kernel, qtype):
    pack, linear, _, _ = FORMATS[qtype]
    raw, w = quantized(qtype, 32, 64, seed=2)
    packed = getattr(kernel, pack)(torch.from_numpy(raw))
    assert getattr(kernel, linear)(torch.zeros(0, 64), packed).shape == (0, 32)
    x = torch.randn(64, 6).t()  # [6, 64], not contiguous
    assert torch.equal(getattr(kernel, linear)(x, packed), kernel.linear(x.contiguous(), kernel.pack(w)))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_bad_shapes_raise(kernel, qtype):
    pack, linear, block_bytes, _ = FORMATS[qtype]
    pack, linear = getattr(kernel, pack), getattr(kernel, linear)
    raw, _ = quantized(qtype, 32, 64, seed=3)
    raw = torch.from_numpy(raw)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        pack(raw[:24])
    with pytest.raises(RuntimeError, match=f"whole {block_bytes}-byte blocks"):
        pack(raw[:, :-1])
    with pytest.raises(RuntimeError, match="2-D uint8"):
        pack(raw.float())
    with pytest.raises(RuntimeError, match="2-D uint8"):
        pack(raw.flatten())
    packed = pack(raw)
    with pytest.raises(RuntimeError, match=r"input's K \(32\) is not the weight's \(64\)"):
        linear(torch.randn(2, 32), packed)
    with pytest.raises(RuntimeError, match="2-D float32 input"):
        linear(torch.randn(2, 64, dtype=torch.float64), packed)
    with pytest.raises(RuntimeError, match="a weight from pack_"):
        linear(torch.randn(2, 64), kernel.pack(torch.randn(32, 64)))
    other = kernel.pack_q8_0 if qtype == Q.Q4_1 else kernel.pack_q4_1
    other_raw, _ = quantized(Q.Q8_0 if qtype == Q.Q4_1 else Q.Q4_1, 32, 64, seed=4)
    with pytest.raises(RuntimeError, match="a weight from pack_"):
        linear(torch.randn(2, 64), other(torch.from_numpy(other_raw)))
