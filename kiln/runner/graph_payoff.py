"""What each compiled CPU shape measured against eager at capture, kept beside the compiled code: a warm start
that loads a shape's code from the cache reuses its verdict instead of timing both paths again.

A verdict belongs to one host, thread count, torch version, kernel choice and model layout (the fingerprint);
anything else in the file is ignored, and an unreadable file is an empty one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform

import torch

from kiln.core.json_file import read_json_dict, write_json_atomic
from kiln.layers.cpu_gemm import cpu_gemm_mode

logger = logging.getLogger("kiln")

FILE_NAME = "kiln_graph_payoff.json"


class PayoffStore:
    def __init__(self, cache_dir: str | None, model) -> None:
        self.path = os.path.join(cache_dir, FILE_NAME) if cache_dir else None
        self.fingerprint = fingerprint(model)
        self.entries = self._read()

    def _read(self) -> dict:
        return read_json_dict(self.path) if self.path is not None else {}

    def _key(self, phase: str, size: int) -> str:
        return f"{self.fingerprint}/{phase}/{size}"

    def get(self, phase: str, size: int) -> tuple[float, float] | None:
        """(compiled ms, eager ms) measured for this shape at an earlier start, or None."""
        entry = self.entries.get(self._key(phase, size))
        try:
            graph_ms, eager_ms = float(entry["graph_ms"]), float(entry["eager_ms"])
        except (TypeError, KeyError, ValueError):
            return None
        return (graph_ms, eager_ms) if graph_ms > 0 and eager_ms > 0 else None

    def put(self, phase: str, size: int, graph_ms: float, eager_ms: float) -> None:
        self.entries[self._key(phase, size)] = {"graph_ms": graph_ms, "eager_ms": eager_ms}
        if self.path is None:
            return
        try:
            write_json_atomic(self.path, self.entries)
        except OSError as e:  # a read-only cache still serves; the next start measures again
            logger.debug(f"could not save graph payoff to {self.path}: {e}")


def fingerprint(model) -> str:
    """Host, threads, torch, kernel choice and the model's tensors (names, shapes, dtypes), LoRA slots included."""
    h = hashlib.sha256()
    h.update(f"{platform.machine()}|{_cpu_name()}|{torch.get_num_threads()}|{torch.__version__}|".encode())
    h.update(f"{cpu_gemm_mode()}|".encode())
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    # LoRA slots (kiln.layers.lora) are no parameters, yet a compiled step runs their delta: a verdict timed with
    # them belongs to their layout alone, and one timed without them to none
    for name, module in model.named_modules():
        lora = getattr(module, "lora", None)
        if lora is not None:
            h.update(f"{name}.lora:{tuple(lora.a.shape)}:{[tuple(b.shape) for b in lora.b]};".encode())
    return h.hexdigest()[:16]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
