"""`kiln serve` started by forking a process that has already imported it.

A server the tests start with `python -m kiln.cli serve` spends ~5 CPU s (more on a busy host) importing torch,
FastAPI, transformers' config classes and Kiln before it parses its first flag, and the suite starts dozens. Here
each pytest worker keeps one multiprocessing fork server that has imported them once (its preload); a server is
a fork of it that runs `kiln.cli.main(["serve", ...])` as the command line would: its own session, its output to
the log, the caller's environment, the interpreter's exit handlers at the end. The fork server is started with
`exec`, so no thread or OpenMP pool of the worker is inherited; Kiln's front then forks its engine as usual.

Not for a server whose environment differs from the worker's in what a module reads at import
(huggingface_hub's HF_HUB_* constants, torch's OMP_NUM_THREADS): ServerProcess spawns those with a command line.
The CLI's own path (`python -m kiln.cli`) stays covered by the tests that start servers with subprocess.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import subprocess
import sys

PRELOAD = ["kiln.cli", "kiln.server.launch"]
_context: mp.context.ForkServerContext | None = None


def context() -> mp.context.ForkServerContext:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _serve(argv: list[str], log_path: str, env: dict[str, str]) -> None:
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # the difference only: clearing the environment first leaves setproctitle unable to title the engine later
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if os.environ.get(k) != v})
    sys.argv = ["kiln", *argv]
    from kiln.cli import main

    try:
        code = main(argv)
    finally:  # multiprocessing's child ends in os._exit, which runs no atexit handler
        sys.stdout.flush()
        atexit._run_exitfuncs()
    sys.exit(code)


class ForkedServer:
    """The part of subprocess.Popen's interface the tests use, over a multiprocessing process."""

    def __init__(self, argv: list[str], log_path: str, env: dict[str, str]):
        self._proc = context().Process(target=_serve, args=(argv, log_path, env), name="kiln-serve")
        self._proc.start()
        self.pid = self._proc.pid
        self.args = ["kiln", *argv]

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
