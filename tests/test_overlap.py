"""The overlap scheduler (kiln.scheduler.overlap): decode steps launched one ahead on the forward thread give the
plain scheduler's tokens, logprobs and finishes, request for request, whether requests end by length, by a stop
token the host only sees a step late, by abort, or arrive while others decode; the extra row of a request that
ended leaves no slot behind, and a step that fails fails its requests and no others."""

from __future__ import annotations

import pytest

import kiln
from kiln.sampling_params import SamplingParams
from kiln.scheduler.io import AbortReq, GenerateReq
from kiln.scheduler.overlap import ForwardThread

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
    finish, the extra row dropped (the integrity check counts every slot), its prefix cached as after a plain
    finish (the same prompt again hits the same cached tokens)."""
    plain, overlap = engines
    free = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    ran = plain.generate(input_ids=PROMPTS, sampling_params=[free] * len(PROMPTS))
    stops = [{**free, "stop_token_ids": [o["output_ids"][4]], "ignore_eos": False} for o in ran]
    want = outputs(plain, stops)
    assert all(reason["type"] == "stop" for _, reason, _ in want)
    counted = launches(monkeypatch)
    assert outputs(overlap, stops) == want
    assert counted
    again = [{**s, "max_new_tokens": 1} for s in stops]
    cached = [
        o["meta_info"]["cached_tokens"] for o in plain.generate(input_ids=PROMPTS, sampling_params=again)
    ]
    assert [
        o["meta_info"]["cached_tokens"] for o in overlap.generate(input_ids=PROMPTS, sampling_params=again)
    ] == cached


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
    plain, overlap = engines
    runner, calls = overlap.scheduler.runner, []
    forward = runner.forward

    def failing(fb):
        calls.append(fb.input_ids.shape[0])
        if len(calls) == 4:
            raise RuntimeError("injected forward failure")
        return forward(fb)

    monkeypatch.setattr(runner, "forward", failing)
    greedy = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    got = overlap.generate(input_ids=PROMPTS[:2], sampling_params=greedy)
    assert all("injected forward failure" in o["meta_info"]["error"] for o in got)
    assert overlap.check_integrity()["ok"]
    monkeypatch.setattr(runner, "forward", forward)
    assert outputs(overlap, [greedy] * 2, PROMPTS[:2]) == outputs(plain, [greedy] * 2, PROMPTS[:2])
