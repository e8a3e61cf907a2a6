"""`kiln wait URL`: follow a starting server's phases with a progress bar; exit 0 when ready, 1 with the failed
phase and reason, 2 on timeout (and, as argparse does, on bad arguments). The replacement for polling logs for
"fired up". A model id's download (downloading) shows its bytes done and total and the rate. A kernel build
(building_kernels) shows what is compiling, whether it is a first build, the seconds elapsed and how long the last
build took: a compiler reports no progress of its own. With the server's prediction, each text ends with the
seconds left ("eta 12 s", /status's eta_s). When stderr is not a terminal (a log file, CI), a line per
phase replaces the bar, whose redraws would fill the log."""

from __future__ import annotations

import sys
import time
from typing import TextIO

import httpx
from tqdm import tqdm

from kiln.core.argtypes import positive_float, server_url
from kiln.loader.hub import progress_text
from kiln.server.startup import PHASES

# Without a terminal: the most often a phase's changed progress is logged again (its first line is immediate).
LOG_EVERY_S = 30.0


class _Bar:
    """The progress bar, for a terminal."""

    def __init__(self, quiet: bool) -> None:
        self.bar = tqdm(total=len(PHASES) - 1, desc="waiting for the server", disable=quiet, unit="phase")

    def show(self, step: int | None, text: str) -> None:
        if step is not None:
            self.bar.n = step
        self.bar.set_description(text, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class _Lines:
    """Progress as log lines: one when the phase (or text without a phase) changes, then at most one per
    LOG_EVERY_S while its progress text changes, so that a long kernel build shows it is alive in a few
    lines."""

    def __init__(self, quiet: bool, stream: TextIO) -> None:
        self.quiet, self.stream = quiet, stream
        self.key: object = None
        self.text, self.at = "", 0.0

    def show(self, step: int | None, text: str) -> None:
        key = step if step is not None else text
        now = time.monotonic()
        changed = key != self.key or (text != self.text and now - self.at >= LOG_EVERY_S)
        if self.quiet or not changed:
            return
        where = f"[{step}/{len(PHASES) - 1}] " if step is not None else ""
        print(f"kiln wait: {where}{text}", file=self.stream, flush=True)
        self.key, self.text, self.at = key, text, now

    def close(self) -> None:
        pass


def _progress(quiet: bool) -> _Bar | _Lines:
    stream = sys.stderr
    return _Bar(quiet) if stream.isatty() else _Lines(quiet, stream)


def _status(client: httpx.Client, url: str) -> dict:
    """Kiln's /status; in front of --dp-size replicas (sglang-router, which has no /status) the router's /health:
    ready or not, without phases."""
    r = client.get(f"{url}/status")
    if r.status_code != 404:
        return r.json()
    ready = client.get(f"{url}/health").status_code == 200
    return {"phase": "ready" if ready else "waiting for the router's workers"}


def wait(url: str, timeout: float, interval: float = 1.0, quiet: bool = False) -> int:
    url = url.rstrip("/")
    deadline = time.time() + timeout
    bar = _progress(quiet)
    last_phase, misses = None, 0
    # one connection for every poll: polling stays cheap next to a busy startup
    client = httpx.Client(timeout=5)
    try:
        while time.time() < deadline:
            try:
                status = _status(client, url)
                misses = 0
            except (httpx.HTTPError, ValueError):
                misses += 1
                if last_phase is not None and misses >= 3:  # it answered before: it went away
                    bar.close()
                    print(f"kiln wait: the server went away during phase {last_phase}", file=sys.stderr)
                    return 1
                bar.show(None, "waiting for the server (not answering yet)")
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
            if phase == "shutting_down":
                bar.close()
                print(f"kiln wait: {url} is shutting down", file=sys.stderr)
                return 1
            step = PHASES.index(phase) if phase in PHASES else None
            bar.show(step, describe(phase, status.get("progress") or {}) + eta_text(status.get("eta_s")))
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
    seen = f"last phase: {last_phase}" if last_phase else "no phase reported yet"
    print(f"kiln wait: {url} not ready after {timeout:.0f} s ({seen})", file=sys.stderr)
    return 2


def describe(phase: str, progress: dict) -> str:
    """The bar's text for a phase and its latest progress report."""
    if phase == "building_kernels":
        return phase + _kernel_detail(progress)
    if phase == "downloading" and "bytes_done" in progress:
        return f"{phase} ({progress_text(progress)})"
    detail = ", ".join(f"{k}={v}" for k, v in progress.items())
    return phase + (f" ({detail})" if detail else "")


def eta_text(eta: float | None) -> str:
    """The seconds left to ready as /status predicts them; nothing without a prediction."""
    return f", eta {eta:.0f} s" if isinstance(eta, (int, float)) else ""


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
    p.add_argument("url", nargs="?", type=server_url, default="http://127.0.0.1:30000")
    p.add_argument("--timeout", type=positive_float, default=900.0, help="seconds (default 900)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=lambda ns: wait(ns.url, ns.timeout, quiet=ns.quiet))
