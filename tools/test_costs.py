"""Where the test suite's time goes: a pytest plugin that records each test's wall time and CPU time (the pytest
process's own and that of the child processes it reaped meanwhile: servers, ranks, compilers), and a summary of
such records by file, optionally against an earlier run's.

    PYTHONPATH=tools .venv/bin/python -m pytest -p test_costs -n 2 --dist loadfile     # writes .cache/test-costs.jsonl
    .venv/bin/python tools/test_costs.py .cache/test-costs.jsonl [EARLIER.jsonl] [--top 30]

A server started by a session fixture is reaped, and so counted, in the last test of its worker; a module
fixture's in that module's last test. TEST_COSTS names another output file."""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest

OUT = Path(os.environ.get("TEST_COSTS", ".cache/test-costs.jsonl"))


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    own0, kids0 = _cpu()
    start = time.monotonic()
    yield
    own1, kids1 = _cpu()
    record = {
        "id": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "wall": round(time.monotonic() - start, 3),
        "cpu": round(own1 - own0, 3),
        "children_cpu": round(kids1 - kids0, 3),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("a") as f:  # one line a test: the workers' appends do not interleave
        f.write(json.dumps(record) + "\n")


def by_file(path: Path) -> dict[str, list[float]]:
    """file -> [tests, wall s, CPU s (own + children)]"""
    files: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for line in path.read_text().splitlines():
        r = json.loads(line)
        row = files[r["id"].split("::")[0].removeprefix("tests/")]
        row[0] += 1
        row[1] += r["wall"]
        row[2] += r["cpu"] + r["children_cpu"]
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description="the suite's time by file, as a Markdown table")
    ap.add_argument("costs", type=Path)
    ap.add_argument("earlier", type=Path, nargs="?", help="an earlier run's records, for its columns beside")
    ap.add_argument("--top", type=int, default=30, help="rows, by wall time (the totals count every file)")
    args = ap.parse_args()
    now = by_file(args.costs)
    before = by_file(args.earlier) if args.earlier else {}
    cols = ["file", "tests", "wall s", "CPU s"] + (["earlier wall s", "earlier CPU s"] if before else [])
    print("| " + " | ".join(cols) + " |\n|---|" + "---:|" * (len(cols) - 1))
    names = sorted(
        set(now) | set(before), key=lambda f: -max(now.get(f, [0, 0])[1], before.get(f, [0, 0])[1])
    )
    total = [0.0] * 4
    for i, name in enumerate(names):
        n, wall, cpu = now.get(name, [0, 0.0, 0.0])
        _, wall0, cpu0 = before.get(name, [0, 0.0, 0.0])
        total = [total[0] + wall, total[1] + cpu, total[2] + wall0, total[3] + cpu0]
        if i < args.top:
            cells = [name, f"{n:.0f}", f"{wall:.0f}", f"{cpu:.0f}"] + (
                [f"{wall0:.0f}", f"{cpu0:.0f}"] if before else []
            )
            print("| " + " | ".join(cells) + " |")
    last = [f"all {len(names)} files", "", f"{total[0]:.0f}", f"{total[1]:.0f}"]
    print("| " + " | ".join(last + ([f"{total[2]:.0f}", f"{total[3]:.0f}"] if before else [])) + " |")


if __name__ == "__main__":
    main()
