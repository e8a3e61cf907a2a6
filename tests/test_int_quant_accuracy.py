"""The CPU matmul modes' accuracy on a tiny random Llama saved as GGUF, through Kiln's model runner (one
teacher-forced prefill): `--cpu-gemm exact` gives the float32 path's logits bit for bit; `auto` multiplies every
GGUF type the integer kernels take in its blocks, and its logits stay within a bound of KL divergence from the float32
path on the same weights, as do --quantization int8's on float32 weights. The memory ledger plans the bytes each
load holds. The default model's figures over a few thousand tokens of English, next to llama.cpp's on the same
tokens: benchmarks/kl_divergence.py, whose reading of llama-perplexity's log-prob files and whose scoring are held
here too, with the one arithmetic difference from llama.cpp too small for a model's KL to resolve (the activations'
block scales: float32 in Kiln, fp16 in llama.cpp)."""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_gguf_loader import VOCAB, _tiny_weights, _write_gguf

from kiln.config import ServerArgs
from kiln.layers import cpu_gemm, int_gemm
from kiln.loader.model_config import read_model_spec
from kiln.memory.ledger_steps import static_bytes
from kiln.memory.ledger_types import LedgerInputs
from kiln.platform import gguf_blocks_expected

Q = gguf.GGMLQuantizationType
pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not gguf_blocks_expected("auto"), reason="Kiln's CPU kernels need AVX2"),
]

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
BOUNDS = {"Q4_0": (0.02, 0.12), "Q4_1": (0.02, 0.12), "Q8_0": (0.02, 0.12), "Q4_K": (3e-5, 1e-4)}
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
    static = static_bytes(LedgerInputs.from_args(args, read_model_spec(path)))
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

    def spy(model: torch.nn.Module, *reporting) -> tuple[int, dict[str, int]]:
        count, kinds = pack(model, *reporting)
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
    kept = qtype.name in ("Q4_1", "Q8_0")
    # the tied LM head of a type Kiln's float kernel reads is multiplied in float32 under auto too
    head = {f"{qtype.name} (float32)": 1} if kept else {}
    assert formats[2] == {f"{qtype.name} (integer)": LINEARS - len(head), **head}
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


def _write_log_prob_file(path: Path, tokens: np.ndarray, logits: list[torch.Tensor]) -> None:
    """A file in llama-perplexity's --kl-divergence-base layout, each chunk's rows stored as perplexity.cpp does."""
    chunks, n_ctx = tokens.shape
    vocab = logits[0].shape[1]
    with path.open("wb") as f:
        f.write(b"_logits_" + struct.pack("<Iii", n_ctx, vocab, chunks) + tokens.astype(np.int32).tobytes())
        for chunk in logits:
            step_and_lowest, steps = kl_divergence.encode_log_probs(chunk)
            rows = np.zeros((chunk.shape[0], 2 * ((vocab + 1) // 2) + 4), dtype=np.uint16)
            rows[:, :4] = step_and_lowest.numpy().view(np.uint16)
            rows[:, 4 : 4 + vocab] = steps.numpy()
            f.write(rows.tobytes())


def test_llama_perplexity_log_probs_read_back_and_score_as_llama_cpp(tmp_path: Path):
    """The benchmark reads llama.cpp's chunks and base log-probs from llama-perplexity's file and scores Kiln with
    llama.cpp's estimator: the stored log-probs are the softmax's to within a step, and the KL over them is the
    exact one's to within the rounding (an odd vocabulary exercises the rows' padding)."""
    n_ctx, vocab = 8, 11
    generator = torch.Generator().manual_seed(0)
    tokens = np.arange(2 * n_ctx, dtype=np.int32).reshape(2, n_ctx)
    logits = [2 * torch.randn(n_ctx - 1 - n_ctx // 2, vocab, generator=generator) for _ in range(2)]
    path = tmp_path / "base.kld"
    _write_log_prob_file(path, tokens, logits)
    file = kl_divergence.LogProbFile.open(path)
    assert (file.n_ctx, file.n_vocab, file.chunks, file.rows) == (n_ctx, vocab, 2, 3)
    np.testing.assert_array_equal(file.tokens(), tokens)
    for chunk, base in enumerate(logits):
        stored = file.log_probs(chunk)
        assert torch.equal(stored, kl_divergence.stored_log_probs(base))
        assert torch.allclose(stored, torch.log_softmax(base, -1), atol=16 / 65535)
        other = base + 0.3 * torch.randn(base.shape, generator=generator)
        kl, same = kl_divergence.stored_divergence(stored, torch.log_softmax(other.double(), -1))
        exact, exact_same = kl_divergence.token_divergence(base, other)
        assert torch.allclose(kl, exact, atol=5e-5) and torch.equal(same, exact_same)
        assert (exact > 1e-3).all()
        itself, _ = kl_divergence.stored_divergence(stored, torch.log_softmax(base.double(), -1))
        assert itself.abs().max() < 5e-5
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="header implies"):
        kl_divergence.LogProbFile.open(path)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_activation_scales_closer_to_exact_than_llama_cpp(qtype: str):
    """Kiln and llama.cpp round the activations to the same int8 blocks; llama.cpp then keeps each block's scale
    (and Q8_1's sum term, for Q4_1) in fp16, Kiln in float32. The output of Kiln's arithmetic must stay far closer
    to the same int8 blocks with exact scales than llama.cpp's: the part of "Kiln's KL divergence must not exceed
    llama.cpp's" that a model's KL over a few thousand tokens is too noisy to resolve."""
    generator = torch.Generator().manual_seed(1)
    rows = torch.from_numpy(
        gguf.quants.quantize(0.05 * torch.randn(64, 512, generator=generator).numpy(), Q[qtype])
    )
    normals = torch.randn(4, 32, 512, generator=generator)
    x = normals[0] / (normals[1:].square().sum(0) / 3).sqrt()  # heavy-tailed, as hidden states are
    exact_scales = kl_divergence.block_scaled_linear(x, rows, qtype, torch.float64)

    def deviation(y: torch.Tensor) -> float:
        return float((y.double() - exact_scales).norm() / exact_scales.norm())

    kiln = deviation(int_gemm.reference_linear(x, rows, qtype))
    assert kiln == pytest.approx(
        deviation(kl_divergence.block_scaled_linear(x, rows, qtype, torch.float32)), abs=1e-6
    )
    assert 0 < 10 * kiln < deviation(kl_divergence.block_scaled_linear(x, rows, qtype, torch.float16))
