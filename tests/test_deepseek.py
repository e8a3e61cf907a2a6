"""DeepSeek-V3 (multi-head latent attention, a dense first layer, then grouped-top-k experts with a shared expert,
yarn rope) served by the Engine on random small configs, token-identical to transformers' DeepseekV3ForCausalLM
greedy output (float32 logits within 1e-4): alone, batched, chunked, on radix hits, under retraction and over
HTTP, with q_lora on and off; an FP8 block-quantized checkpoint dequantized at load and held in FP8; the MTP
layer set aside."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8_blocks import dequantize_reference, quantize_blocks, save_fp8_model
from model_equality import (  # the fixtures among these apply to this module by being imported
    BASE_ARGS,
    EngineEquality,
    Reference,
    engine_fixture,  # noqa: F401
    generate,
    ids_of,
    one_torch_thread,  # noqa: F401
    reference_fixture,  # noqa: F401
    reference_greedy,
    reference_logits,
    spy_logits,
)
from moe_models import MTP_TENSORS, TINY_DEEPSEEK, build_tiny_deepseek, deepseek_hf_model
from test_correctness import load_hf

import kiln
from kiln.loader import fp8
from kiln.memory.kv_pool import LatentKVPool
from kiln.models.spec import ModelSpec
from kiln.runner.attention import MlaBackend

model_spec = ModelSpec.from_config  # a model config dict's spec


pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek-v3")))


# ---------------------------------------------------------------------------------------------- the model


def test_the_model_holds_latent_attention_and_experts(engine: kiln.Engine, model_path: str) -> None:
    runner = engine.scheduler.runner
    model = runner.model
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["LlamaMLP", "SparseMoeBlock", "SparseMoeBlock"]  # first_k_dense_replace 1
    assert model.model.layers[1].mlp.shared_experts is not None
    assert isinstance(runner.kv_pool, LatentKVPool) and isinstance(runner.attn_backend, MlaBackend)
    # one latent row per token per layer, no V half: exactly the ledger's MLA cell
    assert runner.kv_pool.k[0].shape[1:] == (1, 32 + 8) and runner.kv_pool.v_bytes == 0
    assert runner.measured["kv_pool"] == (runner.kv_pool.num_tokens + runner.kv_pool.page_size) * 40 * 3 * 4


def test_the_ledger_counts_what_the_model_holds(engine: kiln.Engine, model_path: str) -> None:

    config = json.loads(Path(model_path, "config.json").read_text())
    runner = engine.scheduler.runner
    assert model_spec(config).weight_bytes(1, 4) == runner.measured["weights"]
    per_token = runner.measured["kv_pool"] // (runner.kv_pool.num_tokens + runner.kv_pool.page_size)
    assert model_spec(config).kv_bytes_per_token(1, 4) == per_token


def test_the_mtp_layer_is_kept_aside(model_path: str) -> None:
    """The loader sets the MTP layer aside for NEXTN (an engine without NEXTN lets it go after startup:
    tests/test_draft_models.py)."""
    from kiln.loader.model_config import read_hf_config
    from kiln.models.config import ModelConfig
    from kiln.runner.model_runner import ModelRunner

    runner = ModelRunner(ModelConfig.from_hf_dict(model_path, read_hf_config(model_path)), torch.float32,
                         torch.float32, "cpu")  # fmt: skip
    runner.load(256, prepack=False)
    model = runner.model
    assert sorted(model.mtp_weights) == sorted(MTP_TENSORS)
    assert all(tuple(model.mtp_weights[k].shape) == shape for k, shape in MTP_TENSORS.items())
    assert len(model.model.layers) == 3  # never a layer of the main model


class TestDeepseekV3MatchesTransformers(EngineEquality):
    """The shared end-to-end scenarios on the tiny DeepSeek-V3 (q_lora and yarn on)."""


def test_without_q_lora(tmp_path: Path, ref: Reference) -> None:
    """Queries straight from the hidden state (q_proj), no yarn: logits and batched greedy tokens."""
    path = str(build_tiny_deepseek(tmp_path / "no-q-lora", seed=1, q_lora_rank=None, rope_scaling=None))
    model = load_hf(path)
    eng = kiln.Engine(model_path=path, **BASE_ARGS)
    try:
        assert eng.scheduler.runner.model.model.layers[0].self_attn.q_proj is not None
        prompt = ref.prompts[5]
        got, out = spy_logits(eng, prompt)
        torch.testing.assert_close(got, reference_logits(model, prompt, out), rtol=0, atol=1e-4)
        eng.scheduler.flush_cache()
        prompts = ref.prompts[:7] + ref.shared
        assert ids_of(generate(eng, prompts)) == [reference_greedy(model, p) for p in prompts]
    finally:
        eng.shutdown()


# ---------------------------------------------------------------------------------------------- tensor parallel


def _attention_steps(cfg, hf_attn, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One latent attention layer on this rank (distributed._TP), loaded from transformers' layer, through the
    MLA backend over its own pool: a 5-token prefill, one decode step, then a 2-token extend on that prefix. The
    o_proj outputs of each step, before the all-reduce."""
    from kiln.core.forward_batch import AttentionMetadata, ForwardBatch, ForwardMode
    from kiln.layers.rotary import RotaryEmbedding
    from kiln.models.deepseek_v3 import DeepseekV3Attention
    from kiln.models.weight_utils import default_weight_loader

    attn = DeepseekV3Attention(cfg, 0)
    params = dict(attn.named_parameters())
    for name, tensor in hf_attn.state_dict().items():
        getattr(params[name], "weight_loader", default_weight_loader)(params[name], tensor, None)
    backend = MlaBackend(LatentKVPool(16, 1, 1, 40, torch.float32), attn.heads, 32)
    rotary = RotaryEmbedding(cfg.hf_config, 64)
    meta, outs, done = AttentionMetadata(), [], 0
    for x in xs:
        n = x.shape[0]
        slots = torch.arange(1, done + n + 1)
        common = dict(positions=torch.arange(done, done + n), out_cache_loc=slots[done:], logits_index=None)
        if n == 1 and done:
            fb = ForwardBatch(ForwardMode.DECODE, torch.zeros(1, dtype=torch.long), **common,
                              kv_table=slots.unsqueeze(0), attn=meta)  # fmt: skip
        else:
            fb = ForwardBatch(ForwardMode.EXTEND, torch.zeros(n, dtype=torch.long), **common, extend_lens=[n],
                              prefix_lens=[done], seq_slots=[slots], attn=meta)  # fmt: skip
        q_nope, q_rope, latent = attn.project(x, rotary.cos_sin_for(fb.positions, x.dtype), rotary)
        outs.append(attn.o_proj(backend.forward_latent(0, q_nope, q_rope, latent, fb, attn, attn.scale)))
        done += n
    return outs


@pytest.mark.unit
def test_two_tensor_parallel_ranks_split_the_heads_and_sum_to_one_rank(monkeypatch) -> None:
    """tp 2 simulated: each rank holds half the heads of q_b_proj, kv_b_proj and o_proj and the whole
    replicated down-projections; the latent pool is the same on both. The ranks' partial outputs summed (the
    all-reduce) equal the tp 1 output, in prefill, decode and extend alike."""
    import kiln.distributed as distributed
    import kiln.layers.linear as linear
    from kiln.models.config import ModelConfig

    small = {k: v for k, v in TINY_DEEPSEEK.items() if k != "num_nextn_predict_layers"}
    cfg = ModelConfig.from_hf_dict("tp", {**small, "model_type": "deepseek_v3", "vocab_size": 64})
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention as HfAttention

    hf_attn = HfAttention(cfg.hf_config, 0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in hf_attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    xs = [torch.randn(n, 64, generator=gen) for n in (5, 1, 2)]
    whole = _attention_steps(cfg, hf_attn, xs)
    monkeypatch.setattr(linear, "all_reduce", lambda t: t)
    ranks = []
    for rank in range(2):
        monkeypatch.setattr(distributed, "_TP", distributed.TPGroup(rank=rank, size=2))
        ranks.append(_attention_steps(cfg, hf_attn, xs))
    for step, want in enumerate(whole):
        torch.testing.assert_close(ranks[0][step] + ranks[1][step], want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.unit
def test_kimi_k2_is_the_deepseek_v3_architecture() -> None:
    from kiln.models.config import ModelConfig
    from kiln.models.deepseek_v3 import DeepseekV3ForCausalLM
    from kiln.models.registry import model_class

    small = {k: v for k, v in TINY_DEEPSEEK.items() if k != "rope_scaling"}
    kimi = {**small, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 99}
    cfg = ModelConfig.from_hf_dict("kimi", kimi)
    assert model_class(cfg.architecture) is DeepseekV3ForCausalLM
    assert cfg.mla is not None and (cfg.mla.latent_width, cfg.mla.q_lora_rank) == (32 + 8, 48)


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("scoring_func 'foo'", dict(scoring_func="foo")),
        ("rope_type", dict(rope_scaling=dict(type="dynamic", factor=2.0))),
        ("attention_bias", dict(attention_bias=True)),
    ],
)
def test_unimplemented_features_are_refused_at_startup(tmp_path: Path, field: str, changes: dict) -> None:
    path = tmp_path / "bad"
    build_tiny_deepseek(path)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(Exception, match=field):
        kiln.Engine(model_path=str(path), **BASE_ARGS)


# ---------------------------------------------------------------------------------------------- FP8


@pytest.mark.unit
def test_fp8_block_dequantization_matches_the_definition() -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(70, 45, generator=gen)
    q, scale = quantize_blocks(w, 16)
    assert scale.shape == (5, 3)
    got = fp8.dequantize_blocks(q, scale, (16, 16))
    assert torch.equal(got, dequantize_reference(q, scale, 16))
    assert (got - w).abs().max() < 0.1 * w.abs().max()  # e4m3 keeps about two significant digits


@pytest.mark.unit
def test_fp8_stream_pairs_weights_with_scales_in_any_order() -> None:
    q, scale = quantize_blocks(torch.randn(20, 20), 16)
    stream = [("a.weight_scale_inv", scale), ("b.bias", torch.ones(3)), ("a.weight", q)]
    out = dict(fp8.block_stream(iter(stream), (16, 16)))
    assert sorted(out) == ["a.weight", "b.bias"] and out["a.weight"].dtype == torch.float32
    with pytest.raises(ValueError, match="c.weight_scale_inv"):
        list(fp8.block_stream(iter([("c.weight", q)]), (16, 16)))


@pytest.mark.unit
def test_fp8_config_is_checked() -> None:
    assert fp8.block_size({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}) == (
        128,
        128,
    )
    with pytest.raises(ValueError, match="fmt"):
        fp8.block_size({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8.block_size({"quant_method": "fp8", "fmt": "e4m3"})


@pytest.mark.parametrize("held", ["dequantize", "keep"])
def test_an_fp8_checkpoint_loads_and_matches_transformers(
    tmp_path: Path, ref: Reference, monkeypatch, held
) -> None:
    """Dequantized at load (the CPU's default), and kept in FP8 blocks (CUDA's from compute capability 8.9;
    KILN_FP8_WEIGHTS=keep runs the kernels here in Triton's interpreter): transformers' logits and greedy tokens
    on the dequantized weights either way."""
    from kiln.layers.fp8_linear import block_factor_bytes

    monkeypatch.setenv("KILN_FP8_WEIGHTS", held)
    model, tok = deepseek_hf_model(seed=2)
    path = tmp_path / "fp8"
    tensors = save_fp8_model(model, tok, path, block=32, architecture="DeepseekV3ForCausalLM")
    config = json.loads((path / "config.json").read_text())
    assert tensors["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    device = "cuda" if held == "keep" and torch.cuda.is_available() else "cpu"  # natively on a GPU
    eng = kiln.Engine(model_path=str(path), **BASE_ARGS, device=device, dtype="float32")
    try:
        runner = eng.scheduler.runner
        held_dtypes = {name: p.dtype for name, p in runner.model.named_parameters()}
        fp8_held = {name for name, dtype in held_dtypes.items() if dtype == torch.float8_e4m3fn}
        if held == "keep":  # every linear and the routed experts, but kv_b_proj (absorbed per head)
            assert {
                "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
                "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                "model.layers.1.mlp.shared_experts.down_proj.weight",
            } <= fp8_held  # fmt: skip
            assert held_dtypes["model.layers.0.self_attn.kv_b_proj.weight"] == torch.float32
            assert not any("embed" in name or "lm_head" in name or "gate.weight" in name for name in fp8_held)
            # the ledger's figure (block factors counted at 4 B a whole block) within 2% of what is held
            measured = runner.measured["weights"]
            assert abs(model_spec(config).weight_bytes(1, 4, fp8_kept=True) - measured) < 0.02 * measured
            # against the dequantized model's (what the ledger counts for it): 3 B saved a weight held in FP8, less
            # the factors
            elements = sum(p.numel() for p in runner.model.parameters() if p.dtype == torch.float8_e4m3fn)
            saved = 3 * elements - block_factor_bytes(runner.model)
            assert model_spec(config).weight_bytes(1, 4) - measured == saved > 0
        else:
            assert not fp8_held
        prompt = ref.prompts[5]
        got, out = spy_logits(eng, prompt)
        torch.testing.assert_close(got, reference_logits(model, prompt, out), rtol=0, atol=1e-4)
        eng.scheduler.flush_cache()
        # Triton's interpreter on the CPU is slow: two prompts there, batched; six elsewhere
        prompts = ref.prompts[: 2 if held == "keep" and device == "cpu" else 6]
        assert ids_of(generate(eng, prompts)) == [reference_greedy(model, p) for p in prompts]
    finally:
        eng.shutdown()
