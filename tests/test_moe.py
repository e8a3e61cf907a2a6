"""Mixture of experts: the router against transformers' own routers on the same random weights (softmax top-k,
DeepSeek-V2's group-limited greedy, DeepSeek-V3's sigmoid grouped top-k with its correction bias), the experts
against a per-token reference and across two simulated tensor-parallel ranks, whole sparse blocks against
transformers' blocks, and a tiny random Qwen3-MoE served by the Engine, token-identical to transformers' greedy
output (float32 logits within 1e-4) alone, batched, chunked, on radix hits, under retraction and over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_equality import (  # the fixtures among these apply to this module by being imported
    BASE_ARGS,
    EngineEquality,
    engine_fixture,  # noqa: F401
    one_torch_thread,  # noqa: F401
    reference_fixture,  # noqa: F401
)
from moe_models import build_tiny_deepseek, build_tiny_moe

import kiln
import kiln.distributed as distributed
import kiln.layers.linear as linear
import kiln.layers.moe as moe
import kiln.layers.rotary as rotary
from kiln.layers.moe import FusedMoE, MoESpec, RouterSpec, SparseMoeBlock, TopKRouter, is_sparse_layer
from kiln.models.spec import ModelSpec

model_spec = ModelSpec.from_config  # a model config dict's spec


pytestmark = pytest.mark.engine

H, I_EXPERT = 32, 16  # hidden size, one expert's intermediate size


def _seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _copy_router(hf_router, ours: TopKRouter) -> None:
    with torch.no_grad():
        hf_router.weight.normal_(0.0, 0.5, generator=_seeded(1))
        ours.weight.copy_(hf_router.weight)
        if ours.e_score_correction_bias is not None:
            hf_router.e_score_correction_bias.uniform_(-0.1, 0.1, generator=_seeded(2))
            ours.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (expert ids, weights) in expert order: routers differ in the order they list a row's picks."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.float().gather(1, order)


def _assert_same_routing(hf_router, ours: TopKRouter, tokens: int = 64) -> None:
    x = torch.randn(tokens, H, generator=_seeded(3))
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_router(x)
        weights, ids = ours(x)
    want_ids, want_weights = _by_expert(hf_weights, hf_ids)
    got_ids, got_weights = _by_expert(weights, ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights, want_weights, rtol=0, atol=1e-7)


# ---------------------------------------------------------------------------------------------- router


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.unit
def test_softmax_router_matches_qwen3_moe(norm_topk_prob: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=H, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    spec = RouterSpec.from_hf(cfg, scoring_func="softmax", topk_method="greedy", float32_routing=False)
    assert (spec.num_experts, spec.top_k, spec.norm_topk_prob) == (8, 3, norm_topk_prob)
    hf_router, ours = Qwen3MoeTopKRouter(cfg), TopKRouter(spec, H)
    _copy_router(hf_router, ours)
    _assert_same_routing(hf_router, ours)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.unit
def test_sigmoid_grouped_router_matches_deepseek_v3(norm_topk_prob: bool) -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=H, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    spec = RouterSpec.from_hf(cfg, scoring_func="sigmoid", topk_method="noaux_tc", float32_routing=True)
    assert (spec.n_group, spec.topk_group, spec.routed_scaling_factor) == (4, 2, 2.5)
    hf_router, ours = DeepseekV3TopkRouter(cfg), TopKRouter(spec, H)
    assert ours.e_score_correction_bias is not None
    _copy_router(hf_router, ours)
    _assert_same_routing(hf_router, ours)
    # the picks stay inside topk_group groups of 4 experts
    _, ids = ours(torch.randn(64, H, generator=_seeded(4)))
    assert all(len(set((row // 4).tolist())) <= 2 for row in ids)


@pytest.mark.unit
def test_a_float32_router_stays_float32_in_a_bfloat16_model() -> None:
    """DeepSeek's gate and correction bias are float32 in transformers whatever the model's dtype."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        deepseek = TopKRouter(RouterSpec(16, 4, "sigmoid", "noaux_tc", 4, 2, float32_routing=True), H)
        qwen = TopKRouter(RouterSpec(8, 2), H)
    finally:
        torch.set_default_dtype(before)
    assert deepseek.weight.dtype == deepseek.e_score_correction_bias.dtype == torch.float32
    assert qwen.weight.dtype == torch.bfloat16 and qwen.e_score_correction_bias is None
    x = torch.randn(5, H, dtype=torch.bfloat16)
    assert deepseek(x)[0].dtype == torch.float32 and qwen(x)[0].dtype == torch.bfloat16


@pytest.mark.unit
def test_group_limited_greedy_router_matches_deepseek_v2() -> None:
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(
        hidden_size=H, n_routed_experts=12, num_experts_per_tok=3, n_group=3, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5,
    )  # fmt: skip
    spec = RouterSpec.from_hf(cfg, scoring_func="softmax", topk_method="greedy", float32_routing=True)
    assert spec.topk_method == "group_limited_greedy"  # the config's own method wins over the default
    hf_router, ours = DeepseekV2TopkRouter(cfg), TopKRouter(spec, H)
    _copy_router(hf_router, ours)
    _assert_same_routing(hf_router, ours)


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("scoring_func", dict(scoring_func="foo")),
        ("topk_method", dict(topk_method="bar")),
        ("hidden_act", dict(hidden_act="gelu")),
        ("n_group", dict(topk_method="noaux_tc", n_group=3)),
        ("topk_group", dict(topk_method="noaux_tc", n_group=4, topk_group=5)),
        ("num_experts_per_tok", dict(num_experts_per_tok=9)),
    ],
)
@pytest.mark.unit
def test_unimplemented_routing_is_refused_naming_the_field(field: str, changes: dict) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        "qwen3_moe", hidden_size=H, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=I_EXPERT
    )
    for name, value in changes.items():
        setattr(cfg, name, value)
    with pytest.raises(ValueError, match=field):
        MoESpec.from_hf(cfg, scoring_func="softmax", topk_method="greedy")


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "foo"])
@pytest.mark.unit
def test_rope_without_a_static_table_is_refused(rope_type: str) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3_moe")
    cfg.rope_parameters = {"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type") as err:
        rotary.check_rope_type(cfg)
    assert "yarn" in str(err.value)  # names what is accepted


@pytest.mark.unit
def test_a_sliding_window_is_every_layers_with_use_sliding_window() -> None:
    """transformers' Qwen3-MoE windows every layer when use_sliding_window is set (its config clears the window
    otherwise): Kiln's layers and its spec say so, and serve it (every layer windowed: the token pool keeps them)."""
    from kiln.models.config import ModelConfig
    from kiln.models.registry import check_model_config

    def config(**changes) -> ModelConfig:
        base = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 16,
                "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}  # fmt: skip
        return ModelConfig.from_hf_dict("m", {**base, **changes})

    plain, windowed = config(sliding_window=128), config(use_sliding_window=True, sliding_window=128)
    assert [layer.window for layer in plain.spec.layers] == [None, None]
    assert [layer.window for layer in windowed.spec.layers] == [128, 128] and not windowed.spec.window_rings
    check_model_config(windowed)


@pytest.mark.unit
def test_qwen_routing_ignores_deepseeks_fields() -> None:
    """transformers' and SGLang's Qwen3-MoE route by softmax top-k whatever else the config holds."""
    from transformers import AutoConfig

    from kiln.models.qwen3_moe import moe_spec

    plain = AutoConfig.for_model("qwen3_moe", num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    extra = dict(
        scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    noisy = AutoConfig.for_model(
        "qwen3_moe", num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, **extra
    )
    assert moe_spec(noisy) == moe_spec(plain)
    assert moe_spec(noisy).router == RouterSpec(8, 2, norm_topk_prob=True)


@pytest.mark.unit
def test_sparse_layers_follow_the_config() -> None:
    from transformers import AutoConfig

    qwen = AutoConfig.for_model("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [is_sparse_layer(qwen, i) for i in range(6)] == [False, True, False, False, False, True]
    deepseek = AutoConfig.for_model("deepseek_v3", num_hidden_layers=4, first_k_dense_replace=1)
    assert [is_sparse_layer(deepseek, i) for i in range(4)] == [False, True, True, True]
    dense = AutoConfig.for_model("qwen3_moe", num_experts=0)
    assert not is_sparse_layer(dense, 0)


# ---------------------------------------------------------------------------------------------- experts


def _full_expert_weights(experts: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's fused layout: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]."""
    gen = _seeded(seed)
    return torch.randn(experts, 2 * I_EXPERT, H, generator=gen) * 0.3, torch.randn(
        experts, H, I_EXPERT, generator=gen
    ) * 0.3


def _load_per_expert(layer: FusedMoE, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    for e in range(gate_up.shape[0]):
        layer.weight_loader(layer.gate_up_proj, gate_up[e, :I_EXPERT], (e, "gate"))
        layer.weight_loader(layer.gate_up_proj, gate_up[e, I_EXPERT:], (e, "up"))
        layer.weight_loader(layer.down_proj, down[e], (e, "down"))


def _routing(tokens: int, experts: int, k: int, seed: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _seeded(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    return torch.rand(tokens, k, generator=gen), ids


def _naive(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t]):
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (torch.nn.functional.silu(g) * u))
    return out


@pytest.mark.unit
def test_experts_match_a_per_token_reference() -> None:
    experts, k, tokens = 6, 2, 13
    layer = FusedMoE(experts, H, I_EXPERT)
    gate_up, down = _full_expert_weights(experts)
    _load_per_expert(layer, gate_up, down)
    assert layer.missing_shards() == []
    x = torch.randn(tokens, H, generator=_seeded(7))
    weights, ids = _routing(tokens, experts, k)
    ids[:, 0] = 1  # every token visits expert 1; some experts get none
    torch.testing.assert_close(layer(x, weights, ids), _naive(x, weights, ids, gate_up, down))
    # the device-side path CUDA graphs capture computes the same product
    flat = ids.reshape(-1)
    rows = x.index_select(0, torch.argsort(flat, stable=True) // k)
    sorted_ids = flat.sort(stable=True).values
    torch.testing.assert_close(layer._grouped_mm(rows, sorted_ids), layer._per_expert(rows, sorted_ids))


@pytest.mark.unit
def test_fused_checkpoint_layout_loads_like_per_expert() -> None:
    gate_up, down = _full_expert_weights(4)
    per_expert, fused = FusedMoE(4, H, I_EXPERT), FusedMoE(4, H, I_EXPERT)
    _load_per_expert(per_expert, gate_up, down)
    fused.weight_loader(fused.gate_up_proj, gate_up)
    fused.weight_loader(fused.down_proj, down)
    assert fused.missing_shards() == []
    assert torch.equal(fused.gate_up_proj, per_expert.gate_up_proj)
    assert torch.equal(fused.down_proj, per_expert.down_proj)


@pytest.mark.unit
def test_a_missing_expert_tensor_is_named() -> None:
    layer = FusedMoE(3, H, I_EXPERT)
    gate_up, down = _full_expert_weights(3)
    _load_per_expert(layer, gate_up, down)
    layer.loaded_shards.discard((2, "up"))
    holder = torch.nn.Module()
    holder.experts = layer
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj\.weight"):
        moe.check_experts_loaded(holder)


@pytest.mark.unit
def test_expert_checkpoint_names() -> None:
    assert moe.expert_target("model.layers.3.mlp.experts.17.up_proj.weight") == (
        "model.layers.3.mlp.experts.gate_up_proj",
        (17, "up"),
    )
    assert moe.expert_target("model.layers.3.mlp.experts.0.down_proj.weight") == (
        "model.layers.3.mlp.experts.down_proj",
        (0, "down"),
    )
    assert moe.expert_target("model.layers.3.mlp.experts.down_proj") == (
        "model.layers.3.mlp.experts.down_proj",
        None,
    )
    assert moe.expert_target("model.layers.3.mlp.shared_experts.gate_proj.weight") is None
    assert moe.expert_target("model.layers.3.mlp.gate.weight") is None


def _deepseek_block_config(n_shared: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=I_EXPERT, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, n_shared_experts=n_shared,
    )  # fmt: skip


def _block_like(hf_block, spec: MoESpec) -> SparseMoeBlock:
    """Our block holding the HF block's weights, loaded the way a checkpoint is."""
    block = SparseMoeBlock(spec)
    with torch.no_grad():
        for p in hf_block.parameters():
            p.normal_(0.0, 0.3, generator=_seeded(p.numel()))
        block.gate.weight.copy_(hf_block.gate.weight)
        if block.gate.e_score_correction_bias is not None:
            hf_block.gate.e_score_correction_bias.uniform_(-0.1, 0.1, generator=_seeded(9))
            block.gate.e_score_correction_bias.copy_(hf_block.gate.e_score_correction_bias)
    block.experts.weight_loader(block.experts.gate_up_proj, hf_block.experts.gate_up_proj.detach())
    block.experts.weight_loader(block.experts.down_proj, hf_block.experts.down_proj.detach())
    shared = getattr(hf_block, "shared_experts", None)
    if shared is not None:
        mlp = block.shared_experts
        for shard, proj in enumerate((shared.gate_proj, shared.up_proj)):
            mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, proj.weight.detach(), shard)
        mlp.down_proj.weight_loader(mlp.down_proj.weight, shared.down_proj.weight.detach())
    return block


@pytest.mark.unit
def test_deepseek_v3_block_with_shared_experts_matches_transformers() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = _deepseek_block_config(n_shared=2)
    spec = MoESpec.from_hf(cfg, scoring_func="sigmoid", topk_method="noaux_tc", float32_routing=True)
    assert spec.shared_intermediate_size == 2 * I_EXPERT
    hf_block = DeepseekV3MoE(cfg).eval()
    block = _block_like(hf_block, spec)
    x = torch.randn(2, 11, H, generator=_seeded(10))
    with torch.no_grad():
        torch.testing.assert_close(block(x.view(-1, H)), hf_block(x).view(-1, H), rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_qwen3_moe_block_matches_transformers() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=I_EXPERT,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    spec = MoESpec.from_hf(cfg, scoring_func="softmax", topk_method="greedy")
    assert spec.shared_intermediate_size == 0
    hf_block = Qwen3MoeSparseMoeBlock(cfg).eval()
    block = _block_like(hf_block, spec)
    assert block.shared_experts is None
    x = torch.randn(2, 11, H, generator=_seeded(11))
    with torch.no_grad():
        torch.testing.assert_close(block(x.view(-1, H)), hf_block(x).view(-1, H), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.unit
def test_two_tensor_parallel_ranks_hold_slices_and_sum_to_one_rank(monkeypatch, ep: int) -> None:
    """tp 2 simulated: each rank built and loaded as its own process would be; the all-reduce becomes a sum of
    the two ranks' partial outputs, which must equal the tp 1 output. ep 1: each rank holds half of every
    expert; ep 2 (--ep-size 2): rank r holds experts [4r, 4r + 4) whole."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = _deepseek_block_config(n_shared=1)
    spec = MoESpec.from_hf(cfg, scoring_func="sigmoid", topk_method="noaux_tc", float32_routing=True)
    hf_block = DeepseekV3MoE(cfg).eval()
    whole = _block_like(hf_block, spec)
    monkeypatch.setattr(moe, "all_reduce", lambda t: t)
    monkeypatch.setattr(linear, "all_reduce", lambda t: t)
    ranks = []
    for rank in range(2):
        monkeypatch.setattr(distributed, "_TP", distributed.TPGroup(rank=rank, size=2, ep_size=ep))
        ranks.append(_block_like(hf_block, spec))
    monkeypatch.setattr(distributed, "_TP", distributed.TPGroup(rank=0, size=1))
    gate_up, down = hf_block.experts.gate_up_proj.detach(), hf_block.experts.down_proj.detach()
    for rank, block in enumerate(ranks):
        if ep == 2:
            experts = slice(4 * rank, 4 * rank + 4)
            assert torch.equal(block.experts.gate_up_proj, gate_up[experts])
            assert torch.equal(block.experts.down_proj, down[experts])
            continue
        half = I_EXPERT // 2
        cols = slice(rank * half, (rank + 1) * half)
        assert block.experts.gate_up_proj.shape == (8, I_EXPERT, H)
        assert torch.equal(block.experts.gate_up_proj[:, :half], gate_up[:, :I_EXPERT][:, cols])
        assert torch.equal(block.experts.gate_up_proj[:, half:], gate_up[:, I_EXPERT:][:, cols])
        assert torch.equal(block.experts.down_proj, down[:, :, cols])
    x = torch.randn(9, H, generator=_seeded(12))
    with torch.no_grad():
        torch.testing.assert_close(ranks[0](x) + ranks[1](x), whole(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- Qwen3-MoE end to end


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build_tiny_moe(tmp_path_factory.mktemp("tiny-qwen3-moe")))


class TestQwen3MoeMatchesTransformers(EngineEquality):
    """The shared end-to-end scenarios on the tiny Qwen3-MoE."""


def test_the_tiny_model_is_sparse(engine: kiln.Engine) -> None:
    model = engine.scheduler.runner.model
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["LlamaMLP", "SparseMoeBlock", "SparseMoeBlock"]
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == (8, 64, 64)


def test_the_ledger_counts_the_parameters_the_model_holds(engine: kiln.Engine, model_path: str) -> None:

    held = sum(p.numel() for p in dict(engine.scheduler.runner.model.named_parameters()).values())
    assert sum(model_spec(json.loads(Path(model_path, "config.json").read_text())).param_counts(1)) == held


def test_an_unknown_scoring_function_is_refused_at_startup(tmp_path: Path) -> None:
    path = build_tiny_deepseek(tmp_path / "bad", scoring_func="foo")
    with pytest.raises(Exception, match="scoring_func 'foo'") as err:
        kiln.Engine(model_path=str(path), **BASE_ARGS)
    assert "softmax" in str(err.value)


@pytest.mark.unit
def test_ep_size_must_split_the_experts() -> None:
    """--ep-size divides the routed experts and leaves tp / ep ranks that divide each expert's intermediate size;
    a dense model has no experts to split. The refusal names the dimension."""
    cfg = {
        **{"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128},
        **{"num_attention_heads": 4, "num_key_value_heads": 2, "moe_intermediate_size": 32, "num_experts": 8},
    }
    assert model_spec(cfg).tp_problems(2, 2) == [] and model_spec(cfg).tp_problems(4, 2) == []
    assert model_spec({**cfg, "num_experts": 6}).tp_problems(4, 4) == ["routed experts 6 (by --ep-size 4)"]
    assert model_spec({**cfg, "moe_intermediate_size": 31}).tp_problems(4, 2) == ["moe_intermediate_size 31"]
    assert model_spec({**cfg, "moe_intermediate_size": 31}).tp_problems(2, 2) == []  # whole experts: no split
    dense = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 128,
        "num_attention_heads": 4,
        "intermediate_size": 64,
    }
    assert "this model is dense" in model_spec(dense).tp_problems(2, 2)[0]
