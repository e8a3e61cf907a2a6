"""Prometheus metrics under stable `kiln:` names (documented in docs/metrics.md).

Latency histograms are observed in the front process as outputs arrive; the scheduler's gauges and
counters come from the engine with every output batch and heartbeat."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kiln.scheduler.io import SchedulerStats, ServerInfo

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)

# SchedulerStats field -> (metric name, help, kind)
ENGINE_FIELDS = {
    "num_running_reqs": ("kiln:num_running_reqs", "requests in the running batch", "gauge"),
    "num_waiting_reqs": ("kiln:num_queue_reqs", "requests waiting to be scheduled", "gauge"),
    "token_usage": ("kiln:token_usage", "fraction of the KV pool in use (running + cached)", "gauge"),
    "used_tokens": ("kiln:num_used_tokens", "KV pool tokens in use (running + cached)", "gauge"),
    "prompt_tokens": ("kiln:prompt_tokens_total", "prompt tokens received", "counter"),
    "generation_tokens": ("kiln:generation_tokens_total", "tokens generated", "counter"),
    "cached_tokens": ("kiln:cached_tokens_total", "prompt tokens served from the prefix cache", "counter"),
    "retracted": (
        "kiln:num_retracted_requests_total",
        "requests retracted when the KV pool ran out",
        "counter",
    ),
    "aborted": ("kiln:num_aborted_requests_total", "requests aborted (client, timeout, shutdown)", "counter"),
    "failed": ("kiln:num_failed_requests_total", "requests failed by an internal error", "counter"),
    "integrity_violations": (
        "kiln:kv_integrity_violations_total",
        "KV pool invariant violations seen",
        "counter",
    ),
}


class _EngineCollector:
    """Exposes the engine's latest gauges and counters with their proper Prometheus types."""

    def __init__(self) -> None:
        self.stats = SchedulerStats()

    def collect(self):
        for key, (name, doc, kind) in ENGINE_FIELDS.items():
            value = float(getattr(self.stats, key))
            if kind == "counter":
                yield CounterMetricFamily(name.removesuffix("_total"), doc, value=value)
            else:
                yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, info: ServerInfo | None = None):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "kiln:time_to_first_token_seconds", "time to first token", buckets=_LAT, registry=r
        )
        self.itl = Histogram(
            "kiln:inter_token_latency_seconds", "time between streamed tokens", buckets=_ITL, registry=r
        )
        self.e2e = Histogram(
            "kiln:e2e_request_latency_seconds", "request latency end to end", buckets=_LAT, registry=r
        )
        self.queue = Histogram(
            "kiln:queue_time_seconds", "time from arrival to the first prefill step", buckets=_LAT, registry=r
        )
        self.requests = Counter("kiln:num_requests_total", "requests finished", ["finish_reason"], registry=r)
        self.rejected = Counter(
            "kiln:num_rejected_requests_total", "requests refused with 429 (queue full)", registry=r
        )
        self.hit_rate = Gauge(
            "kiln:cache_hit_rate", "prefix-cache hit rate: cached / prompt tokens", registry=r
        )
        self.engine = _EngineCollector()
        r.register(self.engine)
        self.ledger = Gauge(
            "kiln:ledger_bytes", "the memory ledger's predicted bytes per rank", ["line"], registry=r
        )
        for name in ("max_total_num_tokens", "max_running_requests", "context_len"):
            Gauge(f"kiln:{name}", f"resolved {name}", registry=r).set(getattr(info, name, 0))
        lines = info.ledger.get("lines", []) if info is not None else []
        for line in lines:
            self.ledger.labels(line=line["name"]).set(line["bytes"])

    def update_engine(self, stats: SchedulerStats) -> None:
        self.engine.stats = stats
        if stats.prompt_tokens:
            self.hit_rate.set(stats.cached_tokens / stats.prompt_tokens)

    def observe_output(
        self,
        start: float,
        first: float | None,
        prev: float | None,
        now: float,
        n_new: int,
        finish_reason: dict | None,
    ) -> None:
        """One output of one request, as the front receives it."""
        if n_new and first == now:
            self.ttft.observe(now - start)
        elif n_new and prev is not None:
            for _ in range(n_new):
                self.itl.observe((now - prev) / n_new)
        if finish_reason is not None:
            self.e2e.observe(now - start)
            self.requests.labels(finish_reason=finish_reason.get("type", "unknown")).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
