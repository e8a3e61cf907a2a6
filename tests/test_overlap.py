"""The overlap scheduler (kiln.scheduler.overlap): decode steps launched one ahead on the forward thread give the
plain scheduler's tokens, logprobs and finishes, request for request, whether requests end by length, by a stop
token the host only sees a step late, by abort, or arrive while others decode; the extra row of a request that
ended leaves no slot behind, and a step that fails fails its requests and no others."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch

import kiln
from kiln.core.forward_batch import ForwardMode
from kiln.sampling_params import SamplingParams
from kiln.scheduler.io import AbortReq, GenerateReq
from kiln.scheduler.overlap import ForwardThread
from kiln.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.engine

PROMPTS = [[5, 9, 14, 3, 7, 11, 2, 8], [1, 2, 3], list(range(100, 130)), [40, 41, 42, 43]]
ARGS = dict(disable_cuda_graph=True, max_total_tokens=2048, num_threads=1)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    plain = kiln.Engine(model_path=tiny_llama, **ARGS)
    overlap = kiln.Engine(model_path=tiny_llama, enable_overlap_schedule=True, **ARGS)
    assert plain.scheduler.forward_thread is None and overlap.scheduler.forward_thread is not None
    yield plain, overlap
    plain.shutdown()
    overlap.shutdown()


@pytest.fixture(autouse=True)
def fresh_engines(request):
    """Each test starts both engines alike: nothing running, nothing in flight, empty prefix caches (so that the
    two see the same cache hits), and leaves them so whatever it left behind."""
    yield
    if "engines" not in request.fixturenames:
        return
    for engine in request.getfixturevalue("engines"):
        engine.scheduler.abort(AbortReq(abort_all=True))
        while engine.scheduler.has_work:
            engine.scheduler.step()
        assert engine.scheduler.flush_cache() and engine.check_integrity()["ok"]


def extra_rows(monkeypatch) -> list[str]:
    """The rids whose extra row (a step launched before their stop was seen) was dropped, as it happens."""
    dropped: list[str] = []
    real = Scheduler._cache_extra_row
    monkeypatch.setattr(
        Scheduler, "_cache_extra_row", lambda self, req: dropped.append(req.rid) or real(self, req)
    )
    return dropped


def launches(monkeypatch) -> list[int]:
    counted: list[int] = []
    real = ForwardThread.launch
    monkeypatch.setattr(
        ForwardThread, "launch", lambda self, reqs, *a: counted.append(len(reqs)) or real(self, reqs, *a)
    )
    return counted


def outputs(engine, params: list[dict], prompts=PROMPTS) -> list[tuple]:
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert engine.check_integrity()["ok"]
    return [
        (o["output_ids"], o["meta_info"]["finish_reason"], o["meta_info"].get("output_token_logprobs"))
        for o in got
    ]


def test_greedy_sampled_and_logprobs_as_the_plain_scheduler(engines, monkeypatch):
    """Different lengths (each request leaves the chain as its last token is in flight), seeded sampling (each
    request's generator drawn in the same order) and logprobs."""
    plain, overlap = engines
    params = [
        {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True},
        {
            "temperature": 0.9,
            "seed": 3,
            "max_new_tokens": 5,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs_num": 2,
        },
        {"temperature": 0, "max_new_tokens": 14, "ignore_eos": True, "logprobs": True, "top_logprobs_num": 2},
        {"temperature": 1.2, "top_k": 20, "seed": 8, "max_new_tokens": 1, "ignore_eos": True},
    ]
    want = outputs(plain, params)
    counted = launches(monkeypatch)
    assert outputs(overlap, params) == want
    assert len(counted) >= 12 and counted[0] == 3  # the one-token request never decodes


def test_a_stop_token_seen_a_step_late(engines, monkeypatch):
    """A request stopped by a token the host reads only after launching its next step: the same output and
    finish, the extra row dropped (the integrity check counts every slot), and the request's KV cached as after a
    plain finish: the prompt and its output asked again hit the same cached tokens, its generated ones included."""
    plain, overlap = engines
    free = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    ran = plain.generate(input_ids=PROMPTS, sampling_params=[free] * len(PROMPTS))
    stops = [{**free, "stop_token_ids": [o["output_ids"][4]], "ignore_eos": False} for o in ran]
    want = outputs(plain, stops)
    assert all(reason["type"] == "stop" for _, reason, _ in want)
    dropped = extra_rows(monkeypatch)
    assert outputs(overlap, stops) == want
    assert len(set(dropped)) == len(dropped) == len(PROMPTS)  # one extra row each
    again = [p + ids for p, (ids, _, _) in zip(PROMPTS, want, strict=True)]

    def cached(engine) -> list[int]:
        out = engine.generate(input_ids=again, sampling_params={"max_new_tokens": 1, "temperature": 0})
        return [o["meta_info"]["cached_tokens"] for o in out]

    hits = cached(plain)
    assert hits == [len(p) - 1 for p in again]  # everything but the last token, which is always computed
    assert cached(overlap) == hits


def drive(
    engine, arrivals: dict[int, GenerateReq], aborts: dict[int, str], steps: int = 200
) -> dict[str, list]:
    """Steps the scheduler by hand: a request added before step k (arrivals), an abort sent before step k."""
    sched, out = engine.scheduler, {}
    for k in range(steps):
        if k in arrivals:
            sched.add_request(arrivals[k])
        if k in aborts:
            sched.abort(AbortReq(aborts[k]))
        for o in sched.step():
            out.setdefault(o.rid, []).extend(o.new_ids)
            if o.finished:
                out[o.rid].append(o.finish_reason["type"])
        if k > max([*arrivals, *aborts]) and not sched.has_work:
            break
    assert engine.check_integrity()["ok"]
    return out


def test_arrivals_and_an_abort_while_a_step_is_in_flight(engines, monkeypatch):
    """A request arriving mid-decode (its prefill drains the step in flight first) and an abort of a request in
    flight: each request's tokens as with the plain scheduler."""
    plain, overlap = engines

    def run(engine) -> dict[str, list]:
        greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True).normalize()
        arrivals = {
            0: GenerateReq("a", PROMPTS[0], greedy),
            1: GenerateReq("c", PROMPTS[1], greedy),
            4: GenerateReq("b", PROMPTS[2], greedy),
        }
        return drive(engine, arrivals, {7: "c"})

    want = run(plain)
    counted = launches(monkeypatch)
    assert run(overlap) == want
    assert want["c"][-1] == "abort" and want["a"][-1] == want["b"][-1] == "length"
    assert counted


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(engines, monkeypatch):
    """The third decode step fails on the forward thread while the second's tokens are being taken in: the two
    requests in it fail with the error; a request that ended by length before it does not; the engine then serves
    as before."""
    plain, overlap = engines
    runner, calls = overlap.scheduler.runner, []
    forward = runner.forward

    def failing(fb):
        calls.append(fb.input_ids.shape[0])
        if len(calls) == 4:  # the prefill, then decode steps 1, 2 and 3
            raise RuntimeError("injected forward failure")
        return forward(fb)

    monkeypatch.setattr(runner, "forward", failing)
    counted = launches(monkeypatch)
    greedy = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    short = {**greedy, "max_new_tokens": 2}
    got = overlap.generate(input_ids=PROMPTS[:3], sampling_params=[greedy, greedy, short])
    assert all("injected forward failure" in o["meta_info"]["error"] for o in got[:2])
    assert "error" not in got[2]["meta_info"] and got[2]["meta_info"]["finish_reason"]["type"] == "length"
    # the short request left the chain after step 1; step 4, launched before step 3 was seen to fail, waited on
    # its tokens and never ran
    assert counted == [3, 2, 2, 2] and calls[1:] == [3, 2, 2]
    assert overlap.check_integrity()["ok"]
    monkeypatch.setattr(runner, "forward", forward)
    assert outputs(overlap, [greedy] * 2, PROMPTS[:2]) == outputs(plain, [greedy] * 2, PROMPTS[:2])


def steps_until(sched, done, limit: int = 60) -> list:
    """Steps the scheduler until done() holds (checked before each step); the outputs on the way."""
    outs: list = []
    for _ in range(limit):
        if done():
            return outs
        outs += sched.step()
    raise AssertionError("the scheduler never got there")


def test_a_deadline_passing_while_the_last_token_is_in_flight(engines):
    """The deadline of a request whose last token is in flight passes: the drain ends it by length, and the
    deadline then finds nothing to abort."""
    sched = engines[1].scheduler
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True).normalize()
    sched.add_request(GenerateReq("d", PROMPTS[0], params))
    req = sched.reqs["d"]

    def last_token_in_flight() -> bool:
        flight = sched.in_flight
        return flight is not None and any(r is req for r in flight.reqs) and len(req.output_ids) == 5

    outs = steps_until(sched, last_token_in_flight)
    req.deadline = time.time() - 1
    outs += steps_until(sched, lambda: not sched.has_work)
    assert [o.finish_reason["type"] for o in outs if o.finished] == ["length"]
    assert len(req.output_ids) == 6 and engines[1].check_integrity()["ok"]


def test_a_flush_right_after_a_stop_seen_late(engines):
    """The last request ended by a stop token with its extra row still in flight: /flush_cache settles that row
    and flushes, rather than refusing as if requests were running."""
    plain, overlap = engines
    free = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    stop = plain.generate(input_ids=PROMPTS[2], sampling_params=free)["output_ids"][4]
    sched = overlap.scheduler
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[stop]).normalize()
    sched.add_request(GenerateReq("f", PROMPTS[2], params))
    steps_until(sched, lambda: "f" not in sched.reqs)
    assert sched.in_flight is not None  # the row of the step launched before the stop was seen
    assert sched.flush_cache()
    assert sched.in_flight is None and sched.kv.cache_tokens() == 0 and overlap.check_integrity()["ok"]


def test_the_decode_log_reports_each_steps_own_graph_flag(engines, monkeypatch):
    """The decode log line's "cuda graph" is the logged step's own: by the time a step is taken in, the runner's
    flag belongs to the step launched after it. Here every other decode step claims a graph, and each step is taken
    in only once the next has run."""
    _, overlap = engines
    runner = overlap.scheduler.runner
    real_forward = runner.forward
    claimed: list[bool] = []
    logged: list[bool] = []

    def forward(fb):
        out = real_forward(fb)
        if fb.mode == ForwardMode.DECODE:
            runner.last_forward_graph = len(claimed) % 2 == 0
            claimed.append(runner.last_forward_graph)
        return out

    real_take = Scheduler._take_step

    def take_after_the_next(self, step):
        if self.in_flight is not None:
            self.in_flight.result.exception()  # waits for the step launched after this one
        real_take(self, step)

    monkeypatch.setattr(runner, "forward", forward)
    monkeypatch.setattr(Scheduler, "_take_step", take_after_the_next)
    monkeypatch.setattr(Scheduler, "_log_decode", lambda self, batch, graphed: logged.append(graphed))
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    overlap.generate(input_ids=PROMPTS[:2], sampling_params=greedy)
    assert len(claimed) >= 6 and logged == claimed


def test_pages_of_four_tokens(tiny_llama, monkeypatch):
    """With --page-size 4 the extra row of a request that ended sits at each offset of a page: 0 (a page of its own,
    given back whole) to 3 (the last slot of a page the request keeps). Each request stops at a token first seen
    there, and gets the plain scheduler's output; every slot is accounted for."""
    engines = [
        kiln.Engine(model_path=tiny_llama, page_size=4, enable_overlap_schedule=on, **ARGS)
        for on in (False, True)
    ]
    try:
        free = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
        ran = [o["output_ids"] for o in engines[0].generate(input_ids=PROMPTS, sampling_params=[free] * 4)]

        def first_seen(i: int, offset: int) -> int | None:
            """An output index whose token first appears there and whose extra row (the token's KV, at position
            len(prompt) + index) sits at `offset` in its page; the first token, sampled by the prefill, has none."""
            ids = ran[i]
            fits = [s for s in range(1, 12) if (len(PROMPTS[i]) + s) % 4 == offset and ids[s] not in ids[:s]]
            return fits[0] if fits else None

        order = next(
            o for o in itertools.permutations(range(4)) if all(first_seen(i, o[i]) for i in range(4))
        )
        ends = [first_seen(i, order[i]) for i in range(4)]
        stops = [{**free, "stop_token_ids": [ran[i][s]], "ignore_eos": False} for i, s in enumerate(ends)]
        dropped = extra_rows(monkeypatch)
        got = outputs(engines[1], stops)
        assert got == outputs(engines[0], stops)
        assert [len(ids) for ids, _, _ in got] == [s + 1 for s in ends] and len(dropped) == 4
    finally:
        for engine in engines:
            engine.shutdown()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_as_the_plain_scheduler(engines, seed, monkeypatch):
    """Seeded random traffic: requests arriving at random steps with random prompts and lengths, greedy or seeded
    sampling, half of them stopped by a token of their own output (seen a step late), some aborted later. Every
    request that was not aborted gets the plain scheduler's tokens and finish (a request's tokens do not depend
    on its batch); the aborted ones end as aborts or as they would have; no slot is lost."""
    plain, overlap = engines
    rng = random.Random(seed)
    reqs: list[tuple[int, GenerateReq]] = []
    for i in range(10):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 40))]
        kw = {"max_new_tokens": rng.randrange(1, 16), "ignore_eos": True, "temperature": 0}
        if rng.random() < 0.4:
            kw.update(temperature=0.8, seed=rng.randrange(1000))
        if rng.random() < 0.5:  # a token this request will produce stops it
            tokens = plain.generate(input_ids=prompt, sampling_params=kw)["output_ids"]
            kw.update(stop_token_ids=[rng.choice(tokens)], ignore_eos=False)
        reqs.append((rng.randrange(0, 30), GenerateReq(f"r{i}", prompt, SamplingParams(**kw).normalize())))
    aborted = {req.rid: step + rng.randrange(1, 6) for step, req in reqs if rng.random() < 0.2}

    def run(engine) -> dict[str, list]:
        sched, out = engine.scheduler, {}
        for k in range(400):
            for step, req in reqs:
                if step == k:
                    sched.add_request(GenerateReq(req.rid, list(req.input_ids), req.params))
            for rid, at in aborted.items():
                if at == k:
                    sched.abort(AbortReq(rid))
            for o in sched.step():
                out.setdefault(o.rid, []).extend(o.new_ids)
                if o.finished:
                    out[o.rid].append(o.finish_reason["type"])
            if k > 40 and not sched.has_work:
                break
        assert engine.check_integrity()["ok"]
        return out

    want = run(plain)
    counted = launches(monkeypatch)
    got = run(overlap)
    assert counted and set(got) == set(want) == {f"r{i}" for i in range(10)}
    assert any(w[-1] == "stop" for w in want.values())
    for rid in want:
        if rid in aborted:  # cut wherever the abort found it: its tokens so far are the plain run's
            assert got[rid][-1] in ("abort", want[rid][-1]), (rid, got[rid], want[rid])
            assert got[rid][:-1] == [t for t in want[rid] if isinstance(t, int)][: len(got[rid]) - 1]
        else:
            assert got[rid] == want[rid], rid


def test_only_requests_with_a_cached_prefix_in_common_share_kv(engines):
    """shares_prefix (a decode batch's `shared_kv`, which spares a GPU's attention its search for shared slots) from
    the radix tree alone: true once a request extends another's cached prompt, false for unrelated ones."""
    from kiln.scheduler.batch import shares_prefix

    plain, _ = engines
    sched = plain.scheduler
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True).normalize()
    sched.add_request(GenerateReq("a", PROMPTS[2], params))
    sched.add_request(GenerateReq("b", PROMPTS[0], params))
    steps_until(sched, lambda: len(sched.running) == 2)
    assert not shares_prefix(sched.running)
    sched.add_request(GenerateReq("c", PROMPTS[2][:20] + [7, 7], params))
    steps_until(sched, lambda: len(sched.running) == 3)
    c = next(r for r in sched.running if r.rid == "c")
    assert c.cached_len > 0 and shares_prefix(sched.running)
    assert not shares_prefix([r for r in sched.running if r.rid != "a"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_an_overlapped_step_waits_for_nothing_on_the_gpu(tiny_llama, graphs):
    """Everything the overlap schedule does for a step before its tokens are taken synchronizes nothing with the
    GPU (torch's sync check set to raise): slot allocation and the step's tensors on the scheduler's thread (pages
    of one token), then on the forward thread the input ids taken from the step before's ids on the device, the
    forward (the default attention backend, unrelated requests; eager and graph replay) and the sampling launch."""
    from concurrent.futures import Future

    from kiln.scheduler.batch import build_decode
    from kiln.scheduler.overlap import InFlight, plain_rows

    engine = kiln.Engine(
        model_path=tiny_llama, device="cuda", disable_cuda_graph=not graphs, cuda_graph_max_bs=8,
        max_total_tokens=2048,
    )  # fmt: skip
    sched = engine.scheduler
    assert sched.forward_thread is not None  # overlap is CUDA's default

    def launch(reqs, after):
        torch.cuda.set_sync_debug_mode("error")
        try:
            slots = sched.kv.alloc_decode(reqs)
            fb = build_decode(reqs, sched.kv.table, slots)
            for r in reqs:  # the slots are the requests' now: released with them
                r.kv_len += 1
            source = list(range(len(reqs))) if after is not None else None
            return fb, sched.forward_thread._run(fb, plain_rows(reqs), after, source)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    try:
        params = SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True).normalize()
        for i, prompt in enumerate(PROMPTS):
            sched.add_request(GenerateReq(f"s{i}", prompt, params))
        steps_until(sched, lambda: len(sched.running) == len(PROMPTS) and not sched.waiting)
        sched.drain()
        reqs = list(sched.running)
        fb, first = launch(reqs, None)
        assert fb.kv_mask is not None and fb.kv_table.is_cuda and not fb.shared_kv
        rows = torch.tensor([r.table_idx for r in reqs])
        assert torch.equal(
            fb.out_cache_loc, sched.kv.table.req_to_token[rows, torch.tensor([r.kv_len - 1 for r in reqs])]
        )
        done = Future()
        done.set_result(first)
        _, second = launch(reqs, InFlight(reqs, done))
        assert second.graphed == graphs
        for step in (first, second):
            ids = step.sampled.result().next_token_ids
            assert len(ids) == len(reqs) and all(0 <= t < sched.runner.model_config.vocab_size for t in ids)
    finally:
        sched.abort(AbortReq(abort_all=True))
        while sched.has_work:
            sched.step()
        assert engine.check_integrity()["ok"]
        engine.shutdown()
