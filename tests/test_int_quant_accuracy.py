"""The CPU matmul modes' accuracy on a tiny random Llama saved as GGUF, through Kiln's model runner (one
teacher-forced prefill): `--cpu-gemm exact` gives the float32 path's logits bit for bit; `auto` multiplies every
GGUF type the integer kernels take in its blocks, and its logits stay within a bound of KL divergence from the float32
path on the same weights, as do --quantization int8's on float32 weights. The memory ledger plans the bytes each
load holds. The default model's figures over a few thousand tokens of English: benchmarks/kl_divergence.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_gguf_loader import VOCAB, _tiny_weights, _write_gguf

from kiln.config import ServerArgs
from kiln.layers import cpu_gemm
from kiln.loader.model_config import read_hf_config
from kiln.memory.ledger_steps import static_bytes
from kiln.memory.ledger_types import LedgerInputs
from kiln.platform import gguf_blocks_expected

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not gguf_blocks_expected("auto"), reason="Kiln's CPU kernels need AVX2")

_SPEC = importlib.util.spec_from_file_location(
    "kl_divergence", Path(__file__).resolve().parents[1] / "benchmarks" / "kl_divergence.py"
)
kl_divergence = importlib.util.module_from_spec(_SPEC)
sys.modules["kl_divergence"] = kl_divergence  # its dataclasses look their module up
_SPEC.loader.exec_module(kl_divergence)

TOKENS = 256
LINEARS = 2 * 4 + 1  # per layer qkv, o, gate_up, down; the tied head
# KL(float32 || mode) bounds, mean and p99 over the tokens: about three times what the integer arithmetic gives on
# each of these models (their weights differ by type: the K-quants' are random blocks, the 32-wide types' three
# times the other tests' random weights, I8's those weights as float32)
BOUNDS = {"Q4_0": (0.02, 0.12), "Q4_1": (0.02, 0.12), "Q8_0": (0.02, 0.12), "Q4_K": (1e-4, 3e-4)}
BOUNDS |= {"Q6_K": (1e-3, 2e-3), "I8": (1e-3, 2e-3)}


def _k_blocks(shape: tuple[int, int], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """K-quant bytes (gguf-py cannot quantize them) with random quants and sub-scales, and super-block scales that
    give weights of the size the other types' have."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // block_size, type_size), dtype=np.uint8)

    def half(value: float) -> np.ndarray:
        return np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)

    if qtype == Q.Q4_K:  # w = d * scale * q - dmin * min, scale and min 0..63, q 0..15
        blocks[:, 0:2], blocks[:, 2:4] = half(3e-4), half(1e-3)
    else:  # Q6_K: w = d * scale * (q - 32), scale -128..127
        blocks[:, type_size - 2 :] = half(4e-5)
    return blocks.reshape(shape[0], -1)


def _encoder(qtype: Q, rng: np.random.Generator):
    def encode(hf_name: str, w: np.ndarray) -> tuple[np.ndarray, Q]:
        if w.ndim == 1 or qtype == Q.F32:
            return w, Q.F32
        if qtype in (Q.Q4_K, Q.Q6_K):
            return _k_blocks(w.shape, qtype, rng), qtype
        return gguf.quants.quantize(w * 3.0, qtype), qtype  # larger weights: logits with clear winners

    return encode


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(autouse=True)
def default_mode():
    yield
    cpu_gemm.set_cpu_gemm("auto")


def _model(tmp_path: Path, qtype: Q) -> str:
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    _write_gguf(path, _tiny_weights("llama", tied=True), "llama", _encoder(qtype, np.random.default_rng(3)))
    return str(path)


def _planned(path: str, mode: str, quantization: str | None = None) -> tuple[int, int]:
    args = ServerArgs(
        model_path=path, device="cpu", device_memory="4GiB", cpu_gemm=mode, quantization=quantization
    )
    static = static_bytes(LedgerInputs.from_args(args, read_hf_config(path)))
    return static.weights, static.packed_head


def _run(path: str, mode: str, tokens: list[int], quantization: str | None = None):
    runner = kl_divergence.load_runner(path, mode, quantization)
    measured = (runner.measured["weights"], runner.measured.get("packed_lm_head", 0))
    assert measured == _planned(path, mode, quantization), (mode, quantization)
    return kl_divergence.teacher_forced_logits(runner, tokens)


def _spy_formats(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, int]]:
    """The packed formats of each load from now on, as prepack_module_weights reports them."""
    formats: list[dict[str, int]] = []
    pack = cpu_gemm.prepack_module_weights

    def spy(model: torch.nn.Module) -> tuple[int, dict[str, int]]:
        count, kinds = pack(model)
        formats.append(kinds)
        return count, kinds

    monkeypatch.setattr(cpu_gemm, "prepack_module_weights", spy)
    return formats


def _assert_close(qtype: str, base: torch.Tensor, logits: torch.Tensor) -> None:
    kl, same = kl_divergence.token_divergence(base, logits)
    stats = kl_divergence.summarize(kl, same)
    mean, p99 = BOUNDS[qtype]
    assert 0 < stats.kl_mean < mean and stats.kl_p99 < p99, (qtype, stats)
    assert stats.top1_agreement > 0.9, (qtype, stats)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_exact_equals_float32_and_integer_stays_close(qtype: Q, tmp_path: Path, tokens, monkeypatch):
    path = _model(tmp_path, qtype)
    formats = _spy_formats(monkeypatch)
    base = _run(path, "f32", tokens)
    exact = _run(path, "exact", tokens)
    assert torch.equal(exact, base)  # Q4_1 / Q8_0 from their blocks, the rest dequantized: the same bits
    integer = _run(path, "auto", tokens)
    assert formats[2] == {f"{qtype.name} (integer)": LINEARS}
    kept = qtype.name in ("Q4_1", "Q8_0")
    assert formats[1] == ({f"{qtype.name} (float32)": LINEARS} if kept else {"float32": LINEARS})
    _assert_close(qtype.name, base, integer)


def test_int8_quantization_at_load_stays_close(tmp_path: Path, tokens, monkeypatch):
    path = _model(tmp_path, Q.F32)
    base = _run(path, "auto", tokens)
    formats = _spy_formats(monkeypatch)
    int8 = _run(path, "auto", tokens, quantization="int8")
    assert formats == [{"I8 (integer)": LINEARS - 1, "float32": 1}]  # the LM head stays float32
    _assert_close("I8", base, int8)
    # a GGUF type the mode does not keep in its blocks (exact: Q4_0) is dequantized, then rounded to int8 rows
    _run(_model(tmp_path, Q.Q4_0), "exact", tokens, quantization="int8")
    assert formats[1] == {"I8 (integer)": LINEARS - 1, "float32": 1}
