"""The engine process: builds the scheduler and runs its loop, talking to the front over ZMQ."""

from __future__ import annotations

import logging
import os
import signal
import traceback

import zmq

from kiln.config import ServerArgs
from kiln.scheduler.io import AbortReq, BatchOut, ControlOut, ControlReq, GenerateReq
from kiln.server.logs import configure_logging

logger = logging.getLogger("kiln")


def engine_main(args: ServerArgs, recv_addr: str, send_addr: str, status_queue) -> None:
    """Entry point of the child process. Reports ("phase", name, info), ("ready", info) or ("error", reason, tb)
    on status_queue during startup."""
    configure_logging(args.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when to stop
    try:
        from kiln.scheduler.launch import build_engine

        parts = build_engine(args, on_phase=lambda name, info: status_queue.put(("phase", name, info)))
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
    ledger = parts.ledger
    return {
        "max_total_num_tokens": ledger.max_total_num_tokens,
        "max_running_requests": ledger.max_running_requests,
        "context_len": ledger.context_len,
        "chunked_prefill_size": ledger.chunked_prefill_size,
        "vocab_size": parts.model_config.vocab_size,
        "device": parts.device,
        "ledger": ledger.to_dict(),
        "measured": dict(parts.scheduler.runner.measured),
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
        while True:
            timeout = 0 if self.sched.has_work else 100
            if self.poller.poll(timeout):
                while True:
                    try:
                        msg = self.recv.recv_pyobj(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(msg)
            if self.sched.has_work or self.sched.outbox:
                outs = self.sched.step()
                if outs:
                    self.send.send_pyobj(BatchOut(outs))

    def handle(self, msg) -> None:
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
