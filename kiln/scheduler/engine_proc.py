"""The engine process: builds the scheduler and runs its loop, talking to the front over ZMQ."""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
import uuid

import zmq

from kiln.config import ServerArgs
from kiln.core.logs import configure_logging
from kiln.scheduler.io import AbortReq, BatchOut, ControlOut, ControlReq, GenerateReq
from kiln.scheduler.output import OutputProcessor

logger = logging.getLogger("kiln")
HEARTBEAT_SECONDS = 1.0


def _inject_fault(phase: str, status_queue) -> None:
    """Fault injection for the startup tests: KILN_FAULT=crash:<phase> or stall:<phase>."""
    kind, _, at = os.environ.get("KILN_FAULT", "").partition(":")
    if at != phase:
        return
    if kind == "crash":
        logger.error(f"injected crash in phase {phase}")
        status_queue.close()
        status_queue.join_thread()  # the phase report reaches the front before the process dies
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
    """Entry point of the child process. Reports ("phase", name, info), ("progress", info), ("ready", info) or
    ("error", reason, tb) on status_queue during startup."""
    _die_with_parent()
    configure_logging(args.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when to stop

    def on_phase(name: str, info: dict) -> None:
        status_queue.put(("phase", name, info) if name != "progress" else ("progress", info))
        if name != "progress":
            _inject_fault(name, status_queue)

    try:
        from kiln.scheduler.launch import build_engine

        parts = build_engine(args, on_phase=on_phase)
    except Exception as e:
        logger.error(f"engine startup failed: {e}")
        status_queue.put(("error", str(e), traceback.format_exc()))
        return
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    status_queue.put(("ready", server_info(parts)))
    EngineLoop(parts, recv, send).run()


def server_info(parts) -> dict:
    from kiln.memory.measure import memory_check, peak_rss_bytes

    ledger = parts.ledger
    runner = parts.scheduler.runner
    measured = dict(runner.measured)
    if "rss_after_pool" in measured:
        measured["warmup_peak"] = max(0, peak_rss_bytes() - measured.pop("rss_after_pool"))
    return {
        "max_total_num_tokens": ledger.max_total_num_tokens,
        "max_running_requests": ledger.max_running_requests,
        "context_len": ledger.context_len,
        "chunked_prefill_size": ledger.chunked_prefill_size,
        "vocab_size": parts.model_config.vocab_size,
        "device": parts.device,
        "ledger": ledger.to_dict(),
        "measured": measured,
        "memory_check": memory_check(ledger, measured),
        "graphs": runner.graphs.summary() if runner.graphs is not None else None,
        "pid": os.getpid(),
    }


class EngineLoop:
    def __init__(self, parts, recv: zmq.Socket, send: zmq.Socket):
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
            outs = self._step() if self.sched.has_work or self.sched.outbox else []
            now = time.time()
            if outs or now - last_sent >= HEARTBEAT_SECONDS:  # an empty batch is the heartbeat
                self.send.send_pyobj(BatchOut(outs, self.sched.gauges()))
                last_sent = now

    def _step(self) -> list:
        try:
            return self.sched.step()
        except Exception as e:  # a scheduler bug fails the requests in flight, never the engine
            eid = uuid.uuid4().hex[:12]
            logger.exception(f"engine error {eid} in a scheduler step: {e!r}")
            self.sched.fail_all(f"internal error {eid}: {type(e).__name__}: {e}")
            out, self.sched.outbox = self.sched.outbox, []
            return out

    def handle(self, msg) -> None:
        try:
            self._handle(msg)
        except Exception as e:  # one bad message fails its request, never the engine
            eid = uuid.uuid4().hex[:12]
            logger.exception(f"engine error {eid} handling {type(msg).__name__}: {e!r}")
            if isinstance(msg, GenerateReq):
                self.sched.stats["failed"] += 1
                self.sched.outbox.append(
                    OutputProcessor.error_output(
                        msg.rid, len(msg.input_ids), f"internal error {eid}: {type(e).__name__}: {e}"
                    )
                )

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
            info = server_info(self.parts)
            info.update(
                {
                    "num_running_reqs": len(s.running),
                    "num_waiting_reqs": len(s.waiting),
                    "token_usage": s.token_usage(),
                    "integrity": s.check_integrity(),
                    "stats": dict(s.stats),
                    "cache_tokens": s.kv.cache.total_size(),
                }
            )
            return ControlOut(msg.cid, True, info)
        if msg.kind == "check_integrity":
            report = s.check_integrity()
            return ControlOut(msg.cid, report["ok"], report)
        return ControlOut(msg.cid, False, {"error": f"unknown control {msg.kind!r}"})
