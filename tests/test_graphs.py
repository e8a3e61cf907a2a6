"""Decode graphs (on the CPU: compiled steps): SGLang's shape lists, padding with dummy rows, the ledger's
reserve, and greedy outputs identical to eager and to transformers while requests join and leave, for batch
sizes that hit, miss (pad up) and straddle (run eagerly above) the captured ones. Small random-weight models;
the default model's figures are in benchmarks/bench_graphs.py."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass

import httpx
import pytest
import torch
from conftest import ServerProcess
from test_correctness import hf_greedy, load_hf

import kiln
from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.core.graph_shapes import (
    bucket_for,
    decode_graph_batch_sizes,
    prefill_bucket_for,
    prefill_graph_token_sizes,
)
from kiln.memory.graph_budget import CPU_COMPILED_STEP_BYTES, CPU_COMPILER_BYTES
from kiln.memory.ledger import LedgerInputs, compute_ledger
from kiln.models.spec import ModelSpec
from kiln.runner import graph_backends, graph_runner
from kiln.runner.graph_backends import BreakablePrefill, CudaGraphDecode, LogitsRows, pad_decode_inputs
from kiln.sampling_params import SamplingParams
from kiln.scheduler.io import GenerateReq
from kiln.scheduler.overlap import ForwardThread

pytestmark = pytest.mark.server

CAPTURED = (1, 2, 4)
PREFILL = (16, 32, 64)  # token counts


# ---------------------------------------------------------------------------------------------- shapes
@pytest.mark.unit
def test_decode_batch_sizes_follow_sglang():
    assert decode_graph_batch_sizes(8) == [1, 2, 4, 8]
    assert decode_graph_batch_sizes(24) == [1, 2, 4, 8, 12, 16, 24]
    assert decode_graph_batch_sizes(10) == [1, 2, 4, 8, 10]  # max_bs appended when missing
    assert len(decode_graph_batch_sizes(256)) == 36 and len(decode_graph_batch_sizes(512)) == 52


@pytest.mark.unit
def test_prefill_token_sizes_and_padding_cap():
    assert [len(prefill_graph_token_sizes(n)) for n in (4096, 8192, 16384)] == [50, 58, 74]
    sizes = prefill_graph_token_sizes(4096)
    assert sizes[:9] == [4, 8, 12, 16, 20, 24, 28, 32, 48]
    assert bucket_for(sizes, 33) == 48 and bucket_for(sizes, 4097) is None
    assert prefill_bucket_for(sizes, 1) is None  # 1 -> 4 pads 4x: eager
    assert prefill_bucket_for(sizes, 2) == 4  # exactly 2x is allowed
    assert prefill_bucket_for(sizes, 300) == 320


def _ledger(**kw):
    cfg = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    gib = 1 << 30
    return compute_ledger(
        LedgerInputs(
            model=ModelSpec.from_config(cfg),
            device_memory_bytes=24 * gib,
            available_memory_bytes=20 * gib,
            **kw,
        )
    )


@pytest.mark.unit
def test_ledger_plans_the_captured_sizes_and_their_reserve():
    assert _ledger().graph_batch_sizes == () and _ledger().graph_reserve_bytes == 0  # the CPU default: none
    led = _ledger(cuda_graph_max_bs=8)
    assert led.graph_batch_sizes == (1, 2, 4, 8)  # SGLang's list up to 8
    assert led.graph_reserve_bytes == CPU_COMPILER_BYTES + 4 * CPU_COMPILED_STEP_BYTES
    assert "4 decode steps (bs <= 8) + 0 prefill sizes" in led.line("graph reserve").inputs
    capped = _ledger(max_running_requests=6, cuda_graph_max_bs=16)
    assert capped.graph_batch_sizes == (1, 2, 4, 6)  # capped at the running requests, which is appended
    assert _ledger(cuda_graph_bs=(3, 1)).graph_batch_sizes == (1, 3)
    assert led.graph_prefill_tokens == ()  # the CPU default: prefill runs eagerly
    pre = _ledger(cuda_graph_max_bs=8, cuda_graph_max_bs_prefill=64)
    assert pre.graph_prefill_tokens == (4, 8, 12, 16, 20, 24, 28, 32, 48, 64)
    assert pre.graph_reserve_bytes == CPU_COMPILER_BYTES + 14 * CPU_COMPILED_STEP_BYTES
    assert _ledger(cuda_graph_bs_prefill=(64, 16)).graph_prefill_tokens == (16, 64)
    assert _ledger(cuda_graph_bs_prefill=(16,), disable_prefill_graph=True).graph_prefill_tokens == ()
    off = _ledger(disable_cuda_graph=True, cuda_graph_max_bs=8, cuda_graph_bs_prefill=(16,))
    assert off.graph_batch_sizes == off.graph_prefill_tokens == () and off.graph_reserve_bytes == 0
    assert off.headroom_bytes - led.headroom_bytes == led.graph_reserve_bytes


@pytest.mark.unit
def test_padding_rows_write_and_read_only_the_padding_slot():
    table = torch.tensor([[5, 6, 7], [8, 9, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]]).view(2, 1, 1, 3)
    fb = ForwardBatch(
        ForwardMode.DECODE, torch.tensor([11, 12]), torch.tensor([2, 1]), torch.tensor([7, 9]),
        torch.arange(2), kv_table=table, kv_mask=mask,
    )  # fmt: skip
    ids, pos, loc, tab, m = pad_decode_inputs(fb, 4)
    assert ids.tolist() == [11, 12, 0, 0] and pos.tolist() == [2, 1, 0, 0] and loc.tolist() == [7, 9, 0, 0]
    assert tab[:2].tolist() == table.tolist() and not tab[2:].any()
    assert m.shape == (4, 1, 1, 3) and m.view(4, 3)[2:].tolist() == [[True, False, False]] * 2
    assert all(t.is_contiguous() and t.stride()[-1] == 1 for t in (ids, tab, m))
    one = ForwardBatch(
        ForwardMode.DECODE, torch.tensor([3]), torch.tensor([0]), torch.tensor([4]), torch.arange(1),
        kv_table=torch.tensor([[4]]),
    )  # fmt: skip
    assert pad_decode_inputs(one, 1)[3].tolist() == [[4, 0]]  # widened to 2 columns: never a length-1 shape


# ---------------------------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def engines(tiny_llama):
    common = dict(model_path=tiny_llama, max_total_tokens=4096, max_running_requests=16, num_threads=1)
    with pytest.MonkeyPatch.context() as mp:  # keep every shape: on a tiny model the payoff is noise
        mp.setattr(graph_runner, "MAX_SLOWDOWN", 1e9)
        graphs = kiln.Engine(**common, cuda_graph_bs=CAPTURED, cuda_graph_bs_prefill=PREFILL)
    eager = kiln.Engine(**common, disable_cuda_graph=True)
    yield graphs, eager


def _record_steps(eng) -> list[tuple[ForwardMode, int, bool]]:
    runner = eng.scheduler.runner
    steps: list[tuple[ForwardMode, int, bool]] = []
    inner = type(runner).forward.__get__(runner)

    def forward(fb):
        out = inner(fb)
        size = fb.batch_size if fb.mode == ForwardMode.DECODE else int(fb.input_ids.numel())
        steps.append((fb.mode, size, runner.last_forward_graph))
        return out

    runner.forward = forward
    return steps


@dataclass
class Run:
    outs: dict[str, list[int]]  # rid -> generated ids
    decodes: list[tuple[int, bool]]  # (batch size, ran on a graph) of every decode step
    prefills: list[tuple[int, bool]]  # (tokens, ran on a graph) of every prefill


def drive(eng, schedule: list[tuple[int, list[int], int]]) -> Run:
    """Requests (arrival step, prompt, max new tokens) added while the engine steps."""
    sched = eng.scheduler
    sched.flush_cache()
    steps = _record_steps(eng)
    pending = sorted(enumerate(schedule), key=lambda x: x[1][0])
    outs: dict[str, list[int]] = defaultdict(list)
    step = 0
    while pending or sched.has_work:
        while pending and pending[0][1][0] <= step:
            i, (_, ids, new) = pending.pop(0)
            sched.add_request(
                GenerateReq(f"r{i}", list(ids), SamplingParams(max_new_tokens=new, temperature=0.0))
            )
        for o in sched.step():
            outs[o.rid].extend(o.new_ids)
        step += 1
        assert step < 500
    del eng.scheduler.runner.forward
    assert eng.check_integrity()["in_use"] == 0
    decodes = [(n, on) for mode, n, on in steps if mode == ForwardMode.DECODE]
    return Run(dict(outs), decodes, [(n, on) for mode, n, on in steps if mode == ForwardMode.EXTEND])


def test_outputs_match_eager_and_transformers_while_requests_join_and_leave(engines, tiny_llama):
    graphs, eager = engines
    assert graphs.scheduler.runner.graphs.captured("decode") == list(CAPTURED)
    assert graphs.scheduler.runner.graphs.captured("prefill") == list(PREFILL)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 3, 12, 8, 21)]
    # three at once (pads to 4), a fourth joins (hits 4), three more (7: above the largest, eager), then they
    # finish one by one (shrinking through 4, 3 -> 4, 2, 1)
    news = [4, 14, 7, 10, 2, 16, 5, 9]
    arrivals = [0, 0, 0, 2, 5, 5, 5, 9]
    schedule = list(zip(arrivals, prompts, news))
    run, ref = drive(graphs, schedule), drive(eager, schedule)
    got, steps = run.outs, run.decodes
    assert got == ref.outs
    assert not any(on for _, on in ref.decodes + ref.prefills)
    assert any(on and n not in PREFILL for n, on in run.prefills), run.prefills  # a prefill padded up
    ran = {(bs, on) for bs, on in steps}
    assert {(1, True), (2, True), (4, True)} <= ran, ran  # hits
    assert (3, True) in ran, ran  # a miss padded up to 4
    assert any(bs > 4 and not on for bs, on in ran), ran  # above the largest captured size: eager
    assert not any(bs > 4 and on for bs, on in ran)
    model = load_hf(tiny_llama)
    for i, (ids, new) in enumerate(zip(prompts, news)):
        ref, _ = hf_greedy(model, ids, new, {model.config.eos_token_id})
        assert got[f"r{i}"] == ref, (i, got[f"r{i}"], ref)


def test_the_overlap_schedule_replays_the_captured_steps_on_its_forward_thread(engines):
    """The overlap schedule (CUDA's default) with captured steps: decode steps launched on the forward thread
    replay the shapes captured at startup, a request joining midway drains and prefills, and the tokens are
    eager's."""
    graphs, eager = engines
    sched = graphs.scheduler
    sched.forward_thread = ForwardThread(sched._forward_and_sample)
    try:
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 9, 3)]
        schedule = list(zip([0, 0, 3], prompts, [8, 12, 6]))
        run, ref = drive(graphs, schedule), drive(eager, schedule)
        assert run.outs == ref.outs
        assert any(on for _, on in run.decodes), run.decodes
    finally:
        sched.forward_thread.shutdown()
        sched.forward_thread = None


def check_prefills_pad_hit_or_fall_back(graphs, eager) -> tuple[list[list[int]], Run]:
    """Prompts alone, one at a time: 20 tokens pad to 32, 64 hit, 5 would pad 3.2x to 16 and 100 is above 64:
    eager. The graphs' tokens equal eager's."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (20, 64, 5, 100)]
    schedule = [(40 * i, ids, 6) for i, ids in enumerate(prompts)]
    run = drive(graphs, schedule)
    assert run.prefills == [(20, True), (64, True), (5, False), (100, False)]
    assert run.outs == drive(eager, schedule).outs
    return prompts, run


def test_prefills_that_pad_hit_or_fall_back_match_eager_and_transformers(engines, tiny_llama):
    prompts, run = check_prefills_pad_hit_or_fall_back(*engines)

    model = load_hf(tiny_llama)
    for i, ids in enumerate(prompts):
        assert run.outs[f"r{i}"] == hf_greedy(model, ids, 6, {model.config.eos_token_id})[0]


def test_shared_prefix_batches_run_compiled_and_match_eager(engines, monkeypatch):
    """With Kiln's CPU attention kernel a compiled decode step takes the prefix the batch shares as an input, so
    such batches stay on the captured shapes (padding rows included) and read the prefix once per chunk."""
    graphs, eager = engines
    assert graphs.scheduler.runner.attn_backend.reads_shared_prefix_once
    widths: list[int] = []  # the shared prefix each compiled step was given
    real = graph_backends.CompiledDecode._shared

    def spy(self, columns):
        widths.append(int(columns))
        return real(self, columns)

    monkeypatch.setattr(graph_backends.CompiledDecode, "_shared", spy)
    prefix = list(range(200, 400))
    schedule = [(0, prefix, 8), (1, prefix + [7, 8], 6), (1, prefix + [9], 6)]
    run = drive(graphs, schedule)
    assert run.outs == drive(eager, schedule).outs
    assert (3, True) in run.decodes, run.decodes  # three requests on the prompt, padded to 4, compiled
    assert max(widths) == 200, widths  # the 200-token prompt, shared through the radix cache


def test_a_shape_that_does_not_pay_runs_eagerly_and_says_so(tiny_llama, monkeypatch, caplog):
    monkeypatch.setattr(graph_runner, "MAX_SLOWDOWN", 0.0)
    with caplog.at_level(logging.INFO, logger="kiln"):
        eng = kiln.Engine(
            model_path=tiny_llama, max_total_tokens=2048, max_running_requests=4, num_threads=1,
            cuda_graph_bs=(2,),
        )  # fmt: skip
    assert eng.scheduler.runner.graphs.captured() == []
    assert "does not pay: this decode shape runs eagerly" in caplog.text
    steps = drive(eng, [(0, [5, 6, 7], 4), (0, [8, 9], 4)]).decodes
    assert steps and not any(on for _, on in steps)


def test_a_graph_that_fails_to_replay_is_an_error_naming_its_shape(engines):
    """A captured shape that cannot run the batch it was chosen for fails that batch's requests with an error
    naming the shape (not a silent eager run that hides a broken graph); the engine goes on serving."""
    graphs, eager = engines
    phase = graphs.scheduler.runner.graphs.phases["decode"]
    backend = phase.backend
    calls = []

    def broken(bs, fb):
        calls.append(bs)
        raise RuntimeError("Detected recompile")

    broken_backend = {"replay": staticmethod(broken), "name": "broken", "reads_shared_prefix_once": False,
                      "shared_gather_limit": 0, "feature_width": None, "logits_rows": LogitsRows()}  # fmt: skip
    phase.backend = type("Broken", (), broken_backend)()
    sched = graphs.scheduler
    try:
        sched.add_request(GenerateReq("bad", [11, 12, 13], SamplingParams(max_new_tokens=5, temperature=0.0)))
        outs = []
        for _ in range(20):
            outs += sched.step()
            if not sched.has_work:
                break
    finally:
        phase.backend = backend
    [failed] = [o for o in outs if o.error]
    assert calls == [1] and failed.rid == "bad"
    assert "GraphReplayError: the decode graph bs=1 failed to run a batch of 1 (broken)" in failed.error
    assert "Detected recompile" in failed.error and "--disable-cuda-graph" in failed.error
    assert graphs.check_integrity()["in_use"] == 0
    run = drive(graphs, [(0, [11, 12, 13], 5)])  # the shape restored: served on the graph again
    assert all(on for _, on in run.decodes) and run.outs == drive(eager, [(0, [11, 12, 13], 5)]).outs


def test_second_start_reuses_the_compiled_code(tiny_llama, tmp_path):
    """Two server starts on one fresh cache directory: the second loads every shape from the cache (AOTAutograd
    and inductor cache hits, nothing compiled, and each shape's timing against eager reused; a step that entered
    inference mode inside the traced code would bypass AOTAutograd's cache and recompile), although its KV pool
    holds another number of tokens (a pool sized from the memory free at each start must not key the compiled
    code), and the capture is reported in the startup events, /status and /get_server_info."""
    args = ["--model-path", tiny_llama, "--max-running-requests", "4", "--cuda-graph-bs", "1", "2",
            "--compile-cache-dir", str(tmp_path / "cache")]  # fmt: skip
    infos = []
    for i, pool in enumerate(("2048", "3000")):
        events = tmp_path / f"events{i}.jsonl"
        flags = [*args, "--max-total-tokens", pool, "--startup-events", str(events)]
        srv = ServerProcess(flags, tmp_path / f"s{i}.log")
        try:
            srv.wait_ready(timeout=600)
            info = httpx.get(f"{srv.url}/get_server_info", timeout=30).json()
            status = httpx.get(f"{srv.url}/status", timeout=30).json()
            log = srv.log_text()
        finally:
            srv.stop()
        infos.append(info)
        recs = [json.loads(x) for x in events.read_text().splitlines()]
        assert [r["phase"] for r in recs if r["event"] == "phase"].count("capturing") == 1
        progress = [r for r in recs if r["event"] == "progress" and r["phase"] == "capturing"]
        assert [(p["shape"], p["done"], p["total"]) for p in progress] == [("bs=2", 0, 2), ("bs=1", 1, 2)]
        assert all(p["avail_mem_gb"] > 0 for p in progress)
        assert (
            "Capture target decode CPU graph begin. backend=inductor" in log and "graph end. elapsed=" in log
        )
        assert status["graphs"]["decode"]["sizes"] == [1, 2]
        assert "capturing" in status["timings"]
        rows = {r["name"]: r for r in info["memory_check"]}
        assert rows["graph_capture"]["predicted"] == CPU_COMPILER_BYTES + 2 * CPU_COMPILED_STEP_BYTES
        assert rows["graph_capture"]["measured"] == info["graphs"]["decode"]["capture_bytes"]
    first, second = (i["graphs"]["decode"]["shapes"] for i in infos)
    assert not any(s["cache_hit"] or s["timed_earlier"] for s in first), first
    assert all(s["cache_hit"] and s["timed_earlier"] for s in second), second
    # the second start reuses what the first measured instead of timing compiled against eager again
    assert [(s["graph_ms"], s["eager_ms"]) for s in first] == [(s["graph_ms"], s["eager_ms"]) for s in second]


# ---------------------------------------------------------------------------------------------- CUDA
def _replaying_capture(fn, pool):
    """Stands in for CUDA graph capture on the CPU: a replay runs fn again. What is left to test is what the CUDA
    backends add around the graphs: static buffers shared by every size and layer, padding, the KV width."""
    fn()
    return fn, pool


def _cuda_backends_on_the_cpu(prefill: tuple[int, ...] = PREFILL, **kwargs) -> kiln.Engine:
    """An engine whose graphs are the CUDA ones, with capture replaced by re-running the captured function."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            graph_runner,
            "CompiledDecode",
            lambda model, attn, device, **kw: CudaGraphDecode(
                model, device, max(CAPTURED), 32, _replaying_capture, **kw
            ),
        )
        mp.setattr(graph_runner, "CompiledPrefill",
                   lambda model, attn, device: BreakablePrefill(model, attn, device, _replaying_capture))  # fmt: skip
        return kiln.Engine(**kwargs, cuda_graph_bs=CAPTURED, cuda_graph_bs_prefill=prefill)


def test_cuda_backends_buffers_match_eager_on_the_cpu(tiny_llama):
    """The CUDA decode graphs and breakable prefill graphs, with capture replaced by re-running the captured
    function, give eager's tokens: batches that hit, pad and straddle; prefills that pad, hit and fall back;
    decodes whose sequences outgrow the graphs' KV width (32) fall back to eager."""
    common = dict(model_path=tiny_llama, max_total_tokens=4096, max_running_requests=16, num_threads=1)
    graphs = _cuda_backends_on_the_cpu(**common)
    eager = kiln.Engine(**common, disable_cuda_graph=True)
    runner = graphs.scheduler.runner.graphs
    assert runner.captured("decode") == list(CAPTURED) and runner.captured("prefill") == list(PREFILL)
    prefill = runner.phases["prefill"].backend
    assert len(prefill.graphs) == len(PREFILL) * 2 * len(graphs.scheduler.runner.model.model.layers)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (20, 6, 11, 4, 64, 9, 5, 100)]
    schedule = list(zip([0, 30, 30, 32, 34, 34, 34, 60], prompts, [6, 12, 3, 9, 5, 7, 2, 3]))
    run = drive(graphs, schedule)
    assert run.outs == drive(eager, schedule).outs
    assert (20, True) in run.prefills and (17, True) in run.prefills, run.prefills  # two prompts padded to 32
    assert (100, False) in run.prefills  # above the largest count: eager
    ran = set(run.decodes)
    assert {(1, True), (2, True), (3, True)} <= ran and any(bs > 4 and not on for bs, on in ran), ran
    assert runner.beyond_width > 0  # the 64- and 100-token prompts decode beyond the width: eagerly


def test_prefill_graphs_longer_than_the_context(tiny_llama):
    """A prefill graph of more tokens than the rotary table holds (the context, 4096, + 8: a batch of prompts is
    longer than any one of them) captures, its dummy prompt's positions inside the table, and gives eager's
    tokens to two prompts prefilled together in it."""
    common = dict(model_path=tiny_llama, max_total_tokens=8192, chunked_prefill_size=8192, num_threads=1)
    graphs = _cuda_backends_on_the_cpu((16, 4160), **common)
    g = torch.Generator().manual_seed(5)
    schedule = [(0, torch.randint(100, 40000, (2060,), generator=g).tolist(), 3) for _ in range(2)]
    run = drive(graphs, schedule)
    assert (4120, True) in run.prefills, run.prefills
    assert run.outs == drive(kiln.Engine(**common, disable_cuda_graph=True), schedule).outs


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def cuda_engines(tiny_llama):
    # float32: token-identical comparisons, as on the CPU (a padded batch may take other GEMM kernels)
    common = dict(model_path=tiny_llama, device="cuda", dtype="float32", max_total_tokens=4096,
                  max_running_requests=16)  # fmt: skip
    graphs = kiln.Engine(**common, cuda_graph_bs=CAPTURED, cuda_graph_bs_prefill=PREFILL)
    return graphs, kiln.Engine(**common, disable_cuda_graph=True)


@pytest.mark.cuda
@needs_cuda
def test_cuda_graphs_match_eager_as_the_batch_shrinks_and_grows(cuda_engines):
    graphs, eager = cuda_engines
    assert graphs.scheduler.runner.graphs.captured() == list(CAPTURED)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (6, 11, 4, 25, 9, 13)]
    # grows 2 -> 3 (pads to 4) -> 6 (eager), shrinks back through 4, 2, 1; then grows again
    schedule = list(zip([0, 0, 2, 4, 4, 4], prompts, [12, 3, 9, 5, 7, 2]))
    schedule += [(40, prompts[0], 4), (41, prompts[1], 4)]
    run = drive(graphs, schedule)
    assert run.outs == drive(eager, schedule).outs
    ran = set(run.decodes)
    assert {(1, True), (2, True), (3, True), (4, True)} <= ran and any(bs > 4 and not on for bs, on in ran)


@pytest.mark.cuda
@needs_cuda
def test_cuda_prefill_graphs_pad_hit_or_fall_back_like_eager(cuda_engines):
    graphs, eager = cuda_engines
    assert graphs.scheduler.runner.graphs.captured("prefill") == list(PREFILL)
    assert graphs.scheduler.runner.graphs.phases["prefill"].backend.name == "breakable"
    check_prefills_pad_hit_or_fall_back(graphs, eager)


@pytest.mark.cuda
@needs_cuda
def test_cuda_shared_prefix_batches_match_eager(cuda_engines):
    """Requests of one length (no KV mask) sharing their prompt: the eager distinct-slot path on the GPU."""
    graphs, eager = cuda_engines
    prefix = list(range(200, 300))
    schedule = [(0, prefix, 6), (0, prefix, 6), (0, prefix, 5), (1, prefix + [7, 8], 4)]
    run = drive(graphs, schedule)
    assert run.outs == drive(eager, schedule).outs
    assert any(bs >= 2 and not on for bs, on in run.decodes), run.decodes


@pytest.mark.cuda
@needs_cuda
def test_cuda_eager_matches_transformers(cuda_engines, tiny_llama):
    _, eager = cuda_engines
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (7, 30)]
    run = drive(eager, [(0, ids, 8) for ids in prompts])
    model = load_hf(tiny_llama)
    for i, ids in enumerate(prompts):
        assert run.outs[f"r{i}"] == hf_greedy(model, ids, 8, {model.config.eos_token_id})[0]


@pytest.mark.cuda
@needs_cuda
def test_cuda_capture_memory_within_the_ledger_reserve(cuda_engines):
    graphs, _ = cuda_engines
    summary = graphs.scheduler.runner.graphs.summary()
    ledger = graphs.parts.ledger
    assert summary["decode"]["sizes"] == list(ledger.graph_batch_sizes)
    assert summary["prefill"]["sizes"] == list(ledger.graph_prefill_tokens)
    measured = {name: phase["capture_bytes"] for name, phase in summary.items()}
    print(f"CUDA capture: measured {measured} bytes, ledger reserve {ledger.graph_reserve_bytes} bytes")
    assert 0 < sum(measured.values()) <= ledger.graph_reserve_bytes, (measured, ledger.graph_reserve_bytes)
    assert all(s["mem_bytes"] >= 0 for phase in summary.values() for s in phase["shapes"])
