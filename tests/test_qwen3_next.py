"""Qwen3-Next, the hybrid linear-attention model: the gated delta rule's chunked form against its recurrent
form and transformers' own, continuation from a saved state (the delta rule's and the causal conv's), the sparse
block's gated shared expert against transformers' block, the state pool's operations, and a tiny random
Qwen3-Next served by the Engine, token-identical to transformers' greedy output (float32 logits within 1e-4)
alone, batched with different lengths and with chunked prefill cutting through the linear layers mid-chunk.

The radix cache is off in these engines: a prefix hit on a hybrid needs the state at the hit, which the prefix
cache's state checkpoints provide (tests/test_hybrid_cache.py covers hits and retraction)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from hybrid_models import TINY_HYBRID, build_tiny_hybrid
from model_equality import (  # the fixture among these applies to this module by being imported
    BASE_ARGS,
    assert_idle,
    generate,
    ids_of,
    one_torch_thread,  # noqa: F401
    reference_greedy,
    reference_logits,
    spy_logits,
)
from test_correctness import load_hf, make_prompt, token_stream

import kiln
from kiln.core.forward_batch import ForwardMode
from kiln.layers.gated_delta import (
    causal_conv1d_decode,
    causal_conv1d_extend,
    chunk_gated_delta_rule,
    delta_rule_extend,
    recurrent_gated_delta_rule,
)
from kiln.layers.moe import MoESpec, SparseMoeBlock
from kiln.memory.state_pool import StatePool

pytestmark = pytest.mark.engine

PROMPT_LENS = [1, 3, 9, 17, 40, 77, 150, 333]
CHUNK = 48  # --chunked-prefill-size: not a multiple of the delta rule's 64-token chunks
ENGINE_ARGS = {**BASE_ARGS, "disable_radix_cache": True}


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _delta_inputs(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k [B, T, 2, 8]; v [B, T, 4, 16] (two value heads per key head); g <= 0 and beta in (0, 1) [B, T, 4]."""
    gen = _seeded(seed)
    q = torch.randn(batch, length, 2, 8, generator=gen)
    k = torch.randn(batch, length, 2, 8, generator=gen)
    v = torch.randn(batch, length, 4, 16, generator=gen)
    g = -torch.rand(batch, length, 4, generator=gen)
    beta = torch.rand(batch, length, 4, generator=gen)
    return q, k, v, g, beta


# ---------------------------------------------------------------------------------------------- the ops


@pytest.mark.unit
def test_chunked_delta_rule_is_transformers() -> None:
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _delta_inputs(2, 150)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta)
    want_out, want_state = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)


@pytest.mark.unit
def test_recurrent_delta_rule_is_transformers() -> None:
    """The one-token step Kiln decodes with (in-place updates, reductions as matmuls), token after token, against
    transformers' recurrent form, from a saved state that it leaves as it is."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    q, k, v, g, beta = _delta_inputs(3, 20, seed=7)
    start = torch.randn(3, 4, 8, 16, generator=_seeded(8))
    kept = start.clone()
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=start)
    want_out, want_state = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, want_state, rtol=0, atol=1e-6)
    assert torch.equal(start, kept)


@pytest.mark.unit
def test_chunked_delta_rule_equals_recurrent_form() -> None:
    q, k, v, g, beta = _delta_inputs(2, 150, seed=1)
    start = torch.randn(2, 4, 8, 16, generator=_seeded(2))
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=start)
    want_out, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=start)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cuts", [(1,), (64,), (37, 100), (5, 6, 7, 149)])
@pytest.mark.unit
def test_delta_rule_continues_from_saved_state(cuts: tuple[int, ...]) -> None:
    """Pieces of a sequence carrying the state equal the sequence at once, each piece in the form an extend of
    its length runs in (one token: the recurrent step; short: chunks of the next power of two; long: 64)."""
    q, k, v, g, beta = _delta_inputs(1, 150, seed=3)
    whole_out, whole_state = chunk_gated_delta_rule(q, k, v, g, beta)
    outs, state, bounds = [], None, (0, *cuts, 150)
    for a, b in zip(bounds, bounds[1:]):
        out, state = delta_rule_extend(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), whole_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, whole_state, rtol=0, atol=1e-5)


@pytest.mark.unit
def test_conv_state_continuation() -> None:
    """Prefill in pieces carrying the conv state, then token-by-token decode from it, equals the whole sequence
    through the conv at once (zeros before the first token, as transformers' left padding)."""
    gen = _seeded(4)
    x, weight = torch.randn(30, 12, generator=gen), torch.randn(12, 4, generator=gen)
    whole, whole_state = causal_conv1d_extend(x, weight, None)
    want = torch.nn.functional.silu(
        torch.nn.functional.conv1d(x.t().unsqueeze(0), weight.unsqueeze(1), padding=3, groups=12)[0, :, :30]
    ).t()
    torch.testing.assert_close(whole, want, rtol=0, atol=1e-6)
    first, state = causal_conv1d_extend(x[:2], weight, None)  # shorter than the kernel's reach
    second, state = causal_conv1d_extend(x[2:20], weight, state)
    steps = []
    for t in range(20, 30):
        out, state_b = causal_conv1d_decode(x[t : t + 1], weight, state.unsqueeze(0))
        steps.append(out)
        state = state_b[0]
    torch.testing.assert_close(torch.cat((first, second, *steps)), whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, whole_state, rtol=0, atol=0)
    assert state.shape == (12, 3)


@pytest.mark.unit
def test_gated_shared_expert_block_matches_transformers() -> None:
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    cfg = Qwen3NextConfig(
        hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True,
    )  # fmt: skip
    spec = MoESpec.from_hf(cfg, scoring_func="softmax", topk_method="greedy")
    assert (spec.shared_intermediate_size, spec.shared_expert_gate) == (24, True)
    torch.manual_seed(5)
    hf = Qwen3NextSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    ours = SparseMoeBlock(spec)
    ours.gate.weight.data.copy_(hf.gate.weight)
    ours.experts.weight_loader(ours.experts.gate_up_proj, hf.experts.gate_up_proj.data)
    ours.experts.weight_loader(ours.experts.down_proj, hf.experts.down_proj.data)
    shared = hf.shared_expert
    ours.shared_experts.gate_up_proj.weight.data.copy_(
        torch.cat((shared.gate_proj.weight, shared.up_proj.weight))
    )
    ours.shared_experts.down_proj.weight.data.copy_(shared.down_proj.weight)
    ours.shared_expert_gate.weight.data.copy_(hf.shared_expert_gate.weight)
    x = torch.randn(1, 20, 32, generator=_seeded(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), hf(x)[0], rtol=0, atol=1e-6)


@pytest.mark.unit
def test_state_pool_operations() -> None:
    pool = StatePool(4, 3, (10, 3), (2, 4, 5), torch.float32)
    assert pool.conv.shape == (3, 4, 10, 3) and pool.ssm.shape == (3, 4, 2, 4, 5)
    assert pool.nbytes == 4 * 3 * (10 * 3 + 2 * 4 * 5) * 4
    pool.conv[:, 1], pool.ssm[:, 1] = 1.0, 2.0
    pool.copy([1], [3])
    assert bool(pool.conv[:, 3].eq(1).all()) and bool(pool.ssm[:, 3].eq(2).all())
    pool.zero([1, 3])
    assert float(pool.conv.abs().sum()) == 0 and float(pool.ssm.abs().sum()) == 0


# ---------------------------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build_tiny_hybrid(tmp_path_factory.mktemp("tiny-qwen3-next")))


class HybridReference:
    """The prompts and transformers' greedy answers to them (8 new tokens, stopping at EOS)."""

    def __init__(self, path: str):
        stream = token_stream()
        self.prompts = [make_prompt(stream, n, 37 * i) for i, n in enumerate(PROMPT_LENS)]
        self.model = load_hf(path)
        self.greedy = [reference_greedy(self.model, p) for p in self.prompts]


@pytest.fixture(scope="module")
def ref(model_path: str) -> HybridReference:
    return HybridReference(model_path)


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[kiln.Engine]:
    eng = kiln.Engine(model_path=model_path, **ENGINE_ARGS)
    yield eng
    eng.shutdown()
    gc.collect()


def test_kv_pool_holds_only_full_attention_layers(engine: kiln.Engine) -> None:
    runner = engine.scheduler.runner
    full = TINY_HYBRID["num_hidden_layers"] // TINY_HYBRID["full_attention_interval"]
    assert len(runner.kv_pool.k) == full
    assert runner.state_pool.conv.shape[:2] == (TINY_HYBRID["num_hidden_layers"] - full, runner.table.size)
    assert runner.state_pool.ssm.dtype == torch.float32


def test_logits_match_transformers(engine: kiln.Engine, ref: HybridReference) -> None:
    prompt = ref.prompts[5]
    got, out = spy_logits(engine, prompt)
    want = reference_logits(ref.model, prompt, out)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_each_prompt_alone(engine: kiln.Engine, ref: HybridReference) -> None:
    outs = []
    for prompt in ref.prompts:
        outs += generate(engine, [prompt])
    assert ids_of(outs) == ref.greedy
    assert_idle(engine)


def test_batched_different_lengths(engine: kiln.Engine, ref: HybridReference) -> None:
    assert ids_of(generate(engine, ref.prompts)) == ref.greedy
    assert_idle(engine)


def _extend_prefixes(eng: kiln.Engine) -> list[int]:
    """Spies on the runner: the prefix length of every request of every extend batch it runs."""
    runner, seen = eng.scheduler.runner, []
    inner = type(runner).forward.__get__(runner)

    def forward(fb):
        if fb.mode == ForwardMode.EXTEND:
            seen.extend(fb.prefix_lens)
        return inner(fb)

    runner.forward = forward
    return seen


def test_chunked_prefill_through_linear_layers(model_path: str, ref: HybridReference) -> None:
    eng = kiln.Engine(model_path=model_path, **{**ENGINE_ARGS, "chunked_prefill_size": CHUNK})
    try:
        prefixes = _extend_prefixes(eng)
        assert ids_of(generate(eng, ref.prompts)) == ref.greedy
        # chunks continued from saved states, at points inside the delta rule's 64-token chunks
        assert any(p % 64 for p in prefixes), prefixes
        assert_idle(eng)
    finally:
        eng.shutdown()


@pytest.mark.unit
def test_unimplemented_config_is_refused() -> None:
    from transformers import Qwen3NextConfig

    from kiln.models.qwen3_next import check_config

    with pytest.raises(ValueError, match="hidden_act"):
        check_config(Qwen3NextConfig(hidden_act="gelu"))
