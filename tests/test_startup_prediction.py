"""Startup prediction (kiln.server.startup_prediction): each phase a size times a rate, cold and warm apart, the
host's history changing the next prediction; the history file (kiln.server.startup_history); /status's eta_s,
which only falls and is null at ready; the watchdog's per-phase limits; `kiln wait`'s ETA text; `kiln plan --json`."""

from __future__ import annotations

import json
import os
import types

import pytest

from kiln.config import ServerArgs
from kiln.server import startup as startup_mod
from kiln.server import startup_prediction as sp
from kiln.server.launch import WATCHDOG_MULTIPLE, Launcher
from kiln.server.startup import StartupState
from kiln.server.startup_history import MAX_KEYS, StartupHistory
from kiln.wait import eta_text

pytestmark = pytest.mark.unit
GIB = 1 << 30
CPUS = os.cpu_count() or 1


def facts(**kw) -> sp.StartupFacts:
    base = dict(device="cpu", host="test cpu", weight_bytes=2 * GIB)
    return sp.StartupFacts(**{**base, **kw})


def test_phases_are_sizes_times_rates():
    f = facts(shapes=("decode/1", "decode/2", "decode/4"), cached_shapes=frozenset({"decode/1"}))
    learned = {
        f"load_s_per_gib@{f.size_class}": 10.0,
        "capture_cold_s": 30.0,
        "capture_warm_s": 4.0,
        "launching_s": 7.0,
    }
    p = sp.predict(f, learned)
    assert p["loading_weights"] == 20.0  # 2 GiB x 10 s/GiB
    assert p["capturing"] == 2 * 30.0 + 4.0  # two cold shapes, one cached
    assert p["launching"] == 7.0
    assert p["total"] == pytest.approx(sum(v for k, v in p.items() if k != "total"), abs=0.2)
    assert (
        list(p)[:2] == ["launching", "loading_weights"]
        and "downloading" not in p
        and "capture_draft" not in p
    )


def test_a_start_with_nothing_to_capture_predicts_no_capturing_phase():
    # the phase is never entered then (kiln.scheduler.launch), and a row predicted for it would never end
    assert "capturing" not in sp.predict(facts())
    assert "capturing" in sp.predict(facts(shapes=("decode/1",)))


def test_cold_and_warm_starts_differ():
    shapes = ("decode/1", "decode/2")
    cold = sp.predict(facts(kernels=(("k", True, None),), shapes=shapes))
    warm = sp.predict(facts(kernels=(("k", False, None),), shapes=shapes, cached_shapes=frozenset(shapes)))
    assert cold["building_kernels"] == sp.DEFAULTS["kernel_cold_s"]
    assert warm["building_kernels"] == sp.DEFAULTS["kernel_warm_s"]
    assert (
        cold["capturing"]
        == 2 * sp.DEFAULTS["capture_cold_s"]
        > warm["capturing"]
        == 2 * sp.DEFAULTS["capture_warm_s"]
    )
    assert cold["total"] > 2 * warm["total"]
    # the first request after a cold capture has its own rate, learned apart from a warm start's
    assert (
        cold["warming_up"] == sp.DEFAULTS["warming_up_cold_s"]
        and warm["warming_up"] == sp.DEFAULTS["warming_up_s"]
    )
    # an extension's own recorded build time is the best estimate of its next build
    assert sp.predict(facts(kernels=(("k", True, 33.0),)))["building_kernels"] == 33.0


def test_a_download_is_predicted_and_said_in_its_bytes(tmp_path):
    first = facts(weight_bytes=3 * GIB, download_bytes=2 * GIB)  # a model id with one of its shards cached
    p = sp.predict(first)
    assert list(p)[:2] == ["downloading", "launching"]
    assert p["downloading"] == 2 * sp.DEFAULTS["download_s_per_gib"]
    assert sp.basis(first, "downloading") == "2.00 GiB to fetch"
    assert sp.basis(first, "loading_weights") == "3.00 GiB once fetched"
    cached = facts(weight_bytes=3 * GIB)
    assert (
        "downloading" not in sp.predict(cached) and sp.basis(cached, "loading_weights") == "3.00 GiB on disk"
    )
    # a small model's size is not "0.00 GiB"
    assert sp.basis(facts(weight_bytes=5 << 20, download_bytes=5 << 20), "downloading") == "5.0 MiB to fetch"
    # a local path is sized from its files, with nothing to download (the Hub's case: tests/test_hub.py)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    args = ServerArgs(model_path=str(tmp_path))
    assert sp.hub_bytes(args) is None and sp.model_bytes(args.model_path) == 1000


def test_history_changes_the_next_prediction(tmp_path):
    hist = StartupHistory(str(tmp_path / "h.json"))
    f = facts(kernels=(("kiln_x", True, None),), shapes=("decode/1",))
    before = sp.predict(f, hist.rates(f.key))
    timings = {"launching": 3.0, "building_kernels": 50.0, "loading_weights": 8.0, "capturing": 12.0}
    kernels = [{"name": "kiln_x", "built": True, "loaded": True, "seconds": 50.0}]
    hist.update(f.key, sp.observed_rates(f, timings, kernels))
    after = sp.predict(f, StartupHistory(str(tmp_path / "h.json")).rates(f.key))  # read back from the file
    assert after["launching"] == 3.0 and after["building_kernels"] == 50.0
    assert after["loading_weights"] == 8.0 and after["capturing"] == 12.0
    assert after != before
    # the next measurement moves a rate halfway: one outlier start does not replace the history
    hist.update(f.key, sp.observed_rates(f, {**timings, "launching": 5.0}, kernels))
    assert sp.predict(f, hist.rates(f.key))["launching"] == 4.0
    # another model size class keeps the built-in per-shape default; another host learns nothing from this one
    big = facts(weight_bytes=64 * GIB, shapes=("decode/1",))
    assert sp.predict(big, hist.rates(big.key))["capturing"] == sp.DEFAULTS["capture_cold_s"]
    assert hist.rates("another host|cpu") == {}


def test_mixed_cold_and_cached_capture_teaches_no_per_shape_rate():
    f = facts(shapes=("decode/1", "decode/2"), cached_shapes=frozenset({"decode/1"}))
    assert not any(k.startswith("capture_") for k in sp.observed_rates(f, {"capturing": 20.0}, None))
    warm = facts(shapes=("decode/1", "decode/2"), cached_shapes=frozenset({"decode/1", "decode/2"}))
    assert sp.observed_rates(warm, {"capturing": 20.0}, None) == {f"capture_warm_s@{warm.size_class}": 10.0}


def test_history_file_is_bounded_and_survives_garbage(tmp_path):
    path = tmp_path / "h.json"
    path.write_text("{not json")
    hist = StartupHistory(str(path))
    assert hist.rates("k") == {}
    for i in range(MAX_KEYS + 5):
        hist.update(f"host{i}|cpu", {"launching_s": float(i)})
    data = json.loads(path.read_text())
    assert len(data["hosts"]) == MAX_KEYS and "host0|cpu" not in data["hosts"]
    assert StartupHistory(str(path)).rates(f"host{MAX_KEYS + 4}|cpu") == {"launching_s": float(MAX_KEYS + 4)}
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary file, renamed


def test_compiled_shapes_make_the_next_capture_warm(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 4096)
    args = ServerArgs(model_path=str(model), compile_cache_dir=str(tmp_path / "cc"), cuda_graph_max_bs=4)
    (tmp_path / "cc").mkdir()
    shapes = sp.capture_shapes(args, "cpu")
    assert shapes == ("decode/1", "decode/2", "decode/4")
    assert sp.facts_for(args, "cpu").cold_shapes == 3
    sp.note_compiled(args, shapes[:2])
    f = sp.facts_for(args, "cpu")
    assert f.cold_shapes == 1 and f.weight_bytes == 4096
    other = ServerArgs(
        model_path=str(model), compile_cache_dir=str(tmp_path / "cc"), cuda_graph_max_bs=4, dtype="bfloat16"
    )
    assert sp.facts_for(other, "cpu").cold_shapes == 3  # compiled for another dtype: cold
    assert (
        sp.capture_shapes(ServerArgs(model_path=str(model)), "cpu") == ()
    )  # the CPU default captures nothing


def test_eta_only_falls_and_is_null_at_ready(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(startup_mod.time, "time", lambda: now[0])
    s = StartupState()
    assert s.to_dict()["eta_s"] is None  # no prediction: no ETA
    s.predicted = {
        "launching": 10.0,
        "loading_weights": 5.0,
        "capturing": 20.0,
        "warming_up": 1.0,
        "total": 36.0,
    }
    assert s.to_dict()["eta_s"] == 36.0 and s.to_dict()["predicted_s"]["total"] == 36.0
    seen = []
    for dt, phase in [
        (4, None),
        (4, None),
        (10, None),
        (0.5, "loading_weights"),
        (1, None),
        (30, "capturing"),
        (1, None),
    ]:
        now[0] += dt
        if phase:
            s.enter(phase)
        seen.append(s.eta())
    assert all(b <= a for a, b in zip(seen, seen[1:])), seen
    assert seen[0] == 32.0 and seen[1] == 28.0
    # launching overran (18 s of 10): held at the floor plus what comes after, not the overrun added back
    assert seen[2] == startup_mod.ETA_FLOOR_S + 26.0
    s.enter("ready")
    assert s.to_dict()["eta_s"] is None


def _launcher(timeout: float, predicted: dict | None) -> types.SimpleNamespace:
    state = types.SimpleNamespace(startup=types.SimpleNamespace(predicted=predicted))
    return types.SimpleNamespace(args=types.SimpleNamespace(watchdog_timeout=timeout), state=state)


def test_watchdog_limit_follows_the_prediction_unless_given():
    predicted = {"building_kernels": 200.0, "capturing": 30.0, "launching": 60.0}
    default = _launcher(ServerArgs.watchdog_timeout, predicted)
    assert Launcher.phase_limit(default, "building_kernels") == (
        WATCHDOG_MULTIPLE * 200.0,
        "3x the prediction",
    )
    assert Launcher.phase_limit(default, "capturing") == (300.0, "--watchdog-timeout")  # the floor
    given = _launcher(20.0, predicted)  # --watchdog-timeout 20: as given
    assert Launcher.phase_limit(given, "building_kernels") == (20.0, "--watchdog-timeout")
    assert Launcher.phase_limit(given, "launching") == (120.0, "--watchdog-timeout")
    assert Launcher.phase_limit(_launcher(300.0, None), "capturing") == (300.0, "--watchdog-timeout")


def test_wait_shows_the_eta():
    assert eta_text(12.4) == ", eta 12 s"
    assert eta_text(None) == ""


def test_a_busy_host_scales_the_cpu_phases_and_teaches_idle_rates():
    f = facts(shapes=("decode/1",), download_bytes=GIB)
    idle, busy = sp.predict(f), sp.predict(facts(shapes=("decode/1",), download_bytes=GIB, slowdown=2.0))
    assert busy["capturing"] == 2 * idle["capturing"] and busy["launching"] == 2 * idle["launching"]
    assert busy["downloading"] == idle["downloading"]  # the network, not the CPU
    # a start that ran with 4 runnable threads on 2 cores took twice what it would have alone
    rates = sp.observed_rates(f, {"launching": 10.0, "capturing": 60.0}, None, {"launching": 2.0 * CPUS})
    assert rates["launching_s"] == 5.0 and rates[f"capture_cold_s@{f.size_class}"] == 60.0
    assert sp.contention(1.0, 2) == 1.0 and sp.contention(6.0, 2) == 3.0


def test_plan_prints_the_prediction(tmp_path, monkeypatch, capsys):
    from kiln.plan import main

    monkeypatch.setattr(sp, "contention_at_launch", lambda cpus=None: 1.0)  # an idle host's figures
    monkeypatch.setenv("KILN_STARTUP_HISTORY", str(tmp_path / "h.json"))
    cc = ["--compile-cache-dir", str(tmp_path / "cc"), "--cuda-graph-max-bs", "2"]
    assert main(["--json", *cc]) == 0
    pred = json.loads(capsys.readouterr().out)["startup_prediction"]
    assert {"launching", "loading_weights", "allocating_kv", "capturing", "warming_up", "total"} <= set(pred)
    # two decode shapes, neither compiled into this fresh cache directory yet
    assert pred["capturing"] == 2 * sp.DEFAULTS["capture_cold_s"]
    assert pred["total"] == pytest.approx(sum(v for k, v in pred.items() if k != "total"), abs=0.5)
    assert main(cc) == 0
    text = capsys.readouterr().out
    assert "Startup prediction (built-in defaults" in text and "2 shapes: 2 cold, 0 cached" in text


def test_engines_fork_on_the_cpu_before_serving_and_spawn_otherwise(monkeypatch):
    """KILN_ENGINE_START_METHOD: "auto" forks a CPU start's engines (they inherit the front's imports) and spawns
    CUDA's and a model id's (started beside uvicorn); "spawn" always spawns; anything else is refused by name. The
    prediction's launching phase follows: a forked engine's rate, not a spawned one's."""
    from kiln.core.envs import EnvError
    from kiln.server.ranks import start_method

    args = ServerArgs(model_path="m")
    monkeypatch.delenv("KILN_ENGINE_START_METHOD", raising=False)
    assert start_method(args, forkable=True, device="cpu") == "fork"
    assert start_method(args, forkable=False, device="cpu") == "spawn"
    assert start_method(args, forkable=True, device="cuda") == "spawn"
    monkeypatch.setenv("KILN_ENGINE_START_METHOD", "spawn")
    assert start_method(args, forkable=True, device="cpu") == "spawn"
    monkeypatch.setenv("KILN_ENGINE_START_METHOD", "fork")
    assert start_method(args, forkable=True, device="cuda") == "spawn"
    monkeypatch.setenv("KILN_ENGINE_START_METHOD", "forkserver")
    with pytest.raises(
        EnvError, match="KILN_ENGINE_START_METHOD='forkserver': expected one of auto, fork, spawn"
    ):
        start_method(args, forkable=True, device="cpu")
    forked = sp.predict(facts(forked=True))
    assert sp.predict(facts())["launching"] == sp.DEFAULTS["launching_s"]
    assert forked["launching"] == sp.DEFAULTS["launching_fork_s"] < sp.DEFAULTS["launching_s"]
    learned = sp.observed_rates(facts(weight_bytes=1, forked=True), {"launching": 0.6}, None)
    assert learned["launching_fork_s"] == 0.6 and "launching_s" not in learned


def test_a_slow_disk_bounds_the_weight_load(tmp_path):
    """The weights' read rate, probed at launch: a disk slower than the load's own work sets loading_weights (bytes
    / rate, not scaled by the CPU's contention); a fast one leaves the CPU's rate to it. The probe reads the first
    weight file, and nothing where there is none."""
    cpu_bound = sp.predict(facts(slowdown=2.0))["loading_weights"]
    assert sp.predict(facts(slowdown=2.0, read_bytes_per_s=10 * GIB))["loading_weights"] == cpu_bound
    slow = sp.predict(facts(slowdown=2.0, read_bytes_per_s=GIB / 100))  # 2 GiB at 10 MiB/s
    assert slow["loading_weights"] == 200.0 > cpu_bound
    weights = tmp_path / "model.gguf"
    weights.write_bytes(os.urandom(3 << 20))
    assert sp.read_rate(str(weights)) > 0 and sp.read_rate(str(tmp_path / "missing")) is None
    assert sp.read_rate(str(tmp_path)) > 0  # a directory: its weight files
    probed = sp.facts_for(ServerArgs(model_path=str(weights), skip_server_warmup=True), "cpu", shapes=())
    assert probed.weight_bytes == 3 << 20 and probed.read_bytes_per_s > 0
    assert sp.basis(probed, "loading_weights").startswith("3.0 MiB on disk, read at ")
