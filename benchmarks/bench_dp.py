"""Data parallelism: `kiln serve` (one server) against `kiln serve --dp-size 2` (two replicas behind SGLang's
router, the `kiln[router]` extra) with `kiln bench serve`, 32 streams and one stream: output tok/s and mean
TTFT.

The replicas split the host's cores between them (each is pinned to its share), so on a host with few cores
the comparison is one server using every core against two servers with half each, plus the router's hop.

    python benchmarks/bench_dp.py [--dp 1 2] [--model-path PATH] [--num-prompts 64] [--input-len 128]
        [--output-len 64] [--policy cache_aware] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(dp: int, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    """`kiln serve --dp-size dp`, ready (with replicas: once the launcher has seen the router register
    them)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--port", str(port), "--dp-size", str(dp)]
    cmd += ["--device", "cpu", "--max-total-tokens", "32768"]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    if dp > 1:
        cmd += ["--router-dp-worker-base-port", str(free_port()), "--router-policy", args.policy]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    ready = "The router is up" if dp > 1 else "ready to roll"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve --dp-size {dp} exited: {log.read_text()[-2000:]}")
        if ready in log.read_text():
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        time.sleep(1)
    proc.kill()
    raise TimeoutError(f"kiln serve --dp-size {dp} not ready")


def bench(url: str, streams: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "kiln.cli", "bench", "serve", "--backend", "kiln", "--base-url", url]
    prompts = args.num_prompts if streams > 1 else args.one_stream
    cmd += ["--dataset-name", "random", "--num-prompts", str(prompts)]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--random-range-ratio", "1", "--max-concurrency", str(streams), "--ignore-eos", "--disable-tqdm"]
    cmd += ["--output-json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    return json.loads(out.read_text().splitlines()[-1])


def run_dp(dp: int, args: argparse.Namespace, work: Path) -> list[dict]:
    proc, url = start_server(dp, args, work / f"serve-dp{dp}.log")
    rows = []
    try:
        for streams in (32, 1):
            record = bench(url, streams, args, work / f"dp{dp}-{streams}.json")
            rows.append(
                {
                    "dp": dp,
                    "streams": streams,
                    "output_tok_s": record["output_throughput"],
                    "mean_ttft_ms": record["mean_ttft_ms"],
                    "failed": record["failed"],
                }
            )
    finally:
        proc.terminate()
        proc.wait(120)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--model-path", default=None, help="default: Kiln's default model")
    p.add_argument("--num-prompts", type=int, default=64, help="requests of the 32-stream run")
    p.add_argument("--one-stream", type=int, default=4, help="requests of the one-stream run")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--policy", default="cache_aware", help="the router's --policy (dp > 1)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-dp-") as tmp:
        rows = [row for dp in args.dp for row in run_dp(dp, args, Path(tmp))]
    print(f"{'dp':>3} {'streams':>7} {'output tok/s':>12} {'mean TTFT ms':>12} {'failed':>6}")
    for r in rows:
        figures = f"{r['output_tok_s']:>12.1f} {r['mean_ttft_ms']:>12.1f} {r['failed']:>6}"
        print(f"{r['dp']:>3} {r['streams']:>7} {figures}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
