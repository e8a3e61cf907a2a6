"""Prometheus metrics: Kiln's own stable `kiln:` names and, beside them, SGLang's `sglang:` names with SGLang's
labels and meanings (both documented in docs/metrics.md).

Both families are always exported rather than chosen by a flag: a dashboard built for SGLang then works against
Kiln unchanged, and Kiln's own names keep their documented meaning. A prefix switch could not do that, because
some figures differ between the two beyond their names (SGLang's cache hit rate is recent where Kiln's is since
startup; SGLang's histograms have other buckets and labels).

Latency histograms are observed in the front process as outputs arrive; the scheduler's gauges and
counters come from the engine with every output batch and heartbeat."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kiln.scheduler.io import SchedulerStats, ServerInfo
from kiln.server.constraints import grammar_compile_histogram

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
    "grammar_cache_hits": (
        "kiln:grammar_cache_hits_total",
        "constraints served by a compiled grammar",
        "counter",
    ),
    "grammar_cache_misses": ("kiln:grammar_cache_misses_total", "constraints compiled anew", "counter"),
    # the hierarchical cache (zero while it is off)
    "host_tier_tokens": ("kiln:hicache_host_tokens", "tokens the host tier holds at most", "gauge"),
    "host_used_tokens": ("kiln:hicache_host_used_tokens", "host tier tokens holding a prefix", "gauge"),
    "host_hit_tokens": (
        "kiln:hicache_host_hit_tokens_total",
        "prompt tokens loaded back from the host tier",
        "counter",
    ),
    "host_load_back_seconds": (
        "kiln:hicache_load_back_seconds_total",
        "seconds the scheduler spent loading prefixes back from the host tier (on CUDA: issuing the copies)",
        "counter",
    ),
    "host_bytes_written": (
        "kiln:hicache_host_bytes_written_total",
        "KV bytes copied to the host tier",
        "counter",
    ),
    "storage_hit_tokens": (
        "kiln:hicache_storage_hit_tokens_total",
        "prompt tokens loaded from the storage tier",
        "counter",
    ),
    "storage_bytes_written": (
        "kiln:hicache_storage_bytes_written_total",
        "KV bytes written to the storage tier",
        "counter",
    ),
    "storage_load_seconds": (
        "kiln:hicache_storage_load_seconds_total",
        "seconds spent reading and checking storage tier files",
        "counter",
    ),
    "storage_skipped_files": (
        "kiln:hicache_storage_skipped_files_total",
        "storage tier files skipped as corrupted, partial or foreign",
        "counter",
    ),
}

# SGLang's histogram buckets (its metrics collector's defaults), so that quantiles read from SGLang dashboards
# fall on the same boundaries against Kiln.
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_E2E_BUCKETS = (*SGLANG_TTFT_BUCKETS, 600, 1200, 1800, 2400)
SGLANG_ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100, 0.200,
    0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
SGLANG_QUEUE_BUCKETS = (
    0.0, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90,
    100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000,
)  # fmt: skip

# SGLang labels its scheduler's figures by engine and rank, its tokenizer's (front) figures by engine alone. A
# Kiln server is one unified engine whose figures come from rank 0.
SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
FRONT_LABELS = ("model_name", "engine_type")

# SchedulerStats field -> (sglang name, help, kind, labels); the counters keep SGLang's `_total` in the name.
SGLANG_ENGINE_FIELDS = {
    "num_running_reqs": (
        "sglang:num_running_reqs",
        "The number of running requests.",
        "gauge",
        SCHEDULER_LABELS,
    ),
    "num_waiting_reqs": (
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue.",
        "gauge",
        SCHEDULER_LABELS,
    ),
    # SGLang's meaning, not Kiln's: without the prefix cache's evictable tokens (SGLang's dashboards read these)
    "running_token_usage": ("sglang:token_usage", "The token usage.", "gauge", SCHEDULER_LABELS),
    "running_tokens": ("sglang:num_used_tokens", "The number of used tokens.", "gauge", SCHEDULER_LABELS),
    "retracted": (
        "sglang:num_retracted_requests_total",
        "Total number of retracted requests.",
        "counter",
        SCHEDULER_LABELS,
    ),
    "prompt_tokens": (
        "sglang:prompt_tokens_total",
        "Number of prefill tokens processed.",
        "counter",
        FRONT_LABELS,
    ),
    "generation_tokens": (
        "sglang:generation_tokens_total",
        "Number of generation tokens processed.",
        "counter",
        FRONT_LABELS,
    ),
    "aborted": ("sglang:num_aborted_requests_total", "Number of requests aborted.", "counter", FRONT_LABELS),
}
# Speculative decoding's gauges, exported once the engine has verified drafts (a server without speculation
# does not export them as constant zeros).
SGLANG_SPEC_FIELDS = {
    "spec_accept_length": (
        "sglang:spec_accept_length",
        "Mean acceptance length of speculative decoding (accepted drafts + bonus token per forward).",
        "gauge",
        SCHEDULER_LABELS,
    ),
    "spec_accept_rate": (
        "sglang:spec_accept_rate",
        "Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).",
        "gauge",
        SCHEDULER_LABELS,
    ),
}

# Seconds of engine reports behind sglang:gen_throughput and sglang:cache_hit_rate. SGLang reports both per
# logging interval (the last decode interval, the last prefill batch), not since startup; a few heartbeats'
# worth keeps the figure recent while smoothing single steps.
RECENT_WINDOW_S = 5.0
# Engine reports closer together than this replace the newest sample, which bounds the window's length.
_SAMPLE_GAP_S = 0.1


@dataclass(frozen=True)
class _Sample:
    """The engine's token counters at one moment."""

    time: float
    generation_tokens: int
    prompt_tokens: int
    cached_tokens: int


class RecentRates:
    """Generation throughput and prefix-cache hit rate over the last `window` seconds of engine reports.

    The hit rate keeps its last value while no prompt arrives, as SGLang's does between prefill batches (a
    decode-only stretch would otherwise read as a 0 % hit rate)."""

    def __init__(self, window: float = RECENT_WINDOW_S):
        self.window = window
        self.samples: deque[_Sample] = deque()
        self.hit_rate = 0.0

    def add(self, stats: SchedulerStats, now: float) -> None:
        sample = _Sample(now, stats.generation_tokens, stats.prompt_tokens, stats.cached_tokens)
        if len(self.samples) > 1 and now - self.samples[-2].time < _SAMPLE_GAP_S:
            self.samples[-1] = sample
        else:
            self.samples.append(sample)
        self._prune(now)
        base, last = self.samples[0], self.samples[-1]
        prompt = last.prompt_tokens - base.prompt_tokens
        if prompt > 0:
            self.hit_rate = min(1.0, max(0.0, (last.cached_tokens - base.cached_tokens) / prompt))

    def _prune(self, now: float) -> None:
        """Keep the newest sample at or before the window's start as the base, and everything after it."""
        while len(self.samples) > 1 and self.samples[1].time <= now - self.window:
            self.samples.popleft()

    def gen_throughput(self, now: float) -> float:
        """Tokens per second generated across the window (0 once the engine has been idle for a window)."""
        self._prune(now)
        if not self.samples:
            return 0.0
        base, last = self.samples[0], self.samples[-1]
        span = max(last.time, now) - base.time
        if span <= 0:
            return 0.0
        return (last.generation_tokens - base.generation_tokens) / span


def _family(name: str, doc: str, kind: str, labels: tuple[str, ...]):
    if kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
    return GaugeMetricFamily(name, doc, labels=labels)


class _EngineCollector:
    """Exposes the engine's latest gauges and counters with their proper Prometheus types, under Kiln's names
    and SGLang's."""

    def __init__(self, info: ServerInfo | None, label_values: dict[str, str]) -> None:
        self.stats = SchedulerStats()
        self.recent = RecentRates()
        self.info = info
        self.label_values = label_values

    def collect(self):
        for key, (name, doc, kind) in ENGINE_FIELDS.items():
            value = float(getattr(self.stats, key))
            if kind == "counter":
                yield CounterMetricFamily(name.removesuffix("_total"), doc, value=value)
            else:
                yield GaugeMetricFamily(name, doc, value=value)
        yield grammar_compile_histogram(self.stats)
        yield from self._collect_sglang()

    def _values(self, labels: tuple[str, ...]) -> list[str]:
        return [self.label_values[label] for label in labels]

    def _collect_sglang(self):
        fields = dict(SGLANG_ENGINE_FIELDS)
        if self.stats.spec_verify_ct:
            fields.update(SGLANG_SPEC_FIELDS)
        for key, (name, doc, kind, labels) in fields.items():
            family = _family(name, doc, kind, labels)
            family.add_metric(self._values(labels), float(getattr(self.stats, key)))
            yield family
        cached = CounterMetricFamily(
            "sglang:cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            labels=(*FRONT_LABELS, "cache_source"),
        )
        cached.add_metric([*self._values(FRONT_LABELS), "device"], float(self.stats.cached_tokens))
        yield cached
        scheduler = self._values(SCHEDULER_LABELS)
        throughput = self.recent.gen_throughput(time.time())
        gauges = {
            "sglang:gen_throughput": ("The generation throughput (token/s).", throughput),
            "sglang:cache_hit_rate": ("The prefix cache hit rate.", self.recent.hit_rate),
        }
        for key in ("max_total_num_tokens", "context_len"):
            gauges[f"sglang:{key}"] = (f"The resolved {key}.", float(getattr(self.info, key, 0)))
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=SCHEDULER_LABELS)
            family.add_metric(scheduler, value)
            yield family
        hits, misses = self.stats.grammar_cache_hits, self.stats.grammar_cache_misses
        grammar = {
            "sglang:num_grammar_cache_hit": ("Number of grammar cache hits.", hits),
            "sglang:num_grammar": ("Number of the total grammar requests.", hits + misses),
        }
        for name, (doc, value) in grammar.items():
            family = CounterMetricFamily(name, doc, labels=SCHEDULER_LABELS)
            family.add_metric(scheduler, float(value))
            yield family


class _Observers:
    """Several histograms observed as one (the queue time is recorded under both families' names)."""

    def __init__(self, *histograms) -> None:
        self.histograms = histograms

    def observe(self, value: float) -> None:
        for histogram in self.histograms:
            histogram.observe(value)


class _SGLangFront:
    """SGLang's front (tokenizer-manager) histograms and request counter, with its labels."""

    def __init__(self, registry: CollectorRegistry, label_values: dict[str, str]) -> None:
        front = [*FRONT_LABELS, "is_streaming"]
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            front,
            buckets=SGLANG_TTFT_BUCKETS,
            registry=registry,
        )
        itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            FRONT_LABELS,
            buckets=SGLANG_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            front,
            buckets=SGLANG_E2E_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "sglang:num_requests_total", "Number of requests processed.", front, registry=registry
        )
        queue = Histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            SCHEDULER_LABELS,
            buckets=SGLANG_QUEUE_BUCKETS,
            registry=registry,
        )
        self.front_values = {k: label_values[k] for k in FRONT_LABELS}
        self.itl = itl.labels(**self.front_values)
        self.queue = queue.labels(**{k: label_values[k] for k in SCHEDULER_LABELS})

    def streaming(self, is_streaming: bool) -> dict[str, str]:
        return {**self.front_values, "is_streaming": "true" if is_streaming else "false"}


def _label_values(model_name: str | None) -> dict[str, str]:
    ranks = dict.fromkeys(("tp_rank", "pp_rank", "moe_ep_rank"), "0")
    return {"model_name": model_name or "default", "engine_type": "unified", **ranks}


class Metrics:
    """Every series /metrics exports; `model_name` labels SGLang's names (the served model name)."""

    def __init__(self, info: ServerInfo | None = None, model_name: str | None = None):
        self.registry = r = CollectorRegistry()
        labels = _label_values(model_name)
        self.ttft = Histogram(
            "kiln:time_to_first_token_seconds", "time to first token", buckets=_LAT, registry=r
        )
        self.itl = Histogram(
            "kiln:inter_token_latency_seconds", "time between streamed tokens", buckets=_ITL, registry=r
        )
        self.e2e = Histogram(
            "kiln:e2e_request_latency_seconds", "request latency end to end", buckets=_LAT, registry=r
        )
        queue = Histogram(
            "kiln:queue_time_seconds", "time from arrival to the first prefill step", buckets=_LAT, registry=r
        )
        self.requests = Counter("kiln:num_requests_total", "requests finished", ["finish_reason"], registry=r)
        self.rejected = Counter(
            "kiln:num_rejected_requests_total", "requests refused with 429 (queue full)", registry=r
        )
        # per LoRA adapter (the base model's requests are not counted here): SGLang has no such family
        self.lora_requests = Counter(
            "kiln:lora_requests_total", "requests finished per LoRA adapter", ["lora_name"], registry=r
        )
        self.lora_tokens = Counter(
            "kiln:lora_tokens_total",
            "prompt and generated tokens per LoRA adapter",
            ["lora_name", "kind"],
            registry=r,
        )
        self.hit_rate = Gauge(
            "kiln:cache_hit_rate", "prefix-cache hit rate: cached / prompt tokens", registry=r
        )
        self.engine = _EngineCollector(info, labels)
        r.register(self.engine)
        self.sglang = _SGLangFront(r, labels)
        self.queue = _Observers(queue, self.sglang.queue)
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
        self.engine.recent.add(stats, time.time())
        if stats.prompt_tokens:
            self.hit_rate.set(stats.cached_tokens / stats.prompt_tokens)

    def observe_lora(self, lora_name: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request on LoRA adapter `lora_name` finished."""
        self.lora_requests.labels(lora_name=lora_name).inc()
        self.lora_tokens.labels(lora_name=lora_name, kind="prompt").inc(prompt_tokens)
        self.lora_tokens.labels(lora_name=lora_name, kind="generation").inc(completion_tokens)

    def observe_output(
        self,
        start: float,
        first: float | None,
        prev: float | None,
        now: float,
        n_new: int,
        finish_reason: dict | None,
    ) -> None:
        """One output of one request, as the front receives it.

        SGLang's `is_streaming` label is true when the request's tokens arrived in more than one output: a
        request whose whole output came at once (unstreamed, or streamed in one chunk) had its first token at
        its end, which is what the label separates on a dashboard."""
        sglang = self.sglang
        if n_new and first == now:
            self.ttft.observe(now - start)
            sglang.ttft.labels(**sglang.streaming(finish_reason is None)).observe(now - start)
        elif n_new and prev is not None:
            for _ in range(n_new):
                self.itl.observe((now - prev) / n_new)
                sglang.itl.observe((now - prev) / n_new)
        if finish_reason is not None:
            self.e2e.observe(now - start)
            self.requests.labels(finish_reason=finish_reason.get("type", "unknown")).inc()
            labels = sglang.streaming(first is not None and first != now)
            sglang.e2e.labels(**labels).observe(now - start)
            sglang.requests.labels(**labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
