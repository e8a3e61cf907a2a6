"""Build, locate and run llama.cpp's `llama-server` for benchmarks/compare.py.

The sources are the llama.cpp tree vendored in the llama-cpp-python sdist on PyPI; the build, and any
requantized model, are cached outside the repository (default ~/.cache/kiln/llama.cpp-<version>/).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

SDIST_VERSION = "0.3.36"
CACHE = Path(os.environ.get("KILN_LLAMA_CPP_CACHE", f"~/.cache/kiln/llama.cpp-{SDIST_VERSION}")).expanduser()
CMAKE_FLAGS = (
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
)  # fmt: skip
TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")


def source_dir(cache: Path = CACHE) -> Path:
    return cache / "src" / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"


def binary(name: str, cache: Path = CACHE) -> Path:
    return cache / "build" / "bin" / name


def _log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def fetch_sources(cache: Path = CACHE) -> Path:
    """Download the sdist with pip (no wheels, no deps) and unpack it, once."""
    src = source_dir(cache)
    if (src / "CMakeLists.txt").exists():
        return src
    sdist = cache / "sdist"
    pkg = f"llama-cpp-python=={SDIST_VERSION}"
    _log(f"pip download {pkg} -> {sdist}")
    pip = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        pkg,
        "-d",
        str(sdist),
    ]
    subprocess.run(pip, check=True, timeout=1800)
    tarball = sdist / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    with tarfile.open(tarball) as tar:
        tar.extractall(cache / "src", filter="data")
    if not (src / "CMakeLists.txt").exists():
        raise RuntimeError(f"{tarball} has no vendored llama.cpp at {src}")
    return src


def build(cache: Path = CACHE, jobs: int = 2, timeout: float = 3 * 3600) -> Path:
    """Build TARGETS (niced) unless they all exist; returns the bin directory."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a second caller waits, then finds it done
        if all(binary(t, cache).exists() for t in TARGETS):
            return binary(TARGETS[0], cache).parent
        if shutil.which("cmake") is None:
            raise RuntimeError("cmake not found: install it (e.g. apt-get install -y cmake)")
        src = fetch_sources(cache)
        out = cache / "build"
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []
        _log(f"building {', '.join(TARGETS)} in {out} (about 20 minutes on 2 cores)")
        subprocess.run(
            [*nice, "cmake", "-S", str(src), "-B", str(out), *CMAKE_FLAGS], check=True, timeout=600
        )
        cmd = [*nice, "cmake", "--build", str(out), "--target", *TARGETS, "-j", str(jobs)]
        subprocess.run(cmd, check=True, timeout=timeout)
    return binary(TARGETS[0], cache).parent


def quantize_command(model: Path, out: Path, qtype: str = "Q4_0", cache: Path = CACHE) -> list[str]:
    """The shipped GGUF is already quantized, so requantizing needs --allow-requantize."""
    return [str(binary("llama-quantize", cache)), "--allow-requantize", str(model), str(out), qtype]


def quantize(model: Path, qtype: str = "Q4_0", cache: Path = CACHE) -> Path:
    """`llama-quantize model out qtype`, cached beside the build."""
    out = cache / "models" / f"{model.stem}.{qtype}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    cmd = quantize_command(model, tmp, qtype, cache)
    _log(" ".join(cmd))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    tmp.rename(out)
    return out


def version(cache: Path = CACHE) -> str:
    """`llama-server --version` plus the vendored tree's commit (the sdist carries no tags)."""
    res = subprocess.run(
        [str(binary("llama-server", cache)), "--version"], capture_output=True, text=True, timeout=60
    )
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("version")]
    desc = subprocess.run(
        ["git", "-C", str(source_dir(cache)), "describe", "--tags", "--always"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    commit = desc.stdout.strip() if desc.returncode == 0 else "unknown"
    head = lines[0] if lines else "version unknown"
    return f"{head}; git describe: {commit}; from llama-cpp-python=={SDIST_VERSION} sdist"


def server_command(model: Path, port: int, parallel: int, ctx: int, threads: int = 2) -> list[str]:
    """llama-server on 127.0.0.1 with continuous batching over `parallel` slots sharing `ctx` tokens."""
    return [
        str(binary("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-tb", str(threads), "--parallel", str(parallel), "-c", str(ctx),
        "--no-webui",
    ]  # fmt: skip


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    """Poll GET {url}/health until 200; raise if the process dies or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s; log: {log}")


def stop(proc: subprocess.Popen, grace: float = 30.0) -> int:
    """SIGTERM the process group, SIGKILL after `grace` seconds; always reaps."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        except ProcessLookupError:
            proc.wait(30)
    return proc.returncode


@contextmanager
def running(cmd: list[str], url: str, log: Path, ready_timeout: float = 600.0) -> Iterator[subprocess.Popen]:
    """Start `cmd` in its own process group, wait for /health, yield it, then stop and reap it."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(url, proc, ready_timeout, log)
            yield proc
        finally:
            stop(proc)


if __name__ == "__main__":
    print(build())
