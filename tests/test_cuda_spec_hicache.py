"""Speculative decoding's draft graphs and the hierarchical cache's host tier on CUDA. These run only on a GPU
(benchmarks/cuda/cuda_checks.sh, part 6) and are skipped elsewhere; they mirror CPU tests of
test_draft_graphs.py and test_hicache.py on the tiny Llama (KILN_TINY_LLAMA), float32, CUDA graphs on:

- EAGLE with a random head: the target's verify shape and the head's decode steps and catch-ups are captured (and
  logged as SGLang logs them) and replayed, the captured target steps hand out the hidden states eager computes,
  and greedy output equals the target's without speculation;
- STANDALONE, the target drafting for itself: the draft's decode steps and catch-up extends (prefill pieces) are
  captured and replayed, nearly every draft is accepted, and greedy output equals the target's alone;
- the host tier: a prefix evicted from a small device pool to pinned host memory is loaded back (the tier's
  counters record it), and greedy output is the same with the tier on and off;
- the host tier's copies on their own stream: a store or a load issued behind a long kernel returns at once, in
  chunks through the device ring, and the rows arrive, in order with the compute stream's own writes."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from test_draft_graphs import ARGS, NEW_TOKENS, SPEC, STEPS, Recorder, assert_hidden_as_eager, generate
from test_draft_models import PROMPTS, save_head
from test_hicache import GREEDY, _prompt

import kiln
from kiln.memory.tier_copies import TierCopies

DEVICE = "cuda"
BS = (1, 2, 4)  # on CUDA verify and catch-up shapes stay within 4 rows: 1 request x (STEPS + 1) = 3
PREFILL = (4, 16)  # a draft model's catch-up extends: 3 tokens in 4, a batch of 4 x 3 in 16
GRAPHS = dict(ARGS, device=DEVICE, dtype="float32", cuda_graph_bs=BS, cuda_graph_bs_prefill=PREFILL)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def outputs(eng: kiln.Engine) -> list[list[int]]:
    """Each prompt alone (batch size 1: the captured verify and catch-up shapes), then all of them at once."""
    alone = generate(eng)
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    return alone + [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=params)]


@pytest.fixture(scope="module")
def plain(tiny_llama) -> list[list[int]]:
    """Greedy output of the target without speculation, graphs on."""
    eng = kiln.Engine(model_path=tiny_llama, **GRAPHS)
    try:
        return outputs(eng)
    finally:
        eng.shutdown()


def test_eagle_draft_graphs_match_the_target_alone(tiny_llama, plain, tmp_path, caplog) -> None:
    head = save_head(tmp_path / "head", Path(tiny_llama), eagle3=False)
    with caplog.at_level(logging.INFO, logger="kiln"):
        eng = kiln.Engine(model_path=tiny_llama, **GRAPHS, **SPEC, speculative_draft_model_path=head)
    try:
        target_runner, drafter = eng.scheduler.runner, eng.scheduler.spec.drafter
        assert target_runner.graphs.captured("decode") == list(BS)
        assert target_runner.graphs.captured("verify") == [STEPS + 1]  # bs 1 x num_draft_tokens
        assert drafter.runner.graphs.captured("decode") == list(BS)  # the head's steps, its features in
        assert drafter.runner.graphs.captured("extend") == [STEPS + 1]  # catch-ups, the target's features in
        chain = f"num_tokens_per_req={STEPS + 1}, bs=[1]"
        for begin, shapes in (  # SGLang's begin lines, each naming its shapes
            (f"Capture target verify {DEVICE.upper()} graph begin.", chain),
            (f"Capture draft {DEVICE} graph begin.", f"num_tokens_per_req=1, bs={list(BS)}"),
            (f"Capture draft extend {DEVICE} graph begin.", chain),
        ):
            assert begin in caplog.text, begin
            assert shapes in caplog.text.split(begin)[1].splitlines()[0], begin
        target = Recorder(target_runner, check_hidden=True)
        draft = Recorder(drafter.runner, check_hidden=False)
        assert outputs(eng) == plain and drafter.drafted_tokens > 0
        assert (STEPS + 1, True) in target.decodes and (1, True) in draft.decodes
        assert target.hidden_pairs
        assert_hidden_as_eager(target)
    finally:
        eng.shutdown()


def test_standalone_draft_graphs_match_the_target_alone(tiny_llama, plain) -> None:
    eng = kiln.Engine(
        model_path=tiny_llama, **GRAPHS, speculative_algorithm="STANDALONE", speculative_num_steps=STEPS,
        speculative_draft_model_path=tiny_llama,
    )  # fmt: skip
    try:
        spec = eng.scheduler.spec
        assert eng.scheduler.runner.graphs.captured("verify") == [STEPS + 1]
        assert spec.drafter.runner.graphs.captured("decode") == list(BS)
        assert spec.drafter.runner.graphs.captured("prefill") == [4, 16]  # catch-ups of up to 4 x 3 tokens
        steps = Recorder(spec.drafter.runner, check_hidden=False)
        assert outputs(eng) == plain
        assert (1, True) in steps.decodes and (STEPS + 1, True) in steps.extends
        assert spec.accept_length() > STEPS  # its own drafts: (nearly) all STEPS accepted, + the bonus
    finally:
        eng.shutdown()


def run_evicting(tiny_llama: str, **tier) -> tuple[list[list[int]], int, dict]:
    """test_hicache's engine run on the GPU: prompt 0, then 1 and 2 (which evict 0 from the 256-token device
    pool), then 0 again; the outputs, prompt 0's cached tokens the second time, and the host tier's state."""
    eng = kiln.Engine(model_path=tiny_llama, device=DEVICE, dtype="float32", max_total_tokens=256,
                      chunked_prefill_size=64, cuda_graph_bs=(1,), cuda_graph_bs_prefill=(64,), **tier)  # fmt: skip
    try:
        outs = [eng.generate(_prompt(s), GREEDY) for s in (0, 1, 2, 0)]
        sched = eng.scheduler
        assert sched.check_integrity()["ok"]
        cache, host = sched.kv.cache, getattr(sched.kv.cache, "host", None)
        state = {}
        if host is not None:
            state = dict(
                pinned=all(t.is_pinned() for t in host._host),
                on_device=all(t.device.type == DEVICE for t in host._device),
                hit_tokens=cache.host_hit_tokens,
                bytes_loaded=host.bytes_loaded,
                metric_hit_tokens=sched.make_stats().host_hit_tokens,
            )
        return [o["output_ids"] for o in outs], outs[3]["meta_info"]["cached_tokens"], state
    finally:
        eng.shutdown()


@pytest.mark.unit
def test_an_evicted_prefix_comes_back_from_pinned_host_memory(tiny_llama) -> None:
    plain_ids, plain_cached, _ = run_evicting(tiny_llama)
    tier_ids, tier_cached, host = run_evicting(tiny_llama, enable_hierarchical_cache=True, hicache_ratio=4.0)
    assert tier_ids == plain_ids  # greedy outputs identical with the tier on and off
    assert plain_cached <= 1  # one tier: prompt 0 was evicted (all but the BOS token the prompts share)
    assert tier_cached >= 100  # two tiers: it came back from the host
    assert host["pinned"] and host["on_device"], host
    assert host["hit_tokens"] >= 100 and host["metric_hit_tokens"] == host["hit_tokens"], host
    assert host["bytes_loaded"] > 0, host


def _busy_gpu() -> None:
    """Keep the compute stream busy for about a second: a copy the host waited for would take that long."""
    torch.cuda._sleep(int(2e9))


@pytest.mark.unit
def test_tier_copies_run_beside_the_compute_stream() -> None:
    torch.manual_seed(0)
    tokens, n = 4096, 2048
    device = [torch.randn(tokens, 8, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)]
    host = [torch.zeros(tokens, 8, 128, dtype=torch.bfloat16, pin_memory=True) for _ in range(4)]
    copies = TierCopies(device, host, chunk_bytes=256 * 1024)  # 32 tokens a chunk: the ring turns 64 times
    want = [t.cpu() for t in device]
    src, dst = torch.randperm(tokens)[:n], torch.randperm(tokens)[:n]
    # the device slots moved before the sleep: no host copy waits behind it
    src_on_device, back = src.to(DEVICE), torch.randperm(tokens)[:n].to(DEVICE)
    torch.cuda.synchronize()

    _busy_gpu()
    t0 = time.perf_counter()
    copies.store(src_on_device, dst)
    issued = time.perf_counter() - t0
    copies.fence()  # as the cache does before it frees the slots
    for t in device:  # the slots reused at once by the compute stream: after the store's gathers
        t[src_on_device] = 0
    assert copies.in_flight_tokens == n and issued < 0.5, (copies.in_flight_tokens, issued)
    copies.drain()
    for h, w in zip(host, want, strict=True):
        assert torch.equal(h[dst], w[src])

    _busy_gpu()
    t0 = time.perf_counter()
    copies.load(dst, back)
    issued = time.perf_counter() - t0
    rows = [t[back] for t in device]  # on the compute stream: after the load's scatter
    assert issued < 0.5, issued
    for r, w in zip(rows, want, strict=True):
        assert torch.equal(r.cpu(), w[src])
