"""Kernel builds in sight: loading Kiln's C++ extensions is a startup phase of its own (building_kernels) that
names each extension, says whether it is a first build or a cached load and how long the last build took (kept
beside torch's cache), ticking the seconds while it runs; /status keeps what each load took and `kiln wait` shows
it in words. A fake extension stands in for the compiler here (nothing is compiled); a real server's phases are
tests/test_startup.py's."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import kiln.layers.kernel_builds as kernel_builds
from kiln.config import ServerArgs
from kiln.layers.kernel_builds import BLOCKED_GEMM, INT_GEMM, Kernel, build_kernels, kernels_for
from kiln.scheduler.launch import build_engine
from kiln.server.startup import PHASES, StartupState
from kiln.wait import describe

pytestmark = pytest.mark.engine


class FakeCompiler:
    """An extension whose load 'compiles' (writes its library into torch's build directory, taking `seconds`)
    when the library is missing or older than its source, as ninja decides, and otherwise just loads."""

    def __init__(self, root: Path, seconds: float = 0.5):
        self.source = root / "fake.cpp"
        self.source.write_text("// a source")
        self.seconds = seconds
        self.kernel = Kernel("kiln_fake", (str(self.source),), self.load)

    def load(self) -> object:
        library = Path(kernel_builds.build_directory(self.kernel)) / "kiln_fake.so"
        if not library.exists() or library.stat().st_mtime < self.source.stat().st_mtime:
            time.sleep(self.seconds)
            library.write_bytes(b"\x7fELF")
        return object()


@pytest.fixture
def fake(tmp_path, monkeypatch) -> FakeCompiler:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    return FakeCompiler(tmp_path)


def _run(kernel: Kernel) -> tuple[list[tuple[str, dict]], list]:
    seen: list[tuple[str, dict]] = []
    builds = build_kernels([kernel], lambda name, info: seen.append((name, info)), tick_s=0.1)
    return seen, builds


@pytest.mark.unit
def test_a_cold_start_builds_in_sight_and_a_second_loads_the_cached_build(fake):
    seen, [build] = _run(fake.kernel)
    assert seen[0] == (
        "building_kernels",
        {"kernels": ["kiln_fake"], "first_build": True, "last_build_s": None},
    )
    ticks = [info for name, info in seen[1:-1]]
    assert ticks and all(name == "progress" for name, _ in seen[1:]), seen
    assert {t["kernel"] for t in ticks} == {"kiln_fake"} and all(t["first_build"] for t in ticks)
    assert [t["elapsed_s"] for t in ticks] == sorted(t["elapsed_s"] for t in ticks)
    assert build.first_build and build.built and build.loaded and build.seconds >= 0.5
    record = json.loads((Path(kernel_builds.build_directory(fake.kernel)) / "kiln_build.json").read_text())
    assert record["name"] == "kiln_fake" and record["seconds"] == build.seconds
    assert seen[-1] == ("progress", {"kernels": [build.__dict__]})

    seen, [cached] = _run(fake.kernel)
    assert seen[0][1] == {"kernels": ["kiln_fake"], "first_build": False, "last_build_s": None}
    assert not cached.first_build and not cached.built and cached.last_build_s == build.seconds

    later = time.time() + 5  # an edited source: a first build again, expected to take the last one's time
    os.utime(fake.source, (later, later))
    seen, [rebuilt] = _run(fake.kernel)
    assert seen[0][1] == {"kernels": ["kiln_fake"], "first_build": True, "last_build_s": build.seconds}
    assert rebuilt.first_build and rebuilt.built and rebuilt.last_build_s == build.seconds


@pytest.mark.unit
def test_nothing_to_load_is_no_phase():
    seen: list = []
    assert build_kernels([], lambda name, info: seen.append(name)) == [] and seen == []


@pytest.mark.unit
def test_the_extensions_each_mode_loads(monkeypatch):
    monkeypatch.setattr(kernel_builds, "cpu_runs_kiln_kernel", lambda: True)
    assert kernels_for("onednn") == ()
    assert kernels_for("f32") == kernels_for("exact") == (BLOCKED_GEMM,)
    assert (
        kernels_for("auto") == kernels_for("kiln") == kernels_for("f32", "int8") == (BLOCKED_GEMM, INT_GEMM)
    )
    monkeypatch.setattr(kernel_builds, "cpu_runs_kiln_kernel", lambda: False)  # oneDNN does the matmuls
    assert kernels_for("auto") == ()


@pytest.mark.unit
def test_status_keeps_what_each_load_took_and_wait_says_it_in_words():
    assert PHASES.index("launching") < PHASES.index("building_kernels") < PHASES.index("loading_weights")
    state = StartupState()
    state.enter("building_kernels", kernels=["kiln_blocked_gemm"], first_build=True, last_build_s=95.0)
    tick = {"kernel": "kiln_blocked_gemm", "first_build": True, "last_build_s": 95.0, "elapsed_s": 12}
    state.step(**tick)
    assert state.to_dict()["progress"] == tick and state.to_dict()["kernels"] is None
    assert describe("building_kernels", tick) == (
        "building_kernels (kiln_blocked_gemm: first build, 12 s, the last build took 95 s)"
    )
    assert describe("building_kernels", {**tick, "first_build": False}) == (
        "building_kernels (kiln_blocked_gemm: cached, 12 s)"
    )
    assert describe("building_kernels", {"kernels": ["a", "b"]}) == "building_kernels (a, b)"
    done = [{"name": "kiln_blocked_gemm", "first_build": True, "built": True, "seconds": 93.1}]
    state.step(kernels=done)
    state.enter("loading_weights")
    assert state.to_dict()["kernels"] == done and state.to_dict()["timings"]["building_kernels"] >= 0
    assert describe("loading_weights", {"tensors_loaded": 3}) == "loading_weights (tensors_loaded=3)"


@pytest.mark.skipif(not kernels_for("auto"), reason="no Kiln kernel on this CPU")
def test_an_engine_start_loads_its_kernels_before_the_weights(tiny_llama):
    phases: list[tuple[str, dict]] = []
    args = ServerArgs(model_path=tiny_llama, device="cpu", max_total_tokens=512, cpu_gemm="f32")
    before = torch.get_num_threads()
    try:
        build_engine(args, lambda name, info: phases.append((name, info)))
    finally:
        torch.set_num_threads(before)
    names = [name for name, _ in phases if name != "progress"]
    assert names[:2] == ["building_kernels", "loading_weights"], names
    assert phases[0][1]["kernels"] == ["kiln_blocked_gemm"]
    report = next(info for name, info in phases if name == "progress" and "kernels" in info)
    assert [k["name"] for k in report["kernels"]] == ["kiln_blocked_gemm"] and report["kernels"][0]["loaded"]
