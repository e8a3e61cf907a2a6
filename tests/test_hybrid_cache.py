"""Hybrid linear-attention models' memory: the state pool sized with the KV pool by the ledger (and `kiln plan`),
asked-for concurrency clamped with one line, the radix tree's state checkpoints (a hit restores the state at the
deepest checkpoint, a prefix without one is recomputed), retraction and aborts freeing state slots, and the
state pool's integrity invariant. Greedy outputs are compared with transformers' on the tiny random Qwen3-Next
of tests/hybrid_models.py."""

from __future__ import annotations

import gc
import json
import logging
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
)
from test_correctness import load_hf, make_prompt, token_stream

import kiln
import kiln.plan as plan
import kiln.scheduler.launch as launch
from kiln.config import ServerArgs
from kiln.core.units import GIB
from kiln.memory.allocator import TokenAllocator
from kiln.memory.ledger import compute_ledger
from kiln.memory.ledger_types import LedgerInputs
from kiln.memory.state_checkpoints import HybridRadixCache
from kiln.memory.state_pool import StatePool
from kiln.models.spec import ModelSpec
from kiln.sampling_params import SamplingParams
from kiln.scheduler.io import AbortReq, GenerateReq
from kiln.scheduler.resolve import resolve, target_platform

model_spec = ModelSpec.from_config  # a model config dict's spec


pytestmark = pytest.mark.engine

INTERVAL = 16  # --mamba-track-interval: small, so that short prompts cross checkpoints
# prefill chunks of one interval: chunk ends land on checkpoints too
ARGS = {
    **BASE_ARGS,
    "max_running_requests": 8,
    "mamba_track_interval": INTERVAL,
    "chunked_prefill_size": INTERVAL,
}
RETRACT_NEW, RETRACT_N, RETRACT_POOL = 32, 6, 160


def hybrid_config(**overrides) -> dict:
    """The tiny hybrid's config.json as a dict (for the ledger alone)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**{**TINY_HYBRID, "vocab_size": 1000, **overrides}).to_dict()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build_tiny_hybrid(tmp_path_factory.mktemp("hybrid")))


@pytest.fixture(scope="module")
def hf(model_path: str):
    return load_hf(model_path)


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[kiln.Engine]:
    eng = kiln.Engine(model_path=model_path, **ARGS)
    yield eng
    eng.shutdown()
    gc.collect()


@pytest.fixture(scope="module")
def stream() -> list[int]:
    return token_stream()


# ---------------------------------------------------------------------------------------------- sizing


@pytest.mark.unit
def test_slot_bytes_follow_the_config() -> None:
    state = model_spec(hybrid_config()).linear_state(1, 4)
    assert state is not None and state.layers == 2  # a full-attention layer every second one
    conv_dim = 2 * 2 * 16 + 4 * 16  # 2 x key heads x key dim + value heads x value dim
    assert state.conv_shape == (conv_dim, 3) and state.ssm_shape == (4, 16, 16)
    assert state.slot_bytes == 2 * (conv_dim * 3 * 4 + 4 * 16 * 16 * 4)
    assert model_spec(hybrid_config()).linear_state(2, 2).conv_shape == (
        conv_dim // 2,
        3,
    )  # per rank, model dtype
    llama = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 128,
    }
    assert model_spec(llama).linear_state(1, 4) is None


def test_ledger_bytes_equal_the_pools(engine: kiln.Engine) -> None:
    ledger, runner = engine.parts.ledger, engine.scheduler.runner
    pool = runner.state_pool
    assert (
        pool.num_slots == ledger.state_slots == 3 * ledger.max_running_requests
    )  # 1 working + 2 checkpoints
    assert pool.nbytes == ledger.line("state pool").bytes + ledger.line("state checkpoints").bytes
    assert runner.kv_pool.k_bytes + runner.kv_pool.v_bytes == ledger.line("kv pool").bytes


def _cpu_ledger(**kw):
    inputs = LedgerInputs(
        model=model_spec(hybrid_config(max_position_embeddings=8192)),
        device="cpu",
        device_memory_bytes=GIB,
        available_memory_bytes=GIB,
        **kw,
    )
    return compute_ledger(inputs)


@pytest.mark.unit
def test_a_hybrid_plans_no_graphs_where_it_runs_eagerly() -> None:
    """The model declares it runs eagerly (ModelSpec.eager_only): a CUDA plan reserves nothing for graphs the
    graph runner will not capture, where a model with graphs reserves for its decode and prefill shapes."""
    gib = 80 * GIB
    common = dict(device="cuda", dtype="bfloat16", device_memory_bytes=gib, available_memory_bytes=gib)
    hybrid = compute_ledger(
        LedgerInputs(model=model_spec(hybrid_config(max_position_embeddings=8192)), **common)
    )
    assert model_spec(hybrid_config()).eager_only and hybrid.fits
    assert hybrid.graph_batch_sizes == () == hybrid.graph_prefill_tokens and hybrid.graph_reserve_bytes == 0
    dense = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 1000, "intermediate_size": 128, "max_position_embeddings": 8192}  # fmt: skip
    planned = compute_ledger(LedgerInputs(model=model_spec(dense), **common))
    assert (
        model_spec(dense).eager_only is None and planned.graph_batch_sizes and planned.graph_reserve_bytes > 0
    )


@pytest.mark.unit
def test_running_requests_clamped_with_one_line() -> None:
    fits = _cpu_ledger(max_running_requests=16, context_length=8192)
    assert fits.fits and not fits.running_clamp and fits.max_running_requests == 16
    assert fits.max_total_num_tokens >= 16 * 8192 and fits.state_slots == 48
    got = _cpu_ledger(max_running_requests=4096, context_length=8192)
    assert got.fits and 16 < got.max_running_requests < 4096
    kept = got.max_running_requests
    assert got.running_clamp.startswith(
        f"--max-running-requests 4096 clamped to {kept} ({4096 - kept} fewer)"
    )
    assert got.max_total_num_tokens >= kept * 8192 and got.state_slots == 3 * kept
    assert _cpu_ledger(max_running_requests=kept + 1, context_length=8192).max_running_requests == kept
    given = _cpu_ledger(max_running_requests=64, max_mamba_cache_size=30)
    assert given.state_slots == 30 and given.max_running_requests == 10
    assert "--max-running-requests 64 clamped to 10 (54 fewer)" in given.running_clamp


@pytest.mark.unit
def test_serve_says_the_clamp_once_before_loading(model_path: str, caplog) -> None:
    args = ServerArgs(
        model_path=model_path,
        device="cpu",
        device_memory="1GiB",
        max_running_requests=4096,
        context_length=2048,
    )
    with caplog.at_level(logging.INFO, logger="kiln"):
        deployment = resolve(args, target_platform(args, serving=False))
        ledger = launch._checked_plan(deployment).ledger  # the plan, nothing allocated
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1  # one line, beside the ledger's table (which shows it too)
    kept = ledger.max_running_requests
    assert f"--max-running-requests 4096 clamped to {kept} ({4096 - kept} fewer)" in said[0].getMessage()


@pytest.mark.unit
def test_ratio_split_and_no_radix_cache() -> None:
    split = _cpu_ledger(mamba_full_memory_ratio=0.5)
    states = split.line("state pool").bytes + split.line("state checkpoints").bytes
    kv = split.line("kv pool").bytes
    assert abs(states / kv - 0.5) < 0.05  # states : KV = 0.5 : 1
    off = _cpu_ledger(max_running_requests=8, context_length=1024, disable_radix_cache=True)
    assert off.state_slots == 8 and off.line("state checkpoints").bytes == 0


@pytest.mark.unit
def test_plan_shows_both_pools(capsys, model_path: str) -> None:
    argv = ["--model-path", model_path, "--device", "cpu", "--device-memory", "8GiB"]
    rc = plan.main([*argv, "--max-running-requests", "4", "--context-length", "2048"])
    out = capsys.readouterr().out
    assert rc == 0
    for name in ("kv pool", "state pool", "state checkpoints"):
        assert f"  {name} " in out
    assert "4 running requests x 3 slots (1 working + 2 checkpoints)" in out
    assert "8 slots x" in out and "--mamba-track-interval 256" in out
    assert "state pool: 12 slots = 4 running requests + 8 prefix-cache checkpoints" in out


@pytest.mark.parametrize(
    "flags, refusal",
    [
        (["--tp-size", "2"], "Kiln runs a hybrid linear-attention model on one rank"),
        (["--enable-hierarchical-cache"], "--enable-hierarchical-cache keeps KV only"),
        (["--speculative-algorithm", "NGRAM"], "--speculative-algorithm NGRAM: a hybrid linear-attention"),
        (["--page-size", "16", "--mamba-track-interval", "24"], "--mamba-track-interval 24 must be a multiple of "
         "--page-size 16"),
    ],
)  # fmt: skip
@pytest.mark.unit
def test_plan_refuses_what_serve_refuses(capsys, model_dir, flags: list[str], refusal: str) -> None:
    rc = plan.main(["--model-path", model_dir(hybrid_config()), "--device", "cpu", *flags])
    assert rc == 2 and refusal in capsys.readouterr().err


@pytest.mark.unit
def test_weights_beyond_one_gpu_are_not_offered_more_ranks(capsys, model_dir) -> None:
    """Qwen3-Next-80B-A3B's 148 GiB of weights on an 80 GiB GPU: a Llama would be told --tp-size 4
    (tests/test_plan.py); a hybrid runs on one rank only, so no flag fixes it."""
    qwen3_next_80b = hybrid_config(
        hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, full_attention_interval=4,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512, mlp_only_layers=[],
        vocab_size=151936,
    )  # fmt: skip
    argv = [
        "--model-path",
        model_dir(qwen3_next_80b),
        "--device",
        "cuda",
        "--device-memory",
        "80GiB",
        "--json",
    ]
    assert plan.main(argv) == 1
    failure = json.loads(capsys.readouterr().out)["failure"]
    assert failure["moment"] == "load_weights" and failure["fix_flags"] == {}, failure
    assert "no flag fixes this" in failure["fix"] and "GPU with more memory" in failure["fix"]
    assert "--tp-size" not in failure["fix"] and "more GPUs" not in failure["fix"]


@pytest.mark.unit
def test_too_few_state_slots_are_fixed_by_as_many_as_the_requests_need(capsys, model_dir) -> None:
    argv = ["--model-path", model_dir(hybrid_config()), "--device", "cpu", "--max-running-requests", "4"]
    assert plan.main([*argv, "--max-mamba-cache-size", "2", "--json"]) == 1
    failure = json.loads(capsys.readouterr().out)["failure"]
    assert "hold no request: each needs 3 slots" in failure["message"], failure
    assert failure["fix_flags"] == {"--max-mamba-cache-size": "12"}, failure
    assert "--max-mamba-cache-size 12 (4 requests x 3 slots)" in failure["fix"]
    assert plan.main([*argv, "--max-mamba-cache-size", "12"]) == 0


# ---------------------------------------------------------------------------------------------- the tree


def _tree(checkpoint_slots: int = 2) -> HybridRadixCache:
    states = StatePool(2 + checkpoint_slots, 1, (3, 2), (1, 2, 2), torch.float32)
    return HybridRadixCache(TokenAllocator(256), 1, states, 2, 4)


def _insert(cache: HybridRadixCache, key: list[int]) -> None:
    cache.insert(key, cache.allocator.alloc(len(key)))


@pytest.mark.unit
def test_match_stops_at_the_deepest_checkpoint() -> None:
    cache = _tree()
    cache.states.conv[:, 0] = 7.0
    key = list(range(1, 13))
    _insert(cache, key)
    assert cache.acquire_prefix(key).indices.numel() == 0  # no checkpoint: recomputed from the start
    assert cache.match_stored(key).indices.numel() == 12
    cache.keep_state(cache.match_stored(key[:8]).node, 0)  # the state after 8 tokens, from working slot 0
    hit = cache.acquire_prefix(key + [99])
    assert hit.indices.numel() == 8 and hit.node.checkpoint is not None
    cache.restore_state(hit.node, 1)
    assert torch.equal(cache.states.conv[:, 1], cache.states.conv[:, 0])
    cache.match_stored(key[:4])  # a split above the checkpoint leaves it on the node that ends at token 8
    assert cache.acquire_prefix(key).indices.numel() == 8
    cache.debug_check()


@pytest.mark.unit
def test_checkpoints_reclaimed_least_recent_first_and_freed_with_their_nodes() -> None:
    cache = _tree(checkpoint_slots=2)
    keys = [[k] * 8 for k in (1, 2, 3)]
    for key in keys:
        _insert(cache, key)
        cache.keep_state(cache.match_stored(key).node, 0)
    assert cache.checkpoint_count() == 2  # the third took the first one's slot
    assert cache.acquire_prefix(keys[0]).indices.numel() == 0
    assert all(cache.acquire_prefix(k + [9]).indices.numel() == 8 for k in keys[1:])
    cache.debug_check()
    cache.evict(256)
    assert cache.checkpoint_count() == 0 and cache.slots.available() == 2
    cache.debug_check()
    _insert(cache, keys[0])
    cache.keep_state(cache.match_stored(keys[0]).node, 1)
    cache.reset()
    assert cache.checkpoint_count() == 0 and cache.slots.available() == 2
    assert cache.state_integrity(table_free=2, live=0)["ok"]


# ---------------------------------------------------------------------------------------------- served


def test_hit_at_a_checkpoint_restores_the_state(engine: kiln.Engine, hf, stream: list[int]) -> None:
    engine.scheduler.flush_cache()
    first = make_prompt(stream, 40, 3)
    (out,) = generate(engine, [first], n=30, ignore_eos=True)  # decode passes tokens 48 and 64: checkpoints
    assert out["output_ids"] == reference_greedy(hf, first, 30, stop_at_eos=False)
    follow = first + out["output_ids"][:10] + make_prompt(stream, 12, 90)  # 50 tokens shared
    turn = first + out["output_ids"] + make_prompt(stream, 9, 91)  # the whole first request shared
    (got_follow,) = generate(engine, [follow])
    (got_turn,) = generate(engine, [turn])
    assert got_follow["meta_info"]["cached_tokens"] == 48  # the decode checkpoint below the 50 shared tokens
    assert got_turn["meta_info"]["cached_tokens"] == 40 + 30 - 1  # the finished request's final state
    assert ids_of([got_follow, got_turn]) == [reference_greedy(hf, follow), reference_greedy(hf, turn)]
    assert_idle(engine)
    engine.scheduler.kv.cache.debug_check()


def test_prefix_shorter_than_the_interval_is_recomputed(engine: kiln.Engine, hf, stream: list[int]) -> None:
    engine.scheduler.flush_cache()
    shared = make_prompt(stream, INTERVAL - 6, 5)
    a, b = shared + make_prompt(stream, 20, 60), shared + make_prompt(stream, 25, 120)
    (out_a,) = generate(engine, [a])
    (out_b,) = generate(engine, [b])
    assert out_b["meta_info"]["cached_tokens"] == 0  # KV cached, but no state to start from
    assert ids_of([out_a, out_b]) == [reference_greedy(hf, a), reference_greedy(hf, b)]
    assert_idle(engine)


def test_chunk_ends_leave_checkpoints(engine: kiln.Engine, hf, stream: list[int]) -> None:
    engine.scheduler.flush_cache()
    long = make_prompt(stream, 3 * INTERVAL + 4, 300)  # chunks end at 16, 32, 48: checkpoints there
    other = long[: 2 * INTERVAL + 5] + make_prompt(stream, 7, 400)
    outs = [generate(engine, [long])[0], generate(engine, [other])[0]]
    assert outs[1]["meta_info"]["cached_tokens"] == 2 * INTERVAL
    assert ids_of(outs) == [reference_greedy(hf, long), reference_greedy(hf, other)]
    assert_idle(engine)


def test_retraction_restarts_from_checkpoints(model_path: str, hf, stream: list[int]) -> None:
    args = {**ARGS, "max_total_tokens": RETRACT_POOL, "chunked_prefill_size": None}
    eng = kiln.Engine(model_path=model_path, **args)
    try:
        prompts = [make_prompt(stream, 20 + 3 * i, 13 * i + 5) for i in range(RETRACT_N)]
        outs = generate(eng, prompts, n=RETRACT_NEW, ignore_eos=True)
        assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0, "no retraction: shrink the pool"
        want = [reference_greedy(hf, p, RETRACT_NEW, stop_at_eos=False) for p in prompts]
        assert ids_of(outs) == want
        assert_idle(eng)
        eng.scheduler.kv.cache.debug_check()
    finally:
        eng.shutdown()
        gc.collect()


def test_integrity_after_aborts(engine: kiln.Engine, stream: list[int]) -> None:
    scheduler = engine.scheduler
    scheduler.flush_cache()
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True).normalize()
    for i in range(4):
        scheduler.add_request(GenerateReq(f"abort-{i}", make_prompt(stream, 30 + i, 50 * i), params))
    for _ in range(12):
        scheduler.step()
        assert scheduler.check_integrity()["ok"]
    scheduler.abort(AbortReq(rid="abort-1"))
    scheduler.step()
    report = scheduler.check_integrity()
    assert report["ok"] and report["states"]["in_use"] == 3, report
    scheduler.abort(AbortReq(abort_all=True))
    scheduler.step()
    report = scheduler.check_integrity()
    assert report["ok"] and report["in_use"] == 0 and report["states"]["in_use"] == 0, report
    assert report["states"]["cached"] > 0  # the decodes crossed checkpoints, which the tree keeps
    scheduler.kv.cache.debug_check()
    assert scheduler.flush_cache() and scheduler.check_integrity()["states"]["cached"] == 0
