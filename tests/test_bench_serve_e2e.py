"""`kiln bench serve` against a real `kiln serve`: the JSON record is complete and its token counts match
what the server itself counted (its /metrics counters, read before and after the run)."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from kiln.bench.cli import main as bench_main
from kiln.bench.metrics import LATENCY_METRICS, LATENCY_STATS
from kiln.bench.serve import RECORD_ARGS

pytestmark = pytest.mark.server

COUNTERS = {
    "prompt": "kiln:prompt_tokens_total",
    "generation": "kiln:generation_tokens_total",
    "cached": "kiln:cached_tokens_total",
}
METRIC_KEYS = {
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "input_throughput", "output_throughput", "total_throughput", "max_output_tokens_per_s",
    "max_concurrent_requests", "concurrency", "total_cached_tokens", "prefix_cache_hit_rate", "errors",
}  # fmt: skip


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for key, name in COUNTERS.items():
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        assert m, f"{name} missing from /metrics"
        out[key] = float(m.group(1))
    return out


def settled_delta(url: str, before: dict[str, float], want_generation: int) -> dict[str, float]:
    """Counter deltas once the server has published the run's generated tokens (bounded wait)."""
    deadline = time.monotonic() + 15
    while True:
        delta = {k: v - before[k] for k, v in counters(url).items()}
        if delta["generation"] >= want_generation or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


def run_bench(url: str, tmp_path, flags: list[str]) -> dict:
    out = tmp_path / "bench.jsonl"
    argv = ["serve", "--base-url", url, "--backend", "openai", "--warmup-requests", "0", "--disable-tqdm",
            "--ignore-eos", "--request-timeout", "120", "--total-timeout", "300", "--output-json", str(out), *flags]  # fmt: skip
    assert bench_main(argv) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def check_record(rec: dict, n: int, out_len: int) -> None:
    """Every field present and sane; `out_len` tokens per request (fixed by ignore_eos)."""
    expected = {"date", "request_rate", "num_requests", *RECORD_ARGS, *METRIC_KEYS}
    expected |= {f"{s}_{m}_ms" for m in LATENCY_METRICS for s in LATENCY_STATS}
    assert expected <= rec.keys(), f"missing: {sorted(expected - rec.keys())}"
    assert rec["completed"] == rec["num_requests"] == n and rec["failed"] == 0, rec["errors"]
    assert rec["total_output_tokens"] == n * out_len  # ignore_eos fixes every output length
    for m in LATENCY_METRICS:
        for s in LATENCY_STATS:
            assert rec[f"{s}_{m}_ms"] is not None and rec[f"{s}_{m}_ms"] >= 0, (s, m)
    assert 0 < rec["mean_ttft_ms"] <= rec["mean_e2e_latency_ms"]
    assert rec["output_throughput"] == pytest.approx(rec["total_output_tokens"] / rec["duration"])


def test_random_run_matches_server_usage(server, tmp_path):
    before = counters(server.url)
    rec = run_bench(server.url, tmp_path, ["--dataset-name", "random", "--num-prompts", "5",
                                           "--random-input-len", "40", "--random-output-len", "16",
                                           "--random-range-ratio", "1", "--max-concurrency", "3",
                                           "--seed", "11"])  # fmt: skip
    check_record(rec, 5, 16)
    delta = settled_delta(server.url, before, 5 * 16)
    assert rec["total_input_tokens"] == delta["prompt"]
    assert rec["total_output_tokens"] == delta["generation"]
    assert rec["total_cached_tokens"] == delta["cached"]
    assert (
        5 * 20 <= rec["total_input_tokens"] <= 5 * 40 + 5
    )  # lengths in [20, 40] (+ BOS if the model adds one)
    assert rec["max_concurrent_requests"] <= 3


def test_shared_prefix_run_reports_cached_tokens(server, tmp_path):
    before = counters(server.url)
    rec = run_bench(server.url, tmp_path, ["--dataset-name", "shared-prefix", "--gsp-num-groups", "1",
                                           "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "160",
                                           "--gsp-question-len", "12", "--gsp-output-len", "16",
                                           "--max-concurrency", "1", "--seed", "12"])  # fmt: skip
    check_record(rec, 4, 16)
    delta = settled_delta(server.url, before, 4 * 16)
    assert rec["total_input_tokens"] == delta["prompt"]
    assert rec["total_output_tokens"] == delta["generation"]
    assert rec["total_cached_tokens"] == delta["cached"]
    # one request at a time: requests 2..4 find the 160-token prefix (less at most a page) in the cache
    assert rec["total_cached_tokens"] >= 3 * 150
    assert rec["prefix_cache_hit_rate"] == pytest.approx(
        rec["total_cached_tokens"] / rec["total_input_tokens"]
    )
