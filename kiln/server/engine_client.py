"""The front's side of the ZMQ link: submits requests, routes each step's outputs to the waiting handler,
and aborts a request whose handler went away (client disconnect)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from kiln.sampling_params import SamplingParams
from kiln.scheduler.fanout import prefill_only_params
from kiln.scheduler.io import (
    AbortReq,
    BatchOut,
    ControlOut,
    ControlReq,
    EngineState,
    GenerateReq,
    OutputAccumulator,
    PoolSpec,
    ReqOutput,
    SchedulerStats,
)
from kiln.scheduler.output import OutputProcessor

logger = logging.getLogger("kiln")


class RequestLog:
    """--log-requests: a line when a request arrives and one when it ends (finish reason, token counts, latency),
    as SGLang's `Receive:` / `Finish:` lines, with what --log-requests-level adds (SGLang's levels): 1 the
    sampling parameters the request changed, 2 its prompt and output text cut at MAX_CHARS, 3 them whole."""

    MAX_CHARS = 2048

    def __init__(self, decode: Callable[[list[int]], str], level: int = 2):
        self.decode = decode
        self.level = level
        self.texts: dict[str, list[str]] = {}

    def receive(self, rid: str, input_ids: list[int], params: SamplingParams) -> None:
        self.texts[rid] = []
        line = f"Receive: rid={rid}, prompt_tokens={len(input_ids)}"
        if self.level >= 1:
            changed = {
                f.name: getattr(params, f.name)
                for f in dataclasses.fields(params)
                if getattr(params, f.name) != getattr(_DEFAULT_PARAMS, f.name)
            }
            line += f", sampling_params={changed}"
        if self.level >= 2:
            # a token is at least a character: decoding more than MAX_CHARS of them would only be clipped
            ids = input_ids if self.level >= 3 else input_ids[: self.MAX_CHARS + 1]
            line += f", text={self._clip(self.decode(ids))!r}"
        logger.info(line)

    def output(self, out: ReqOutput, start: float) -> None:
        parts = self.texts.setdefault(out.rid, [])
        parts.append(out.text_delta)
        if not out.finished:
            return
        del self.texts[out.rid]
        reason = out.finish_reason or {}
        text = f", text={self._clip(''.join(parts))!r}" if self.level >= 2 else ""
        logger.info(
            f"Finish: rid={out.rid}, finish_reason={reason.get('type')}, prompt_tokens={out.prompt_tokens}, "
            f"completion_tokens={out.completion_tokens}, cached_tokens={out.cached_tokens}, "
            f"e2e_latency={time.time() - start:.3f}{text}" + (f", error={out.error}" if out.error else "")
        )

    def went_away(self, rid: str) -> None:
        self.texts.pop(rid, None)
        logger.info(f"Abort: rid={rid} (its client went away)")

    def _clip(self, text: str) -> str:
        whole = self.level >= 3 or len(text) <= self.MAX_CHARS
        return text if whole else text[: self.MAX_CHARS] + "..."


_DEFAULT_PARAMS = SamplingParams()


class EngineClient:
    def __init__(self, engine_addr: str, front_addr: str):
        self._send = zmq.Context.instance().socket(zmq.PUSH)
        self._send.connect(engine_addr)
        self._actx = zmq.asyncio.Context()
        self._recv = self._actx.socket(zmq.PULL)
        self._recv.bind(front_addr)
        self.queues: dict[str, asyncio.Queue] = {}
        self.controls: dict[int, asyncio.Future] = {}
        self._cids = itertools.count(1)
        self.last_output_time = time.time()
        self._task: asyncio.Task | None = None
        self.metrics = None  # a kiln.server.metrics.Metrics, when /metrics is on
        self.request_log: RequestLog | None = None  # --log-requests
        self.engine_stats = SchedulerStats()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def _recv_loop(self) -> None:
        while True:
            msg = await self._recv.recv_pyobj()
            self.last_output_time = time.time()
            if isinstance(msg, BatchOut):
                self.engine_stats = msg.stats
                if self.metrics is not None:
                    self.metrics.update_engine(msg.stats)
                for out in msg.outputs:
                    q = self.queues.get(out.rid)
                    if q is not None:
                        q.put_nowait(out)
            elif isinstance(msg, ControlOut):
                fut = self.controls.pop(msg.cid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    @property
    def num_active(self) -> int:
        return len(self.queues)

    def fail_all(self, reason: str) -> None:
        """The engine died or stalled: every request in flight ends now with `reason` as its engine error (a 500
        with an error id, an error event on a stream), rather than waiting on outputs that will not come."""
        for rid, q in self.queues.items():
            q.put_nowait(OutputProcessor.error_output(rid, 0, reason))

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        stream: bool = False,
        rid: str | None = None,
        deadline: float | None = None,
        observe: bool = True,
        pool: PoolSpec | None = None,
        lora_path: str | None = None,
    ) -> AsyncIterator[ReqOutput]:
        """Yields the request's outputs until it finishes; aborts it if the consumer stops early. `observe`
        False keeps it out of the front's latency metrics and the engine's token counters (a health probe is no
        client's request)."""
        rid = rid or uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        finished = False
        start, first, prev = time.time(), None, None
        log = self.request_log if observe else None
        if log is not None:
            log.receive(rid, input_ids, params)
        try:
            self._send.send_pyobj(
                GenerateReq(
                    rid,
                    input_ids,
                    params,
                    stream,
                    deadline,
                    log_metrics=observe,
                    pool=pool,
                    lora_path=lora_path,
                )
            )
            while True:
                out: ReqOutput = await q.get()
                finished = out.finished
                if log is not None:
                    log.output(out, start)
                if self.metrics is not None and observe:
                    now = time.time()
                    if out.queue_time is not None:
                        self.metrics.queue.observe(out.queue_time)
                    if out.new_ids and first is None:
                        first = now
                    self.metrics.observe_output(
                        start, first, prev, now, len(out.new_ids), out.finish_reason if finished else None
                    )
                    prev = now if out.new_ids else prev
                    if finished and lora_path is not None:
                        self.metrics.observe_lora(lora_path, out.prompt_tokens, out.completion_tokens)
                yield out
                if finished:
                    return
        finally:
            self.queues.pop(rid, None)
            if not finished:
                self.abort(rid)
                if log is not None:
                    log.went_away(rid)

    async def collect(
        self,
        input_ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        deadline: float | None = None,
        observe: bool = True,
        pool: PoolSpec | None = None,
        lora_path: str | None = None,
    ) -> OutputAccumulator:
        result = OutputAccumulator()
        async for out in self.generate(input_ids, params, False, rid, deadline, observe, pool, lora_path):
            result.add(out)
        assert result.last is not None
        return result

    async def prefill_only(self, input_ids: list[int], lora_path: str | None = None) -> None:
        """Compute a prompt's KV once so that n samples share it through the prefix cache: Kiln's own request,
        not a client's, so the metrics count the samples alone."""
        await self.collect(input_ids, prefill_only_params(), observe=False, lora_path=lora_path)

    def abort(
        self, rid: str | None = None, abort_all: bool = False, message: str = "aborted by the client"
    ) -> None:
        self._send.send_pyobj(AbortReq(rid, abort_all, message))

    async def control(self, kind: str, timeout: float = 30.0, args: dict | None = None) -> ControlOut:
        cid = next(self._cids)
        fut = asyncio.get_running_loop().create_future()
        self.controls[cid] = fut
        self._send.send_pyobj(ControlReq(kind, cid, args or {}))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.controls.pop(cid, None)

    async def engine_state(self, timeout: float = 30.0) -> EngineState:
        """The engine's server info, stats and a fresh integrity report."""
        out = await self.control("server_info", timeout)
        if out.state is None:
            raise RuntimeError(f"the engine answered server_info without its state: {out.data}")
        return out.state

    def close(self) -> None:
        if self._task:
            self._task.cancel()
        self._send.close(0)
        self._recv.close(0)
