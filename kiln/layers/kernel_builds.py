"""Kiln's C++ extensions built in sight: a startup phase of their own, or ahead of time at install.

torch's extension loader compiles an extension the first time a process loads it, then loads the cached build;
a first start otherwise sits a minute or more inside whichever step first multiplies a matrix, with nothing
saying why. Startup instead loads every extension the run will use first, in the `building_kernels` phase, which
names each one, says whether it is a first build (no cached build, or sources newer than it) or a cached load, and
how long the last build took, ticking the seconds elapsed while the compiler runs (it gives no progress to show).
The duration of each build is kept beside torch's cache of it (kiln_build.json in its build directory), so the
next first build (new sources, a cleared cache) can say how long to expect.

`python -m kiln.layers.kernel_builds` builds every extension ahead of time (`make install` runs it), so that a
first start only loads them.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import kiln.layers.cpu_gemm as cpu_gemm
import kiln.layers.int_gemm as int_gemm
from kiln.layers.extension_loader import extension_directory
from kiln.platform import cpu_runs_kiln_kernel, integer_compute

logger = logging.getLogger("kiln")

PHASE = "building_kernels"
RECORD = "kiln_build.json"  # in the extension's build directory: how long its last build took
TICK_S = 1.0  # seconds between progress reports while an extension builds or loads

OnPhase = Callable[[str, dict], None]


@dataclass(frozen=True)
class Kernel:
    """One of Kiln's C++ extensions: its torch extension name (its build directory's), its sources, and the
    function that loads it (building it on first use; None where it cannot be built, with a warning saying why)."""

    name: str
    sources: tuple[str, ...]
    load: Callable[[], object]


@dataclass(frozen=True)
class KernelBuild:
    """What loading one extension took: a compile (`built`) or a cached load, as expected beforehand or not."""

    name: str
    first_build: bool  # expected before loading: no cached build, or sources newer than it
    built: bool  # the build was (re)made: its library changed
    seconds: float
    last_build_s: float | None  # the previous build's duration, when one was recorded
    loaded: bool  # False where the extension could not be built (Kiln falls back, as its warning says)


BLOCKED_GEMM = Kernel("kiln_blocked_gemm", tuple(cpu_gemm._SOURCES), cpu_gemm.blocked_kernel)
INT_GEMM = Kernel("kiln_int_gemm", (int_gemm._SOURCE,), int_gemm.kernel)
ALL_KERNELS = (BLOCKED_GEMM, INT_GEMM)


def kernels_for(cpu_gemm_mode: str, quantization: str | None = None) -> tuple[Kernel, ...]:
    """The extensions a CPU run under --cpu-gemm `cpu_gemm_mode` (and --quantization) loads: none with --cpu-gemm
    onednn or on a CPU without AVX2/FMA (oneDNN then does the matmuls); Kiln's float32 kernels otherwise, and the
    integer kernels where the mode multiplies quantized weights in integers or --quantization int8 asks for them."""
    if cpu_gemm_mode == "onednn" or not cpu_runs_kiln_kernel():
        return ()
    if integer_compute(cpu_gemm_mode) or quantization == "int8":
        return (BLOCKED_GEMM, INT_GEMM)
    return (BLOCKED_GEMM,)


def build_directory(kernel: Kernel) -> str:
    """The extension's build directory (under TORCH_EXTENSIONS_DIR when set)."""
    return extension_directory(kernel.name, kernel.sources)


def _library_mtime(kernel: Kernel) -> float | None:
    path = os.path.join(build_directory(kernel), f"{kernel.name}.so")
    return os.path.getmtime(path) if os.path.exists(path) else None


def is_first_build(kernel: Kernel) -> bool:
    """Whether loading the extension will compile it: no cached library, or a source newer than it (the rule
    torch's ninja build follows)."""
    built = _library_mtime(kernel)
    return built is None or any(os.path.getmtime(source) > built for source in kernel.sources)


def last_build_seconds(kernel: Kernel) -> float | None:
    """How long the extension's last recorded build took, or None when none was recorded."""
    try:
        with open(os.path.join(build_directory(kernel), RECORD)) as f:
            return float(json.load(f)["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _record_build(kernel: Kernel, seconds: float) -> None:
    path = os.path.join(build_directory(kernel), RECORD)
    try:
        with open(path, "w") as f:
            json.dump({"name": kernel.name, "seconds": round(seconds, 1), "built_at": time.time()}, f)
    except OSError as e:  # a read-only cache still serves; only the next estimate is lost
        logger.warning(f"Could not record the build time of {kernel.name} in {path}: {e}")


def _expectation(first: bool, last: float | None) -> str:
    if not first:
        return "cached build: loading it"
    if last is None:
        return "first build here: compiling, typically a minute or two"
    return f"first build here: compiling, the last build took {last:.0f} s"


def _load_in_sight(kernel: Kernel, on_phase: OnPhase, tick_s: float) -> KernelBuild:
    """Loads one extension, reporting progress (the seconds elapsed) every tick_s while it builds or loads."""
    first, last = is_first_build(kernel), last_build_seconds(kernel)
    before = _library_mtime(kernel)
    logger.info(f"Kernel {kernel.name}: {_expectation(first, last)}.")
    info = {"kernel": kernel.name, "first_build": first, "last_build_s": last}
    t0 = time.perf_counter()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(tick_s):
            on_phase("progress", {**info, "elapsed_s": round(time.perf_counter() - t0)})

    ticker = threading.Thread(target=tick, name=f"kiln-build-{kernel.name}", daemon=True)
    ticker.start()
    try:
        extension = kernel.load()
    finally:
        done.set()
        ticker.join()
    seconds = time.perf_counter() - t0
    after = _library_mtime(kernel)
    built = after is not None and after != before
    if built:
        _record_build(kernel, seconds)
    verb = "built" if built else "loaded from torch's extension cache"
    logger.info(f"Kernel {kernel.name} {verb} in {seconds:.1f} s.")
    return KernelBuild(kernel.name, first, built, round(seconds, 1), last, extension is not None)


def build_kernels(
    kernels: Sequence[Kernel], on_phase: OnPhase | None = None, tick_s: float = TICK_S
) -> list[KernelBuild]:
    """Loads each extension in the `building_kernels` startup phase, entered (through on_phase, as
    kiln.scheduler.launch reports phases) with the names, whether any is a first build, and what the last builds
    of those took together where each was recorded; progress follows every tick_s, and a last report lists what
    each load took. No phase when there is nothing to load."""
    if not kernels:
        return []
    report = on_phase or (lambda name, info: None)
    lasts = [last_build_seconds(k) for k in kernels if is_first_build(k)]
    known = bool(lasts) and None not in lasts
    report(
        PHASE,
        {
            "kernels": [k.name for k in kernels],
            "first_build": bool(lasts),
            "last_build_s": round(sum(lasts), 1) if known else None,
        },
    )
    builds = [_load_in_sight(k, report, tick_s) for k in kernels]
    report("progress", {"kernels": [asdict(b) for b in builds]})
    return builds


def main() -> int:
    """`python -m kiln.layers.kernel_builds`: build (or load) every Kiln extension now, printing what each took;
    several build side by side, each in a process of its own (one compiler each: `make install` on two cores).
    Exits 0 even where one cannot be built: Kiln then runs without it, as the warning says."""
    kernels = ALL_KERNELS if cpu_runs_kiln_kernel() else (INT_GEMM,)
    if len(kernels) == 1:
        _build_alone(kernels[0])
        return 0
    with ProcessPoolExecutor(len(kernels), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_build_alone, kernels))
    return 0


def _build_alone(kernel: Kernel) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    build_kernels([kernel], _show_progress)


def _show_progress(name: str, info: dict) -> None:
    if name == "progress" and "elapsed_s" in info and info["elapsed_s"] % 15 == 0:
        print(f"  {info['kernel']}: {info['elapsed_s']} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
