"""Startup as a state machine: downloading -> launching -> building_kernels -> loading_weights -> allocating_kv ->
capturing -> warming_up -> ready, or failed(phase, reason, hint). Read by the log, /status, the probes and the
--startup-events file. downloading (a Hugging Face model id's start begins there) fetches the weights in the front
process before the engine launches, its progress the bytes done and total and the rate (kiln.server.download).
building_kernels (CPU runs of Kiln's kernels only) loads Kiln's C++ extensions, compiling them on a first start
(kiln.layers.kernel_builds); /status keeps what each load took under "kernels". With a prediction of each phase
(kiln.server.startup_prediction), /status carries it as "predicted_s" and the seconds left as "eta_s"."""

from __future__ import annotations

import json
import logging
import os
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


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not on this platform: taken as an idle host
        return 0.0


# the least a phase still running is expected to take (it has not ended yet)
ETA_FLOOR_S = 0.5


class StartupState:
    def __init__(self, events_file: str | None = None, first_phase: str = "launching"):
        self.phase = first_phase
        self.progress: dict = {}
        self.timings: dict[str, float] = {}
        # the host's 1-minute load average as each phase ended: how contended the CPU was (startup_prediction)
        self.loads: dict[str, float] = {}
        self.error: dict | None = None
        self.ledger: dict | None = None
        self.memory_check: list | None = None
        self.graphs: dict | None = None
        self.draft_graphs: dict | None = None
        # what loading each Kiln extension took: building_kernels' last report
        self.kernels: list | None = None
        # {phase: seconds, "total": seconds} predicted at launch, or None; eta_s only falls (see eta)
        self.predicted: dict[str, float] | None = None
        self._eta: float | None = None
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
            self.loads[self.phase] = load_average()
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

    def phase_elapsed(self) -> float:
        return time.time() - self._phase_start

    def eta(self) -> float | None:
        """Seconds to ready: the current phase's predicted remainder (at least ETA_FLOOR_S: it has not ended) and the
        later phases' predictions. It never rises: a phase that overruns holds the ETA at the floor plus what comes
        after, rather than adding its overrun back, so a poller sees time to go that only falls. None once ready,
        failed, or without a prediction."""
        if self.predicted is None or self.phase in ("ready", "failed"):
            return None
        with self._lock:
            phase, elapsed = self.phase, self.phase_elapsed()
            order = [p for p in PHASES if p in self.predicted]
            later = PHASES[PHASES.index(phase) + 1 :] if phase in PHASES else []
            current = max(self.predicted.get(phase, 0.0) - elapsed, ETA_FLOOR_S)
            raw = current + sum(self.predicted[p] for p in order if p in later)
            self._eta = raw if self._eta is None else min(raw, self._eta)
            return round(self._eta, 1)

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
            "predicted_s": self.predicted,
            "eta_s": self.eta(),
        }

    def _emit(self, record: dict) -> None:
        if not self._events_file:
            return
        record = {"time": time.time(), **record}
        with open(self._events_file, "a") as f:
            f.write(json.dumps(record) + "\n")
