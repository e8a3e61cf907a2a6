"""The Scheduler with a fake model: admission, chunked prefill, interleaved decode, retraction, aborts,
prefill-only requests, and the KV integrity invariant after every step.

The fake runner keeps a KV "pool" of (token, position) per slot. Each forward writes its tokens at their
slots and computes the next token of every sequence from what it reads back through the request table, so
a request whose table row, cached prefix or retraction went wrong gets a different output than the pure
reference `expected()`.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.memory.allocator import TokenAllocator
from kiln.memory.req_to_token import ReqToTokenPool
from kiln.sampling_params import SamplingParams
from kiln.scheduler.io import AbortReq, GenerateReq, ReqOutput
from kiln.scheduler.req import ReqState
from kiln.scheduler.scheduler import Scheduler
from kiln.scheduler.step import StepKind

pytestmark = pytest.mark.unit

VOCAB = 1000
EOS = VOCAB - 1  # never produced by next_token


def next_token(seq: list[int]) -> int:
    """The fake model: a position-weighted hash of the whole sequence (never EOS)."""
    return (sum((i + 1) * t for i, t in enumerate(seq)) * 31 + len(seq)) % (VOCAB - 1)


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


class FakeTokenizer:
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" t{i}" for i in ids)


class FakeRunner:
    """What the Scheduler uses of a ModelRunner, over a pool that records (token, position) per slot."""

    def __init__(self, pool: int, page_size: int, rows: int, context_len: int):
        self.allocator = TokenAllocator(pool, page_size, debug=True)
        self.table = ReqToTokenPool(rows + 1, context_len + 8)
        self.model_config = SimpleNamespace(vocab_size=VOCAB, eos_token_ids=(EOS,))
        slots = (self.allocator.num_pages + 1) * page_size
        self.tok = torch.full((slots,), -1, dtype=torch.int64)
        self.pos = torch.full((slots,), -1, dtype=torch.int64)
        self.last_forward_seconds = 1e-3
        self.last_forward_graph = False
        self.calls: list[tuple[ForwardMode, list[int]]] = []  # (mode, tokens per request)
        self.errors: list[str] = []

    def _read(self, slots: torch.Tensor) -> list[int]:
        n = slots.numel()
        if self.pos[slots].tolist() != list(range(n)):
            self.errors.append(f"KV positions {self.pos[slots].tolist()} for a {n}-token sequence")
        return self.tok[slots].tolist()

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        self.tok[fb.out_cache_loc] = fb.input_ids
        self.pos[fb.out_cache_loc] = fb.positions
        if fb.mode == ForwardMode.EXTEND:
            self.calls.append((fb.mode, list(fb.extend_lens)))
            seqs = [self._read(s) for s in fb.seq_slots]
        else:
            self.calls.append((fb.mode, [1] * fb.batch_size))
            lens = (fb.positions + 1).tolist()
            seqs = [self._read(fb.kv_table[b, :n]) for b, n in enumerate(lens)]
        logits = torch.zeros(len(seqs), VOCAB)
        for b, seq in enumerate(seqs):
            logits[b, next_token(seq)] = 1.0
        return logits


def make(
    pool: int = 4096,
    page_size: int = 1,
    max_running: int = 16,
    chunk: int | None = None,
    max_prefill: int = 16384,
    radix: bool = True,
    policy: str = "fcfs",
    context_len: int = 2048,
    runner_cls: type[FakeRunner] = FakeRunner,
) -> Scheduler:
    runner = runner_cls(pool, page_size, max_running, context_len)
    return Scheduler(
        runner,  # type: ignore[arg-type]
        FakeTokenizer(),
        max_total_num_tokens=runner.allocator.size,
        max_running_requests=max_running,
        context_len=context_len,
        chunked_prefill_size=chunk,
        max_prefill_tokens=max_prefill,
        page_size=page_size,
        disable_radix_cache=not radix,
        schedule_policy=policy,
    )


_rid = iter(range(10**9))


def add(s: Scheduler, prompt: list[int], max_new: int = 8, **kw) -> str:
    rid = f"r{next(_rid)}"
    s.add_request(
        GenerateReq(rid, list(prompt), SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw))
    )
    return rid


def check(s: Scheduler) -> dict:
    rep = s.check_integrity()
    assert rep["ok"], rep
    assert not s.runner.errors, s.runner.errors[:3]
    return rep


def step(s: Scheduler, outs: dict[str, list[ReqOutput]]) -> None:
    for o in s.step():
        outs[o.rid].append(o)
    check(s)
    assert len(s.running) <= s.max_running_requests


def drive(s: Scheduler, outs: dict | None = None, max_steps: int = 20000) -> dict[str, list[ReqOutput]]:
    """Step until idle, checking integrity after every step; the outputs per request id."""
    outs = outs if outs is not None else defaultdict(list)
    for _ in range(max_steps):
        step(s, outs)
        if not s.has_work:
            break
    else:
        raise AssertionError("the scheduler did not go idle")
    rep = check(s)
    assert rep["in_use"] == 0 and rep["free"] + rep["cached"] == rep["total"], rep
    assert s.runner.table.available_size() == s.runner.table.size
    return outs


def ids(outs: list[ReqOutput]) -> list[int]:
    return [t for o in outs for t in o.new_ids]


def final(outs: list[ReqOutput]) -> ReqOutput:
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    return outs[-1]


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (VOCAB - 1) for i in range(n)]


def extends(s: Scheduler) -> list[list[int]]:
    return [lens for mode, lens in s.runner.calls if mode == ForwardMode.EXTEND]


# ---------------------------------------------------------------- outputs


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("radix", [True, False])
def test_outputs_follow_the_model(ps: int, radix: bool) -> None:
    s = make(page_size=ps, radix=radix)
    prompts = [prompt(n, n) for n in (1, 3, 8, 17, 40)]
    rids = [add(s, p, max_new=10) for p in prompts]
    outs = drive(s)
    for rid, p in zip(rids, prompts):
        assert ids(outs[rid]) == expected(p, 10)
        f = final(outs[rid])
        assert f.finish_reason == {"type": "length", "length": 10}
        assert (f.prompt_tokens, f.completion_tokens) == (len(p), 10)


@pytest.mark.parametrize("ps", [1, 4])
def test_cached_prefix_is_reused(ps: int) -> None:
    s = make(page_size=ps)
    p = prompt(30, 1)
    a = add(s, p)
    first = drive(s)
    assert ids(first[a]) == expected(p, 8) and final(first[a]).cached_tokens == 0
    q = p + expected(p, 7) + [5]  # a's prompt and the 7 outputs that have KV, then new
    b = add(s, q)
    second = drive(s)
    hit = 37 // ps * ps
    assert final(second[b]).cached_tokens == hit
    assert extends(s)[-1] == [38 - hit]
    assert ids(second[b]) == expected(q, 8)


# ---------------------------------------------------------------- admission


def test_prefill_batch_respects_max_prefill_tokens() -> None:
    s = make(max_prefill=100)
    rids = [add(s, prompt(40, k)) for k in range(3)] + [add(s, prompt(150, 9))]
    outs = drive(s)
    batches = extends(s)
    assert batches[0] == [40, 40], batches  # a third 40 would pass the 100-token budget
    assert [150] in batches  # a prompt over the budget still runs, alone
    assert all(sum(e) <= 100 or len(e) == 1 for e in batches)
    assert all(final(outs[r]).completion_tokens == 8 for r in rids)


def test_max_running_requests_caps_the_batch() -> None:
    s = make(max_running=3)
    prompts = [prompt(5 + k, k) for k in range(7)]
    rids = [add(s, p, max_new=6) for p in prompts]
    outs = drive(s)
    assert max(len(lens) for _, lens in s.runner.calls) <= 3
    for rid, p in zip(rids, prompts):
        assert ids(outs[rid]) == expected(p, 6)


def test_admission_counts_the_kv_each_request_will_need() -> None:
    # 256-token pool; each request needs 50 prompt + 50 new tokens: two fit, the third must wait
    s = make(pool=256)
    prompts = [prompt(50, k) for k in range(3)]
    rids = [add(s, p, max_new=50) for p in prompts]
    outs = defaultdict(list)
    step(s, outs)
    assert extends(s) == [[50, 50]] and len(s.waiting) == 1
    drive(s, outs)
    for rid, p in zip(rids, prompts):
        assert ids(outs[rid]) == expected(p, 50)


@pytest.mark.parametrize("radix", [True, False])
def test_requests_sharing_an_uncached_prefix_compute_it_once(radix: bool) -> None:
    """In-batch prefix caching: of requests arriving together with a common uncached 100-token prefix, one
    computes it; the others wait one batch and read it from the radix cache. Unrelated requests are not held."""
    s = make(radix=radix)
    shared = prompt(100, 5)
    prompts = [shared + prompt(6, 10 + k) for k in range(3)] + [prompt(50, 99)]
    rids = [add(s, p, max_new=4) for p in prompts]
    outs = drive(s)
    batches = extends(s)
    if radix:
        assert batches[:2] == [[106, 50], [6, 6]], batches
        assert [final(outs[r]).cached_tokens for r in rids] == [0, 100, 100, 0]
    else:  # nothing to read it back from: all at once
        assert batches[0] == [106, 106, 106, 50], batches
    for rid, p in zip(rids, prompts):
        assert ids(outs[rid]) == expected(p, 4)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_the_longest_cached_prefix_first(policy: str) -> None:
    s = make(policy=policy, max_running=1)
    p = prompt(40, 1)
    add(s, p, max_new=1)
    drive(s)  # p is cached
    other, hit = prompt(20, 2), p + [3]
    rids = [add(s, other, max_new=2), add(s, hit, max_new=2)]
    outs = drive(s)
    after = extends(s)[1:]
    assert after == ([[20], [1]] if policy == "fcfs" else [[1], [20]])
    assert ids(outs[rids[0]]) == expected(other, 2) and ids(outs[rids[1]]) == expected(hit, 2)


# ---------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("radix", [True, False])
def test_long_prompt_is_prefilled_in_chunks(ps: int, radix: bool) -> None:
    s = make(chunk=64, page_size=ps, radix=radix)
    p = prompt(300, 3)
    rid = add(s, p)
    outs = drive(s)
    assert extends(s) == [[64], [64], [64], [64], [44]]
    assert ids(outs[rid]) == expected(p, 8)


def test_decodes_continue_between_chunks() -> None:
    s = make(chunk=64)
    short, long_ = prompt(5, 1), prompt(300, 2)
    a = add(s, short, max_new=30)
    outs = defaultdict(list)
    step(s, outs)  # a is prefilled and decoding
    b = add(s, long_, max_new=4)
    drive(s, outs)
    modes = [(m.value, sum(lens)) for m, lens in s.runner.calls]
    chunks = [i for i, (m, _) in enumerate(modes) if m == "extend"][1:]
    assert [modes[i][1] for i in chunks] == [64, 64, 64, 64, 44]
    for i, j in zip(chunks, chunks[1:]):
        assert "decode" in [m for m, _ in modes[i + 1 : j]], f"no decode between chunks: {modes}"
    assert ids(outs[a]) == expected(short, 30) and ids(outs[b]) == expected(long_, 4)


def test_chunks_of_a_prompt_share_the_budget_with_new_requests() -> None:
    s = make(chunk=64)
    rids = [add(s, prompt(100, 1)), add(s, prompt(20, 2)), add(s, prompt(20, 3))]
    outs = drive(s)
    assert extends(s)[0] == [64]  # the long prompt takes the whole first chunk budget
    assert all(sum(e) <= 64 for e in extends(s))
    for rid, n, k in zip(rids, (100, 20, 20), (1, 2, 3)):
        assert ids(outs[rid]) == expected(prompt(n, k), 8)


# ---------------------------------------------------------------- request states


def test_a_request_moves_through_its_states_with_its_queues() -> None:
    """waiting -> prefilling (a chunk a step) -> running -> finished; every step's integrity check holds each live
    request's state to the queue it is in."""
    s = make(chunk=64)
    rid = add(s, prompt(150, 1), max_new=3)
    req = s.reqs[rid]
    seen = [req.state]
    outs = defaultdict(list)
    while s.has_work:
        step(s, outs)
        if seen[-1] != req.state:
            seen.append(req.state)
    assert seen == [ReqState.WAITING, ReqState.PREFILLING, ReqState.RUNNING, ReqState.FINISHED]


def test_a_retracted_request_is_preempted_then_runs_again() -> None:
    s = make(pool=256, max_running=8)
    reqs = [s.reqs[add(s, prompt(10 + k, k), max_new=64)] for k in range(8)]
    history: dict[str, list[ReqState]] = {r.rid: [r.state] for r in reqs}
    outs = defaultdict(list)
    while s.has_work:
        step(s, outs)
        for r in reqs:
            if history[r.rid][-1] != r.state:
                history[r.rid].append(r.state)
    preempted = [h for h in history.values() if ReqState.PREEMPTED in h]
    assert preempted and s.make_stats().retracted >= len(preempted)
    for h in preempted:
        at = h.index(ReqState.PREEMPTED)
        # re-admitted, its prompt and output prefilled again: within one step when it fits one batch
        assert h[at - 1] == ReqState.RUNNING and h[at + 1] in (ReqState.PREFILLING, ReqState.RUNNING)
        assert h[-1] == ReqState.FINISHED


def test_the_integrity_check_names_a_request_in_the_wrong_state() -> None:
    s = make()
    rid = add(s, prompt(5, 1))
    s.reqs[rid].state = ReqState.RUNNING  # still in the waiting queue
    report = s.check_integrity()
    assert not report["ok"] and report["misplaced_states"] == [f"{rid}: running in waiting"]


# ---------------------------------------------------------------- a step as data


def test_a_step_is_a_plan_its_result_and_one_update() -> None:
    """schedule() decides a plan of plain data (requests, tokens each computes, each one's start, the requests whose
    row samples), execute() runs it and changes no request, update() commits it."""
    s = make(chunk=64)
    a, b = add(s, prompt(100, 1), max_new=2), add(s, prompt(10, 2), max_new=2)
    ra, rb = s.reqs[a], s.reqs[b]
    first = s.schedule()
    assert (first.kind, first.reqs, first.new_tokens, first.starts, first.sampled) == (
        StepKind.PREFILL, (ra,), (64,), (0,), ()
    )  # fmt: skip
    s.update(first, s.execute(first))
    second = s.schedule()
    assert (second.reqs, second.new_tokens, second.starts, second.sampled) == (
        (ra, rb),
        (36, 10),
        (64, 0),
        (0, 1),
    )
    result = s.execute(second)
    assert result.sampled.next_token_ids == [expected(prompt(100, 1), 1)[0], expected(prompt(10, 2), 1)[0]]
    assert ra.output_ids == rb.output_ids == [] and ra.state == rb.state == ReqState.PREFILLING
    s.update(second, result)
    assert len(ra.output_ids) == len(rb.output_ids) == 1 and s.running == [ra, rb]
    decode = s.schedule()
    assert (decode.kind, decode.new_tokens, decode.starts) == (StepKind.DECODE, (1, 1), (100, 10))
    s.update(decode, s.execute(decode))
    assert not s.has_work and check(s)["in_use"] == 0


class FailingRunner(FakeRunner):
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        raise RuntimeError("the device fell over")


def test_a_failed_forward_is_the_results_error_and_update_fails_its_requests() -> None:
    s = make(runner_cls=FailingRunner)
    rid = add(s, prompt(10, 1))
    plan = s.schedule()
    result = s.execute(plan)
    assert isinstance(result.error, RuntimeError) and s.reqs[rid].output_ids == []
    s.update(plan, result)
    (out,) = s.take_outputs()
    assert out.finished and "the device fell over" in out.error and check(s)["in_use"] == 0


# ---------------------------------------------------------------- retraction


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("radix", [True, False])
def test_retraction_under_a_tiny_pool_keeps_every_request(ps: int, radix: bool) -> None:
    s = make(pool=256, page_size=ps, radix=radix, max_running=8)
    prompts = [prompt(10 + k, k) for k in range(8)]
    rids = [add(s, p, max_new=64) for p in prompts]
    outs = drive(s)
    assert s.make_stats().retracted > 0
    assert sum(final(outs[r]).num_retractions for r in rids) == s.make_stats().retracted
    for rid, p in zip(rids, prompts):
        assert final(outs[rid]).finish_reason == {"type": "length", "length": 64}
        assert ids(outs[rid]) == expected(p, 64)


def test_a_stalled_chunked_prompt_does_not_drop_the_decoding_request() -> None:
    """One long decode and a prompt admitted chunk by chunk beside it. The prompt's later chunks no longer
    pass admission (the decode's reservation), so it stalls holding its first chunks; when the pool runs dry
    the only running request must not be aborted for lack of memory, and the step must not crash."""
    s = make(pool=64, chunk=8)
    a = add(s, [5], max_new=60)
    p = prompt(20, 3)
    b = add(s, p, max_new=1)
    outs = drive(s)
    assert final(outs[a]).finish_reason == {"type": "length", "length": 60}
    assert ids(outs[a]) == expected([5], 60) and ids(outs[b]) == expected(p, 1)


class EosFirstRunner(FakeRunner):
    """The fake model with EOS as every step's first choice and the fake model's token as its second."""

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        logits = super().forward(fb)
        logits[:, EOS] = 2.0
        return logits


@pytest.mark.parametrize("min_new", [0, 1, 5])
def test_eos_is_banned_for_exactly_min_new_tokens(min_new: int) -> None:
    """min_new_tokens outputs come before EOS may end a request, and EOS ends it at the first step after."""
    s = make(runner_cls=EosFirstRunner)
    p = prompt(9, 3)
    rid = add(s, p, max_new=20, min_new_tokens=min_new)
    out = drive(s)[rid]
    assert ids(out) == expected(p, min_new) + [EOS]
    assert final(out).finish_reason["type"] == "stop" and final(out).completion_tokens == min_new + 1


def test_integrity_reports_a_leaked_slot_and_counts_it() -> None:
    """A slot taken outside any request or cached prefix breaks free + cached + in use == total: the check says
    so (it is what /get_server_info and kiln:kv_integrity_violations_total report)."""
    s = make()
    add(s, prompt(12, 1))
    drive(s)
    assert s.check_integrity()["ok"] and s.integrity_violations == 0
    leaked = s.runner.allocator.alloc(1)
    assert leaked is not None
    rep = s.check_integrity()
    assert not rep["ok"] and rep["free"] + rep["cached"] + rep["in_use"] == rep["total"] - 1, rep
    assert s.integrity_violations == 1 and s.make_stats().integrity_violations == 1


# ---------------------------------------------------------------- aborts and prefill-only


@pytest.mark.parametrize("radix", [True, False])
def test_abort_all_frees_everything(radix: bool) -> None:
    s = make(pool=512, chunk=32, radix=radix, max_running=4)
    rids = [add(s, prompt(10, k), max_new=50) for k in range(3)] + [add(s, prompt(200, 7))]
    rids += [add(s, prompt(10, 10 + k)) for k in range(4)]  # beyond max_running: waiting
    outs = defaultdict(list)
    for _ in range(6):
        step(s, outs)
    assert s.running and s.chunked is not None and s.waiting
    s.abort(AbortReq(abort_all=True))
    drive(s, outs)
    for rid in rids:
        assert final(outs[rid]).finish_reason["type"] == "abort"
    assert s.make_stats().aborted == len(rids)


def test_abort_one_request_leaves_the_others() -> None:
    s = make()
    p = [prompt(12, k) for k in range(3)]
    rids = [add(s, x, max_new=20) for x in p]
    outs = defaultdict(list)
    for _ in range(4):
        step(s, outs)
    s.abort(AbortReq(rid=rids[1]))
    s.abort(AbortReq(rid="no-such-request"))
    drive(s, outs)
    assert final(outs[rids[1]]).finish_reason["type"] == "abort"
    assert ids(outs[rids[0]]) == expected(p[0], 20) and ids(outs[rids[2]]) == expected(p[2], 20)


def test_max_new_tokens_zero_is_prefill_only() -> None:
    s = make()
    p = prompt(40, 5)
    rid = add(s, p, max_new=0)
    outs = drive(s)
    f = final(outs[rid])
    assert ids(outs[rid]) == [] and f.finish_reason == {"type": "length", "length": 0}
    assert [m for m, _ in s.runner.calls] == [ForwardMode.EXTEND]
    rid2 = add(s, p, max_new=3)
    outs = drive(s)
    assert final(outs[rid2]).cached_tokens == 39 and ids(outs[rid2]) == expected(p, 3)


def test_invalid_request_is_answered_not_queued() -> None:
    s = make()
    rid = add(s, [VOCAB + 5])
    outs = drive(s)
    f = final(outs[rid])
    assert f.finish_reason["type"] == "abort" and "vocabulary" in f.error
    assert not s.runner.calls


# ---------------------------------------------------------------- random workloads


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    lens=st.lists(
        st.tuples(st.integers(1, 60), st.integers(0, 24), st.integers(0, 3)), min_size=1, max_size=10
    ),
    pool=st.integers(120, 400),
    ps=st.sampled_from([1, 4]),
    chunk=st.sampled_from([None, 16, 48]),
    radix=st.booleans(),
    policy=st.sampled_from(["fcfs", "lpm"]),
    stagger=st.integers(0, 3),
)
def test_random_workloads_finish_correctly(lens, pool, ps, chunk, radix, policy, stagger) -> None:
    """Any mix of prompt lengths, shared prefixes, pool sizes and arrival times: every request finishes with
    the model's tokens, none is dropped, and the pool is whole after every step."""
    s = make(pool=pool, page_size=ps, chunk=chunk, radix=radix, policy=policy, max_running=6)
    shared = prompt(32, 99)
    outs: dict[str, list[ReqOutput]] = defaultdict(list)
    want = {}
    for n, new, pre in lens:
        p = shared[: pre * 10] + prompt(n, n + new)
        want[add(s, p, max_new=new)] = expected(p, new)
        for _ in range(stagger):
            step(s, outs)
    drive(s, outs)
    for rid, w in want.items():
        f = final(outs[rid])
        assert f.finish_reason["type"] == "length", f
        assert ids(outs[rid]) == w


def test_every_prompt_needs_its_sampling_params():
    """kiln.Engine.generate(["a", "b", "c"], [p, p]) ran two prompts and returned two results: zip dropped the
    third. A list of params is one per prompt, as in SGLang."""
    from kiln.sampling_params import InvalidParam
    from kiln.scheduler.fanout import fan_out

    p = SamplingParams(max_new_tokens=2)
    with pytest.raises(InvalidParam, match="got 2 sampling params for 3 prompts"):
        fan_out([[1], [2], [3]], [p, p])
    assert len(fan_out([[1], [2]], [p, p]).samples) == 2
