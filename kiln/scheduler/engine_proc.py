"""The engine process: builds the scheduler and runs its loop, talking to the front over ZMQ."""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
import uuid
from typing import TYPE_CHECKING

import zmq

import kiln.core.envs as envs
from kiln.config import ServerArgs
from kiln.core.logs import configure_logging
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
    ReqOutput,
    ServerInfo,
    StartupFailed,
)

if TYPE_CHECKING:
    from kiln.scheduler.launch import EngineParts

logger = logging.getLogger("kiln")
HEARTBEAT_SECONDS = 1.0


class _StartupReporter:
    """Sends the engine's startup phases and progress to the front, and makes the test hook KILN_FAULT crash or
    stall the process when it enters the phase the hook names."""

    def __init__(self, status_queue, fault: envs.Fault | None):
        self.status_queue = status_queue
        self.fault = fault

    def __call__(self, name: str, info: dict) -> None:
        if name == "progress":
            self.status_queue.put(Progress(info))
            return
        self.status_queue.put(PhaseEntered(name, info))
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


def engine_main(args: ServerArgs, recv_addr: str, send_addr: str, status_queue) -> None:
    """Entry point of the child process. Reports PhaseEntered, Progress, then EngineReady or StartupFailed on
    status_queue during startup (kiln.scheduler.io)."""
    _die_with_parent()
    configure_logging(args.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when to stop
    try:
        from kiln.scheduler.launch import build_engine

        parts = build_engine(args, on_phase=_StartupReporter(status_queue, envs.fault()))
    except Exception as e:
        logger.error(f"engine startup failed: {e}")
        status_queue.put(StartupFailed(str(e), traceback.format_exc()))
        return
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    status_queue.put(EngineReady(server_info(parts)))
    EngineLoop(parts, recv, send).run()


def server_info(parts: EngineParts) -> ServerInfo:
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
    )


class EngineLoop:
    def __init__(self, parts: EngineParts, recv: zmq.Socket, send: zmq.Socket):
        self.parts = parts
        self.sched = parts.scheduler
        self.recv, self.send = recv, send
        self.poller = zmq.Poller()
        self.poller.register(recv, zmq.POLLIN)

    def run(self) -> None:
        last_sent = 0.0
        while True:
            timeout = 0 if self.sched.has_work else 100
            if self.poller.poll(timeout):
                while True:
                    try:
                        msg = self.recv.recv_pyobj(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(msg)
            outs = self._step() if self.sched.has_work else self.sched.take_outputs()
            now = time.time()
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
            self.send.send_pyobj(self.control(msg))

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
        return ControlOut(msg.cid, False, {"error": f"unknown control {msg.kind!r}"})
