"""Nothing a client does hurts a real `kiln serve`: aborted streams free their KV without disturbing the others,
overload gives 429 with Retry-After, --request-timeout ends long requests, --api-key guards all but the probes,
SIGTERM drains and exits 0, and schemathesis plus hypothesis-generated bad requests never get a 5xx.

Three servers (default model, small pools) start at once in one module fixture."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from conftest import ServerProcess, assert_pool_at_baseline, children_left
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

KEY = "kiln-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# exact: survivors are compared token for token with the prompt decoded alone, which float32 arithmetic keeps; with
# activations rounded to int8 (auto) a batch's attention paths can move a value across a rounding step
BASE = ["--max-total-tokens", "8192", "--chunked-prefill-size", "512", "--cpu-gemm", "exact"]
CMPL, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("robustness")
    srvs = {
        "main": ServerProcess([*BASE, "--max-running-requests", "32"], d / "main.log"),
        "limited": ServerProcess(
            [*BASE, "--max-running-requests", "2", "--max-queued-requests", "2", "--api-key", KEY]
            + ["--shutdown-timeout", "3"],
            d / "limited.log",
        ),
        "timed": ServerProcess(
            [*BASE, "--max-running-requests", "4", "--request-timeout", "1"], d / "timed.log"
        ),
    }
    try:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda s: s.wait_ready(timeout=300), srvs.values()))
        yield srvs
    finally:
        for s in srvs.values():
            s.stop()


def info(url: str, headers: dict | None = None) -> dict:
    return httpx.get(f"{url}/get_server_info", headers=headers, timeout=30).json()


def alive(url: str, headers: dict | None = None) -> None:
    r = httpx.post(f"{url}{CMPL}", json={"prompt": "Hi", "max_tokens": 1}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text


def read_sse(resp: httpx.Response, stop_after: int | None = None) -> tuple[list[dict], bool]:
    """The JSON chunks of an SSE stream and whether [DONE] came; stops early after `stop_after` text chunks."""
    chunks, texts = [], 0
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return chunks, True
        chunks.append(json.loads(line[6:]))
        texts += bool(chunks[-1].get("choices") and chunks[-1]["choices"][0].get("text"))
        if stop_after is not None and texts >= stop_after:
            break
    return chunks, False


# ---------------------------------------------------------------------------------------------- aborts
PROMPTS = ["The capital of France is", "Two plus two equals", "My favourite colour is", "Once upon a time"]


def test_half_of_32_streams_killed_survivors_unchanged(servers):
    url = servers["main"].url
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    alone = {p: httpx.post(f"{url}{CMPL}", json={**body, "prompt": p}, timeout=120).json() for p in PROMPTS}
    alone = {p: r["choices"][0]["text"] for p, r in alone.items()}
    aborted_before = info(url)["stats"]["aborted"]
    barrier = threading.Barrier(32)

    def client(i: int) -> tuple[str, str | None, bool]:
        killed = i % 2 == 1
        req = {**body, "prompt": PROMPTS[i % 4], "stream": True, "max_tokens": 400 if killed else 8}
        barrier.wait(60)
        with httpx.stream("POST", f"{url}{CMPL}", json=req, timeout=180) as resp:
            assert resp.status_code == 200
            chunks, done = read_sse(resp, stop_after=2 if killed else None)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        finish = next(
            (c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]), None
        )
        return text, finish, done

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(client, range(32)))
    for i, (text, finish, done) in enumerate(results):
        if i % 2 == 0:
            assert done and finish == "length", (i, results[i])
            assert text == alone[PROMPTS[i % 4]], (i, text, alone[PROMPTS[i % 4]])
        else:
            assert not done and finish is None, (i, results[i])  # really cut mid-flight
    integ = assert_pool_at_baseline(url)
    assert integ["in_use"] == 0
    assert info(url)["stats"]["aborted"] - aborted_before == 16


# ---------------------------------------------------------------------------------------------- overload
def test_overload_gives_429_with_retry_after_and_accepted_ones_complete(servers):
    url = servers["limited"].url
    barrier = threading.Barrier(16)  # 4x the capacity (2 running + 2 queued)

    def one(_: int) -> httpx.Response:
        barrier.wait(60)
        body = {"prompt": "Count: one, two,", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        return httpx.post(f"{url}{CMPL}", json=body, headers=AUTH, timeout=120)

    t0 = time.time()
    with ThreadPoolExecutor(16) as pool:
        resps = list(pool.map(one, range(16)))
    assert time.time() - t0 < 120
    codes = [r.status_code for r in resps]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= 2, codes
    for r in resps:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
        else:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 4
    assert_pool_at_baseline_auth(url)


def assert_pool_at_baseline_auth(url: str) -> None:
    deadline = time.time() + 20
    while True:
        data = info(url, AUTH)
        idle = data["num_running_reqs"] == 0 and data["num_waiting_reqs"] == 0
        if idle and data["integrity"]["in_use"] == 0 or time.time() > deadline:
            break
        time.sleep(0.25)
    assert data["integrity"]["ok"] and idle and data["integrity"]["in_use"] == 0, data


def test_api_key_guards_everything_but_probes_and_metrics(servers):
    url = servers["limited"].url
    for path in ("/live", "/ready", "/health", "/metrics", "/status"):
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 200, path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        r = httpx.post(f"{url}{CMPL}", json={"prompt": "Hi", "max_tokens": 1}, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert httpx.get(f"{url}/get_server_info", headers=headers, timeout=30).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30).status_code == 200
    alive(url, AUTH)


def test_request_timeout_aborts_long_generation_with_a_reason(servers):
    url = servers["timed"].url
    t0 = time.time()
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{url}{CMPL}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "abort", r.json()
    assert r.json()["usage"]["completion_tokens"] < 2000
    gen = {"text": "Tell me a long story.", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    meta = httpx.post(f"{url}{GEN}", json=gen, timeout=120).json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta
    assert "timed out" in json.dumps(meta["finish_reason"]), meta
    assert time.time() - t0 < 60
    assert_pool_at_baseline(url)


# ---------------------------------------------------------------------------------------------- schemathesis
def test_openapi_operations_never_5xx(servers):
    """Every operation of Kiln's own /openapi.json, fuzzed by schemathesis: valid bodies (every declared field
    within its bounds) and invalid ones (each field out of its type or bounds). Against the server with
    --request-timeout 1, so that a valid body asking for thousands of tokens ends within a second."""
    schemathesis = pytest.importorskip("schemathesis")  # in the test extras
    from schemathesis.generation import GenerationMode

    url = servers["timed"].url
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {CMPL, CHAT, GEN, "/health", "/abort_request"}
    bodies = {op.path for op in ops if op.body}
    assert bodies >= {CMPL, CHAT, GEN, "/abort_request"}, bodies  # the spec declares what the routes read
    failures = []
    for op in ops:
        # a route without a body has nothing to get wrong (negative generation is unsatisfiable there)
        for mode in GenerationMode if op.path in bodies else [GenerationMode.POSITIVE]:
            examples = 20 if op.path in bodies else 3

            @settings(
                max_examples=examples,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.generate],
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case) -> None:
                resp = case.call(base_url=url, timeout=60)
                if resp.status_code >= 500 or (resp.status_code >= 400 and "error" not in resp.json()):
                    failures.append(
                        f"{case.method} {case.path} body={case.body!r}: {resp.status_code} {resp.text[:200]}"
                    )

            run()
    assert not failures, "\n".join(sorted(set(failures)))


def test_server_alive_after_schemathesis(servers):
    alive(servers["timed"].url)
    assert_pool_at_baseline(servers["timed"].url)


# ---------------------------------------------------------------------------------------------- fuzzing
BAD_NUMBER = st.sampled_from([-1, -1e9, 1e308, float("nan"), float("inf"), "1", None, [1], {"a": 1}, True])
HUGE_TOKENS = st.sampled_from([-1, -(2**63), 10**6, 2**31, 2**63, 10**30, 1.5, "16", None, float("nan")])
ODD_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
BAD_IDS = st.lists(st.sampled_from([-1, 49152, 2**31, 2**64, 1.5, "7", None]), min_size=1, max_size=4)
LOGIT_BIAS = st.one_of(
    st.dictionaries(
        st.sampled_from(["abc", "-5", "49152", "1e3", "", "10"]), BAD_NUMBER, min_size=1, max_size=3
    ),
    st.sampled_from([[1, 2], "x", 5]),
)
STOP = st.one_of(st.lists(ODD_TEXT, max_size=6), st.lists(st.integers(), min_size=1, max_size=3), ODD_TEXT)
SAMPLING = {
    "temperature": BAD_NUMBER,
    "top_p": BAD_NUMBER,
    "top_k": st.sampled_from([0, -5, 10**20, 2.5, "3"]),
    "min_p": BAD_NUMBER,
    "presence_penalty": BAD_NUMBER,
    "frequency_penalty": BAD_NUMBER,
    "repetition_penalty": BAD_NUMBER,
    "n": st.sampled_from([0, -1, 129, 10**6, "2", None, 1.5]),
    "seed": st.sampled_from([-1, 2**64, 1.5, "x", None, [1]]),
    "logit_bias": LOGIT_BIAS,
    "stop": STOP,
    "stop_token_ids": BAD_IDS,
    "min_tokens": st.sampled_from([-1, 10**6, "2"]),
}
PROMPT = st.one_of(
    st.just(""), st.just([]), st.just([[]]), ODD_TEXT, BAD_IDS, st.just([42] * 9000), st.integers(), st.none()
)


@st.composite
def bad_request(draw) -> tuple[str, dict]:
    """A small valid body of one of the three endpoints with a few fields replaced by odd or bad values."""
    path = draw(st.sampled_from([CMPL, CHAT, GEN]))
    mutate = draw(
        st.lists(st.sampled_from([*SAMPLING, "prompt", "max_tokens", "unknown"]), max_size=3, unique=True)
    )
    sp = {"max_tokens": draw(st.integers(1, 3)), "temperature": 0}
    for k in mutate:
        if k in SAMPLING:
            sp[k] = draw(SAMPLING[k])
        elif k == "max_tokens":
            sp[k] = draw(HUGE_TOKENS)
        elif k == "unknown":
            sp[draw(st.sampled_from(["foo", "best_of_n", "echo", "suffix"]))] = draw(BAD_NUMBER)
    prompt = draw(PROMPT) if "prompt" in mutate else draw(st.sampled_from(["Hi", [1, 2, 3]]))
    stream = draw(st.booleans())
    if path == CMPL:
        return path, {"prompt": prompt, "stream": stream, **sp}
    if path == CHAT:
        content = prompt if isinstance(prompt, str) or "prompt" in mutate else "Hi"
        role = draw(st.sampled_from(["user", "user", "system", "robot", 5]))
        return path, {"messages": [{"role": role, "content": content}], "stream": stream, **sp}
    sp["max_new_tokens"] = sp.pop("max_tokens")
    key = "text" if isinstance(prompt, str) or prompt is None else "input_ids"
    return path, {key: prompt, "sampling_params": sp, "stream": stream}


def check_response(url: str, path: str, body: dict) -> None:
    raw = json.dumps(body)  # NaN and Infinity stay literal, as a careless client would send them
    headers = {"content-type": "application/json"}
    with httpx.stream("POST", url + path, content=raw, headers=headers, timeout=120) as r:
        if r.status_code == 200 and body.get("stream"):
            _, done = read_sse(r)
            assert done, f"stream ended without [DONE]: {raw[:300]}"
            return
        r.read()
    assert r.status_code < 500, f"{path} {raw[:300]} -> {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"], (raw[:300], err)
        assert r.status_code != 400 or err["param"], f"400 without a param: {raw[:300]} -> {err}"


@settings(
    max_examples=60,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a dead server fails every later example
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
)
@given(req=bad_request())
def test_malformed_and_extreme_requests_never_5xx(servers, req):
    check_response(servers["main"].url, *req)


def test_main_server_alive_and_at_baseline_after_fuzzing(servers):
    alive(servers["main"].url)
    assert_pool_at_baseline(servers["main"].url)


# Requests found to give a 5xx or to kill the engine; the last two take the whole server down.
REGRESSIONS = {
    "surrogate-prompt": (CMPL, {"prompt": "\udcff", "max_tokens": 1}, "prompt"),
    "generate-temperature-null": (
        GEN,
        {"text": "Hi", "sampling_params": {"temperature": None}},
        "temperature",
    ),
    "generate-logit-bias-key": (
        GEN,
        {"text": "Hi", "sampling_params": {"logit_bias": {"abc": 1}}},
        "logit_bias",
    ),
    "generate-stop-int": (GEN, {"text": "Hi", "sampling_params": {"stop": 5}}, "stop"),
    "generate-empty-input-ids": (GEN, {"input_ids": []}, ("prompt", "input_ids")),
    "abort-request-malformed-json": ("/abort_request", "{not json", "body"),
    "completions-seed-past-int64": (CMPL, {"prompt": "Hi", "max_tokens": 1, "seed": 2**70}, "seed"),
    "generate-seed-string": (GEN, {"text": "Hi", "sampling_params": {"seed": "x"}}, "seed"),
}


@pytest.mark.parametrize("case", list(REGRESSIONS))
def test_regression_requests_get_400_and_server_survives(servers, case):
    url = servers["main"].url
    if servers["main"].proc.poll() is not None:
        pytest.fail(
            f"the server is already down (exit {servers['main'].proc.returncode}) from an earlier request"
        )
    path, body, params = REGRESSIONS[case]
    raw = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    time.sleep(0.5)  # an engine that dies on this request dies within a step
    assert r.status_code == 400, f"{r.status_code} {r.text[:300]}"
    # the parameter is named: alone, or as its path inside the body (e.g. sampling_params.seed)
    named = r.json()["error"]["param"]
    wanted = (params,) if isinstance(params, str) else params
    assert named in wanted or any(named.startswith(f"sampling_params.{p}") for p in wanted), r.text
    alive(url)


def test_client_rid_is_honoured_or_refused(servers):
    """`rid` is accepted in the bodies; it must name the request (so /abort_request can use it), not be ignored."""
    url = servers["timed"].url
    body = {"text": "Hi", "rid": "kiln-test-rid-1", "sampling_params": {"max_new_tokens": 1}}
    r = httpx.post(f"{url}{GEN}", json=body, timeout=60)
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "rid"
    else:
        assert r.json()["meta_info"]["id"] == "kiln-test-rid-1", r.json()["meta_info"]


# ---------------------------------------------------------------------------------------------- shutdown
def test_sigterm_under_load_drains_aborts_and_exits_0(servers):
    srv = servers["limited"]
    url = srv.url
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    assert children
    results: list = [None] * 3
    first = [threading.Event() for _ in range(3)]

    def stream(i: int) -> None:
        body = {"prompt": f"Story {i}:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}{CMPL}", json=body, headers=AUTH, timeout=120) as r:
            lines = r.iter_lines()
            head = next(line for line in lines if line.startswith("data: "))
            first[i].set()
            results[i] = read_sse(_Chain(head, lines))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.time() + 120
    while sum(e.is_set() for e in first) < 2 and time.time() < deadline:  # 2 run, 1 waits (--max-running 2)
        time.sleep(0.1)
    assert sum(e.is_set() for e in first) >= 2, "the streams never started"
    # the third request must be in the engine's queue before the signal (on a slow host its POST can come after it,
    # and be refused with a 503 instead of being drained)
    while time.time() < deadline:
        data = info(url, AUTH)
        if data["num_running_reqs"] + data["num_waiting_reqs"] >= 3:
            break
        time.sleep(0.1)
    os.kill(srv.proc.pid, signal.SIGTERM)
    time.sleep(0.3)
    try:
        r = httpx.post(f"{url}{CMPL}", json={"prompt": "Hi", "max_tokens": 1}, headers=AUTH, timeout=10)
        assert r.status_code == 503, r.text
    except httpx.TransportError:
        pass  # already closed: connection refused is fine
    for t in threads:
        t.join(60)
    assert srv.proc.wait(60) == 0, srv.log_text()[-3000:]
    assert all(r is not None for r in results), results
    for chunks, done in results:
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        assert finish in ("length", "abort"), chunks[-1]
        assert done
    assert any(c["choices"][0]["finish_reason"] == "abort" for res in results for c in res[0] if c["choices"])
    left = children_left(children)
    assert not left, f"children left after shutdown: {left}"


class _Chain:
    """A response-like object whose iter_lines() yields one already-read line, then the rest."""

    def __init__(self, first: str, rest):
        self.first, self.rest = first, rest

    def iter_lines(self):
        yield self.first
        yield from self.rest


def test_a_second_signal_ends_the_drain_at_once(servers):
    """SIGTERM drains (/status says shutting_down); a second signal (SIGINT, an operator's Ctrl-C) aborts what is
    still running at once: the stream still ends with its abort chunk and [DONE], and the exit is a clean 0, not
    uvicorn's forced one (exit 130, cancelled streams, tracebacks)."""
    srv = servers["main"]  # --shutdown-timeout 30: a long stream outlasts it unless the second signal cuts it
    result: list = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "A long story:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}{CMPL}", json=body, timeout=120) as r:
            lines = r.iter_lines()
            head = next(line for line in lines if line.startswith("data: "))
            started.set()
            result.append(read_sse(_Chain(head, lines)))

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(120), "the stream never started"
    os.kill(srv.proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert httpx.get(f"{srv.url}/status", timeout=10).json()["phase"] == "shutting_down"
    t0 = time.time()
    os.kill(srv.proc.pid, signal.SIGINT)
    thread.join(60)
    assert srv.proc.wait(60) == 0, srv.log_text()[-3000:]
    assert time.time() - t0 < 15, "the second signal did not end the drain"
    (chunks, done), log = result[0], srv.log_text()
    assert done and [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "abort"
    assert "Traceback" not in log and "Kiln stopped" in log, log[-3000:]
