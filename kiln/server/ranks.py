"""This node's engine processes, one per tensor-parallel rank: starting them, following what each reports,
blaming the one that failed or stalled, and reaping them all. Also a node's life when it is not node 0 (its ranks
alone, no HTTP)."""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing as mp
import os
import queue
import signal
import time

import torch

from kiln.config import ServerArgs
from kiln.core import envs
from kiln.platform import detect_device
from kiln.scheduler.engine_proc import PEER_FAILED_EXIT, Beat, RankSpec, engine_main
from kiln.scheduler.io import PhaseEntered, Progress, RankFailed, RankReady, StartupFailed
from kiln.server.startup import PHASES, StartupState

logger = logging.getLogger("kiln")

# seconds the front waits, on a rank's startup failure, for a peer whose crash caused it to be seen dead
PEER_DEATH_WAIT = 3.0


class RankProcesses:
    """This node's engine processes, one per tensor-parallel rank, and what each reported: its phase, when it last
    reported, whether it finished startup, why it ended."""

    def __init__(self, args: ServerArgs):
        self.args = args
        per_node = args.tp_size // args.nnodes
        self.local = list(range(args.node_rank * per_node, (args.node_rank + 1) * per_node))
        self.procs: dict[int, mp.process.BaseProcess] = {}
        self.phases = dict.fromkeys(self.local, "launching")
        self.last_event = dict.fromkeys(self.local, time.time())
        self.ready: set[int] = set()
        self.failures: dict[int, str] = {}
        self.beats: dict[int, Beat] = {}

    def start(
        self, engine_addr: str, front_addr: str, forkable: bool = True, close_in_child: tuple[int, ...] = ()
    ):
        """Start the ranks, forked where `forkable` allows (start_method); a forked rank first closes the
        descriptors `close_in_child` (the front's HTTP listener: a rank holding it would keep the port bound after
        the front ends)."""
        method = start_method(self.args, forkable)
        if method == "fork" and torch.get_num_threads() != 1:
            # serve() runs the front on one thread: a parent whose OpenMP pool exists forks children whose first
            # parallel region waits on the parent's threads forever
            method = "spawn"
        logger.debug(f"Starting {len(self.local)} engine process(es) by {method}")
        ctx = mp.get_context(method)
        target = engine_main if method == "spawn" else functools.partial(_forked_engine_main, close_in_child)
        status_q = ctx.Queue()
        init_method = f"tcp://{self.args.dist_init_addr or f'127.0.0.1:{_free_port()}'}"
        for local_rank, rank in enumerate(self.local):
            beat = Beat(ctx.RawValue("d", time.time()), ctx.RawValue("q", 0))
            self.beats[rank] = beat
            spec = RankSpec(rank, local_rank, len(self.local), init_method, beat)
            self.procs[rank] = ctx.Process(
                target=target,
                name=f"kiln::engine{'' if self.args.tp_size == 1 else f'-tp{rank}'}",
                args=(self.args, engine_addr, front_addr, status_q, spec),
                daemon=True,
            )
            self.procs[rank].start()
        return status_q

    def name(self, rank: int) -> str:
        """The prefix naming a rank in a reason; none with one rank."""
        return f"rank {rank}: " if self.args.tp_size > 1 else ""

    def note(self, msg, startup: StartupState) -> None:
        """A rank's startup report: rank 0's phases are the server's."""
        rank = getattr(msg, "rank", 0)
        self.last_event[rank] = time.time()
        match msg:
            case PhaseEntered(name=name, info=info):
                self.phases[rank] = name
                if rank == self.local[0] and name in PHASES:
                    startup.enter(name, **info)
            case Progress(info=info) if rank == self.local[0]:
                startup.step(**info)
            case RankReady():
                self.ready.add(rank)
            case RankFailed(phase=phase, reason=reason):
                self.phases[rank] = phase
                self.failures[rank] = reason

    def most_silent(self) -> tuple[int, str, float]:
        """The rank still starting that reported least recently: (rank, its phase, seconds since)."""
        starting = [r for r in self.local if r not in self.ready] or self.local
        rank = min(starting, key=lambda r: self.last_event[r])
        return rank, self.phases[rank], time.time() - self.last_event[rank]

    def stalled_rank(self, limit: float) -> tuple[int, float] | None:
        """The rank furthest behind (Beat.lag), when its last stamp is over limit seconds old."""
        if len(self.ready) < len(self.local):  # beats start once all are built
            return None
        rank = min(self.local, key=lambda r: self.beats[r].lag())
        silent = time.time() - self.beats[rank].time.value
        return (rank, silent) if silent > limit else None

    def dead(self) -> bool:
        return any(not p.is_alive() for p in self.procs.values())

    def crashed_peer(self, reporter: int, wait: float = PEER_DEATH_WAIT) -> bool:
        """Whether a rank other than `reporter` died of its own failure (within `wait` seconds): a rank whose
        startup failed in a collective reports first, but the peer that crashed is the one to blame."""
        deadline = time.time() + (wait if self.args.tp_size > 1 else 0)
        while True:
            if any(self._crashed(r) for r in self.procs if r != reporter):
                return True
            if time.time() >= deadline:
                return False
            time.sleep(0.05)

    def _crashed(self, rank: int) -> bool:
        code = self.procs[rank].exitcode
        return code is not None and code not in (0, PEER_FAILED_EXIT)

    def first_dead(self) -> tuple[int, int | None]:
        """The dead rank to blame: one that crashed itself (not ended because a peer failed, nor returned after
        reporting a startup failure), else the lowest."""
        dead = [(r, p.exitcode) for r, p in self.procs.items() if not p.is_alive()]
        own = [(r, code) for r, code in dead if self._crashed(r)]
        return (own or dead or [(self.local[0], None)])[0]

    def phase_of(self, rank: int, default: str) -> str:
        return self.phases.get(rank, default) if self.args.tp_size > 1 else default

    def reason_of(self, rank: int) -> str:
        return f": {self.failures[rank]}" if rank in self.failures else ""

    def stop(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method(args: ServerArgs, forkable: bool, device: str | None = None) -> str:
    """ "fork" or "spawn" for this node's engine processes (KILN_ENGINE_START_METHOD): fork on the CPU when the
    caller allows it (`forkable`: no threads or connections of the HTTP server yet), spawn otherwise."""
    if envs.engine_start_method() == "spawn" or not forkable:
        return "spawn"
    device = device or (args.device if args.device != "auto" else detect_device())
    return "fork" if device == "cpu" else "spawn"


def _forked_engine_main(close_in_child: tuple[int, ...], *args) -> None:
    for fd in close_in_child:
        with contextlib.suppress(OSError):
            os.close(fd)
    engine_main(*args)


def serve_ranks(args: ServerArgs) -> int:
    """A node other than node 0 (--node-rank > 0): its ranks alone, no HTTP. It ends when one of its ranks ends
    (node 0's ending ends them: their collectives fail), or on SIGTERM / SIGINT, with every rank reaped."""
    ranks = RankProcesses(args)
    status_q = ranks.start("", "")  # rank 0 lives on node 0: these ranks talk to no front
    stopping: list[int] = []
    startup = StartupState()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    logger.info(f"Node {args.node_rank}: ranks {ranks.local} joining {args.dist_init_addr}")
    while not stopping and not ranks.dead():
        with contextlib.suppress(queue.Empty):
            msg = status_q.get(True, 0.5)
            if isinstance(msg, StartupFailed):
                logger.error(f"rank {msg.rank}: {msg.reason}")
            ranks.note(msg, startup)
    code = 0 if stopping else 1
    if not stopping:
        rank, exitcode = ranks.first_dead()
        logger.error(f"rank {rank}'s engine process exited with code {exitcode}{ranks.reason_of(rank)}")
    ranks.stop()
    return code
