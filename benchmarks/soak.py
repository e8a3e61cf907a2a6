"""Soak test (`make soak`, not in CI): mixed valid, invalid, abandoned and hostile traffic (one request in ten:
bodies not UTF-8, nested without end, beyond the size limit or sent too slowly, prompts far beyond the context,
batches that can never be admitted, idle connections, random bytes) against a `kiln serve` it starts.

Passes when no request got a 5xx or lost its connection, the server stayed up, the engine's RSS after warm-up
stayed within --rss-tolerance, the KV pool is back at baseline at the end, and the log holds no traceback.
Prints a summary; exit 0 / 1.

    python benchmarks/soak.py --minutes 1
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

CMPL, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
PROMPTS = ["The capital of France is", "Write a haiku about rain.", "List three colours:", "def fib(n):"]
INVALID = [
    (CMPL, {"prompt": "", "max_tokens": 4}),
    (CMPL, {"prompt": "Hi", "max_tokens": 10**9}),
    (CMPL, {"prompt": "Hi", "temperature": -1}),
    (CMPL, {"prompt": "Hi", "logit_bias": {"abc": 1}}),
    (CMPL, {"prompt": [10**7], "max_tokens": 1}),
    (CMPL, {"prompt": "Hi", "unknown_field": 1}),
    (CHAT, {"messages": []}),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "top_p": 0}),
    (GEN, {"text": "Hi", "sampling_params": {"foo": 1}}),
    (GEN, {"input_ids": [-1]}),
]


# The soak server's limits, so that hostile requests meet them within seconds.
READ_TIMEOUT = 5
BODY_LIMIT = 2_000_000
SERVE_LIMITS = ["--max-running-requests", "16", "--max-queued-requests", "16"]
SERVE_LIMITS += ["--request-read-timeout", str(READ_TIMEOUT), "--max-request-bytes", str(BODY_LIMIT)]
HOSTILE_BODIES = [
    (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    (GEN, b"[" * 100_000 + b"]" * 100_000),
    (CMPL, b'{"prompt": "Hi", "max_tokens": ' + b"9" * 10_000 + b"}"),
    (CMPL, b'{"prompt": "Hi",,'),
    (GEN, json.dumps({"text": [f"text {i}" for i in range(300)]}).encode()),
    (CMPL, json.dumps({"prompt": "a" * 1_000_000, "max_tokens": 1}).encode()),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Soak:
    def __init__(self, url: str, seconds: float, workers: int, seed: int):
        self.url, self.seconds, self.workers = url, seconds, workers
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.statuses: Counter = Counter()  # every HTTP answer by class: 5xx must stay 0
        self.failures: list[str] = []
        self.stop_at = 0.0

    def hostile(self, http: httpx.Client, rng: random.Random) -> None:
        kind = rng.choice(["body", "body", "random_bytes", "too_large", "slow_body", "idle"])
        if kind == "body":
            path, raw = rng.choice(HOSTILE_BODIES)
        elif kind == "random_bytes":
            path, raw = rng.choice([CMPL, CHAT, GEN, "/abort_request"]), rng.randbytes(rng.randint(0, 300))
        else:
            self.note(f"hostile_{kind}", *self.hostile_socket(kind))
            return
        r = http.post(self.url + path, content=raw, headers={"content-type": "application/json"})
        ok = 400 <= r.status_code < 500 and "error" in r.json()
        self.note(
            f"hostile_{kind}", "ok" if ok else "FAIL", f"{path} {raw[:100]!r} -> {r.status_code} {r.text}"
        )

    def hostile_socket(self, kind: str) -> tuple[str, str]:
        """A raw connection: a body declared beyond the limit (413 unread), a body that stops halfway (408
        after the read timeout), or a connection opened and held without a byte (closed by the client)."""
        host, port = self.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=READ_TIMEOUT + 30) as sock:
            head = f"POST {GEN} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            if kind == "idle":
                time.sleep(1.0)
                return "ok", ""
            size = 10 * BODY_LIMIT if kind == "too_large" else 1000
            sock.sendall(f"{head}Content-Length: {size}\r\n\r\n{{".encode())
            answer = b""
            while b"\r\n" not in answer:
                more = sock.recv(4096)
                if not more:
                    break
                answer += more
        if answer.startswith(b"HTTP/1.1 "):
            with self.lock:
                self.statuses[f"{answer[9:10].decode()}xx"] += 1
        want = b"HTTP/1.1 413" if kind == "too_large" else b"HTTP/1.1 408"
        return ("ok" if answer.startswith(want) else "FAIL"), f"{kind}: {answer[:200]!r}"

    def count_status(self, response: httpx.Response) -> None:
        with self.lock:
            self.statuses[f"{response.status_code // 100}xx"] += 1

    def note(self, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.counts[f"{kind}:{outcome}"] += 1
            if outcome == "FAIL" and len(self.failures) < 20:
                self.failures.append(f"{kind}: {detail[:300]}")

    def valid(self, http: httpx.Client, rng: random.Random) -> None:
        path = rng.choice([CMPL, CHAT, GEN])
        n = rng.randint(1, 8)
        prompt = rng.choice(PROMPTS)
        body = {
            CMPL: {"prompt": prompt, "max_tokens": n, "temperature": rng.choice([0, 0.7])},
            CHAT: {"messages": [{"role": "user", "content": prompt}], "max_tokens": n},
            GEN: {"text": prompt, "sampling_params": {"max_new_tokens": n}},
        }[path]
        if rng.random() < 0.5:
            body["stream"] = True
            with http.stream("POST", self.url + path, json=body) as r:
                lines = [x for x in r.iter_lines() if x.startswith("data: ")]
                ok = r.status_code == 200 and lines and lines[-1] == "data: [DONE]"
                self.note("valid_stream", "ok" if ok else "FAIL", f"{r.status_code} {lines[-1:]}")
            return
        r = http.post(self.url + path, json=body)
        self.note("valid", "ok" if r.status_code == 200 else "FAIL", f"{path} {r.status_code} {r.text}")

    def invalid(self, http: httpx.Client, rng: random.Random) -> None:
        path, body = rng.choice(INVALID)
        r = http.post(self.url + path, json=body)
        ok = 400 <= r.status_code < 500 and "error" in r.json()
        self.note("invalid", "ok" if ok else "FAIL", f"{path} {body} -> {r.status_code} {r.text}")

    def abandoned(self, http: httpx.Client, rng: random.Random) -> None:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": 500, "ignore_eos": True}
        if rng.random() < 0.5:
            with http.stream("POST", self.url + CMPL, json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break  # leave after the first chunk
            self.note("abandoned_stream", "ok" if r.status_code == 200 else "FAIL", str(r.status_code))
            return
        try:
            http.post(self.url + CMPL, json=body, timeout=rng.uniform(0.3, 2.0))
            self.note("abandoned", "finished")
        except httpx.TimeoutException:
            self.note("abandoned", "ok")

    def worker(self, k: int) -> None:
        rng = random.Random(self.rng.random() + k)
        actions = [self.valid] * 9 + [self.invalid] * 5 + [self.abandoned] * 4 + [self.hostile] * 2
        with httpx.Client(timeout=120, event_hooks={"response": [self.count_status]}) as http:
            while time.time() < self.stop_at:
                action = rng.choice(actions)
                try:
                    action(http, rng)
                except httpx.TimeoutException as e:
                    self.note(action.__name__, "FAIL", f"timed out: {e!r}")
                except (httpx.HTTPError, OSError) as e:
                    self.note(action.__name__, "FAIL", f"transport error: {e!r}")
                    time.sleep(1)

    def run(self, sample_rss) -> None:
        self.stop_at = time.time() + self.seconds
        threads = [threading.Thread(target=self.worker, args=(k,), daemon=True) for k in range(self.workers)]
        for t in threads:
            t.start()
        while time.time() < self.stop_at:
            sample_rss()
            time.sleep(2)
        for t in threads:
            t.join(150)


def wait_ready(srv: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if srv.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {srv.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"kiln serve not ready after {timeout:.0f} s")


def pool_at_baseline(url: str, timeout: float = 60) -> dict:
    """Waits for the server to go idle; then no KV may be held by a request, and a flush empties the pool."""
    deadline = time.time() + timeout
    while True:
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        integ = info["integrity"]
        idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        if (integ["ok"] and idle and integ["in_use"] == 0) or time.time() > deadline:
            break
        time.sleep(0.5)
    flushed = httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200
    after = httpx.get(f"{url}/get_server_info", timeout=30).json()["integrity"]
    ok = bool(integ["ok"] and idle and integ["in_use"] == 0 and flushed and after["free"] == after["total"])
    return {
        **after,
        "ok": ok,
        "idle": idle,
        "in_use_when_idle": integ["in_use"],
        "running": info["num_running_reqs"],
        "waiting": info["num_waiting_reqs"],
    }


def rss_verdict(samples: list[tuple[float, int]], seconds: float, tolerance: float) -> dict:
    """Median RSS just after warm-up vs median RSS at the end."""
    warm = min(60.0, 0.25 * seconds)
    window = max(6.0, 0.15 * seconds)
    t0 = samples[0][0] if samples else 0.0
    early = [r for t, r in samples if warm <= t - t0 < warm + window]
    late = [r for t, r in samples if t - t0 >= seconds - window]
    if not early or not late:
        return {"ok": False, "reason": "too few RSS samples"}
    a, b = statistics.median(early), statistics.median(late)
    growth = (b - a) / a
    return {
        "ok": abs(growth) <= tolerance,
        "after_warmup_mib": a / 2**20,
        "end_mib": b / 2**20,
        "growth": growth,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--serve-arg", action="append", default=[], help="extra `kiln serve` argument (repeatable)"
    )
    a = p.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="kiln-soak-")) / "serve.log"
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--port", str(port), "--max-total-tokens", "8192"]
    cmd += [*SERVE_LIMITS, *a.serve_arg]
    with open(log, "w") as logf:
        srv = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return _soak(a, srv, url, log)
    finally:
        if srv.poll() is None:
            srv.terminate()
            try:
                srv.wait(60)
            except subprocess.TimeoutExpired:
                srv.kill()
                srv.wait(10)


def _soak(a: argparse.Namespace, srv: subprocess.Popen, url: str, log: Path) -> int:
    t_start = time.time()
    wait_ready(srv, url, 600)
    engine = psutil.Process(httpx.get(f"{url}/get_server_info", timeout=30).json()["pid"])
    front = psutil.Process(srv.pid)
    samples: list[tuple[float, int]] = []
    front_samples: list[int] = []

    def sample() -> None:
        try:
            samples.append((time.time(), engine.memory_info().rss))
            front_samples.append(front.memory_info().rss)
        except psutil.Error:
            pass

    seconds = a.minutes * 60
    soak = Soak(url, seconds, a.workers, a.seed)
    print(f"soak: {a.minutes:g} min against {url} (log {log}), {a.workers} workers", flush=True)
    soak.run(sample)
    alive = srv.poll() is None
    pool = pool_at_baseline(url) if alive else {"ok": False, "reason": "server exited"}
    rss = rss_verdict(samples, seconds, a.rss_tolerance)
    failed = sum(v for k, v in soak.counts.items() if k.endswith(":FAIL"))
    summary = {
        "minutes": a.minutes,
        "requests": dict(sorted(soak.counts.items())),
        "failed": failed,
        "statuses": dict(sorted(soak.statuses.items())),
        "server_alive": alive,
        "engine_rss": rss,
        "front_rss_mib": [round(front_samples[0] / 2**20, 1), round(front_samples[-1] / 2**20, 1)]
        if front_samples
        else None,
        "pool": pool,
        "wall_s": round(time.time() - t_start, 1),
    }
    tracebacks = log.read_text().count("Traceback")
    summary["log_tracebacks"] = tracebacks
    five_xx = soak.statuses.get("5xx", 0)
    ok = alive and failed == 0 and five_xx == 0 and rss["ok"] and pool["ok"] and tracebacks == 0
    print(json.dumps(summary, indent=2))
    for f in soak.failures:
        print(f"  failure: {f}")
    print(f"soak: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
