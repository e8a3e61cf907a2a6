"""Kiln's integer CPU matmuls (kiln/layers/int_gemm.py): the C++ scalar path gives the pure-torch reference's bits,
every instruction-set path this CPU runs gives the scalar path's bits, and the products stay close to float32's on
the dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.layers import int_gemm

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(int_gemm.kernel() is None, reason="the integer kernel could not be built here"),
]

GGUF_QUANTIZED = (
    "Q4_0",
    "Q4_1",
    "Q8_0",
)  # the types gguf-py quantizes; the K-quants are built from random bytes
ROWS_OF_X = (1, 3, 17, 600)  # decode, row tiles and their remainders, more than one panel of prefill rows


def _half_bytes(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(*values.shape, 2)


def raw_rows(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Raw rows of a random matrix: gguf-py's quantization of Gaussian weights, or (K-quants) random bytes with
    small valid fp16 scales."""
    rng = np.random.default_rng(seed)
    if qtype == "I8":
        return int_gemm.quantize_int8_rows(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)))
    if qtype in GGUF_QUANTIZED:
        import gguf

        weights = rng.standard_normal((n, k)).astype(np.float32)
        return torch.from_numpy(gguf.quants.quantize(weights, gguf.GGMLQuantizationType[qtype]))
    blocks = rng.integers(0, 256, (n, k // 256, int_gemm.RAW_BYTES[qtype]), dtype=np.uint8)
    if qtype == "Q4_K":
        blocks[..., 0:2] = _half_bytes(rng.uniform(1e-3, 1e-2, (n, k // 256)))  # d
        blocks[..., 2:4] = _half_bytes(rng.uniform(1e-3, 1e-2, (n, k // 256)))  # dmin
    else:  # Q6_K
        blocks[..., 208:210] = _half_bytes(rng.uniform(5e-4, 2e-3, (n, k // 256)))
    return torch.from_numpy(blocks.reshape(n, -1))


def shapes(qtype: str) -> list[tuple[int, int]]:
    """(N, K): N not a multiple of 16 (padded rows), and a K of several blocks."""
    return [(40, 512), (16, 256)] if int_gemm.WEIGHTS_PER_BLOCK[qtype] == 256 else [(40, 512), (16, 96)]


def activations(m: int, k: int, width: int) -> torch.Tensor:
    """x [m, k]: rows of every magnitude, and (from 3 rows) a block of zeros, whose int8 scale is 0."""
    x = torch.randn(m, k) * torch.logspace(-3, 3, m)[:, None]
    if m >= 3:
        x[1, :width] = 0
    return x


@pytest.fixture(scope="module")
def products() -> dict:
    """qtype -> [(rows, x, {isa: kernel's product})] over every shape and number of rows."""
    torch.manual_seed(0)
    out: dict = {}
    try:
        for qtype in int_gemm.QTYPES:
            for n, k in shapes(qtype):
                rows = raw_rows(qtype, n, k)
                packed = int_gemm.pack(qtype, rows)
                for m in ROWS_OF_X:
                    x = activations(m, k, int_gemm.WEIGHTS_PER_BLOCK[qtype])
                    by_isa = {}
                    for isa in int_gemm.available_isas():
                        int_gemm.set_isa(isa)
                        by_isa[isa] = int_gemm.linear(x, packed, qtype, n, k)
                    out.setdefault(qtype, []).append((rows, x, by_isa))
    finally:
        int_gemm.set_isa(None)
    return out


@pytest.mark.parametrize("qtype", int_gemm.QTYPES)
def test_scalar_path_gives_the_reference_bits(products, qtype):
    for rows, x, by_isa in products[qtype]:
        assert torch.equal(by_isa["scalar"], int_gemm.reference_linear(x, rows, qtype)), (
            qtype,
            tuple(x.shape),
        )


@pytest.mark.parametrize("qtype", int_gemm.QTYPES)
def test_every_instruction_set_gives_the_scalar_bits(products, qtype):
    for _, x, by_isa in products[qtype]:
        for isa, y in by_isa.items():
            assert torch.equal(y, by_isa["scalar"]), (qtype, isa, tuple(x.shape))


# the error of int8 activations per block on top of the weights' own: the K-quants' activations share one scale
# over 256 values, so they round coarser
ERROR_BOUND = {"Q4_K": 0.02, "Q6_K": 0.02}


@pytest.mark.parametrize("qtype", int_gemm.QTYPES)
def test_close_to_float32_on_the_dequantized_weights(products, qtype):
    for rows, x, by_isa in products[qtype]:
        exact = x @ int_gemm.dequantize(rows, qtype).T
        error = ((by_isa["scalar"] - exact).norm() / exact.norm()).item()
        assert error < ERROR_BOUND.get(qtype, 0.015), (qtype, tuple(x.shape), error)


def test_the_unpacked_integers_dequantize_as_gguf_does():
    for qtype in int_gemm.QTYPES[:-1]:
        rows = raw_rows(qtype, 16, 512, seed=1)
        unpacked = int_gemm.dequantize_unpacked(int_gemm.unpack_rows(rows, qtype))
        assert torch.equal(unpacked, int_gemm.dequantize(rows, qtype)), qtype


def test_int8_rows_keep_each_rows_scale():
    weight = torch.randn(24, 64) * torch.linspace(0.01, 10, 24)[:, None]
    back = int_gemm.dequantize(int_gemm.quantize_int8_rows(weight), "I8")
    step = weight.abs().amax(1, keepdim=True) / 127
    assert ((back - weight).abs() <= step / 2 + 1e-6 * step).all()
    assert int_gemm.quantize_int8_rows(torch.zeros(16, 32)).view(torch.uint8).any(dim=1).logical_not().all()


def test_the_opaque_op_and_leading_dimensions():
    rows = raw_rows("Q4_0", 32, 64)
    packed = int_gemm.pack("Q4_0", rows)
    x = torch.randn(2, 3, 64)
    y = torch.ops.kiln.int_linear(x, packed, "Q4_0", 32, 64)
    assert y.shape == (2, 3, 32)
    assert torch.equal(y, int_gemm.linear(x, packed, "Q4_0", 32, 64))
    assert torch.equal(y.reshape(6, 32), int_gemm.reference_linear(x.reshape(6, 64), rows, "Q4_0"))
    with pytest.raises(ValueError, match="the input's K 32 is not the weight's 64"):
        int_gemm.linear(torch.randn(1, 32), packed, "Q4_0", 32, 64)
    with pytest.raises(RuntimeError, match="bytes per 16 rows do not match"):
        int_gemm.linear(torch.randn(1, 64), packed, "Q4_1", 32, 64)
    with pytest.raises(RuntimeError, match="n \\(48\\) vs 2 blocks"):
        int_gemm.linear(torch.randn(1, 64), packed, "Q4_0", 48, 64)


def test_activations_on_rounding_ties_round_half_to_even_on_every_path():
    """Each block's largest value 127 makes the int8 scale 1, so the other values are exact products: x.5 ties
    must round half to even on every path (the vector paths convert under the default rounding mode) and
    values of +-127 must not wrap."""
    k, n = 64, 32
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 127.0, -127.0, 3.49, -3.51])
    x = torch.cat([torch.tensor([127.0]), ties.repeat(6)[: k // 2 - 1]]).repeat(2, 2)
    act = int_gemm.quantize_activations(x, 32)
    assert act.q[0, 1:4].tolist() == [0, 2, 2] and act.q[0, 7:11].tolist() == [126, -126, 127, -127]
    rows = raw_rows("Q8_0", n, k)
    packed = int_gemm.pack("Q8_0", rows)
    try:
        for isa in int_gemm.available_isas():
            int_gemm.set_isa(isa)
            assert torch.equal(
                int_gemm.linear(x, packed, "Q8_0", n, k), int_gemm.reference_linear(x, rows, "Q8_0")
            )
    finally:
        int_gemm.set_isa(None)


def test_a_compiled_step_calls_the_cpp_kernels_on_the_path_set():
    """kiln::int_linear and kiln::decode_attention have C++ CPU kernels, so a compiled step's calls never enter
    Python; the integer one follows set_isa()."""
    from kiln.layers import cpu_gemm

    assert cpu_gemm.blocked_kernel() is not None
    for op in ("kiln::int_linear", "kiln::decode_attention"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"), op
    ext = int_gemm.kernel()
    try:
        for isa in int_gemm.available_isas():
            int_gemm.set_isa(isa)
            assert ext.isa() == int_gemm.ISAS.index(isa)
    finally:
        int_gemm.set_isa(None)
    assert ext.isa() == int_gemm.ISAS.index(int_gemm.available_isas()[-1])
    with pytest.raises(ValueError, match="unknown quantized type 'Q9'"):
        torch.ops.kiln.int_linear(
            torch.randn(1, 64), int_gemm.pack("Q4_0", raw_rows("Q4_0", 32, 64)), "Q9", 32, 64
        )


def test_set_isa_refuses_an_instruction_set_the_cpu_lacks(monkeypatch):
    monkeypatch.setattr(int_gemm, "_detected_isas", lambda: ("scalar", "avx2"))
    assert int_gemm.available_isas() == ["scalar", "avx2"]
    with pytest.raises(ValueError, match="'avx512vnni' is not supported by this CPU"):
        int_gemm.set_isa("avx512vnni")
    with pytest.raises(ValueError, match="'sse9' is unknown"):
        int_gemm.set_isa("sse9")
    int_gemm.set_isa("avx2")
    try:
        assert int_gemm.current_isa() == "avx2"
    finally:
        int_gemm.set_isa(None)
    assert int_gemm.current_isa() == "avx2"  # the best of what the (patched) detection reports
    monkeypatch.undo()
    int_gemm.set_isa(None)  # the C++ kernel of the compiled steps back on this CPU's best path
    assert int_gemm.kernel().isa() == int_gemm.ISAS.index(int_gemm.available_isas()[-1])


def test_the_float32_kernels_avx512_path_gives_the_avx2_bits():
    """Kiln's float32 kernel (csrc/blocked_gemm.cpp) takes AVX-512 where the CPU has it: the same FMAs per output
    in the same order as its AVX2 path, so the same products, also for the GGUF blocks it expands from 5 rows."""
    from kiln.layers import cpu_gemm

    kernel = cpu_gemm.blocked_kernel()
    if kernel is None or not kernel.avx512_enabled():
        pytest.skip("no AVX-512 here")
    torch.manual_seed(0)
    weight = torch.randn(48, 96)
    packed, q4_1 = kernel.pack(weight), kernel.pack_q4_1(raw_rows("Q4_1", 48, 96))
    xs = [torch.randn(m, 96) for m in (1, 3, 5, 8, 13, 600)]
    products = {}
    try:
        for avx512 in (False, True):
            kernel.set_avx512(avx512)
            products[avx512] = [(kernel.linear(x, packed), kernel.linear_q4_1(x, q4_1)) for x in xs]
    finally:
        kernel.set_avx512(True)
    for x, avx2, avx512 in zip(xs, products[False], products[True], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(avx2, avx512, strict=True)), tuple(x.shape)
