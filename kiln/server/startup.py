"""Startup as a state machine: downloading -> launching -> building_kernels -> loading_weights -> allocating_kv ->
capturing -> warming_up -> ready, or failed(phase, reason, hint). Read by the log, /status, the probes and the
--startup-events file. downloading (a Hugging Face model id's start begins there) fetches the weights in the front
process before the engine launches, its progress the bytes done and total and the rate (kiln.server.download).
building_kernels (CPU runs of Kiln's kernels only) loads Kiln's C++ extensions, compiling them on a first start
(kiln.layers.kernel_builds); /status keeps what each load took under "kernels"."""

from __future__ import annotations

import json
import logging
import threading
import time

logger = logging.getLogger("kiln")

PHASES = [
    "downloading",
    "launching",
    "building_kernels",
    "loading_weights",
    "allocating_kv",
    "capturing",
    "capture_draft",
    "warming_up",
    "ready",
]


class StartupState:
    def __init__(self, events_file: str | None = None, first_phase: str = "launching"):
        self.phase = first_phase
        self.progress: dict = {}
        self.timings: dict[str, float] = {}
        self.error: dict | None = None
        self.ledger: dict | None = None
        self.memory_check: list | None = None
        self.graphs: dict | None = None
        self.draft_graphs: dict | None = None
        # what loading each Kiln extension took: building_kernels' last report
        self.kernels: list | None = None
        self._t0 = self._phase_start = time.time()
        self._events_file = events_file
        self._lock = threading.Lock()
        self._emit({"event": "phase", "phase": self.phase})

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    @property
    def failed(self) -> bool:
        return self.phase == "failed"

    def enter(self, phase: str, **info) -> None:
        with self._lock:
            if self.phase in ("ready", "failed") or phase == self.phase:
                return
            now = time.time()
            self.timings[self.phase] = round(now - self._phase_start, 3)
            self.phase, self._phase_start, self.progress = phase, now, dict(info)
        self._emit({"event": "phase", "phase": phase, **info})

    def step(self, **progress) -> None:
        self.progress = progress
        if self.phase == "building_kernels" and "kernels" in progress:
            self.kernels = progress["kernels"]
        self._emit({"event": "progress", "phase": self.phase, **progress})

    def fail(self, reason: str, hint: str = "") -> None:
        """The first failure is the one reported; later ones (its consequences) are ignored."""
        with self._lock:
            if self.phase == "failed":
                return
            failed_phase = self.phase
            self.timings[self.phase] = round(time.time() - self._phase_start, 3)
            self.phase = "failed"
            self.error = {"phase": failed_phase, "reason": reason, "hint": hint}
        self._emit({"event": "failed", **self.error})

    def to_dict(self) -> dict:
        return {
            "phase": self.phase,
            "progress": self.progress,
            "timings": self.timings,
            "error": self.error,
            "elapsed": round(time.time() - self._t0, 3),
            "ledger": self.ledger,
            "memory_check": self.memory_check,
            "graphs": self.graphs,
            "draft_graphs": self.draft_graphs,
            "kernels": self.kernels,
        }

    def _emit(self, record: dict) -> None:
        if not self._events_file:
            return
        record = {"time": time.time(), **record}
        with open(self._events_file, "a") as f:
            f.write(json.dumps(record) + "\n")
