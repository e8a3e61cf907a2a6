"""Ranks that fail, nodes and signals: a rank that crashes or stalls in a phase ends `kiln serve --tp-size 2`
naming it and its phase (the five faults start at once, so the module waits out one watchdog, not five), a tp that
does not divide the heads is refused before loading, two `kiln serve` processes form one group as node 0 and
node 1, an engine stalled mid-stream fails its request, and SIGTERM leaves no engine process behind."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import ServerProcess, free_port
from test_tp import COMMON, GREEDY, PROMPTS, generate, ids

pytestmark = pytest.mark.slow


def engine_children(proc: subprocess.Popen, count: int, timeout: float = 120) -> list[psutil.Process]:
    """The server's engine processes once count of them run."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            kids = [
                p
                for p in psutil.Process(proc.pid).children()
                if " ".join(p.cmdline()).startswith("kiln::engine")
            ]
        except psutil.Error:
            kids = []
        if len(kids) >= count or proc.poll() is not None:
            return kids
        time.sleep(0.2)
    return []


def assert_gone(kids: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(kids, timeout=5)
    assert not alive, alive


FAULTS = {
    "crash:loading_weights@1": "loading_weights",
    "stall:loading_weights@1": "loading_weights",
    "crash:capturing@1": "capturing",
    "crash:serving@1": "serving",
    "stall:serving@1": "serving",
}


class FailingServer:
    """A tp 2 server with a fault injected in rank 1, followed by a thread until it exits: its engine processes
    and every /health answer it gave meanwhile."""

    def __init__(self, model: str, fault: str, phase: str, log: Path):
        # capture runs only when a graph shape is asked for (the CPU compiles none by default); the fault fires as
        # rank 1 enters the phase, before anything compiles
        graphs = ["--cuda-graph-bs", "1"] if phase == "capturing" else []
        self.srv = ServerProcess(
            ["--model-path", model, "--tp-size", "2", *COMMON, *graphs, "--watchdog-timeout", "20"],
            log,
            {"KILN_FAULT": fault},
        )
        self.kids: list[psutil.Process] = []
        self.health: list[int] = []
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        self.kids = engine_children(self.srv.proc, 2)
        while self.srv.proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                self.health.append(httpx.get(f"{self.srv.url}/health", timeout=2).status_code)
            time.sleep(0.5)

    def finish(self, timeout: float = 300) -> int:
        self.thread.join(timeout)
        return self.srv.stop()


@pytest.fixture(scope="module")
def failing(tiny_llama, tmp_path_factory):
    """The five faults' servers, started together: most of their time is a watchdog's wait."""
    d = tmp_path_factory.mktemp("faults")
    servers = {
        fault: FailingServer(tiny_llama, fault, phase, d / f"{fault.replace(':', '-')}.log")
        for fault, phase in FAULTS.items()
    }
    yield servers
    for server in servers.values():
        server.srv.stop()


@pytest.mark.parametrize("fault, phase", FAULTS.items())
def test_a_failing_rank_ends_the_server(failing, fault, phase):
    server = failing[fault]
    code = server.finish()
    failure = next(
        line for line in Path(server.srv.log_path).read_text().splitlines() if "Kiln failed" in line
    )
    assert code != 0 and "rank 1" in failure and phase in failure, failure
    assert 200 not in server.health
    assert_gone(server.kids)


def test_tp_size_that_does_not_divide_is_refused(default_model, tmp_path):
    srv = ServerProcess(
        ["--model-path", default_model, "--tp-size", "2", "--device", "cpu"], tmp_path / "s.log"
    )
    assert srv.proc.wait(120) == 1
    srv.stop()
    log = Path(srv.log_path).read_text()
    assert "num_attention_heads 9" in log and "that work: 1, 3" in log and "Load weight" not in log


def test_in_process_engine_refuses_several_ranks():
    """kiln.Engine is one process: it refuses --tp-size 2 before reading the model instead of running one rank."""
    from kiln.config import ServerArgs
    from kiln.scheduler.launch import build_engine
    from kiln.scheduler.resolve import StartupRefused

    with pytest.raises(StartupRefused, match="one process per rank"):
        build_engine(ServerArgs(model_path="/nonexistent", tp_size=2))


@pytest.mark.unit
def test_nnodes_needs_dist_init_addr():
    from kiln.config import ServerArgs

    with pytest.raises(ValueError, match="--dist-init-addr"):
        ServerArgs(tp_size=2, nnodes=2)


# ------------------------------------------------------------------------------------------------ nodes
def test_two_nodes_on_loopback(tiny_llama, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    nodes = [
        ServerProcess(
            ["--model-path", tiny_llama, "--tp-size", "2", "--nnodes", "2", "--node-rank", str(rank),
             "--dist-init-addr", addr, *COMMON],
            tmp_path / f"node{rank}.log",
        )
        for rank in (0, 1)
    ]  # fmt: skip
    try:
        nodes[0].wait_ready()
        assert "TP1] Load weight end" in nodes[1].log_text()
        import kiln

        eng = kiln.Engine(model_path=tiny_llama, device="cpu", max_total_tokens=4096, chunked_prefill_size=16)
        want = ids(eng.generate(PROMPTS, GREEDY))
        assert ids(generate(nodes[0].url, PROMPTS, GREEDY)) == want
        kids = engine_children(nodes[1].proc, 1)
        nodes[0].stop()
        nodes[1].proc.wait(60)  # node 0's end ends node 1's rank, and node 1 with it
        assert_gone(kids)
    finally:
        for node in nodes:
            node.stop()


def test_an_engine_stalled_while_serving_ends_the_server_and_fails_its_requests(tiny_llama, tmp_path):
    """One rank, stopped mid-stream (SIGSTOP): the watchdog ends the server as it does with several ranks, and the
    request in flight gets an error event instead of a stream that just stops."""
    srv = ServerProcess(
        ["--model-path", tiny_llama, *COMMON, "--watchdog-timeout", "6"], tmp_path / "serve.log"
    )
    srv.wait_ready()
    [engine] = engine_children(srv.proc, 1)
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 2:
                    engine.suspend()
    finally:
        code = srv.proc.wait(60)
        with contextlib.suppress(psutil.NoSuchProcess):  # reaped by the server as it ended
            engine.resume()
    assert any('"error"' in e for e in events), events[-3:]
    failure = next(line for line in srv.log_text().splitlines() if "Kiln failed" in line)
    assert code != 0 and "the engine loop made no progress in phase serving" in failure, failure
    assert_gone([engine])
    srv.stop()


# ------------------------------------------------------------------------------------------------ SIGTERM
@pytest.mark.parametrize("tp", [1, 2])
def test_sigterm_leaves_no_engine_process(tiny_llama, tmp_path, tp):
    srv = ServerProcess(["--model-path", tiny_llama, "--tp-size", str(tp), *COMMON], tmp_path / "serve.log")
    srv.wait_ready()
    kids = engine_children(srv.proc, tp)
    assert len(kids) == tp
    srv.proc.terminate()
    srv.proc.wait(60)
    assert [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE] == []
    srv.stop()
