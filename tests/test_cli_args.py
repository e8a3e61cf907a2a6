"""Command-line arguments of `kiln bench` and `kiln wait`: nonsense is refused by argparse (one line, exit 2,
no traceback), and `kiln wait` logs a few lines, not a redrawn bar, when stderr is not a terminal."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import kiln.wait as kiln_wait
from kiln.cli import build_parser

pytestmark = [pytest.mark.server, pytest.mark.server]

README = Path(__file__).resolve().parent.parent / "README.md"


def _refused(argv: list[str], capsys) -> str:
    """argparse's error text for argv, which must exit with code 2."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2, argv
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["bench", "offline", "--num-seqs", "0"], "--num-seqs"),
        (["bench", "offline", "--max-input-len", "-1"], "--max-input-len"),
        (["bench", "offline", "--min-output-len", "0"], "--min-output-len"),
        (["bench", "offline", "--temperature", "-0.5"], "--temperature"),
        (["bench", "offline", "--engine-arg", "max_running_requests"], "--engine-arg"),
        (["bench", "one-batch", "--batch-size", "0"], "--batch-size"),
        (["bench", "one-batch", "--input-len", "0"], "--input-len"),
        (["bench", "one-batch", "--output-len", "-2"], "--output-len"),
        (["bench", "serve", "--num-prompts", "-1"], "--num-prompts"),
        (["bench", "serve", "--max-concurrency", "0"], "--max-concurrency"),
        (["bench", "serve", "--request-rate", "-1"], "--request-rate"),
        (["bench", "serve", "--request-rate", "0"], "--request-rate"),
        (["bench", "serve", "--request-rate", "nan"], "--request-rate"),
        (["bench", "serve", "--random-input-len", "0"], "--random-input-len"),
        (["bench", "serve", "--random-range-ratio", "1.5"], "--random-range-ratio"),
        (["bench", "serve", "--warmup-requests", "-1"], "--warmup-requests"),
        (["bench", "serve", "--request-timeout", "0"], "--request-timeout"),
        (["bench", "serve", "--sharegpt-output-len", "3"], "--sharegpt-output-len"),
        (["bench", "serve", "--num-turns", "0"], "--num-turns"),
        (["bench", "serve", "--gsp-num-groups", "0"], "--gsp-num-groups"),
        (["bench", "serve", "--port", "70000"], "--port"),
        (["bench", "serve", "--extra-request-body", "{not json"], "--extra-request-body"),
        (["wait", "--timeout", "-5"], "--timeout"),
        (["wait", "--timeout", "0"], "--timeout"),
        # a word that is no server URL was tried until the timeout
        (["wait", "notaurl"], "url"),
        (["wait", "127.0.0.1:30000"], "url"),
        (["wait", "http://127.0.0.1:99999"], "url"),
        (["bench", "serve", "--base-url", "foo"], "--base-url"),
    ],
)
@pytest.mark.unit
@pytest.mark.unit
def test_nonsense_numbers_are_refused_naming_the_flag(argv, flag, capsys):
    err = _refused(argv, capsys)
    assert f"error: argument {flag}: must be" in err, err


@pytest.mark.unit
@pytest.mark.unit
def test_the_range_is_named():
    from kiln.core.argtypes import fraction, positive_int

    with pytest.raises(Exception, match=r"must be an integer >= 1, got 0"):
        positive_int("0")
    with pytest.raises(Exception, match=r"must be a number in \[0, 1\], got -0.1"):
        fraction("-0.1")


@pytest.mark.parametrize("kind", ["input", "output"])
@pytest.mark.unit
@pytest.mark.unit
def test_min_above_max_is_refused_naming_both_flags(kind, capsys):
    err = _refused(["bench", "offline", f"--min-{kind}-len", "50", f"--max-{kind}-len", "8"], capsys)
    assert f"error: --min-{kind}-len (50) must not exceed --max-{kind}-len (8)" in err, err


def test_reported_offline_crash_is_a_usage_error():
    """The review's command: the default --min-input-len 100 above --max-input-len 32 crashed in randrange."""
    argv = ["bench", "offline", "--model-path", "M", "--num-seqs", "4", "--max-input-len", "32"]
    argv += ["--max-output-len", "8"]
    p = subprocess.run([sys.executable, "-m", "kiln.cli", *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert "--min-input-len (100) must not exceed --max-input-len (32)" in p.stderr


def test_dataset_file_is_required_at_parse_time(capsys):
    err = _refused(["bench", "serve", "--dataset-name", "jsonl"], capsys)
    assert "--dataset-name jsonl needs --dataset-path" in err


def test_sensible_values_still_parse():
    ns = build_parser().parse_args(
        ["bench", "serve", "--request-rate", "inf", "--random-range-ratio", "0", "--warmup-requests", "0"]
    )
    assert ns.request_rate == float("inf") and ns.random_range_ratio == 0.0 and ns.warmup_requests == 0
    ns = build_parser().parse_args(["bench", "offline", "--min-input-len", "8", "--max-input-len", "8"])
    assert (ns.min_input_len, ns.max_input_len, ns.num_seqs) == (8, 8, 256)
    ns = build_parser().parse_args(["bench", "one-batch", "--engine-arg", "max_running_requests=4"])
    assert ns.engine_arg == ["max_running_requests=4"]
    assert build_parser().parse_args(["wait", "--timeout", "0.5"]).timeout == 0.5


@pytest.mark.unit
@pytest.mark.unit
def test_readme_documents_exit_2_for_bad_arguments_too():
    (line,) = [s for s in README.read_text().splitlines() if s.startswith("kiln wait ")]
    assert "2 timeout or bad args" in line, line


# ---------------------------------------------------------------------------------------- kiln wait


class _Script:
    """A fake /status: each poll gets the next answer; the last one repeats."""

    def __init__(self, answers: list[dict]) -> None:
        self.answers, self.polls = answers, 0

    def next(self) -> dict:
        answer = self.answers[min(self.polls, len(self.answers) - 1)]
        self.polls += 1
        return answer


def _start(script: _Script) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(script.next()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    for port in range(31300, 31400):
        try:
            srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        except OSError:
            continue
        threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
        return srv, f"http://127.0.0.1:{port}"
    pytest.skip("no free port in 31300-31399")


def _phases() -> list[dict]:
    kernel = [{"phase": "building_kernels", "progress": {"kernel": "k", "elapsed_s": s}} for s in range(6)]
    return [
        {"phase": "launching"},
        {"phase": "launching"},
        *kernel,
        {"phase": "loading_weights", "progress": {"done": 1}},
        {"phase": "loading_weights", "progress": {"done": 2}},
        {"phase": "ready", "elapsed": 1.5},
    ]


@pytest.fixture
def status_server():
    servers = []

    def start(answers: list[dict]) -> tuple[_Script, str]:
        script = _Script(answers)
        srv, url = _start(script)
        servers.append(srv)
        return script, url

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.mark.unit
@pytest.mark.unit
def test_wait_logs_one_line_per_phase_without_a_terminal(status_server, capsys):
    script, url = status_server(_phases())
    assert kiln_wait.wait(url, timeout=30, interval=0.01) == 0
    out, err = capsys.readouterr()
    assert script.polls == len(_phases())
    assert "\r" not in err  # no bar redraws in a log
    lines = err.splitlines()
    assert [line.split("] ")[1].split(" ")[0] for line in lines] == [
        "launching",
        "building_kernels",
        "loading_weights",
        "ready",
    ], err
    assert lines[1] == "kiln wait: [2/8] building_kernels (k: cached, 0 s)"
    assert "is ready after 1.5 s" in out


@pytest.mark.unit
@pytest.mark.unit
def test_wait_logs_changing_progress_again_after_the_interval(status_server, capsys, monkeypatch):
    monkeypatch.setattr(kiln_wait, "LOG_EVERY_S", 0.0)
    _, url = status_server(_phases())
    assert kiln_wait.wait(url, timeout=30, interval=0.01) == 0
    err = capsys.readouterr().err
    assert err.count("building_kernels") == 6 and err.count("loading_weights") == 2, err


@pytest.mark.unit
@pytest.mark.unit
def test_wait_draws_the_bar_on_a_terminal(status_server, monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    _, url = status_server(_phases())
    assert kiln_wait.wait(url, timeout=30, interval=0.01) == 0
    assert "\r" in tty.getvalue() and "building_kernels" in tty.getvalue()


def _refusing_port() -> tuple[socket.socket, int]:
    """A port bound but not listening: connections to it are refused, and no other test can take it."""
    for port in range(31300, 31400):
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
            return sock, port
        except OSError:
            sock.close()
    pytest.skip("no free port in 31300-31399")


@pytest.mark.unit
@pytest.mark.unit
def test_wait_timeout_before_any_phase_says_so(capsys):
    sock, port = _refusing_port()
    with sock:
        assert kiln_wait.wait(f"http://127.0.0.1:{port}", timeout=0.3, interval=0.05) == 2
    err = capsys.readouterr().err
    assert "(no phase reported yet)" in err, err
    assert "None" not in err
    assert err.count("not answering yet") == 1  # logged once, not once per poll


@pytest.mark.unit
@pytest.mark.unit
def test_wait_timeout_names_the_last_phase(status_server, capsys):
    _, url = status_server([{"phase": "loading_weights"}])
    assert kiln_wait.wait(url, timeout=0.3, interval=0.05) == 2
    assert "(last phase: loading_weights)" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.unit
def test_wait_on_a_server_shutting_down_exits_1_at_once(status_server, capsys):
    _, url = status_server([{"phase": "loading_weights"}, {"phase": "shutting_down"}])
    assert kiln_wait.wait(url, timeout=30, interval=0.01) == 1
    assert "is shutting down" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.unit
def test_wait_reads_a_routers_health_where_there_is_no_status(capsys):
    """`kiln serve --dp-size N` answers through sglang-router, which has /health but no /status: ready is its
    /health's 200 (it waited forever, counting 404s as "not answering")."""
    polls = {"health": 0}

    class Router(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                polls["health"] += 1
            code = (
                200
                if self.path == "/health" and polls["health"] > 2
                else 404
                if self.path == "/status"
                else 503
            )
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    try:
        assert kiln_wait.wait(f"http://127.0.0.1:{srv.server_address[1]}", timeout=20, interval=0.01) == 0
    finally:
        srv.shutdown()
        srv.server_close()
    assert polls["health"] == 3 and "is ready" in capsys.readouterr().out


def test_bench_serve_against_no_server_is_one_line_and_exit_1(capsys):
    """It printed a traceback."""
    from kiln.bench.cli import main

    argv = ["serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--dataset-name", "random"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "kiln bench serve: error: warm-up request to http://127.0.0.1:9" in err and "Traceback" not in err


@pytest.mark.unit
@pytest.mark.unit
def test_num_threads_defaults_to_omp_num_threads_then_every_core(monkeypatch):
    import os

    from kiln.platform import cpu_threads

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(None) == 3 and cpu_threads(2) == 2  # --num-threads wins over the variable
    for unset in ("", "0", "four"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert cpu_threads(None) == cores
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpu_threads(None) == cores
