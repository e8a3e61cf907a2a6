"""`kiln wait URL`: follow a starting server's phases with a progress bar; exit 0 when ready, 1 with the failed
phase and reason, 2 on timeout. The replacement for polling logs for "fired up". A kernel build (building_kernels)
shows what is compiling, whether it is a first build, the seconds elapsed and how long the last build took: a
compiler reports no progress of its own."""

from __future__ import annotations

import sys
import time

import httpx
from tqdm import tqdm

from kiln.server.startup import PHASES


def wait(url: str, timeout: float, interval: float = 1.0, quiet: bool = False) -> int:
    url = url.rstrip("/")
    deadline = time.time() + timeout
    bar = tqdm(total=len(PHASES) - 1, desc="waiting for the server", disable=quiet, unit="phase")
    last_phase, misses = None, 0
    # one connection for every poll: polling stays cheap next to a busy startup
    client = httpx.Client(timeout=5)
    try:
        while time.time() < deadline:
            try:
                status = client.get(f"{url}/status").json()
                misses = 0
            except (httpx.HTTPError, ValueError):
                misses += 1
                if last_phase is not None and misses >= 3:  # it answered before: it went away
                    bar.close()
                    print(f"kiln wait: the server went away during phase {last_phase}", file=sys.stderr)
                    return 1
                bar.set_description("waiting for the server (not answering yet)")
                time.sleep(interval)
                continue
            phase = status.get("phase")
            if phase == "failed":
                err = status.get("error") or {}
                bar.close()
                print(
                    f"kiln wait: startup failed in phase {err.get('phase')}: {err.get('reason')}"
                    + (f"\nhint: {err['hint']}" if err.get("hint") else ""),
                    file=sys.stderr,
                )
                return 1
            if phase in PHASES:
                bar.n = PHASES.index(phase)
            bar.set_description(describe(phase, status.get("progress") or {}))
            bar.refresh()
            if phase != last_phase:
                last_phase = phase
            if phase == "ready":
                bar.close()
                if not quiet:
                    print(f"kiln wait: {url} is ready after {status.get('elapsed', 0):.1f} s")
                return 0
            time.sleep(interval)
    finally:
        bar.close()
        client.close()
    print(f"kiln wait: {url} not ready after {timeout:.0f} s (last phase: {last_phase})", file=sys.stderr)
    return 2


def describe(phase: str, progress: dict) -> str:
    """The bar's text for a phase and its latest progress report."""
    if phase == "building_kernels":
        return phase + _kernel_detail(progress)
    detail = ", ".join(f"{k}={v}" for k, v in progress.items())
    return phase + (f" ({detail})" if detail else "")


def _kernel_detail(progress: dict) -> str:
    """A kernel build's progress in words: the extension, first build or cached, seconds so far, the last build's
    duration; before the first tick, the extensions the phase loads."""
    if "kernel" in progress:
        first, last = progress.get("first_build"), progress.get("last_build_s")
        state = "first build" if first else "cached"
        expected = f", the last build took {last:.0f} s" if first and last else ""
        return f" ({progress['kernel']}: {state}, {progress.get('elapsed_s', 0)} s{expected})"
    names = [k if isinstance(k, str) else k.get("name", "?") for k in progress.get("kernels") or []]
    return f" ({', '.join(names)})" if names else ""


def register(subparsers) -> None:
    p = subparsers.add_parser("wait", help="wait for a starting server to be ready, showing its phases")
    p.add_argument("url", nargs="?", default="http://127.0.0.1:30000")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=lambda ns: wait(ns.url, ns.timeout, quiet=ns.quiet))
