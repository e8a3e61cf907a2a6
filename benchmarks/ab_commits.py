"""Kiln at one commit against Kiln at another, side by side: did a change move the serving figures?

Both servers are up at once (the base commit from a git worktree, the other from this checkout), configured alike
as a user deploys them (`kiln serve` at its defaults), and `kiln bench serve` sends each workload to one, then the
other, their order swapped each repetition. Each figure is the minimum over the repetitions of the per-token time
(its output tok/s the maximum), with the host's CPU model and load average printed beside it.

    .venv/bin/python benchmarks/ab_commits.py --base 083fd3e [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_runs import bench, start_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {"one stream": 1, "32 streams": 32}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def start_at(checkout: Path, flags: list[str], log: Path):
    """`kiln serve` run from `checkout` (its kiln package first on the path), with this venv's Python."""
    here = Path.cwd()
    os.chdir(checkout)
    try:
        return start_server(flags, log)
    finally:
        os.chdir(here)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare against (a worktree of it is made)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--one-stream", type=int, default=6, help="requests of the one-stream workload")
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--flag", action="append", default=[], help="a `kiln serve` flag for both, repeatable")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-ab-"))
    base = work / "base"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base], check=True
    )
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    names = {"base": f"base {args.base}", "head": f"head {head.stdout.strip()}"}
    procs = []
    try:
        servers = {}
        for key, checkout in (("base", base), ("head", ROOT)):
            proc, url = start_at(checkout, args.flag, work / f"{key}.log")
            procs.append(proc)
            servers[key] = url
        results: dict[tuple[str, str], list[float]] = {}
        loads = []
        for rep in range(args.reps):
            order = ["base", "head"] if rep % 2 == 0 else ["head", "base"]
            for workload, streams in WORKLOADS.items():
                for key in order:
                    loads.append(os.getloadavg()[0])
                    out = bench(servers[key], streams, args, work / f"{key}-{rep}-{streams}.json")
                    results.setdefault((workload, key), []).append(out["output_throughput"])
        report(results, names, loads, args)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)


def report(results: dict, names: dict, loads: list[float], args: argparse.Namespace) -> None:
    print(
        f"host: {cpu_model()}, {os.cpu_count()} cores; load average at each run {min(loads):.1f}-{max(loads):.1f}"
    )
    print(
        f"random {args.input_len} in / {args.output_len} out, {args.reps} repetitions alternating, output tok/s"
    )
    print(
        f"| workload | {names['base']} best / median | {names['head']} best / median | head / base (best) |"
    )
    print("|---|---:|---:|---:|")
    for workload in WORKLOADS:
        base, head = results[(workload, "base")], results[(workload, "head")]
        print(
            f"| {workload} | {max(base):.1f} / {statistics.median(base):.1f} | {max(head):.1f} / "
            f"{statistics.median(head):.1f} | {max(head) / max(base):.3f} |"
        )
    print(json.dumps({f"{w} {k}": v for (w, k), v in results.items()}))
    print(f"at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


if __name__ == "__main__":
    main()
