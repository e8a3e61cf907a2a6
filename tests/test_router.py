"""`kiln serve --dp-size 2`: two replicas of the tiny model behind SGLang's router (sglang-router, the
`kiln[router]` extra). Requests are served through the router, cache-aware routing keeps a shared prefix on
one replica (where Kiln's cached_tokens shows the hit), separately started servers work behind
`launch_router`, and SIGTERM or a dead replica ends the router and every replica. The refusals need no
router."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import ServerProcess, free_port

import kiln.cli as cli
from kiln.config import ServerArgs
from kiln.server.replicas import cli_argv

pytestmark = pytest.mark.slow

REPLICA_FLAGS = ["--max-total-tokens", "4096", "--max-running-requests", "8", "--num-threads", "1"]
# long enough that the router's cache_aware policy (a match over the request's characters) sees the match
PREFIX_A = "Alpha: " + " ".join(f"apple{i} orchard{i}" for i in range(60))
PREFIX_B = "Bravo! " + " ".join(f"{i} zebra {i} yak" for i in range(60))


def wait_for_workers(url: str, count: int, timeout: float = 60.0) -> list[str]:
    """The router's worker URLs once `count` of them are registered and healthy."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            workers = httpx.get(f"{url}/workers", timeout=5).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            workers = []
        healthy = [w["url"] for w in workers if w.get("is_healthy")]
        if len(healthy) >= count:
            return sorted(healthy)
        time.sleep(0.5)
    raise TimeoutError(f"the router at {url} did not register {count} workers")


def prompt_tokens(replica: str) -> int:
    """The prompt tokens a replica has been sent so far (its own counter)."""
    return httpx.get(f"{replica}/get_server_info", timeout=30).json()["stats"]["prompt_tokens"]


def complete(url: str, model: str, prompt: str, max_tokens: int = 2) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def model_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def family(url: str, replicas: list[str], prefix: str) -> tuple[list[int], dict[str, int]]:
    """Three requests sharing `prefix`, one after the other: their cached_tokens, and the prompt tokens each
    replica received meanwhile."""
    before = {r: prompt_tokens(r) for r in replicas}
    model = model_name(url)
    cached = [
        complete(url, model, f"{prefix} question {k}?")["usage"]["prompt_tokens_details"]["cached_tokens"]
        for k in range(3)
    ]
    return cached, {r: prompt_tokens(r) - before[r] for r in replicas}


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def start_dp(tiny_llama: str, log: Path, *extra: str) -> ServerProcess:
    srv = ServerProcess(
        [
            "--dp-size",
            "2",
            "--model-path",
            tiny_llama,
            "--router-dp-worker-base-port",
            str(free_port()),
            *extra,
        ]
        + REPLICA_FLAGS,
        log,
    )
    srv.wait_ready(timeout=300)  # the router answers /health from its start
    deadline = time.time() + 120
    while "The router is up" not in srv.log_text():  # the launcher has seen every replica registered
        assert time.time() < deadline and srv.proc.poll() is None, srv.log_text()[-3000:]
        time.sleep(0.5)
    return srv


@pytest.fixture(scope="module")
def dp(tiny_llama, tmp_path_factory):
    """`kiln serve --dp-size 2` (cache_aware: the router's default, passed through as a router flag) and the
    replicas' URLs; the last test of the module ends it with SIGTERM."""
    srv = start_dp(tiny_llama, tmp_path_factory.mktemp("dp") / "serve.log", "--router-policy", "cache_aware")
    try:
        yield srv, wait_for_workers(srv.url, 2)
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------- refusals
def test_dp_size_without_the_router_names_the_install_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sglang_router", None)  # `import sglang_router` now raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--dp-size", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--dp-size 2" in err and "pip install 'kiln[router]'" in err and "pip install sglang-router" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dp-size", "0"], "--dp-size 0 must be >= 1"),
        (["--router-policy", "round_robin"], "--router-* flags configure the router of --dp-size > 1"),
        (["--dp-size", "2", "--router-policy", "fastest"], "invalid choice: 'fastest'"),
        (["--dp-size", "2", "--router-worker-urls", "http://x"], "sets it itself"),
        (["--dp-size", "2", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (
            ["--dp-size", "2", "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "h:5"],
            "without --nnodes",
        ),
    ],
)
def test_bad_dp_flags_are_refused_before_anything_starts(argv, message, capsys):
    pytest.importorskip("sglang_router")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_replica_gets_the_same_flags_on_its_own_port():
    args = ServerArgs(
        model_path="/m",
        dp_size=2,
        port=1234,
        max_total_tokens=4096,
        disable_radix_cache=True,
        cuda_graph_bs=(1, 4),
    )
    argv = cli_argv(args)
    assert ServerArgs.from_cli(cli.build_parser().parse_args(["serve", *argv])) == args


def test_a_replica_gets_the_sglang_flags_kiln_only_acknowledges():
    line = [
        "serve",
        "--model-path",
        "/m",
        "--dp-size",
        "2",
        "--trust-remote-code",
        "--attention-backend",
        "fa3",
    ]
    args = ServerArgs.from_cli(cli.build_parser().parse_args(line))
    assert args.foreign_flags
    argv = cli_argv(args)
    assert "--foreign-flags" not in argv
    assert ServerArgs.from_cli(cli.build_parser().parse_args(["serve", *argv])) == args


# ------------------------------------------------------------------------------------- through the router
def test_requests_are_served_through_the_router(dp):
    srv, replicas = dp
    assert len(replicas) == 2
    model = model_name(srv.url)  # the replicas' own name for the model, which the router learnt from them
    assert model == model_name(replicas[0])
    native = httpx.post(
        f"{srv.url}/generate",
        json={"text": "Hello there", "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
        timeout=120,
    )
    assert native.status_code == 200, native.text
    assert native.json()["meta_info"]["completion_tokens"] == 3
    assert complete(srv.url, model, "Once upon a time", 3)["usage"]["completion_tokens"] == 3
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=chat, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2
    assert httpx.post(f"{srv.url}/flush_cache", timeout=30).status_code == 200


def test_cache_aware_keeps_a_shared_prefix_on_one_replica(dp):
    srv, replicas = dp
    cached_a, sent_a = family(srv.url, replicas, PREFIX_A)
    assert min(cached_a[1:]) > 0, cached_a  # the prefix computed by the first request is reused
    assert len([r for r in replicas if sent_a[r] > 0]) == 1, sent_a  # all three on one replica
    # another family: its requests stay together too (on either replica: with no load to balance, cache_aware
    # places a prefix it has not seen by its own tie-breaks)
    cached_b, sent_b = family(srv.url, replicas, PREFIX_B)
    assert min(cached_b[1:]) > 0, cached_b
    assert len([r for r in replicas if sent_b[r] > 0]) == 1, sent_b


def test_separately_started_servers_work_behind_launch_router(tiny_llama, tmp_path):
    servers = [
        ServerProcess(["--model-path", tiny_llama, *REPLICA_FLAGS], tmp_path / f"w{i}.log") for i in range(2)
    ]
    router_port = free_port()
    url = f"http://127.0.0.1:{router_port}"
    router = None
    try:
        for s in servers:
            s.wait_ready(timeout=300)
        cmd = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(router_port),
        ]
        cmd += ["--prometheus-port", str(free_port()), "--policy", "round_robin", "--log-level", "warn"]
        cmd += ["--worker-urls", *(s.url for s in servers)]
        router = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
        )
        assert wait_for_workers(url, 2) == sorted(s.url for s in servers)
        before = [prompt_tokens(s.url) for s in servers]
        for k in range(2):
            assert complete(url, model_name(url), f"Request number {k}")["usage"]["completion_tokens"] == 2
        assert all(prompt_tokens(s.url) > b for s, b in zip(servers, before))  # round robin: one each
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        for s in servers:
            s.stop()


def test_a_replica_that_dies_ends_the_router_and_the_others(tiny_llama, tmp_path):
    srv = start_dp(tiny_llama, tmp_path / "serve.log")
    try:
        replicas = wait_for_workers(srv.url, 2)
        family_before = descendants(srv.proc.pid)
        port = replicas[1].rsplit(":", 1)[1]
        victim = next(p for p in family_before if "kiln.cli" in p.cmdline() and port in p.cmdline())
        victim.kill()
        assert srv.proc.wait(60) == 1
        _, alive = psutil.wait_procs(family_before, timeout=30)
        assert not alive, alive
        assert re.search(
            rf"Kiln failed: DP replica \d \(port {port}\) exited with code -9 while serving", srv.log_text()
        )
    finally:
        srv.stop()


def test_sigterm_ends_the_router_and_every_replica(dp):
    """Last in the module: it ends the shared server."""
    srv, _ = dp
    family_before = descendants(srv.proc.pid)
    commands = [" ".join(p.cmdline()) for p in family_before]
    assert sum(c.startswith("sglang::router") for c in commands) == 1  # the router's process title
    assert sum("kiln.cli serve" in c for c in commands) == 2  # and their engine processes
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    _, alive = psutil.wait_procs(family_before, timeout=30)
    assert not alive, alive
