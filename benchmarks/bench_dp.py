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
import subprocess
import tempfile
from pathlib import Path

from serve_runs import add_load_args, bench, free_port, start_server


def start_dp_server(dp: int, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    """`kiln serve --dp-size dp`, ready (with replicas: once the launcher has seen the router register them)."""
    flags = ["--dp-size", str(dp)] + (["--model-path", args.model_path] if args.model_path else [])
    if dp > 1:
        flags += ["--router-dp-worker-base-port", str(free_port()), "--router-policy", args.policy]
    return start_server(flags, log, "The router is up" if dp > 1 else "ready to roll")


def run_dp(dp: int, args: argparse.Namespace, work: Path) -> list[dict]:
    proc, url = start_dp_server(dp, args, work / f"serve-dp{dp}.log")
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
    add_load_args(p)
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
