"""Serving-benchmark metrics, under the names SGLang's bench_serving uses (pure computation, no I/O)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# Latency families and the statistics reported for each (all in milliseconds).
LATENCY_METRICS = ("e2e_latency", "ttft", "tpot", "itl")
LATENCY_STATS = ("mean", "median", "std", "p90", "p95", "p99", "max")
# The rows of each latency block of the printed result, in order.
SECTION_STATS = ("mean", "median", "p90", "p99")
SECTION_STATS_ITL = ("mean", "median", "p90", "p95", "p99", "max")
STAT_LABELS = {"mean": "Mean", "median": "Median", "p90": "P90", "p95": "P95", "p99": "P99", "max": "Max"}


@dataclass
class RequestRecord:
    """One request's timeline (seconds on one monotonic clock) and token counts."""

    start: float = 0.0  # when the request was sent
    end: float = 0.0  # when the response finished
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens carried by each such chunk
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not report it
    success: bool = False
    error: str = ""
    text: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else 0.0

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1); None for single-token outputs."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        """Gaps between streamed chunks; a chunk carrying k tokens adds k gaps of gap/k."""
        out: list[float] = []
        for i in range(1, len(self.chunk_times)):
            gap = self.chunk_times[i] - self.chunk_times[i - 1]
            k = max(1, self.chunk_tokens[i])
            out.extend([gap / k] * k)
        return out


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(LATENCY_STATS)
    arr = np.asarray(values, dtype=np.float64) * scale
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "std": float(arr.std()),
        "p90": float(np.percentile(arr, 90)),
        "p95": float(np.percentile(arr, 95)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
    }


def peak_output_throughput(records: list[RequestRecord], window: float = 1.0) -> float:
    """Most output tokens arriving within any `window` seconds, divided by the window (tok/s)."""
    events = sorted((t, k) for r in records for t, k in zip(r.chunk_times, r.chunk_tokens, strict=False))
    best, total, lo = 0, 0, 0
    for t, k in events:
        total += k
        while events[lo][0] <= t - window:
            total -= events[lo][1]
            lo += 1
        best = max(best, total)
    return best / window


def peak_concurrent_requests(records: list[RequestRecord]) -> int:
    """Most requests in flight at once (a request ending at t does not overlap one starting at t)."""
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def compute_metrics(records: list[RequestRecord], duration: float) -> dict:
    """Aggregate figures of one run; failed requests count only in `failed`."""
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = duration if duration > 0 else math.inf
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported)
    reported_prompt = sum(r.prompt_tokens for r in reported)
    result: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_throughput": (total_in + total_out) / dur,
        "max_output_tokens_per_s": peak_output_throughput(ok),
        "max_concurrent_requests": peak_concurrent_requests(ok),
        "concurrency": sum(r.latency for r in ok) / dur,
        "total_cached_tokens": cached if reported else None,
        "prefix_cache_hit_rate": cached / reported_prompt if reported and reported_prompt else None,
    }
    series = {
        "e2e_latency": [r.latency for r in ok],
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itls()],
    }
    for name in LATENCY_METRICS:
        for stat, value in _stats(series[name]).items():
            result[f"{stat}_{name}_ms"] = value
    errors = [r.error for r in records if not r.success]
    result["errors"] = sorted(set(errors))[:5]
    return result


def _row(label: str, value: object, fmt: str = ".2f") -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float) and fmt:
        text = format(value, fmt)
    else:
        text = str(value)
    return f"{label:<40} {text:<10}"


def format_result(m: dict, backend: str = "", request_rate: float = math.inf, max_concurrency=None) -> str:
    """The `==== Serving Benchmark Result ====` block."""
    hit = m["prefix_cache_hit_rate"]
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        _row("Backend:", backend),
        _row("Traffic request rate:", request_rate, ""),
        _row("Max request concurrency:", max_concurrency if max_concurrency else "not set"),
        _row("Successful requests:", m["completed"]),
        _row("Failed requests:", m["failed"]),
        _row("Benchmark duration (s):", m["duration"]),
        _row("Total input tokens:", m["total_input_tokens"]),
        _row("Total generated tokens:", m["total_output_tokens"]),
        _row("Request throughput (req/s):", m["request_throughput"]),
        _row("Input token throughput (tok/s):", m["input_throughput"]),
        _row("Output token throughput (tok/s):", m["output_throughput"]),
        _row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"]),
        _row("Peak concurrent requests:", m["max_concurrent_requests"]),
        _row("Total token throughput (tok/s):", m["total_throughput"]),
        _row("Concurrency:", m["concurrency"]),
        _row("Prefix cache hit rate:", None if hit is None else f"{hit:.2%}"),
    ]
    if (
        m.get("accept_length") is not None
    ):  # the server decodes speculatively: SGLang's line after Concurrency
        lines.insert(
            lines.index(_row("Concurrency:", m["concurrency"])) + 1,
            _row("Accept length:", m["accept_length"]),
        )
    sections = (
        ("End-to-End Latency", "e2e_latency", "E2E Latency"),
        ("Time to First Token", "ttft", "TTFT"),
        ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
        ("Inter-token Latency", "itl", "ITL"),
    )
    for title, key, short in sections:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        # ascending, as SGLang prints them; ITL adds SGLang's P95 and Max lines
        stats = SECTION_STATS_ITL if key == "itl" else SECTION_STATS
        for stat in stats:
            lines.append(_row(f"{STAT_LABELS[stat]} {short} (ms):", m[f"{stat}_{key}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
