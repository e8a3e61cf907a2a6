"""What the parallelism benchmarks share: start a `kiln serve` on a free port and wait until it is ready, and run
`kiln bench serve` against it at a number of streams (random prompts of fixed lengths, EOS ignored)."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    flags: list[str], log: Path, ready_line: str = "ready to roll"
) -> tuple[subprocess.Popen, str]:
    """`kiln serve --device cpu --max-total-tokens 32768 FLAGS` on a free port, once `ready_line` is in its log
    and /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--port", str(port), "--device", "cpu"]
    cmd += ["--max-total-tokens", "32768", *flags]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve {' '.join(flags)} exited: {log.read_text()[-2000:]}")
        if ready_line in log.read_text():
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        time.sleep(1)
    proc.kill()
    raise TimeoutError(f"kiln serve {' '.join(flags)} not ready")


def bench(url: str, streams: int, args: argparse.Namespace, out: Path) -> dict:
    """`kiln bench serve` at `streams` concurrent requests (args.num_prompts of them, or args.one_stream for one
    stream); its result record."""
    cmd = [sys.executable, "-m", "kiln.cli", "bench", "serve", "--backend", "kiln", "--base-url", url]
    prompts = args.num_prompts if streams > 1 else args.one_stream
    cmd += ["--dataset-name", "random", "--num-prompts", str(prompts)]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--random-range-ratio", "1", "--max-concurrency", str(streams), "--ignore-eos", "--disable-tqdm"]
    cmd += ["--output-json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    return json.loads(out.read_text().splitlines()[-1])


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64, help="requests of the 32-stream run")
    p.add_argument("--one-stream", type=int, default=4, help="requests of the one-stream run")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
