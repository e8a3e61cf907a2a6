"""The engine process: builds the scheduler and runs its loop, talking to the front over ZMQ."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import setproctitle
import zmq

import kiln.core.envs as envs
import kiln.distributed as distributed
import kiln.platform as platform
from kiln.config import ServerArgs
from kiln.core.logs import configure_logging, rank_tag
from kiln.scheduler.io import (
    AbortReq,
    BatchOut,
    ControlOut,
    ControlReq,
    EngineReady,
    EngineState,
    GenerateReq,
    PhaseEntered,
    Progress,
    RankFailed,
    RankReady,
    ReqOutput,
    ServerInfo,
    StartupFailed,
)

if TYPE_CHECKING:
    from kiln.scheduler.launch import EngineParts
    from kiln.scheduler.spec_step import SpecDecoder

logger = logging.getLogger("kiln")
HEARTBEAT_SECONDS = 1.0
# the exit code of a rank whose collective failed because another rank died or went silent: the front names a
# rank that ended otherwise, the one that caused it
PEER_FAILED_EXIT = 4


@dataclass(frozen=True)
class Beat:
    """A rank's loop as the front sees it, in memory both share: when it last began a turn and how many it began.
    Ranks meet in a collective at the start of every turn, so the rank that stopped on its own is the one with the
    fewest turns (the others wait for it in the next meeting, their clocks stopped earlier than its own may have);
    among equals, the oldest stamp."""

    time: Any  # a shared double, time.time() at the last stamp
    turns: Any  # a shared int64, the turns begun

    def stamp(self, turn: bool = False) -> None:
        self.time.value = time.time()
        if turn:
            self.turns.value += 1

    def lag(self) -> tuple[int, float]:
        """What orders ranks by how far behind they are: fewest turns, then oldest stamp."""
        return self.turns.value, self.time.value


@dataclass(frozen=True)
class RankSpec:
    """Which tensor-parallel rank an engine process is, and where the group meets (tcp://HOST:PORT)."""

    rank: int = 0
    local_rank: int = 0  # its index among the ranks on this node
    local_ranks: int = 1  # the ranks on this node, which share its cores
    init_method: str | None = None
    beat: Beat | None = None  # stamped by the loop at each turn, read by the front


class _StartupReporter:
    """Sends the engine's startup phases and progress to the front, and makes the test hook KILN_FAULT crash or
    stall the process when it enters the phase the hook names."""

    def __init__(self, status_queue, fault: envs.Fault | None, rank: int = 0):
        self.status_queue = status_queue
        self.fault = fault if fault is not None and fault.rank == rank else None
        self.rank = rank
        self.phase = "launching"

    def __call__(self, name: str, info: dict) -> None:
        if name == "progress":
            self.status_queue.put(Progress(info, self.rank))
            return
        self.phase = name
        self.status_queue.put(PhaseEntered(name, info, self.rank))
        if self.fault is not None and self.fault.phase == name:
            self._inject(self.fault.kind, name)

    def _inject(self, kind: str, phase: str) -> None:
        if kind == "crash":
            logger.error(f"injected crash in phase {phase}")
            self.status_queue.close()
            self.status_queue.join_thread()  # the phase report reaches the front before the process dies
            os._exit(3)
        if kind == "stall":
            logger.warning(f"injected stall in phase {phase}")
            time.sleep(3600)


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when the front dies, whatever killed it (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _pin_threads(spec: RankSpec) -> None:
    """CPU ranks on one node split its cores: each is pinned to its share, so tp 2 on 2 cores runs one thread per
    rank instead of two ranks of two threads preempting each other inside every collective."""
    cores = sorted(os.sched_getaffinity(0))
    if spec.local_ranks <= 1 or not cores:
        return
    n = len(cores)
    share = cores[spec.local_rank * n // spec.local_ranks : (spec.local_rank + 1) * n // spec.local_ranks]
    os.sched_setaffinity(0, share or [cores[spec.local_rank % n]])
    logger.info(f"CPU threads pinned to cores {sorted(os.sched_getaffinity(0))}")


def _join_group(args: ServerArgs, spec: RankSpec) -> None:
    """Pin this rank's threads and join the tensor-parallel group (before any layer is built: layers shard by it)."""
    if args.tp_size == 1:
        return
    device = platform.detect_device() if args.device == "auto" else args.device
    if device == "cpu":
        _pin_threads(spec)
    else:
        import torch

        torch.cuda.set_device(spec.local_rank)
    # a collective waits a little past the front's watchdog, so the front names the silent rank first
    distributed.init_tp(
        spec.rank, args.tp_size, device, spec.init_method, args.watchdog_timeout + 30, ep_size=args.ep_size
    )


def engine_main(
    args: ServerArgs, recv_addr: str, send_addr: str, status_queue, spec: RankSpec = RankSpec()
) -> None:
    """Entry point of a rank's process. Reports PhaseEntered, Progress, then EngineReady (rank 0) or RankReady, or
    StartupFailed, on status_queue during startup (kiln.scheduler.io). Rank 0 alone talks to the front over ZMQ."""
    _die_with_parent()
    # the process's name in ps and top ("kiln::engine", "kiln::engine-tp1"), as SGLang titles its schedulers: a
    # forked rank would otherwise show the front's command line, a spawned one multiprocessing's
    setproctitle.setproctitle(mp.current_process().name)
    configure_logging(args.log_level, rank_tag(spec.rank, args.tp_size))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when to stop
    reporter = _StartupReporter(status_queue, envs.fault(), spec.rank)
    try:
        from kiln.scheduler.launch import build_engine

        _join_group(args, spec)
        parts = build_engine(args, on_phase=reporter)
        # from here its loop's beat is watched (--watchdog-timeout); with several ranks, a rank that waits on the
        # others is silent because of them
        if spec.beat is not None:
            spec.beat.stamp()
        status_queue.put(RankReady(spec.rank))
        info = server_info(parts)
    except Exception as e:
        logger.error(f"engine startup failed: {e}")
        status_queue.put(StartupFailed(str(e), traceback.format_exc(), spec.rank))
        return
    if spec.rank != 0:
        _serve(EngineLoop(parts, None, None, spec.beat), reporter, status_queue)
        return
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    status_queue.put(EngineReady(info))
    _serve(EngineLoop(parts, recv, send, spec.beat), reporter, status_queue)


def _serve(loop: EngineLoop, reporter: _StartupReporter, status_queue) -> None:
    """The loop until the front stops this process; with several ranks, a collective that fails (another rank
    died or went silent) ends this one with its reason reported."""
    if loop.beat is not None:
        loop.beat.stamp()
    reporter("serving", {})
    try:
        loop.run()
    except Exception as e:
        if distributed.tp_size() == 1:
            raise
        logger.error(f"rank {distributed.tp_rank()} stops: {e!r}")
        status_queue.put(RankFailed(distributed.tp_rank(), "serving", f"{type(e).__name__}: {e}"))
        status_queue.close()
        status_queue.join_thread()
        os._exit(PEER_FAILED_EXIT)


def server_info(parts: EngineParts) -> ServerInfo:
    """What the engine resolved and measured. With several ranks every rank calls it at the same point of the
    loop (startup's end, the server_info control each rank receives), for the ranks' memory checks are gathered."""
    info = _rank_info(parts)
    if distributed.tp_size() == 1:
        return info
    checks = distributed.all_gather_objects(info.memory_check)
    return replace(info, tp_size=distributed.tp_size(), memory_check_per_rank=checks)


def _rank_info(parts: EngineParts) -> ServerInfo:
    from kiln.memory.measure import memory_check, peak_rss_bytes

    ledger = parts.ledger
    runner = parts.scheduler.runner
    measured = dict(runner.measured)
    if "rss_after_pool" in measured:
        measured["warmup_peak"] = max(0, peak_rss_bytes() - measured.pop("rss_after_pool"))
    return ServerInfo(
        max_total_num_tokens=ledger.max_total_num_tokens,
        max_running_requests=ledger.max_running_requests,
        context_len=ledger.context_len,
        chunked_prefill_size=ledger.chunked_prefill_size,
        vocab_size=parts.model_config.vocab_size,
        device=parts.device,
        ledger=ledger.to_dict(),
        measured=measured,
        memory_check=memory_check(ledger, measured),
        graphs=runner.graphs.summary() if runner.graphs is not None else None,
        pid=os.getpid(),
        draft_graphs=_draft_graphs(parts.scheduler.spec),
        pooling=parts.pooling,
        hidden_size=parts.model_config.hidden_size,
    )


def _draft_graphs(spec: SpecDecoder | None) -> dict | None:
    """The draft's captured steps, for /status beside the target's: a watcher sees what capture_draft did."""
    draft = getattr(getattr(spec, "drafter", None), "runner", None)
    graphs = getattr(draft, "graphs", None)
    return graphs.summary() if graphs is not None else None


class EngineLoop:
    """One rank's loop. Rank 0 receives the front's messages; with several ranks it broadcasts them at the start of
    every iteration, every rank handles the same messages in the same order and runs the same deterministic
    scheduler on them (the sampled tokens come from rank 0 too), and rank 0 alone answers the front. With one
    rank nothing is broadcast."""

    def __init__(
        self, parts: EngineParts, recv: zmq.Socket | None, send: zmq.Socket | None, beat: Beat | None = None
    ):
        self.parts = parts
        self.beat = beat
        self.sched = parts.scheduler
        self.recv, self.send = recv, send
        self.tp = distributed.tp_size()
        self.poller = zmq.Poller()
        if recv is not None:
            self.poller.register(recv, zmq.POLLIN)

    def _receive(self) -> list:
        """The front's messages since the last iteration (rank 0); then, with several ranks, rank 0's on every rank."""
        msgs: list = []
        if self.recv is not None:
            timeout = 0 if self.sched.has_work else 100
            if self.poller.poll(timeout):
                while True:
                    try:
                        msgs.append(self.recv.recv_pyobj(zmq.NOBLOCK))
                    except zmq.Again:
                        break
        if self.tp == 1:
            return msgs
        if (
            self.recv is not None
        ):  # deadlines are read off rank 0's clock, so every rank expires the same requests
            msgs.extend(self.sched.expired_aborts())
        return distributed.broadcast_objects(msgs if self.recv is not None else None)

    def run(self) -> None:
        last_sent = 0.0
        while True:
            if self.beat is not None:
                self.beat.stamp(turn=True)
            for msg in self._receive():
                self.handle(msg)
            outs = self._step() if self.sched.has_work else self.sched.take_outputs()
            now = time.time()
            if self.send is None:
                continue
            if outs or now - last_sent >= HEARTBEAT_SECONDS:  # an empty batch is the heartbeat
                self.send.send_pyobj(BatchOut(outs, self.sched.make_stats()))
                last_sent = now

    def _step(self) -> list[ReqOutput]:
        try:
            return self.sched.step()
        except Exception as e:  # a scheduler bug fails the requests in flight, never the engine
            eid = uuid.uuid4().hex[:12]
            logger.exception(f"engine error {eid} in a scheduler step: {e!r}")
            self.sched.fail_all(f"internal error {eid}: {type(e).__name__}: {e}")
            return self.sched.take_outputs()

    def handle(self, msg) -> None:
        try:
            self._handle(msg)
        except Exception as e:  # one bad message fails its request, never the engine
            eid = uuid.uuid4().hex[:12]
            logger.exception(f"engine error {eid} handling {type(msg).__name__}: {e!r}")
            if isinstance(msg, GenerateReq):
                error = f"internal error {eid}: {type(e).__name__}: {e}"
                self.sched.fail_request(msg.rid, len(msg.input_ids), error)

    def _handle(self, msg) -> None:
        if isinstance(msg, GenerateReq):
            self.sched.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.sched.abort(msg)
        elif isinstance(msg, ControlReq):
            out = self.control(msg)  # every rank runs it (a flush, the gathered server info); rank 0 answers
            if self.send is not None:
                self.send.send_pyobj(out)

    def control(self, msg: ControlReq) -> ControlOut:
        s = self.sched
        if msg.kind == "flush_cache":
            return ControlOut(msg.cid, s.flush_cache())
        if msg.kind == "server_info":
            state = EngineState(server_info(self.parts), s.make_stats(), s.check_integrity())
            return ControlOut(msg.cid, True, state=state)
        if msg.kind == "check_integrity":
            report = s.check_integrity()
            return ControlOut(msg.cid, report["ok"], report)
        if msg.kind in ("load_lora_adapter", "unload_lora_adapter"):
            ok, data = s.lora_control(msg.kind, msg.args)
            return ControlOut(msg.cid, ok, data)
        return ControlOut(msg.cid, False, {"error": f"unknown control {msg.kind!r}"})
