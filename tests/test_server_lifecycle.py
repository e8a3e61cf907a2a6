"""Request and server lifecycle on a real `kiln serve`: client disconnects abort and free their KV, /health is
503 until the warm-up has been served, concurrent streams match sequential greedy runs, and the pool ends
where it started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from conftest import ServerProcess, children_left

pytestmark = pytest.mark.server

LONG = 3000  # new tokens no test waits for: seconds of decoding on this machine


def info(url: str) -> dict:
    r = httpx.get(f"{url}/get_server_info", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(url: str, timeout: float = 20.0) -> dict:
    """Polls until nothing runs or waits and no request holds private KV; returns the last info."""
    deadline = time.time() + timeout
    while True:
        data = info(url)
        idle = data["num_running_reqs"] == 0 and data["num_waiting_reqs"] == 0
        if idle and data["integrity"]["in_use"] == 0 or time.time() > deadline:
            return data
        time.sleep(0.2)


def wait_running(url: str, timeout: float = 30.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if info(url)["num_running_reqs"] >= 1:
            return True
        time.sleep(0.1)
    return False


def abort_leftovers(url: str) -> None:
    """Cleanup after a disconnect scenario, so that a request the server failed to abort cannot slow the rest."""
    httpx.post(f"{url}/abort_request", json={"abort_all": True}, timeout=30)
    wait_idle(url)


def assert_freed(url: str, aborted_before: int) -> None:
    data = wait_idle(url)
    assert data["num_running_reqs"] == 0 and data["num_waiting_reqs"] == 0, data
    assert data["integrity"]["ok"] is True, data["integrity"]
    assert data["integrity"]["in_use"] == 0, data["integrity"]
    assert data["stats"]["aborted"] >= aborted_before + 1, data["stats"]


@pytest.fixture(scope="module")
def baseline(server) -> dict:
    """The pool with nothing cached and nothing running, taken before this module's scenarios."""
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
    return info(server.url)["integrity"]


def test_baseline_is_an_empty_pool(baseline):
    assert baseline["ok"] and baseline["in_use"] == 0 and baseline["cached"] == 0
    assert baseline["free"] == baseline["total"]


# ---------------------------------------------------------------------------------------------- disconnects
def test_stream_disconnect_aborts_and_frees_kv(server, client, model, baseline):
    before = info(server.url)["stats"]["aborted"]
    stream = client.completions.create(
        model=model,
        prompt="Count slowly from one to a million: one, two, three,",
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        got = 0
        for chunk in stream:
            got += bool(chunk.choices and chunk.choices[0].text)
            if got >= 3:
                break
        running = info(server.url)
        stream.close()
        assert got == 3
        assert (
            running["num_running_reqs"] == 1 and running["integrity"]["in_use"] > 0
        )  # it was really running
        assert_freed(server.url, before)
    finally:
        abort_leftovers(server.url)


def test_non_stream_disconnect_aborts_and_frees_kv(server, model, baseline):
    before = info(server.url)["stats"]["aborted"]
    body = {
        "model": model,
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": LONG,
        "ignore_eos": True,
        "temperature": 0,
    }
    outcome: dict = {}

    def impatient_client() -> None:
        try:
            outcome["resp"] = httpx.post(
                f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(6.0)
            )
        except httpx.TimeoutException as e:
            outcome["timeout"] = e

    t = threading.Thread(target=impatient_client)
    t.start()
    try:
        assert wait_running(server.url), "the long request never started"
        t.join(30)
        assert not t.is_alive() and "timeout" in outcome, outcome
        assert_freed(server.url, before)
    finally:
        t.join(30)
        abort_leftovers(server.url)


# ---------------------------------------------------------------------------------------------- concurrency
PROMPTS = [
    f"Question {i}: name a fruit that is {c}. Answer:"
    for i, c in enumerate(["red", "yellow", "green", "orange", "purple", "blue", "brown", "pink"])
]


def test_concurrent_streams_match_sequential(server, client, model):
    def stream_one(prompt: str) -> tuple[str, str]:
        barrier.wait(30)
        text, finish = "", None
        for chunk in client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    sequential = [
        client.completions.create(
            model=model, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in PROMPTS
    ]
    barrier = threading.Barrier(len(PROMPTS))
    peak, done = 0, threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, info(server.url)["num_running_reqs"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(stream_one, PROMPTS))
    finally:
        done.set()
        watcher.join(30)
    assert [r[0] for r in results] == sequential
    assert all(r[1] == "length" for r in results)
    assert peak >= 2, "the streams never ran in one batch"
    data = wait_idle(server.url)
    assert data["integrity"]["ok"] and data["integrity"]["in_use"] == 0


# ---------------------------------------------------------------------------------------------- startup probes
def test_health_is_503_until_warmed_up(tiny_llama, tmp_path):
    tmp = tmp_path / "tmp"  # the server's temporary folder: its sockets' folder is removed when it stops
    tmp.mkdir()
    srv = ServerProcess(
        ["--model-path", tiny_llama, "--max-total-tokens", "1024", "--context-length", "1024"],
        tmp_path / "serve.log",
        {"TMPDIR": str(tmp)},
    )
    seen: list[tuple[int, str | None]] = []
    early_request: httpx.Response | None = None
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            assert srv.proc.poll() is None, srv.log_text()[-3000:]
            try:
                health = httpx.get(f"{srv.url}/health", timeout=5)
                phase = httpx.get(f"{srv.url}/status", timeout=5).json()["phase"]
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            seen.append(
                (health.status_code, health.json().get("phase") if health.status_code == 503 else phase)
            )
            if health.status_code == 200:
                break
            if early_request is None and phase in ("launching", "loading_weights"):
                early_request = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi"}, timeout=30)
            time.sleep(0.05)
        assert seen and seen[-1][0] == 200, seen[-5:]
        not_ready = [p for code, p in seen if code == 503]
        assert not_ready, "never saw /health answer 503 before it was ready"
        assert all(p not in (None, "ready", "failed") for p in not_ready), not_ready
        assert all(code == 503 for code, _ in seen[:-1])  # 200 only once ready, never before
        status = httpx.get(f"{srv.url}/status", timeout=5).json()
        assert status["phase"] == "ready" and "warming_up" in status["timings"]  # went through the warm-up
        assert "The server is fired up and ready to roll!" in srv.log_text()
        if early_request is not None:
            assert early_request.status_code == 503, early_request.text
            assert early_request.json()["error"]["type"] == "unavailable"
        ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert [p.name for p in tmp.glob("kiln-*")], "the server made its sockets' folder elsewhere"
    finally:
        code = srv.stop()
    assert code == 0 and not list(tmp.glob("kiln-*")), f"exit {code}; the sockets' folder must be gone"


# ---------------------------------------------------------------------------------------------- at the end
def test_pool_back_at_baseline(server, baseline):
    data = wait_idle(server.url)
    assert data["integrity"]["ok"] and data["integrity"]["in_use"] == 0
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
    after = info(server.url)["integrity"]
    assert after == baseline


def test_a_signal_during_startup_stops_it_cleanly(tiny_llama, tmp_path):
    """SIGTERM while the model loads: nothing to drain, so the server stops at once and exits 0, its engine
    process reaped, without uvicorn re-raising the signal (exit 143) or leaked-semaphore warnings."""
    # the engine stalls as it enters loading_weights: the signal finds startup there, whatever the machine's speed
    srv = ServerProcess(
        ["--model-path", tiny_llama, "--max-total-tokens", "1024"],
        tmp_path / "serve.log",
        env={"KILN_FAULT": "stall:loading_weights"},
    )
    try:
        deadline = time.time() + 120
        phase = None
        while time.time() < deadline and srv.proc.poll() is None and phase != "loading_weights":
            try:
                phase = httpx.get(f"{srv.url}/status", timeout=5).json()["phase"]
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        assert phase == "loading_weights", srv.log_text()[-3000:]
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        os.kill(srv.proc.pid, signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.log_text()[-3000:]
        log = srv.log_text()
        assert "Shutting down during startup" in log and "Kiln stopped" in log, log[-3000:]
        assert "Traceback" not in log and "leaked" not in log, log[-3000:]
        left = children_left(children)
        assert not left, left
    finally:
        srv.stop()


def test_a_port_in_use_is_one_line_before_the_engine_starts(tiny_llama, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "kiln.cli", "serve", "--model-path", tiny_llama, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out and "--port" in out, out
    assert "Traceback" not in out and "Load weight" not in out, out


def test_a_pool_too_small_for_the_warm_up_names_the_flag_to_raise(tiny_llama, tmp_path):
    """The warm-up request does not fit a tiny --max-total-tokens: the operator is told the minimum to start
    with, not a client's max_tokens advice."""
    srv = ServerProcess(["--model-path", tiny_llama, "--max-total-tokens", "8"], tmp_path / "serve.log")
    try:
        assert srv.proc.wait(300) == 1
        log = srv.log_text()
        assert "the KV pool holds 8 tokens, fewer than the warm-up request needs" in log, log[-3000:]
        assert "start with --max-total-tokens" in log and "max_tokens <=" not in log, log[-3000:]
    finally:
        srv.stop()
