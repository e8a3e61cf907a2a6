"""benchmarks/compare.py's arithmetic: ratios paired per repetition, the verdict taken from the worst one, the
servers' order alternating, and fresh prompts per repetition (the run itself needs llama.cpp built and is a
benchmark, not a test)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_SPEC = importlib.util.spec_from_file_location(
    "compare", Path(__file__).resolve().parents[1] / "benchmarks" / "compare.py"
)
compare = importlib.util.module_from_spec(_SPEC)
sys.modules["compare"] = compare  # its dataclasses look their module up
_SPEC.loader.exec_module(compare)


def run(server: str, rep: int, tok_s: float, ttft: float, workload: str = "single") -> dict:
    return {"server": server, "workload": workload, "rep": rep, "output_throughput": tok_s, "mean_ttft_ms": ttft,
            "load_1min": 0.5 + rep, "cpu_ms_per_token": 10.0, "front_cpu_ms_per_token": 1.0,
            "completed": 4, "failed": 0, "median_tpot_ms": 12.0}  # fmt: skip


def data(runs: list[dict], target=(1.0, None)) -> dict:
    return {"workloads": [{"name": "single", "label": "one stream", "target": target}], "runs": runs}


def test_ratios_are_paired_per_repetition_and_the_verdict_takes_the_worst():
    # Kiln is ahead in repetitions 0 and 2 and behind in 1, where llama.cpp had a fast run: pairing by repetition
    # gives 1.2, 0.9, 1.1, not Kiln's best over llama.cpp's worst (1.33)
    runs = [run("Kiln", 0, 120, 100), run(compare.LLAMA, 0, 100, 200),
            run(compare.LLAMA, 1, 110, 200), run("Kiln", 1, 99, 100),
            run("Kiln", 2, 110, 100), run(compare.LLAMA, 2, 100, 250)]  # fmt: skip
    d = data(runs)
    assert compare.paired(d, "single", "output_throughput") == pytest.approx([1.2, 0.9, 1.1])
    assert compare.paired(d, "single", "mean_ttft_ms") == pytest.approx([0.5, 0.5, 0.4])
    row = compare.headline(d)[2]
    assert "0.90 / 1.10" in row and "≥ 1x: **no**" in row and "0.50-2.50" in row
    assert compare.verdict([1.0, 1.3], [], (1.0, None)) == "≥ 1x: yes"
    assert compare.verdict([10.5, 12.0], [0.1, 0.25], (10.0, 0.2)) == "≥ 10x, TTFT ≤ 0.2x: **no**"
    assert compare.verdict([0.5], [], (None, None)) == "—"


def test_a_repetition_missing_on_one_side_is_left_out_not_divided_by_zero():
    runs = [run("Kiln", 0, 120, 100), run(compare.LLAMA, 0, 100, 200), run("Kiln", 1, 99, 100),
            run(compare.LLAMA, 2, 0.0, 200), run("Kiln", 2, 50, 100)]  # fmt: skip
    assert compare.paired(data(runs), "single", "output_throughput") == pytest.approx([1.2])


def test_servers_take_turns_going_first():
    firsts = [compare.in_turn(["A", "B"], rep, i)[0] for rep in range(3) for i in range(2)]
    assert firsts == ["A", "B", "B", "A", "A", "B"]


def test_every_repetition_asks_new_prompts(tmp_path):
    a, b = (compare.workloads(False, rep, tmp_path) for rep in (0, 1))
    assert [w.name for w in a] == ["single", "random-c32", "shared-prefix", "chat-single", "chat-c32"]
    for wa, wb in zip(a, b, strict=True):
        assert wa.concurrency == wb.concurrency and wa.flags != wb.flags, wa.name
    chat = [
        json.loads(x)
        for x in Path(a[4].flags[a[4].flags.index("--dataset-path") + 1]).read_text().splitlines()
    ]
    assert len(chat) == 64 and len({c["prompt"] for c in chat}) == 64
    assert all(c["output_len"] == 128 and len(c["prompt"].split()) > 60 for c in chat)
