"""Mixtral (a sparse MoE in every layer), Phi-3 (q/k/v and gate/up fused in the checkpoint, partial rotary,
LongRoPE) and Qwen2 with use_sliding_window on tiny random configs whose sliding window (16 tokens) is far shorter
than most prompts, served by the Engine token-identical to transformers' float32 greedy output (logits within
1e-4): the shared scenarios of tests/model_equality.py on Mixtral, plain-rope Phi-3 and Qwen2 (its first layer
full, max_window_layers), and LongRoPE's short and long factors around original_max_position_embeddings, per
request, as transformers' generation picks them. `kiln plan` on Mixtral and Phi-3 over a context past the window."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_equality import (  # the fixtures among these apply to this module by being imported
    BASE_ARGS,
    EngineEquality,
    assert_idle,
    engine_fixture,  # noqa: F401
    generate,
    ids_of,
    one_torch_thread,  # noqa: F401
    random_model,
    reference_fixture,  # noqa: F401
    reference_greedy,
    reference_logits,
    spy_logits,
)
from test_correctness import load_hf, make_prompt, token_stream

import kiln
import kiln.plan as plan
from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.layers.rotary import LongRopeEmbedding, RotaryEmbedding, rotary_config

pytestmark = pytest.mark.engine

WINDOW = 16  # Mixtral's and Phi-3's every layer, Qwen2's past max_window_layers
_SHAPE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=4096, tie_word_embeddings=False, sliding_window=WINDOW,
)  # fmt: skip
TINY_MIXTRAL = dict(_SHAPE, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
TINY_PHI3 = dict(_SHAPE, intermediate_size=128)
TINY_QWEN2 = dict(_SHAPE, intermediate_size=128, use_sliding_window=True, max_window_layers=1)
ORIGINAL = 32  # LongRoPE's original_max_position_embeddings: the prompts below fall on both sides of it
ROTARY = 12  # of the head's 16 dims: partial_rotary_factor 0.75, as Phi-4-mini's


def longrope(seed: int = 1) -> dict:
    """Phi-3 with LongRoPE over 3/4 of each head: random short factors near 1, long ones up to 9."""
    gen = torch.Generator().manual_seed(seed)
    short, long = 1 + torch.rand(ROTARY // 2, generator=gen), 1 + 8 * torch.rand(ROTARY // 2, generator=gen)
    scaling = {"type": "longrope", "short_factor": short.tolist(), "long_factor": long.tolist()}
    return dict(
        TINY_PHI3, original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75, rope_scaling=scaling
    )


def build(kind: str, out_dir: Path, seed: int = 0, **config) -> Path:
    """A random Mixtral, Phi-3 or Qwen2 saved with transformers (Mixtral's experts as w1 / w3 / w2 per expert
    under block_sparse_moe, as its checkpoints hold them), with the default model's tokenizer."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    classes = {
        "mixtral": (MixtralConfig, MixtralForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    tiny = {"mixtral": TINY_MIXTRAL, "phi3": TINY_PHI3, "qwen2": TINY_QWEN2}[kind]
    model, tok = random_model(*classes, seed, **(config or tiny))
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


# seeds whose greedy steps in the scenarios have no near tie (top-2 logits 3e-4 apart or more), which float
# rounding alone would decide
SEEDS = {"mixtral": 1, "phi3": 4, "qwen2": 0, "longrope": 5}


@pytest.fixture(scope="module", params=["mixtral", "phi3", "qwen2"])
def model_path(request, tmp_path_factory) -> str:
    return str(build(request.param, tmp_path_factory.mktemp(request.param), SEEDS[request.param]))


class TestFamiliesMatchTransformers(EngineEquality):
    """The shared end-to-end scenarios on the tiny Mixtral, Phi-3 and Qwen2, but HTTP's: the server does not depend on
    the family (tests/test_moe.py and tests/test_deepseek.py serve their models over it), and a server start
    per family would double this module's time."""

    test_over_http = None


def test_the_layers_are_the_familys(engine: kiln.Engine, model_path: str) -> None:
    model = engine.scheduler.runner.model
    windows = [layer.self_attn.window for layer in model.model.layers]
    assert windows == ([None, WINDOW] if type(model).__name__ == "Qwen2ForCausalLM" else [WINDOW, WINDOW])
    if type(model).__name__ == "Qwen2ForCausalLM":
        return
    if type(model).__name__ == "MixtralForCausalLM":
        assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SparseMoeBlock"] * 2
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape == (8, 64, 64) and experts.down_proj.shape == (8, 64, 32)
    else:
        assert type(model).__name__ == "Phi3ForCausalLM"
        assert model.model.layers[0].self_attn.qkv_proj.out_per_rank == (4 + 2 * 2) * 16


def test_the_ledger_counts_what_the_model_holds(engine: kiln.Engine, model_path: str, capsys) -> None:
    assert plan.main(["--model-path", model_path, "--device", "cpu", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    runner = engine.scheduler.runner
    assert planned["weight_bytes"] == runner.measured["weights"]
    per_token = runner.measured["kv_pool"] // (runner.kv_pool.num_tokens + runner.kv_pool.page_size)
    assert planned["kv_bytes_per_token"] == per_token


def test_mixtral_loads_transformers_stacked_experts_as_its_checkpoints(tmp_path: Path) -> None:
    """transformers' own parameter names (mlp.gate, mlp.experts.gate_up_proj stacked) load the same weights as
    the checkpoint's (block_sparse_moe, experts.E.w1 / w3 / w2)."""
    from kiln.loader.model_config import read_hf_config
    from kiln.loader.weights import iter_safetensors
    from kiln.models.config import ModelConfig
    from kiln.models.mixtral import MixtralForCausalLM

    path = str(build("mixtral", tmp_path / "m", seed=2))
    cfg = ModelConfig.from_hf_dict(path, read_hf_config(path))
    from_checkpoint, from_state_dict = MixtralForCausalLM(cfg), MixtralForCausalLM(cfg)
    from_checkpoint.load_weights(iter_safetensors(path))
    state = load_hf(path).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    from_state_dict.load_weights(state.items())
    ours = from_state_dict.state_dict()
    assert all(torch.equal(t, ours[name]) for name, t in from_checkpoint.state_dict().items())


# ---------------------------------------------------------------------------------------------- rotary


@pytest.mark.unit
def test_partial_rotary_turns_the_first_dims_as_transformers() -> None:
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    cfg = Phi3Config(**{**TINY_PHI3, "partial_rotary_factor": 0.5}, pad_token_id=0)
    q, k = torch.randn(1, 4, 9, 16), torch.randn(1, 2, 9, 16)
    cos, sin = Phi3RotaryEmbedding(cfg)(q, torch.arange(9)[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    rotary = RotaryEmbedding(rotary_config(cfg, 16), 64)
    cos_sin = rotary.cos_sin_for(torch.arange(9), torch.float32)
    assert cos_sin.shape == (2, 9, 1, 8)
    for x, want in ((q, want_q), (k, want_k)):
        got = rotary.apply(x[0].transpose(0, 1), cos_sin).transpose(0, 1)
        torch.testing.assert_close(got, want[0], rtol=0, atol=1e-6)


def _extend(prefix_lens: list[int], extend_lens: list[int]) -> tuple[ForwardBatch, torch.Tensor]:
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)])
    empty = torch.zeros(0, dtype=torch.long)
    fb = ForwardBatch(
        ForwardMode.EXTEND,
        positions,
        positions,
        empty,
        None,
        extend_lens=extend_lens,
        prefix_lens=prefix_lens,
    )
    return fb, positions


@pytest.mark.unit
def test_longrope_picks_its_factors_per_request_as_transformers() -> None:
    """Each request of a batch turns by the short factors while its sequence ends within
    original_max_position_embeddings in this forward, by the long ones once it ends past it (transformers
    decides once per forward; here per request, so a batch gives each its own)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cfg = Phi3Config(**longrope(), pad_token_id=0)
    ours = LongRopeEmbedding(cfg, 256)

    def transformers(start: int, end: int) -> torch.Tensor:
        hf = Phi3RotaryEmbedding(cfg)  # a new one: it keeps the last forward's factors
        cos, sin = hf(torch.zeros(1), torch.arange(end)[None])  # the sequence so far decides
        half = ROTARY // 2
        return torch.stack((cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)))[:, start:end]

    # a short prompt, a long one, and an extend on a 30-token prefix that ends past the original length
    fb, positions = _extend([0, 0, 30], [20, 40, 5])
    got = ours.cos_sin_for(positions, torch.float32, fb)[:, :, 0]
    want = torch.cat((transformers(0, 20), transformers(0, 40), transformers(30, 35)), dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # decode rows: each by its own position, the last of its sequence
    positions = torch.tensor([31, 32])
    decode = ForwardBatch(ForwardMode.DECODE, positions, positions, positions, None)
    got = ours.cos_sin_for(positions, torch.float32, decode)[:, :, 0]
    torch.testing.assert_close(got, torch.cat((transformers(31, 32), transformers(32, 33)), dim=1))
    assert not torch.allclose(transformers(0, 20), transformers(0, 40)[:, :20])  # the factors differ


# ---------------------------------------------------------------------------------------------- LongRoPE


@pytest.fixture(scope="module")
def longrope_path(tmp_path_factory) -> str:
    return str(build("phi3", tmp_path_factory.mktemp("phi3-longrope"), SEEDS["longrope"], **longrope()))


@pytest.fixture(scope="module")
def longrope_engine(longrope_path: str) -> Iterator[kiln.Engine]:
    eng = kiln.Engine(model_path=longrope_path, **BASE_ARGS)
    yield eng
    eng.shutdown()
    gc.collect()


@pytest.fixture(scope="module")
def longrope_hf(longrope_path: str):
    return load_hf(longrope_path)


# below, at and past the original length; 28 and 31 cross it while decoding
LONGROPE_LENS = [1, 9, 20, 28, 31, 32, 33, 40, 77, 150, 333]


@torch.inference_mode()
def generation_logits(model, ids: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits as its greedy generation computes them: the prompt in one forward, then a token a
    forward over the cache. LongRoPE picks its factors per forward, so a one-forward reference (reference_logits)
    differs from generation once a sequence grows past original_max_position_embeddings."""
    out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    rows = [out.logits[0, -1].float()]
    for tok in generated[:-1]:
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def test_longrope_logits_match_transformers_generation(longrope_engine: kiln.Engine, longrope_hf) -> None:
    stream = token_stream()
    for n in (20, 28, 40, 150):
        prompt = make_prompt(stream, n, 11 * n)
        got, out = spy_logits(longrope_engine, prompt)
        want = generation_logits(longrope_hf, prompt, out)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        if n > ORIGINAL:  # a prompt past the original length is prefilled by the long factors throughout
            torch.testing.assert_close(got, reference_logits(longrope_hf, prompt, out), rtol=0, atol=1e-4)
    # the comparison sees the long factors: transformers held to the short ones answers otherwise
    rotary = longrope_hf.model.rotary_emb
    rotary.long_inv_freq = rotary.original_inv_freq.clone()
    try:
        short_only = generation_logits(longrope_hf, prompt, out)
    finally:
        del rotary.long_inv_freq
    assert (short_only - got).abs().max() > 1e-2


def test_longrope_greedy_alone_batched_and_chunked(
    longrope_engine: kiln.Engine, longrope_hf, longrope_path: str
) -> None:
    """Token-identical to transformers alone and in one batch of prompts on both sides of the original length,
    and in chunks of half of it, alone and batched: a long prompt's first chunks end within the original length
    and still turn by the long factors, as transformers' one forward over the whole prompt does (the batch
    carries each prompt's whole length, ForwardBatch.fill_lens)."""
    stream = token_stream()
    prompts = [make_prompt(stream, n, 29 * i) for i, n in enumerate(LONGROPE_LENS)]
    want = [reference_greedy(longrope_hf, p) for p in prompts]
    alone = []
    for prompt in prompts:
        longrope_engine.scheduler.flush_cache()
        alone += ids_of(generate(longrope_engine, [prompt]))
    assert alone == want
    longrope_engine.scheduler.flush_cache()
    assert ids_of(generate(longrope_engine, prompts)) == want
    assert_idle(longrope_engine)
    eng = kiln.Engine(model_path=longrope_path, **{**BASE_ARGS, "chunked_prefill_size": ORIGINAL // 2})
    try:
        assert [ids_of(generate(eng, [p]))[0] for p in prompts] == want
        eng.scheduler.flush_cache()
        assert ids_of(generate(eng, prompts)) == want
        assert_idle(eng)
    finally:
        eng.shutdown()


# ---------------------------------------------------------------------------------------------- plan


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["mixtral", "phi3"])
def test_plan_serves_both_over_a_context_past_their_window(kind: str, capsys, model_dir) -> None:
    """transformers' Mixtral and Phi-3 mask every layer to sliding_window (Phi-3-mini-4k: 2047 of 4096), and so
    does Kiln: plan fits them over their whole context."""
    from transformers import MixtralConfig, Phi3Config

    config = MixtralConfig(**TINY_MIXTRAL) if kind == "mixtral" else Phi3Config(**longrope(), pad_token_id=0)
    config.architectures = [f"{'Mixtral' if kind == 'mixtral' else 'Phi3'}ForCausalLM"]
    windowed = model_dir({**config.to_dict(), "sliding_window": 2047}, f"{kind}-window")
    assert plan.main(["--model-path", windowed, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits" in out and "context_len=4096" in out
