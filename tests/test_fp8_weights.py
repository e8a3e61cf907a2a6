"""FP8 block weights kept as the checkpoint stores them (kiln/layers/fp8_linear.py, kiln/layers/triton_fp8.py),
here in Triton's interpreter: the kernels against the dequantized weights in float64, a Qwen3-MoE FP8 checkpoint
(merged q/k/v, row-parallel and expert weights in FP8) against transformers, and the refusals. DeepSeek-V3's
FP8 checkpoint held both ways is tests/test_deepseek.py's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fp8_blocks import dequantize_reference, quantize_blocks, save_fp8_model
from model_equality import (  # the fixtures among these apply to this module by being imported
    BASE_ARGS,
    generate,
    ids_of,
    one_torch_thread,  # noqa: F401
    random_model,
    reference_greedy,
    reference_logits,
    spy_logits,
)
from moe_models import TINY_MOE
from test_correctness import make_prompt, token_stream

import kiln
from kiln.layers import fp8_linear
from kiln.layers.triton_fp8 import expert_blocks, fp8_block_linear, fp8_grouped_linear, group_rows
from kiln.models.spec import ModelSpec

model_spec = ModelSpec.from_config  # a model config dict's spec


pytestmark = pytest.mark.engine

pytest.importorskip("triton")
FP8 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # natively on a GPU (benchmarks/cuda/cuda_checks.sh)


def _weight(n: int, k: int, block: int, seed: int, experts: int | None = None):
    """An fp8 weight [N, K] (or [E, N, K]) with a different factor in every block, and its float64 value."""
    gen = torch.Generator().manual_seed(seed)
    qs, scales, values = [], [], []
    for _ in range(experts or 1):
        q, scale = quantize_blocks(torch.randn(n, k, generator=gen), block)
        scale = scale * (0.5 + torch.rand(scale.shape, generator=gen))  # blocks told apart by their factors
        qs.append(q), scales.append(scale), values.append(dequantize_reference(q, scale, block).double())
    if experts is None:
        return qs[0].to(DEVICE), scales[0].to(DEVICE), values[0]
    return torch.stack(qs).to(DEVICE), torch.stack(scales).to(DEVICE), torch.stack(values)


def _close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    """Within one rounding to the output's dtype, plus float32 accumulation in another order: a few float32 eps of
    the sum of the products' magnitudes (`magnitude`, |x| @ |w|^T)."""
    allowed = torch.finfo(got.dtype).eps * want.abs() + 4 * torch.finfo(torch.float32).eps * magnitude
    excess = (got.double().cpu() - want).abs() - allowed
    assert excess.max() <= 0, (
        f"{(excess > 0).sum().item()} outputs off by up to {excess.max().item():.3g} more"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.unit
def test_the_kernel_multiplies_the_weight_its_blocks_hold(dtype, block, rows):
    """Both dimensions end in a part block; 70 rows are two tiles of 64 in half precision, five of 16 in float32."""
    n, k = 3 * block - 5, 2 * block + 3
    weight, scale, value = _weight(n, k, block, seed=rows)
    x = torch.randn(rows, k).to(dtype)
    _close(
        fp8_block_linear(x.to(DEVICE), weight, scale, (block, block)),
        x.double() @ value.T,
        x.double().abs() @ value.abs().T,
    )


@pytest.mark.unit
def test_a_batch_of_sequences_a_strided_input_and_a_bias():
    weight, scale, value = _weight(40, 48, 16, seed=1)
    wide = torch.randn(2, 3, 64)
    x = wide[..., :48]  # rows 64 apart, as a view of a wider projection's output
    bias = torch.randn(40)
    got = fp8_block_linear(x.to(DEVICE), weight, scale, (16, 16), bias.to(DEVICE))
    assert got.shape == (2, 3, 40)
    _close(got, x.double() @ value.T + bias.double(), x.double().abs() @ value.abs().T + bias.double().abs())
    assert fp8_block_linear(torch.empty(0, 48, device=DEVICE), weight, scale, (16, 16)).shape == (0, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.unit
def test_grouped_rows_take_their_own_experts_weight(dtype):
    """Rows sorted by expert: an expert with none, one with more rows than a tile (float32's tiles are 16), and
    rows of another rank's experts (ids >= E), which stay zero."""
    experts, n, k = 5, 40, 48
    weight, scale, value = _weight(n, k, 16, seed=3, experts=experts)
    ids = torch.tensor([0, 0, 1] + [3] * 37 + [4, 5, 5, 7])
    x = torch.randn(len(ids), k).to(dtype)
    on = x.to(DEVICE)
    got = fp8_grouped_linear(on, weight, scale, (16, 16), group_rows(ids.to(DEVICE), experts, on)).cpu()
    want, magnitude = (
        torch.zeros(len(ids), n, dtype=torch.float64),
        torch.zeros(len(ids), n, dtype=torch.float64),
    )
    for row, e in enumerate(ids.tolist()):
        if e < experts:
            want[row], magnitude[row] = x[row].double() @ value[e].T, x[row].double().abs() @ value[e].abs().T
    _close(got, want, magnitude)
    assert not got[ids >= experts].any()


@pytest.mark.unit
def test_expert_blocks_cover_each_experts_rows_once():
    ids = torch.tensor([0, 0, 2, 2, 2, 2, 2, 4, 9, 9])
    expert, first, count = expert_blocks(ids, 5, 2)
    covered = []
    for e, f, c in zip(expert.tolist(), first.tolist(), count.tolist()):
        if e < 5:
            assert 0 < c <= 2 and all(ids[f + i] == e for i in range(c))
            covered += range(f, f + c)
    assert covered == list(range(8))  # every row of an expert of this rank once, in order; none of expert 9's
    assert len(expert) == 5 + 5  # as many as any 10 rows could need: a static shape


def test_a_qwen3_moe_fp8_checkpoint_matches_transformers(tmp_path: Path, monkeypatch) -> None:
    """Merged q/k/v, o_proj's row-parallel split and the experts held in FP8: transformers' logits and greedy
    tokens on the dequantized weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    monkeypatch.setenv("KILN_FP8_WEIGHTS", "keep")
    model, tok = random_model(Qwen3MoeConfig, Qwen3MoeForCausalLM, 5, **TINY_MOE)
    save_fp8_model(model, tok, tmp_path, block=16, architecture="Qwen3MoeForCausalLM")
    eng = kiln.Engine(model_path=str(tmp_path), **BASE_ARGS, device=DEVICE, dtype="float32")
    try:
        held = {name: p.dtype for name, p in eng.scheduler.runner.model.named_parameters()}
        for name in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.experts.gate_up_proj"):
            assert held[f"model.layers.1.{name}"] == FP8, name
        stream = token_stream()
        prompts = [make_prompt(stream, n, 37 * i) for i, n in enumerate((1, 9, 40, 77))]
        got, out = spy_logits(eng, prompts[2])
        torch.testing.assert_close(got, reference_logits(model, prompts[2], out), rtol=0, atol=1e-4)
        eng.scheduler.flush_cache()
        assert ids_of(generate(eng, prompts)) == [reference_greedy(model, p) for p in prompts]
    finally:
        eng.shutdown()


def _fp8_module(module: torch.nn.Module, block: int) -> torch.nn.Module:
    from kiln.loader.weights import materialize

    with torch.device("meta"):
        module = module()
    fp8_linear.convert_to_fp8(module, (block, block))
    materialize(module, DEVICE)
    return module


def _checkpoint_tensor(rows: int, cols: int, block: int) -> torch.Tensor:
    q, scale = quantize_blocks(torch.randn(rows, cols), block)
    q.fp8_blocks = fp8_linear.Fp8Blocks(scale, (block, block))
    return q


@pytest.mark.unit
def test_a_shard_that_cuts_a_block_is_refused_with_the_numbers():
    from kiln.layers.linear import ColumnParallelLinear

    layer = _fp8_module(lambda: ColumnParallelLinear(64, 48), 32)
    with pytest.raises(
        ValueError, match=r"48 rows \(from 48 of 96\) cuts the FP8 weight blocks of 32"
    ) as err:
        fp8_linear.copy_blocks(layer, "weight", _checkpoint_tensor(96, 64, 32), 0, 0, 48, 48)
    assert "--tp-size" in str(err.value) and "KILN_FP8_WEIGHTS=dequantize" in str(err.value)
    # a shard ending where the tensor does may end in a part block
    fp8_linear.copy_blocks(layer, "weight", _checkpoint_tensor(80, 64, 32), 0, 0, 32, 48)
    assert not layer.weight_scale_inv.isnan().any()


@pytest.mark.unit
def test_an_unquantized_tensor_for_an_fp8_weight_is_refused_and_an_unloaded_one_found():
    from kiln.layers.linear import RowParallelLinear

    layer = _fp8_module(lambda: RowParallelLinear(64, 32), 16)
    with pytest.raises(ValueError, match="without block scales"):
        layer.weight_loader(layer.weight, torch.randn(32, 64))
    with pytest.raises(ValueError, match="weight_scale_inv: the load copied no block factors"):
        fp8_linear.check_blocks_loaded(layer)
    layer.weight_loader(layer.weight, _checkpoint_tensor(32, 64, 16))
    fp8_linear.check_blocks_loaded(layer)


@pytest.mark.unit
def test_where_fp8_weights_are_kept(monkeypatch):
    from kiln import platform
    from kiln.core.envs import EnvError

    cpu = platform.Platform("cpu", "cpu", triton=True)
    h100 = platform.Platform("cuda", "H100", (9, 0), triton=True, here=False)
    a100 = platform.Platform("cuda", "A100", (8, 0), triton=True, here=False)
    monkeypatch.delenv("KILN_FP8_WEIGHTS", raising=False)
    assert not platform.fp8_weights_kept(cpu)
    assert platform.fp8_weights_kept(h100)  # Triton converts e4m3 from 8.9 on
    assert not platform.fp8_weights_kept(a100)
    assert not platform.fp8_weights_kept(replace(h100, triton=False))  # the kernels are Triton's
    assert not platform.fp8_weights_kept(h100, "dummy")
    monkeypatch.setenv("KILN_FP8_WEIGHTS", "keep")
    assert platform.fp8_weights_kept(cpu)
    monkeypatch.setenv("KILN_FP8_WEIGHTS", "dequantize")
    assert not platform.fp8_weights_kept(h100)
    monkeypatch.setenv("KILN_FP8_WEIGHTS", "sometimes")
    with pytest.raises(EnvError, match="auto, keep, dequantize"):
        platform.fp8_weights_kept(cpu)


@pytest.mark.unit
def test_two_ranks_hold_their_shards_of_the_values_and_the_factors(monkeypatch):
    """tp 2 simulated: column-parallel halves concatenated, and row-parallel and expert partial sums added (the
    all-reduce), equal the products with the whole dequantized weights; the up rows of each expert's gate_up sit
    a block past its gate rows, and down's columns split by rank."""
    import torch.nn.functional as F

    import kiln.distributed as distributed
    import kiln.layers.linear as linear
    import kiln.layers.moe as moe

    monkeypatch.setattr(linear, "all_reduce", lambda t: t)
    monkeypatch.setattr(moe, "all_reduce", lambda t: t)
    column, row = _checkpoint_tensor(64, 48, 16), _checkpoint_tensor(40, 64, 16)
    experts = {(e, part): _checkpoint_tensor(*((48, 32) if part == "down" else (32, 48)), 16)
               for e in range(3) for part in ("gate", "up", "down")}  # fmt: skip
    x = torch.randn(5, 48)
    ids, weights = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]]), torch.rand(5, 2)
    on = (x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE))
    halves, partial, routed = [], [], []
    for rank in range(2):
        monkeypatch.setattr(distributed, "_TP", distributed.TPGroup(rank=rank, size=2))
        col = _fp8_module(lambda: linear.ColumnParallelLinear(48, 64), 16)
        col.weight_loader(col.weight, column)
        down = _fp8_module(lambda: linear.RowParallelLinear(64, 40), 16)
        down.weight_loader(down.weight, row)
        layer = _fp8_module(lambda: moe.FusedMoE(3, 48, 32), 16)
        for (e, part), tensor in experts.items():
            stacked = layer.down_proj if part == "down" else layer.gate_up_proj
            layer.weight_loader(stacked, tensor, (e, part))
        fp8_linear.check_blocks_loaded(layer)
        halves.append(col(on[0]))
        partial.append(down(halves[-1]).cpu())
        routed.append(layer(*on).cpu())
    value = {key: dequantize_reference(t, t.fp8_blocks.scale_inv, 16) for key, t in experts.items()}
    h = x @ dequantize_reference(column, column.fp8_blocks.scale_inv, 16).T
    torch.testing.assert_close(torch.cat(halves, 1).cpu(), h, rtol=1e-5, atol=1e-5)
    want = h @ dequantize_reference(row, row.fp8_blocks.scale_inv, 16).T
    torch.testing.assert_close(partial[0] + partial[1], want, rtol=1e-5, atol=1e-4)
    want = torch.zeros_like(x)
    for t in range(5):
        for k in range(2):
            e = int(ids[t, k])
            act = F.silu(x[t] @ value[e, "gate"].T) * (x[t] @ value[e, "up"].T)
            want[t] += weights[t, k] * (act @ value[e, "down"].T)
    torch.testing.assert_close(routed[0] + routed[1], want, rtol=1e-5, atol=1e-4)


@pytest.mark.unit
def test_a_tp_size_that_cuts_the_fp8_blocks_is_refused_before_launch(monkeypatch):
    """Qwen3-30B-A3B-FP8 at tp 8: each rank's 96 of an expert's 768 intermediate rows cut the 128-row blocks
    (SGLang refuses it too). Whole experts per rank (--ep-size 8) or the weights dequantized serve it."""
    from types import SimpleNamespace

    from kiln.scheduler.resolve import tp_refusal

    monkeypatch.delenv("KILN_FP8_WEIGHTS", raising=False)
    config = model_spec({
        "num_attention_heads": 32, "num_key_value_heads": 4, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "hidden_size": 4096, "num_hidden_layers": 2,
        "vocab_size": 1024,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    })  # fmt: skip
    from kiln.platform import Platform

    args = SimpleNamespace(tp_size=8, ep_size=1, load_format="auto")
    h100 = Platform("cuda", "H100", (9, 0), triton=True, here=False)
    refusal = tp_refusal(args, config, h100)
    assert (
        "moe_intermediate_size 768 (/ 8 = 96 per rank, not a multiple of the FP8 weight block 128)" in refusal
    )
    assert "sizes that work: 1, 2;" in refusal and "KILN_FP8_WEIGHTS=dequantize" in refusal
    assert tp_refusal(SimpleNamespace(**{**vars(args), "ep_size": 8}), config, h100) is None
    dummy = SimpleNamespace(**{**vars(args), "load_format": "dummy"})
    assert tp_refusal(dummy, config, h100) is None  # bfloat16 drawn
    assert tp_refusal(args, config, Platform("cpu", "cpu", triton=True)) is None  # dequantized there
    assert tp_refusal(args, config, replace(h100, name="A100", capability=(8, 0))) is None  # and there
    monkeypatch.setenv("KILN_FP8_WEIGHTS", "dequantize")
    assert tp_refusal(args, config, h100) is None


@pytest.mark.unit
def test_kiln_plan_refuses_it_too(monkeypatch, model_dir, capsys):
    from test_ledger import QWEN3_30B_A3B

    import kiln.plan as plan

    monkeypatch.delenv("KILN_FP8_WEIGHTS", raising=False)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU dequantizes FP8 weights: nothing to cut")
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    path = model_dir({**QWEN3_30B_A3B, "quantization_config": fp8}, "qwen3-30b-a3b-fp8")
    argv = ["--model-path", path, "--device", "cuda", "--device-memory", "141GiB", "--json"]
    assert plan.main([*argv, "--tp-size", "8"]) == 2
    assert "not a multiple of the FP8 weight block 128" in capsys.readouterr().err
    assert plan.main([*argv, "--tp-size", "2"]) == 0  # 384 rows a rank: three blocks


@pytest.mark.unit
def test_a_cast_that_would_drop_or_saturate_fp8_is_refused():
    """A tensor bound for an FP8 weight must bring its block factors, and an fp8 tensor bound for another dtype
    must have them to be dequantized: a plain cast would read the weight as noise."""
    with pytest.raises(ValueError, match="without FP8 block scales"):
        fp8_linear.as_dtype(torch.randn(4, 4), FP8)
    with pytest.raises(ValueError, match="without FP8 block scales"):
        fp8_linear.as_dtype(torch.randn(4, 4).to(FP8), torch.bfloat16)
    held = _checkpoint_tensor(32, 32, 16)
    assert fp8_linear.as_dtype(held, FP8) is held
    want = dequantize_reference(held, held.fp8_blocks.scale_inv, 16)
    assert torch.equal(fp8_linear.as_dtype(held, torch.float32), want)


@pytest.mark.unit
def test_replicated_kv_heads_take_their_heads_blocks(monkeypatch):
    """tp 4 over 2 KV heads: ranks 0 and 1 hold KV head 0, ranks 2 and 3 head 1, each its own query head; each
    rank's q, k and v rows and their factors sit a block apart in the merged weight."""
    import kiln.distributed as distributed
    from kiln.layers.linear import QKVParallelLinear

    parts = {part: _checkpoint_tensor(rows, 32, 16) for part, rows in (("q", 64), ("k", 32), ("v", 32))}
    value = {part: dequantize_reference(t, t.fp8_blocks.scale_inv, 16) for part, t in parts.items()}
    x = torch.randn(3, 32)
    for rank in range(4):
        monkeypatch.setattr(distributed, "_TP", distributed.TPGroup(rank=rank, size=4))
        layer = _fp8_module(lambda: QKVParallelLinear(32, 16, 4, 2), 16)
        for part, tensor in parts.items():
            layer.weight_loader(layer.weight, tensor, part)
        fp8_linear.check_blocks_loaded(layer)
        kv = slice(16 * (rank // 2), 16 * (rank // 2) + 16)
        want = torch.cat([value["q"][16 * rank : 16 * rank + 16], value["k"][kv], value["v"][kv]])
        torch.testing.assert_close(layer(x.to(DEVICE)).cpu(), x @ want.T, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.unit
def test_fp8_experts_replay_in_a_cuda_graph_without_a_host_sync(monkeypatch):
    """The routed experts in FP8 are captured and replayed (new routing each replay) under torch's sync check,
    giving the eager product."""
    import kiln.layers.moe as moe

    monkeypatch.setattr(moe, "all_reduce", lambda t: t)
    layer = _fp8_module(lambda: moe.FusedMoE(8, 128, 256), 128)
    for e in range(8):
        for part in ("gate", "up", "down"):
            shape = (128, 256) if part == "down" else (256, 128)
            stacked = layer.down_proj if part == "down" else layer.gate_up_proj
            layer.weight_loader(stacked, _checkpoint_tensor(*shape, 128), (e, part))
    x = torch.randn(4, 128, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.randint(0, 8, (4, 2), device=DEVICE)
    weights = torch.rand(4, 2, device=DEVICE)
    layer(x, weights, ids)  # compiles the kernels before the capture
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")  # any host read of a device value inside raises
    try:
        with torch.cuda.graph(graph):
            out = layer(x, weights, ids)
        layer(x, weights, ids)  # eagerly too: no per-expert counts read back
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for seed in range(3):
        routing = torch.randint(0, 8, (4, 2), generator=torch.Generator().manual_seed(seed))
        ids.copy_(routing.to(DEVICE))
        graph.replay()
        eager = layer(x, weights, ids)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_a_qwen3_next_fp8_checkpoint_matches_transformers(tmp_path: Path, monkeypatch) -> None:
    """The hybrid model's linear-attention input projection is reordered at load and left in the serving dtype,
    from FP8 tensors dequantized first; its output projection, attention and experts are held in FP8."""
    from hybrid_models import hybrid_hf_model

    monkeypatch.setenv("KILN_FP8_WEIGHTS", "keep")
    model, tok = hybrid_hf_model(seed=4)
    save_fp8_model(model, tok, tmp_path, block=16, architecture="Qwen3NextForCausalLM")
    eng = kiln.Engine(model_path=str(tmp_path), **BASE_ARGS, device=DEVICE, dtype="float32")
    try:
        held = {name: p.dtype for name, p in eng.scheduler.runner.model.named_parameters()}
        assert held["model.layers.0.linear_attn.in_proj.weight"] == torch.float32
        assert held["model.layers.0.linear_attn.out_proj.weight"] == FP8
        assert sum(dtype == FP8 for dtype in held.values()) > 10
        prompt = make_prompt(token_stream(), 40, 0)
        got, out = spy_logits(eng, prompt)  # every step's logits (the Triton interpreter is slow: one prompt)
        torch.testing.assert_close(got, reference_logits(model, prompt, out), rtol=0, atol=1e-4)
        assert out == reference_greedy(model, prompt)
    finally:
        eng.shutdown()


@pytest.mark.unit
def test_the_attention_parts_a_rank_holds_must_be_whole_blocks_too():
    """Merged q / k / v rows start each part on a block; a KV head of 64 rows per rank cuts one. DeepSeek-V3's
    latent attention holds whole blocks a rank at tp 32, where its MLPs' 576 and experts' 64 rows a rank do not."""
    from test_ledger import DEEPSEEK_V3

    gqa = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2048,
           "intermediate_size": 8192, "num_hidden_layers": 2, "vocab_size": 1024}  # fmt: skip
    block = (128, 128)
    (problem,) = model_spec(gqa).tp_problems(8, fp8_block=block)
    assert problem.startswith("key / value rows (kv heads x head_dim) 512 (/ 8 = 64 per rank")
    assert model_spec(gqa).tp_problems(4, fp8_block=block) == [] and model_spec(gqa).tp_problems(8) == []
    assert model_spec(DEEPSEEK_V3).tp_problems(16, fp8_block=block) == []
    assert [p.split(" (")[0] for p in model_spec(DEEPSEEK_V3).tp_problems(32, fp8_block=block)] == [
        "intermediate_size 18432",
        "moe_intermediate_size 2048",
    ]
