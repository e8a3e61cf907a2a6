"""Startup as observable data on real `kiln serve` processes: phases in order through /status and the
--startup-events file, probes 503 until warmed up, `kiln wait` exit codes, a crashing or stalling engine ends
the server with a non-zero exit and its reason and leaves no child behind, a config that does not fit is refused
before allocating with `kiln plan`'s words, and the memory check is within 5%.

The four servers start at once (one module fixture) so the module costs one startup of wall time."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import ServerProcess

from kiln.layers.kernel_builds import kernels_for

pytestmark = pytest.mark.slow

SMALL = ["--max-total-tokens", "4096", "--max-running-requests", "8", "--chunked-prefill-size", "512"]
ORDER = [
    "launching",
    "building_kernels",
    "loading_weights",
    "allocating_kv",
    "capturing",
    "capture_draft",
    "warming_up",
    "ready",
]
# the extensions a default CPU start loads (none without AVX2)
KERNELS = [k.name for k in kernels_for("auto")]
BOOT_S = 240.0  # the most any server here may take to become ready or to fail
REFUSE = ["--device-memory", "1GiB", "--max-total-tokens", "10000000"]


@dataclass
class Watch:
    """What was seen of one server while it started (filled by a thread)."""

    srv: ServerProcess
    events: Path | None = None
    children: dict[int, psutil.Process] = field(default_factory=dict)
    polls: list[dict] = field(default_factory=list)  # /status phase with the /ready and /health answers
    exit_code: int | None = None
    wait_result: tuple[int | None, str] | None = None  # `kiln wait` run alongside: (exit code, stderr)


def start_wait(url: str, timeout: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kiln.cli", "wait", url, "--timeout", str(timeout)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_wait(p: subprocess.Popen, within: float) -> tuple[int | None, str]:
    """The exit code and output of `kiln wait`; None as the code if it had not exited within `within` s."""
    try:
        out, err = p.communicate(timeout=within)
        return p.returncode, out + err
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        return None, out + err + f"\n(still waiting {within:.0f} s later; killed)"


def kiln_wait(url: str, timeout: float, kill_after: float) -> tuple[int | None, str]:
    return finish_wait(start_wait(url, timeout), kill_after)


def note_children(w: Watch) -> None:
    try:
        for c in psutil.Process(w.srv.proc.pid).children(recursive=True):
            w.children.setdefault(c.pid, c)
    except psutil.Error:
        pass


def watch_until_exit(w: Watch, wait_alongside: bool = False) -> None:
    """Records children until the server exits; optionally runs `kiln wait` against it meanwhile."""
    waiter = start_wait(w.srv.url, BOOT_S) if wait_alongside else None
    deadline = time.time() + BOOT_S
    while w.srv.proc.poll() is None and time.time() < deadline:
        note_children(w)
        time.sleep(0.1)
    w.exit_code = w.srv.proc.poll()
    if waiter is not None:  # `kiln wait` must notice a failed server within 20 s, not wait out its timeout
        w.wait_result = finish_wait(waiter, 20)


def poll_until_ready(w: Watch) -> None:
    deadline = time.time() + BOOT_S
    with httpx.Client(timeout=5) as http:
        while time.time() < deadline and w.srv.proc.poll() is None:
            note_children(w)
            try:
                ready, health = http.get(f"{w.srv.url}/ready"), http.get(f"{w.srv.url}/health")
                # read the phase *after* both probes: phases only move forward, so a phase that is still
                # not "ready" here was not "ready" when the probes answered either
                status = http.get(f"{w.srv.url}/status").json()
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            w.polls.append(
                {
                    "phase": status["phase"],
                    "eta_s": status.get("eta_s", "missing"),
                    "predicted_s": status.get("predicted_s"),
                    "ready": ready.status_code,
                    "health": health.status_code,
                    "ready_body": ready.json() if ready.status_code == 503 else None,
                }
            )
            if ready.status_code == 200 and status["phase"] == "ready":
                return
            time.sleep(0.05)


@pytest.fixture(scope="module")
def boot(tmp_path_factory, default_model):
    d = tmp_path_factory.mktemp("startup")
    ev = {k: d / f"{k}.events.jsonl" for k in ("ok", "stall", "refuse")}
    w = {
        "ok": Watch(ServerProcess([*SMALL, "--startup-events", str(ev["ok"])], d / "ok.log"), ev["ok"]),
        "crash": Watch(ServerProcess(SMALL, d / "crash.log", {"KILN_FAULT": "crash:allocating_kv"})),
        "stall": Watch(
            ServerProcess(
                [*SMALL, "--watchdog-timeout", "5", "--startup-events", str(ev["stall"])],
                d / "stall.log",
                {"KILN_FAULT": "stall:loading_weights"},
            ),
            ev["stall"],
        ),
        "refuse": Watch(
            ServerProcess([*REFUSE, "--startup-events", str(ev["refuse"])], d / "refuse.log"), ev["refuse"]
        ),
    }
    early = {}
    threads = [
        threading.Thread(target=poll_until_ready, args=(w["ok"],)),
        threading.Thread(target=watch_until_exit, args=(w["crash"], True)),
        threading.Thread(target=watch_until_exit, args=(w["stall"],)),
        threading.Thread(target=watch_until_exit, args=(w["refuse"],)),
        threading.Thread(target=lambda: early.update(r=kiln_wait(w["ok"].srv.url, 1, 60))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOOT_S + 30)
    w["early_wait"] = early.get("r")
    try:
        yield w
    finally:
        for k in ("ok", "crash", "stall", "refuse"):
            w[k].srv.stop()


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_no_children_left(w: Watch, timeout: float = 15.0) -> None:
    assert w.children, "never saw the engine child process"
    deadline = time.time() + timeout
    alive: list = []
    while time.time() < deadline:
        alive = []
        for p in w.children.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append((p.pid, " ".join(p.cmdline())[:120]))
            except psutil.Error:
                pass
        if not alive:
            return
        time.sleep(0.2)
    pytest.fail(f"processes left behind by kiln serve: {alive}")


# ---------------------------------------------------------------------------------------------- a good start
def test_phases_in_order_through_status(boot):
    w = boot["ok"]
    assert w.polls and w.polls[-1]["phase"] == "ready", w.srv.log_text()[-3000:]
    seen = [p["phase"] for p in w.polls]
    distinct = [p for i, p in enumerate(seen) if i == 0 or p != seen[i - 1]]
    assert all(p in ORDER for p in distinct), distinct
    idx = [ORDER.index(p) for p in distinct]
    assert idx == sorted(idx) and len(set(idx)) == len(idx), f"phases out of order: {distinct}"
    # the server answers while the engine loads; a forked engine (the CPU's) may be past launching by then
    assert distinct[0] in ORDER[: ORDER.index("loading_weights") + 1], distinct
    assert {"loading_weights", "ready"} <= set(distinct), distinct
    status = httpx.get(f"{w.srv.url}/status", timeout=10).json()
    assert status["error"] is None and status["ledger"], status
    for phase in ("launching", "loading_weights", "allocating_kv", "warming_up"):
        assert phase in status["timings"], status["timings"]


def test_status_predicts_each_phase_and_an_eta_that_only_falls(boot):
    """/status carries the startup prediction from the first poll, and eta_s (seconds to ready) never rises by
    more than a second between polls, and is null once ready."""
    polls = boot["ok"].polls
    assert polls and polls[-1]["phase"] == "ready"
    predicted = polls[0]["predicted_s"]
    assert predicted and {"launching", "loading_weights", "warming_up", "total"} <= set(predicted), predicted
    assert predicted["total"] == pytest.approx(sum(v for k, v in predicted.items() if k != "total"), abs=0.5)
    etas = [p["eta_s"] for p in polls if p["phase"] != "ready"]
    assert etas and all(isinstance(e, (int, float)) and e > 0 for e in etas), etas
    assert all(b - a <= 1.0 for a, b in zip(etas, etas[1:])), etas
    assert polls[-1]["eta_s"] is None


def test_phases_in_order_in_events_file(boot):
    recs = events(boot["ok"].events)
    phases = [r["phase"] for r in recs if r["event"] == "phase"]
    building = ["building_kernels"] if KERNELS else []
    assert [p for p in phases if p != "capturing"] == [
        "launching",
        *building,
        "loading_weights",
        "allocating_kv",
        "warming_up",
        "ready",
    ], phases
    assert all(isinstance(r["time"], float) for r in recs)
    times = [r["time"] for r in recs]
    assert times == sorted(times)
    assert all(r["phase"] in ORDER for r in recs if r["event"] == "progress")
    assert not [r for r in recs if r["event"] == "failed"]


@pytest.mark.skipif(not KERNELS, reason="no Kiln kernel on this CPU")
def test_kernel_loads_are_their_own_phase_in_status_and_log(boot):
    """Whether first or cached (the test machine's cache decides), the phase names what it loads and /status and
    the log say what each load took."""
    w = boot["ok"]
    [entered] = [r for r in events(w.events) if r["event"] == "phase" and r["phase"] == "building_kernels"]
    assert entered["kernels"] == KERNELS and isinstance(entered["first_build"], bool), entered
    status = httpx.get(f"{w.srv.url}/status", timeout=10).json()
    assert [k["name"] for k in status["kernels"]] == KERNELS, status["kernels"]
    assert all(k["loaded"] and k["first_build"] == k["built"] for k in status["kernels"]), status["kernels"]
    assert "building_kernels" in status["timings"]
    log = w.srv.log_text()
    for name in KERNELS:
        assert f"Kernel {name}: " in log and f"Kernel {name} " in log, log[-3000:]


def test_probes_503_with_phase_until_warmed_up(boot):
    w = boot["ok"]
    before = [p for p in w.polls if p["phase"] != "ready"]
    assert before, "never saw the server before it was ready"
    for p in before:
        assert p["ready"] == 503 and p["health"] == 503, p
        assert p["ready_body"]["ready"] is False and p["ready_body"]["phase"] in ORDER[:-1], p
    assert w.polls[-1]["ready"] == 200
    for path in ("/live", "/ready", "/health"):
        assert httpx.get(f"{w.srv.url}{path}", timeout=10).status_code == 200, path
    log = w.srv.log_text()
    assert log.index("Memory ledger") < log.index("Load weight begin")  # the ledger is printed first
    assert "The server is fired up and ready to roll!" in log


def test_kiln_wait_exit_codes_on_a_good_server(boot):
    code, text = boot["early_wait"]
    assert code == 2, f"`kiln wait --timeout 1` during startup: {code} {text}"
    assert "not ready after" in text
    code, text = kiln_wait(boot["ok"].srv.url, 30, 60)
    assert code == 0, text
    assert "is ready" in text


def test_the_engine_is_titled_and_holds_no_http_listener(boot):
    """The engine process is titled as SGLang titles its schedulers, and, forked from the front on the CPU, it
    closed the front's listening socket: holding it, the port would stay bound after the front ends."""
    w = boot["ok"]
    front = psutil.Process(w.srv.proc.pid)
    engines = [p for p in front.children() if " ".join(p.cmdline()).startswith("kiln::engine")]
    assert len(engines) == 1, [p.cmdline() for p in front.children()]

    def listens(p: psutil.Process) -> bool:
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == w.srv.port for c in p.net_connections("tcp")
        )

    assert listens(front) and not listens(engines[0])


def test_memory_check_within_5_percent(boot):
    info = httpx.get(f"{boot['ok'].srv.url}/get_server_info", timeout=30).json()
    rows = {r["name"]: r for r in info["memory_check"]}
    for name in ("weights", "kv_pool"):
        r = rows[name]
        assert r["predicted"] > 0 and r["measured"] > 0, r
        err = (r["measured"] - r["predicted"]) / r["predicted"]
        assert abs(err) <= 0.05, r
        assert abs(err - r["error"]) < 1e-3, r


# ---------------------------------------------------------------------------------------------- failures
def test_engine_crash_ends_server_with_reason_and_no_orphans(boot):
    w = boot["crash"]
    assert w.exit_code is not None and w.exit_code != 0, (w.exit_code, w.srv.log_text()[-3000:])
    log = w.srv.log_text()
    assert "Kiln failed" in log and "allocating_kv" in log and "exited with code 3" in log, log[-3000:]
    assert "The server is fired up" not in log
    assert_no_children_left(w)


def test_kiln_wait_reports_the_failed_phase(boot):
    code, text = boot["crash"].wait_result
    assert code == 1, f"`kiln wait` on a crashing server gave {code}: {text[-500:]}"
    assert "allocating_kv" in text and "exited with code 3" in text, text


def test_watchdog_fires_on_a_stalled_phase(boot):
    w = boot["stall"]
    assert w.exit_code is not None and w.exit_code != 0, w.srv.log_text()[-3000:]
    failed = [r for r in events(w.events) if r["event"] == "failed"]
    assert len(failed) == 1, failed
    assert failed[0]["phase"] == "loading_weights", failed[0]
    assert "--watchdog-timeout" in failed[0]["reason"]
    # the limit was given (--watchdog-timeout 5): it says so, beside the phase's prediction and its time so far
    assert "(predicted " in failed[0]["reason"] and ", elapsed " in failed[0]["reason"], failed[0]
    assert "phase loading_weights made no progress" in w.srv.log_text()
    assert_no_children_left(w)


def test_config_that_does_not_fit_is_refused_like_kiln_plan(boot, default_model):
    w = boot["refuse"]
    assert w.exit_code is not None and w.exit_code != 0, w.srv.log_text()[-3000:]
    log = w.srv.log_text()
    plan = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "plan", "--model-path", default_model, *REFUSE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 1, plan.stdout + plan.stderr
    verdict = plan.stdout[plan.stdout.index("verdict: does not fit") :]
    message = verdict.split(" fails: ", 1)[1].splitlines()[0].strip()
    fix = next(line.strip() for line in verdict.splitlines() if line.strip().startswith("fix:"))
    assert message in log and fix in log, f"plan said:\n{verdict}\nserve said:\n{log[-3000:]}"
    assert "Kiln will not start" in log
    # refused before anything large was allocated: no weights loaded, no KV pool
    assert "Load weight begin" not in log and "KV Cache is allocated" not in log
    phases = [r["phase"] for r in events(w.events) if r["event"] == "phase"]
    assert phases == ["launching"], phases
    assert_no_children_left(w)
