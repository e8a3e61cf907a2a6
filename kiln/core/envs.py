"""Every environment variable Kiln reads, in one place (vLLM's envs.py). User choices are flags (`kiln serve
--help`); what is left here is either another tool's own variable that Kiln honours, or a hook for the tests.
Each is read through a function that validates it and names the valid values in its error."""

from __future__ import annotations

import os
from dataclasses import dataclass

# The startup-failure tests' hook: make the engine process crash or stall when it enters a startup phase, so
# that the front's handling of a dead or silent engine can be tested end to end. "crash:<phase>" | "stall:<phase>",
# with "@<rank>" to hit one tensor-parallel rank alone ("crash:loading_weights@1"; rank 0 without it).
KILN_FAULT = "KILN_FAULT"
# Where Kiln's fused Triton kernels (RMSNorm with the residual add, SiLU-and-multiply, rotary) serve half-precision
# activations: "auto" on CUDA; "all" on the CPU too, in Triton's interpreter (slow: for checking them without a GPU);
# "off" nowhere, torch's own ops everywhere (the unfused step, for an A/B run or to rule the kernels out).
KILN_TRITON_FUSED = "KILN_TRITON_FUSED"
TRITON_FUSED_MODES = ("auto", "all", "off")
# What an FP8 block-quantized checkpoint's weights are held in (kiln.layers.fp8_linear): "auto" keeps them in FP8
# on CUDA from compute capability 8.9 and dequantizes them elsewhere; "keep" keeps them everywhere (on the CPU the
# kernels run in Triton's interpreter: slow, for checking them without a GPU); "dequantize" never (the A/B
# reference).
KILN_FP8_WEIGHTS = "KILN_FP8_WEIGHTS"
FP8_WEIGHTS_MODES = ("auto", "keep", "dequantize")
# inductor's own on-disk cache directory; the default for --compile-cache-dir when set.
TORCHINDUCTOR_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"
# SGLang's own switch, honoured under its name: a --context-length longer than the model's maximum position is
# refused unless it is "1" or "true" (positions past what the model was trained on may give wrong outputs).
SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"

# How the front starts its engine processes (vLLM's VLLM_WORKER_MULTIPROC_METHOD): "auto" forks them on the CPU
# when they start before the HTTP server runs, so that they inherit the front's imports (torch, transformers' config
# classes, Kiln: ~5 CPU s per rank) instead of importing everything again, and spawns them otherwise (CUDA cannot
# be used in a forked child once the parent has touched it; a model id's engines start after its download, beside
# uvicorn's threads and open connections); "spawn" always, "fork" wherever "auto" would allow it.
KILN_ENGINE_START_METHOD = "KILN_ENGINE_START_METHOD"
ENGINE_START_METHODS = ("auto", "fork", "spawn")
# Where startup keeps what each phase took on this host (kiln.server.startup_history), to predict the next start;
# the tests and the startup benchmark point it at a temporary file so that their starts teach the real one nothing.
KILN_STARTUP_HISTORY = "KILN_STARTUP_HISTORY"

FAULT_KINDS = ("crash", "stall")


class EnvError(ValueError):
    """An environment variable holds a value Kiln does not take."""


@dataclass(frozen=True)
class Fault:
    kind: str  # one of FAULT_KINDS
    phase: str
    rank: int = 0  # the tensor-parallel rank it hits


def fault() -> Fault | None:
    """KILN_FAULT parsed, or None when unset."""
    raw = os.environ.get(KILN_FAULT, "")
    if not raw:
        return None
    kind, sep, rest = raw.partition(":")
    phase, at, rank = rest.partition("@")
    if kind not in FAULT_KINDS or not sep or not phase or (at and not rank.isdigit()):
        raise EnvError(f"{KILN_FAULT}={raw!r}: expected crash:<phase> or stall:<phase>, optionally @<rank>")
    return Fault(kind, phase, int(rank) if at else 0)


def inductor_cache_dir() -> str | None:
    return os.environ.get(TORCHINDUCTOR_CACHE_DIR) or None


def startup_history_path() -> str:
    return os.environ.get(KILN_STARTUP_HISTORY) or os.path.join(
        os.path.expanduser("~"), ".cache", "kiln", "startup_history.json"
    )


def _mode(name: str, modes: tuple[str, ...]) -> str:
    """A variable that takes one of `modes`, the first its default."""
    raw = os.environ.get(name, modes[0])
    if raw not in modes:
        raise EnvError(f"{name}={raw!r}: expected one of {', '.join(modes)}")
    return raw


def triton_fused() -> str:
    return _mode(KILN_TRITON_FUSED, TRITON_FUSED_MODES)


def fp8_weights() -> str:
    return _mode(KILN_FP8_WEIGHTS, FP8_WEIGHTS_MODES)


def engine_start_method() -> str:
    return _mode(KILN_ENGINE_START_METHOD, ENGINE_START_METHODS)


def allow_longer_context_len() -> bool:
    return os.environ.get(SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN, "").lower() in ("1", "true")
