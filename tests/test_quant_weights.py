"""GGUF matrices kept in their blocks at load: the rows the weight loaders copy are the rows whose blocks are kept
(shards, merged projections, columns aligned to the type's block), and the default model served from its blocks
under `--cpu-gemm exact` computes exactly what it computes from the dequantized float32 weights, while the default
mode multiplies the same blocks with the integer kernels (their accuracy: tests/test_int_quant_accuracy.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import kiln
from kiln.layers import cpu_gemm
from kiln.layers.quant_rows import GGUFRows, keep_rows, pop_rows
from kiln.platform import gguf_blocks_expected

pytestmark = pytest.mark.engine


def _loaded(n: int, k: int, qtype: str = "Q4_1", seed: int = 0) -> torch.Tensor:
    """A float32 tensor as the GGUF loader yields it: dequantized, with its raw blocks attached."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    t = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).copy())
    t.gguf_rows = GGUFRows(qtype, torch.from_numpy(raw))
    return t


@pytest.mark.unit
def test_rows_kept_in_any_order_come_back_in_row_order():
    a, b = _loaded(32, 64, seed=1), _loaded(16, 64, seed=2)
    param = torch.nn.Parameter(torch.empty(48, 64), requires_grad=False)
    keep_rows(param, b, 32, 0, 16)  # the second part first, as a merged projection may load
    keep_rows(param, a, 0, 0, 32)
    got = pop_rows(param)
    assert got.qtype == "Q4_1" and torch.equal(got.rows, torch.cat([a.gguf_rows.rows, b.gguf_rows.rows]))
    assert pop_rows(param) is None  # forgotten once taken


@pytest.mark.unit
def test_a_shard_keeps_its_rows_and_block_aligned_columns():
    full = _loaded(64, 128)
    rows = torch.nn.Parameter(torch.empty(32, 128), requires_grad=False)
    keep_rows(rows, full, 0, 32, 32)  # rank 1 of 2, column-parallel
    assert torch.equal(pop_rows(rows).rows, full.gguf_rows.rows[32:])
    cols = torch.nn.Parameter(torch.empty(64, 64), requires_grad=False)
    keep_rows(cols, full, 0, 0, 64, k_start=64, k_len=64)  # rank 1 of 2, row-parallel: blocks 2 and 3
    assert torch.equal(pop_rows(cols).rows, full.gguf_rows.rows[:, 2 * 20 :])


@pytest.mark.parametrize(
    "case", ["unaligned columns", "a part without blocks", "two types", "missing rows", "overlap"]
)
@pytest.mark.unit
def test_weights_whose_rows_are_not_all_in_blocks_get_none(case):
    param = torch.nn.Parameter(torch.empty(64, 64), requires_grad=False)
    full = _loaded(64, 64)
    if case == "unaligned columns":
        keep_rows(param, _loaded(64, 96), 0, 0, 64, k_start=16, k_len=64)
    elif case == "a part without blocks":
        keep_rows(param, full, 0, 0, 32)
        keep_rows(param, torch.zeros(32, 64), 32, 0, 32)
    elif case == "two types":
        keep_rows(param, full, 0, 0, 32)
        keep_rows(param, _loaded(32, 64, "Q8_0"), 32, 0, 32)
    elif case == "missing rows":
        keep_rows(param, full, 0, 0, 32)
    else:
        keep_rows(param, full, 0, 0, 48)
        keep_rows(param, full, 32, 0, 32)
    assert pop_rows(param) is None


@pytest.fixture
def cpu_gemm_restored():
    """The engines below set the module-wide --cpu-gemm mode as they load; later loads in this process that do not
    set it (load_model in other tests) get the default back."""
    yield
    cpu_gemm.set_cpu_gemm("auto")


@pytest.mark.unit
def test_k_quant_columns_are_kept_on_super_block_bounds():
    """A row-parallel shard of a K-quant matrix keeps its blocks only where it starts on a 256-wide super-block."""
    rows = torch.from_numpy(np.random.default_rng(4).integers(0, 256, (16, 2 * 144), dtype=np.uint8))
    full = torch.zeros(16, 512)
    full.gguf_rows = GGUFRows("Q4_K", rows)
    half = torch.nn.Parameter(torch.empty(16, 256), requires_grad=False)
    keep_rows(half, full, 0, 0, 16, k_start=256, k_len=256)
    assert torch.equal(pop_rows(half).rows, rows[:, 144:])
    quarter = torch.nn.Parameter(torch.empty(16, 128), requires_grad=False)
    keep_rows(quarter, full, 0, 0, 16, k_start=128, k_len=128)  # 32-aligned, but inside a super-block
    assert pop_rows(quarter) is None


@pytest.mark.skipif(not gguf_blocks_expected("auto"), reason="Kiln's quantized kernel needs AVX2")
def test_default_model_from_its_blocks_equals_float32_bit_for_bit(default_model, cpu_gemm_restored):
    """Under --cpu-gemm exact every projection and the tied head run from the GGUF's Q4_1 / Q8_0 blocks, and give
    the float32 kernel's outputs bit for bit on the dequantized weights; greedy outputs are the same tokens."""
    args = dict(max_total_tokens=4096, max_running_requests=4)
    blocks = kiln.Engine(model_path=default_model, cpu_gemm="exact", **args)
    f32 = kiln.Engine(model_path=default_model, cpu_gemm="f32", **args)
    qm, fm = blocks.scheduler.runner.model, f32.scheduler.runner.model
    assert qm.lm_head.packed_weight.dtype == torch.uint8 and fm.lm_head.packed_weight.dtype == torch.float32
    f_modules = dict(fm.named_modules())
    g = torch.Generator().manual_seed(0)
    checked = 0
    for name, mod in qm.named_modules():
        if not getattr(mod, "packed", False):
            continue
        weight = mod.packed_weight if getattr(mod, "packed_weight", None) is not None else mod.weight
        assert weight.dtype == torch.uint8, name
        x = torch.randn(5, f_modules[name].weight.shape[1], generator=g)  # [N / 16, K, 16] or [vocab, K]
        with torch.inference_mode():
            assert torch.equal(mod(x), f_modules[name](x)), name
        checked += 1
    assert checked == 4 * 30 + 1
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = [{"max_new_tokens": 12, "temperature": 0.0}] * 2
    got, want = (
        blocks.generate(prompt=prompts, sampling_params=params),
        f32.generate(prompt=prompts, sampling_params=params),
    )
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    blocks.shutdown()
    f32.shutdown()


@pytest.mark.skipif(not gguf_blocks_expected("auto"), reason="Kiln's quantized kernel needs AVX2")
def test_default_model_multiplies_its_blocks_in_integers_by_default(default_model, cpu_gemm_restored):
    """The default mode packs every projection for the integer kernels (uint8 [N / 16, bytes per 16 rows]) and
    the tied Q8_0 head for the float kernel (uint8 [N / 16, K / 32, 16 blocks]: multiplied in float32, see
    kiln.layers.cpu_gemm.prepack), and the model still knows its capital."""
    engine = kiln.Engine(model_path=default_model, max_total_tokens=4096, max_running_requests=4)
    model = engine.scheduler.runner.model
    packed = [m.weight for m in model.modules() if getattr(m, "packed", False) and m is not model.lm_head]
    assert len(packed) == 4 * 30
    assert all(w.dtype == torch.uint8 and w.dim() == 2 for w in packed)
    head = model.lm_head.packed_weight
    assert head.dtype == torch.uint8 and head.dim() == 3
    out = engine.generate(
        prompt="The capital of France is", sampling_params={"max_new_tokens": 4, "temperature": 0}
    )
    assert "Paris" in out["text"]
    engine.shutdown()
