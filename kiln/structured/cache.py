"""Grammars compiled on a thread pool and cached per spec, as SGLang's grammar backends do: the engine loop
submits a request's spec and goes on stepping the batch; the request alone waits until its matcher is ready."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kiln.structured.backend import LLGuidanceBackend
from kiln.structured.matcher import GrammarMatcher
from kiln.structured.spec import GrammarSpec

COMPILE_THREADS = 2
MAX_CACHED_GRAMMARS = 1024  # distinct specs kept compiled; the least recently used beyond it are dropped
# upper bounds (seconds) of the compile-time histogram's buckets; the last, +Inf, is implied
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0)


@dataclass
class GrammarCounters:
    """Compile cache hits and misses, and the compile-time histogram kept as running counts (a snapshot is sent
    with every output batch, so it must not grow with the number of compiles)."""

    hits: int = 0
    misses: int = 0
    compiles: int = 0
    compile_seconds_sum: float = 0.0
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(COMPILE_BUCKETS))

    def observe(self, seconds: float) -> None:
        self.compiles += 1
        self.compile_seconds_sum += seconds
        for i, bound in enumerate(COMPILE_BUCKETS):
            if seconds <= bound:
                self.bucket_counts[i] += 1

    def buckets(self) -> tuple[int, ...]:
        """Cumulative counts per COMPILE_BUCKETS bound, then the total (+Inf)."""
        return (*self.bucket_counts, self.compiles)


class GrammarCache:
    def __init__(self, backend: LLGuidanceBackend, threads: int = COMPILE_THREADS):
        self.backend = backend
        self.counters = GrammarCounters()
        self._compiled: OrderedDict[GrammarSpec, Future] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kiln-grammar")

    def submit(self, spec: GrammarSpec) -> Future:
        """A future of a fresh matcher for spec; its exception is the GrammarError that refused the spec."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is None:
                self.counters.misses += 1
                compiled = self._compiled[spec] = self._pool.submit(self._compile, spec)
                if len(self._compiled) > MAX_CACHED_GRAMMARS:  # a server fed ever new schemas stays bounded
                    self._compiled.popitem(last=False)
            else:
                self.counters.hits += 1
                self._compiled.move_to_end(spec)
        return self._pool.submit(self._matcher, compiled) if not compiled.done() else self._now(compiled)

    def _now(self, compiled: Future) -> Future:
        """A cached grammar's matcher, copied on the calling thread: it costs microseconds."""
        done: Future = Future()
        try:
            done.set_result(self.backend.matcher(compiled.result()))
        except Exception as e:  # the spec's GrammarError, handed to the request as its failure
            done.set_exception(e)
        return done

    def _compile(self, spec: GrammarSpec):
        start = time.perf_counter()
        try:
            return self.backend.compile(spec)
        finally:
            with self._lock:
                self.counters.observe(time.perf_counter() - start)

    def _matcher(self, compiled: Future) -> GrammarMatcher:
        return self.backend.matcher(compiled.result())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
