"""`kiln serve --dp-size N`: N replicas of the whole server behind SGLang's router, laid out as SGLang's
`sglang_router.launch_server` does: each replica is a `kiln serve` with --dp-size 1 on its own port (found
upward from --router-dp-worker-base-port) and in its own process group, and the router listens on
--host/--port with the replicas as its workers. Router flags pass through as `--router-<flag>`.

Unlike SGLang, the router runs as a child process (`python -m sglang_router.launch_router`) rather than inside
this one: the Rust router blocks the interpreter while it serves, so this process could not watch the replicas
or handle SIGTERM itself. Here this process only supervises: it starts the replicas, starts the router once
every replica answers /health, and then ends everything (exit code 1, naming the child) when any child exits,
or on SIGTERM/SIGINT (exit code 0), sending SIGTERM to each child so that each drains as a lone server
does."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from kiln.config import ServerArgs
from kiln.core.logs import configure_logging

logger = logging.getLogger("kiln")
ROUTER_INSTALL = "pip install 'kiln[router]' (or pip install sglang-router)"
ROUTER_FLAG_PREFIX = "--router-"
# the router's own flags that this launcher sets itself
RESERVED_ROUTER_FLAGS = ("--router-worker-urls", "--router-host", "--router-port")
ROUTER_READY_TIMEOUT = 60.0
# beyond --shutdown-timeout, how long a child may take to exit after SIGTERM before its group is killed
EXIT_GRACE_SECONDS = 15.0
POLL_SECONDS = 0.5


class RouterFlagError(ValueError):
    """A --router-* flag this launcher cannot pass on."""


class _RouterFlagParser(argparse.ArgumentParser):
    """The router's flags, with a bad one reported alone (not under the router's whole usage text)."""

    def error(self, message: str) -> NoReturn:
        raise RouterFlagError(message)


def router_missing(dp_size: int) -> str | None:
    """Why --dp-size cannot run here, when SGLang's router is not installed; None when it is."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return (
            f"--dp-size {dp_size} runs the replicas behind SGLang's router, which is not installed: "
            f"{ROUTER_INSTALL}"
        )
    return None


def split_router_flags(tokens: list[str]) -> list[str]:
    """The arguments argparse did not know, checked to be `--router-*` flags with their values (anything else
    is an unknown argument)."""
    if tokens and not tokens[0].startswith(ROUTER_FLAG_PREFIX):
        raise RouterFlagError(f"unrecognized arguments: {' '.join(tokens)}")
    strays = [t for t in tokens if t.startswith("--") and not t.startswith(ROUTER_FLAG_PREFIX)]
    if strays:
        raise RouterFlagError(f"unrecognized arguments: {' '.join(strays)}")
    return tokens


def router_cli_flags(tokens: list[str]) -> list[str]:
    """`--router-*` flags checked by the router's own parser (a bad one is refused, naming it, before anything
    starts) and turned into `launch_router` flags (the prefix dropped)."""
    reserved = [t for t in tokens if t.split("=", 1)[0] in RESERVED_ROUTER_FLAGS]
    if reserved:
        raise RouterFlagError(f"{reserved[0]}: kiln serve --dp-size sets it itself (use --host/--port)")
    from sglang_router.router_args import RouterArgs

    parser = _RouterFlagParser(prog="kiln serve", add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    parser.parse_args(tokens)
    return [
        "--" + t.removeprefix(ROUTER_FLAG_PREFIX) if t.startswith(ROUTER_FLAG_PREFIX) else t for t in tokens
    ]


def cli_argv(args: ServerArgs) -> list[str]:
    """`kiln serve` flags that rebuild `args` (those that differ from the defaults)."""
    argv: list[str] = []
    for f in dataclasses.fields(ServerArgs):
        value = getattr(args, f.name)
        if value == f.default or f.metadata.get("cli") is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        if value is None:  # no flag spells None over a non-None default
            raise ValueError(f"{flag}: None cannot be passed to a replica")
        if isinstance(value, bool):
            argv.append(flag)
        elif isinstance(value, tuple):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    for tokens in args.foreign_flags:  # SGLang flags Kiln only acknowledges: each replica logs them too
        argv += list(tokens)
    return argv


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        # as uvicorn binds: a port that only has connections in TIME_WAIT is free to serve on
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_worker_ports(host: str, base_port: int, count: int, taken: set[int]) -> list[int]:
    """SGLang's scheme: from the base port upward in random strides of 100-1000, keeping the free ones (a
    stride leaves room for any ports a replica opens beside its own)."""
    ports: list[int] = []
    port = base_port
    while len(ports) < count:
        if port > 65535:
            raise RuntimeError(f"no {count} free ports above --router-dp-worker-base-port {base_port}")
        if port not in taken and port_is_free(host, port):
            ports.append(port)
        port += random.randint(100, 1000)
    return ports


def free_port(host: str, taken: set[int]) -> int:
    """A port the system has free now, other than `taken`."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port


def _parent_death_signal() -> Callable[[], None] | None:
    """Linux: a callable for Popen's preexec_fn that has the child sent SIGTERM when this process dies, even
    by SIGKILL, so no replica or router outlives its supervisor. None elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@dataclass(frozen=True)
class Placement:
    """Where one replica runs: its share of the cores this process may use, and of the GPUs."""

    cores: tuple[int, ...]
    gpus: str | None  # CUDA_VISIBLE_DEVICES for the replica; None leaves the variable as it is


def _visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def placements(dp_size: int, tp_size: int, device: str) -> list[Placement]:
    """Each replica's cores and GPUs. The cores are split evenly, so replicas (and the tensor-parallel ranks
    each splits its share among) do not preempt each other; the GPUs as SGLang's base_gpu_id = rank * tp-size
    does, when there are dp-size x tp-size of them (with fewer, the replicas share them, and each must be
    given its part of the memory with --mem-fraction-static or --max-total-tokens)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    n = len(cores)
    core_shares = [
        tuple(cores[i * n // dp_size : (i + 1) * n // dp_size] or cores[i % n : i % n + 1])
        for i in range(dp_size)
    ]
    gpus = _visible_gpus() if device != "cpu" else []
    if len(gpus) >= dp_size * tp_size:
        gpu_shares: list[str | None] = [
            ",".join(gpus[i * tp_size : (i + 1) * tp_size]) for i in range(dp_size)
        ]
    else:
        if gpus:
            logger.warning(
                f"{len(gpus)} GPU(s) for --dp-size {dp_size} x --tp-size {tp_size}: the replicas share them; "
                "give each its part of the memory (--mem-fraction-static or --max-total-tokens)"
            )
        gpu_shares = [None] * dp_size
    return [Placement(c, g) for c, g in zip(core_shares, gpu_shares)]


def _spans(cores: tuple[int, ...]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    spans: list[list[int]] = []
    for c in cores:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans) or "all"


@dataclass
class Child:
    """A replica or the router: a process leading its own process group."""

    name: str
    proc: subprocess.Popen

    def exited(self) -> int | None:
        return self.proc.poll()


def _get(url: str, timeout: float = 2.0) -> bytes | None:
    """The body of a 200 answer, or None for any other answer or none."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read() if resp.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


class Replicas:
    """Starts and supervises the replicas and the router of one `kiln serve --dp-size N`."""

    def __init__(self, args: ServerArgs, router_flags: list[str]):
        self.args = args
        self.router_flags = router_flags
        self.children: list[Child] = []
        self.stopping = threading.Event()
        self.preexec = _parent_death_signal()

    def _spawn(self, name: str, cmd: list[str], place: Placement | None = None) -> Child:
        env = (
            None
            if place is None or place.gpus is None
            else {**os.environ, "CUDA_VISIBLE_DEVICES": place.gpus}
        )

        def in_child() -> None:  # between fork and exec
            if self.preexec is not None:
                self.preexec()
            if place is not None and place.cores:
                os.sched_setaffinity(0, place.cores)

        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=in_child, env=env)
        child = Child(name, proc)
        self.children.append(child)
        return child

    def start_replicas(self) -> list[str]:
        args = self.args
        ports = find_worker_ports(args.host, args.router_dp_worker_base_port, args.dp_size, {args.port})
        for rank, (port, place) in enumerate(zip(ports, placements(args.dp_size, args.tp_size, args.device))):
            replica = dataclasses.replace(args, port=port, dp_size=1)
            gpus = "" if place.gpus is None else f", GPUs {place.gpus}"
            logger.info(f"Launching DP replica {rank} on port {port} (cores {_spans(place.cores)}{gpus})")
            cmd = [sys.executable, "-m", "kiln.cli", "serve", *cli_argv(replica)]
            self._spawn(f"DP replica {rank} (port {port})", cmd, place)
        return [f"http://{args.host}:{port}" for port in ports]

    def start_router(self, worker_urls: list[str]) -> None:
        args = self.args
        taken = {args.port, *(int(url.rsplit(":", 1)[1]) for url in worker_urls)}
        metrics_port = free_port(args.host, taken)
        router_level = {"debug": "debug"}.get(args.log_level.lower(), "info" if args.log_requests else "warn")
        # defaults of Kiln's choosing, before the user's flags so that theirs win: the router's Prometheus
        # exporter on Kiln's host and a free port (its own default, 0.0.0.0:29000, would clash with a second
        # router on this machine), its drain as long as the replicas'
        defaults = ["--prometheus-host", args.host, "--prometheus-port", str(metrics_port), "--log-level"]
        defaults += [router_level, "--shutdown-grace-period-secs", str(int(args.shutdown_timeout))]
        cmd = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            args.host,
            "--port",
            str(args.port),
        ]
        cmd += ["--worker-urls", *worker_urls, *defaults, *self.router_flags]
        logger.info(
            f"Launching the router on http://{args.host}:{args.port} for {', '.join(worker_urls)} "
            f"(its own metrics on port {metrics_port} unless --router-prometheus-port says otherwise)"
        )
        self._spawn("the router", cmd)

    def _first_exit(self) -> Child | None:
        return next((c for c in self.children if c.exited() is not None), None)

    def _wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Polls `ready` until it holds; False when a child exits, a stop is asked for, or the time is up."""
        deadline = None if timeout is None else time.time() + timeout
        while not self.stopping.is_set():
            if self._first_exit() is not None:
                return False
            if ready():
                return True
            if deadline is not None and time.time() > deadline:
                return False
            self.stopping.wait(POLL_SECONDS)
        return False

    def _router_ready(self) -> bool:
        """Every replica registered with the router and healthy there."""
        try:
            listing = json.loads(_get(f"http://{self.args.host}:{self.args.port}/workers") or b"{}")
        except ValueError:
            return False
        workers = listing.get("workers", []) if isinstance(listing, dict) else []
        return sum(1 for w in workers if w.get("is_healthy")) >= self.args.dp_size

    def bring_up(self) -> str | None:
        """Replicas, then the router; None when all are up, else why not."""
        urls = self.start_replicas()

        def replicas_ready() -> bool:
            return all(_get(f"{url}/health", timeout=5) is not None for url in urls)

        if not self._wait_until(replicas_ready, timeout=None):
            return None if self.stopping.is_set() else self._exit_reason("during startup")
        self.start_router(urls)
        if not self._wait_until(self._router_ready, ROUTER_READY_TIMEOUT):
            if self.stopping.is_set():
                return None
            if self._first_exit() is not None:
                return self._exit_reason("during startup")
            return (
                f"the router did not register the {self.args.dp_size} replicas within "
                f"{ROUTER_READY_TIMEOUT:.0f} s"
            )
        logger.info(
            f"The router is up on http://{self.args.host}:{self.args.port} with {self.args.dp_size} "
            "replicas; the server is fired up and ready to roll!"
        )
        return None

    def _exit_reason(self, when: str) -> str:
        child = self._first_exit()
        assert child is not None
        return f"{child.name} exited with code {child.exited()} {when}"

    def watch(self) -> str | None:
        """Until a stop is asked for (None) or a child exits (why)."""
        self._wait_until(lambda: False, timeout=None)
        return None if self.stopping.is_set() else self._exit_reason("while serving")

    def stop(self) -> None:
        """SIGTERM to each child (the process alone: a replica drains and stops its own engine), then SIGKILL
        to the process group of any that has not exited in time, and of every child's leftovers."""
        for c in self.children:
            if c.exited() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + self.args.shutdown_timeout + EXIT_GRACE_SECONDS
        for c in self.children:
            try:
                c.proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                logger.warning(f"{c.name} did not exit after SIGTERM: killing its process group")
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        failure = self.bring_up()
        if failure is None and not self.stopping.is_set():
            failure = self.watch()
        if failure:
            logger.error(f"Kiln failed: {failure}; ending the other replicas and the router")
        else:
            logger.info(f"Shutting down {', '.join(c.name for c in self.children)}")
        self.stop()
        return 1 if failure else 0


def serve_replicas(args: ServerArgs, router_flags: list[str]) -> int:
    """`kiln serve --dp-size N`, with the router's flags as router_cli_flags gives them."""
    configure_logging(args.log_level)
    t0 = time.time()
    code = Replicas(args, router_flags).run()
    logger.info(f"Kiln stopped after {time.time() - t0:.1f} s with exit code {code}")
    return code
