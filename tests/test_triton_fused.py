"""Kiln's fused Triton kernels (kiln.layers.triton_fused: RMSNorm with and without the residual add, SiLU-and-multiply,
rotary) against the torch code they replace, and a bfloat16 model whose layers run them. In float32 the kernels'
arithmetic is checked tightly against float64; in half precision against the torch path, to the rounding of the
dtype. Without a GPU they run in Triton's interpreter (which rounds to bfloat16 by truncation, so a value may sit one
unit in the last place from torch's); on CUDA the same tests run them compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton_fused = pytest.importorskip("kiln.layers.triton_fused")
if not triton_fused.available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from kiln.layers import fused  # noqa: E402
from kiln.layers.activation import silu_and_mul  # noqa: E402
from kiln.layers.norm import RMSNorm  # noqa: E402
from kiln.layers.rotary import RotaryEmbedding  # noqa: E402

pytestmark = pytest.mark.engine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# one unit in the last place of each dtype, relative: the most a single rounding may differ by
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def close_in_dtype(got: torch.Tensor, want: torch.Tensor, ulps: int = 3, scale: float = 1e-2) -> None:
    """Equal to within `ulps` units in the last place of their dtype, relative to each value's size. Each side
    rounds twice (the norm, then its product with the weight; SiLU, then its product), a whole unit each way in the
    interpreter: three units bound the two results' distance. A sum of rounded terms (rotary's) is off by units of
    its terms, not of itself: `scale` is their size."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = ulps * ULP[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


def reference_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).to(x.dtype)


@pytest.mark.parametrize("hidden", [576, 64, 1000])
@pytest.mark.unit
def test_rms_norm_arithmetic_in_float32(hidden):
    x, w = randn(7, hidden), randn(hidden, seed=1)
    torch.testing.assert_close(triton_fused.rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.unit
def test_rms_norm_and_its_residual_add_as_the_torch_code(dtype):
    norm = RMSNorm(576, 1e-5).to(DEVICE, dtype)
    norm.weight.data = randn(576, dtype=dtype, seed=2)
    x, residual = randn(9, 576, dtype=dtype), randn(9, 576, dtype=dtype, seed=3)
    close_in_dtype(triton_fused.rms_norm(x, norm.weight, 1e-5), torch_path(norm, x))
    total, normed = triton_fused.add_rms_norm(x, residual, norm.weight, 1e-5)
    close_in_dtype(total, residual + x, ulps=1)
    close_in_dtype(normed, torch_path(norm, residual + x))
    assert residual.equal(randn(9, 576, dtype=dtype, seed=3))  # inputs are left as they were


@pytest.mark.unit
def test_rms_norm_of_strided_rows_and_heads():
    """Rows read in place out of a wider tensor (row stride 3x their width: the kernel's own stride), and q/k norm's
    heads out of the fused qkv projection, which no [rows, D] view can describe (they are copied into rows)."""
    qkv = randn(5, 3 * 4 * 32)
    w = randn(4 * 32, seed=4)
    torch.testing.assert_close(
        triton_fused.rms_norm(qkv[:, : 4 * 32], w, 1e-6), reference_rms_norm(qkv[:, :128], w, 1e-6)
    )
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    got = triton_fused.rms_norm(q, w[:32], 1e-6)
    assert got.shape == (5, 4, 32)
    torch.testing.assert_close(got, reference_rms_norm(q, w[:32], 1e-6))


@pytest.mark.parametrize("n", [96, 1000, 2500])  # one block, one partial block, several blocks
@pytest.mark.unit
def test_silu_and_mul(n):
    gate_up = randn(6, 2 * n)
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(triton_fused.silu_and_mul(gate_up), (F.silu(gate) * up).float())
    half = gate_up.to(torch.bfloat16)
    close_in_dtype(triton_fused.silu_and_mul(half), torch_path(silu_and_mul, half))


class RopeConfig:
    hidden_size, num_attention_heads, head_dim, rope_theta = 256, 4, 64, 10000.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.unit
def test_rotary_of_q_and_k_read_out_of_qkv(dtype):
    """q and k rotated together straight out of the merged projection's output (a strided view), at scattered
    positions, as LlamaAttention rotates them."""
    rope = RotaryEmbedding(RopeConfig(), 512).to(DEVICE)
    positions = torch.tensor([0, 1, 2, 300, 511, 17], device=DEVICE)
    qkv = randn(6, 8 * 64, dtype=dtype)
    qk = qkv[:, : 6 * 64].view(6, 6, 64)
    cos_sin = rope.cos_sin_for(positions, dtype)
    got = triton_fused.rotary(qk, cos_sin)
    if dtype == torch.float32:
        x = qk.double()
        cs = cos_sin.double()
        want = (x * cs[0] + torch.roll(x, 32, dims=-1) * cs[1]).float()
        torch.testing.assert_close(got, want)
    else:
        close_in_dtype(got, torch_path(rope.apply, qk, cos_sin), scale=float(qk.abs().max()))


def torch_path(fn, *args):
    """fn's result with the fused kernels switched off: the torch code they replace."""
    saved, fused.MODE = fused.MODE, "off"
    try:
        return fn(*args)
    finally:
        fused.MODE = saved


@pytest.mark.unit
def test_the_layers_choose_the_kernels_for_half_precision_only(monkeypatch):
    """RMSNorm, silu_and_mul and rotary call the fused kernels for half-precision activations where they serve
    (CUDA, or the CPU when asked), never for float32, which keeps torch's exact ops, and never when switched off."""
    monkeypatch.setattr(fused, "MODE", "all")
    calls: list[str] = []
    for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary"):
        real = getattr(triton_fused, name)
        monkeypatch.setattr(triton_fused, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    rope = RotaryEmbedding(RopeConfig(), 64).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        norm = RMSNorm(64).to(DEVICE, dtype)
        x = randn(3, 64, dtype=dtype)
        norm(x)
        norm.add_forward(x, x)
        silu_and_mul(x)
        rope.apply(x.view(3, 1, 64), rope.cos_sin_for(torch.arange(3, device=DEVICE), dtype))
        assert calls == (
            [] if dtype == torch.float32 else ["rms_norm", "add_rms_norm", "silu_and_mul", "rotary"]
        )
        calls.clear()
        torch_path(norm, x)
        assert calls == []


def test_a_bfloat16_model_runs_the_fused_kernels(tiny_llama, monkeypatch):
    """A bfloat16 tiny Llama served with every layer's norms, residual adds, SiLU-and-multiply and rotary in the
    fused kernels gives the greedy tokens of the same model on torch's ops, batched: token for token up to the
    first step where torch's two best tokens are within bfloat16's noise (there the two roundings may pick either,
    and the texts part), and at least two tokens of every prompt."""
    import kiln

    prompts = [[5, 9, 14, 3, 7, 11, 2, 8], [1, 2, 3], list(range(100, 130))]
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True, "top_logprobs_num": 2}

    def run() -> list[dict]:
        engine = kiln.Engine(
            model_path=tiny_llama, dtype="bfloat16", disable_cuda_graph=True, device=DEVICE,
            max_total_tokens=1024, num_threads=1,
        )  # fmt: skip
        try:
            return engine.generate(input_ids=prompts, sampling_params=greedy)
        finally:
            engine.shutdown()

    monkeypatch.setattr(fused, "MODE", "off")
    want = run()
    launched: list[str] = []
    real = triton_fused.add_rms_norm
    monkeypatch.setattr(triton_fused, "add_rms_norm", lambda *a: launched.append("add") or real(*a))
    monkeypatch.setattr(fused, "MODE", "all")
    got = run()
    assert launched, "the model's layers never reached the fused kernels"
    for g, w in zip(got, want, strict=True):
        tops = w["meta_info"]["output_top_logprobs"]
        clear = next((i for i, top in enumerate(tops) if top[0][1] - top[1][1] < 0.02), len(tops))
        assert clear >= 2, tops  # enough tokens decided by a clear margin to compare
        assert g["output_ids"][:clear] == w["output_ids"][:clear]
