"""The overlap scheduler's step: decode steps run one ahead of the scheduler on a forward thread (SGLang's overlap
schedule and its forward thread).

In steady decode the scheduler launches step N+1 before it has read step N's tokens: N+1's input ids are N's
sampled tokens, which the forward thread takes from N's chosen ids where they are (a future token per row, resolved
on the device as SGLang resolves them: on a GPU the thread launches N+1 behind N without waiting for either), while
N's tokens travel to the host. While N+1 runs, the scheduler appends N's tokens, detokenizes, checks stops and
streams. A
request that N ends with EOS or a stop has already been launched in N+1: its output goes out when N is processed,
and its extra row is dropped, with the slot it took, once N+1 is in. A request that N ends by length is known ahead
and is left out of N+1.

Only plain decode chains: anything else (a prefill to schedule, a grammar, penalties, min_new_tokens still ahead,
speculative decoding, a hybrid model's state tracking, several ranks, a pool too full for the step) first drains
the step in flight, then runs as without overlap. Everything that touches a request's KV outside a step (aborts,
deadlines, flushes, integrity checks, closing) drains first too, as does the end of an in-process Engine call.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

import kiln.distributed as distributed
from kiln.core.forward_batch import ForwardBatch
from kiln.core.transfer import to_device
from kiln.runner.device_sampler import PendingSample
from kiln.runner.sampler import SampleOutput, SamplingRow
from kiln.scheduler.req import Req
from kiln.scheduler.step import StepPlan, StepResult, decode_plan


@dataclass
class Launched:
    """What a launched step gives back: its sampling, launched (the chosen ids on the device, the host's copy under
    way), and whether it replayed a captured graph (the runner's flag by then may be the next step's)."""

    sampled: PendingSample
    graphed: bool


@dataclass
class InFlight:
    """A launched decode step: its requests (row order), its plan and its result, when it comes."""

    reqs: list[Req]
    result: Future[Launched]
    plan: StepPlan | None = None


class ForwardThread:
    """One thread that launches decode steps in launch order: forward, then sampling. On a GPU it waits for
    neither: a step reads the ids the step before chose where they are, on the device."""

    def __init__(self, step: Callable[[ForwardBatch, list[SamplingRow]], Launched]):
        self.step = step  # forward + sample: the scheduler's runner and sampler
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-forward")

    def launch(
        self,
        reqs: list[Req],
        fb: ForwardBatch,
        rows: list[SamplingRow],
        after: InFlight | None,
        plan: StepPlan | None = None,
    ) -> InFlight:
        """Runs the step once `after` (the step in flight, or None) is launched; each request that was in it reads
        its input id from the ids that step chose. `plan`: the scheduler's, which commits the step when it is in."""
        source = None
        if after is not None:
            row_of = {id(r): i for i, r in enumerate(after.reqs)}
            source = [row_of.get(id(r)) for r in reqs]
        return InFlight(reqs, self.pool.submit(self._run, fb, rows, after, source), plan)

    def _run(
        self,
        fb: ForwardBatch,
        rows: list[SamplingRow],
        after: InFlight | None,
        source: list[int | None] | None,
    ) -> Launched:
        if after is not None:
            # raises where that step failed: this one fails with it
            ids = after.result.result().sampled.ids
            if ids.device.type != "cpu":
                fb = fb.to(ids.device)
            src = to_device(torch.tensor([-1 if i is None else i for i in source]), ids.device)
            fb = replace(fb, input_ids=torch.where(src >= 0, ids[src.clamp(min=0)], fb.input_ids))
        return self.step(fb, rows)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)


def _ends_by_length(req: Req, context_len: int) -> bool:
    """Whether the token in flight for req ends it by length (max_new_tokens or the context), known ahead."""
    return len(req.output_ids) + 1 >= req.params.max_new_tokens or req.seq_len + 1 >= context_len


def chainable(req: Req) -> bool:
    """A request whose next step needs nothing of the step in flight but its token: no grammar to advance, no
    penalties over its output, no EOS ban left (min_new_tokens)."""
    p = req.params
    return req.matcher is None and not p.needs_penalties and len(req.output_ids) >= p.min_new_tokens


def next_rows(running: list[Req], in_flight: InFlight | None, context_len: int) -> list[Req]:
    """The requests the next step decodes: the running ones, less those the step in flight ends by length."""
    pending = {id(r) for r in in_flight.reqs} if in_flight is not None else set()
    return [r for r in running if not (id(r) in pending and _ends_by_length(r, context_len))]


def plain_rows(reqs: list[Req]) -> list[SamplingRow]:
    """Sampling rows for the forward thread. They share the requests' output lists, which the scheduler appends to
    meanwhile: only penalties read them, and a request with penalties does not chain."""
    return [SamplingRow(r.params, r.generator, r.input_ids, r.output_ids) for r in reqs]


class OverlapSchedule:
    """The scheduler's side of the overlap: when a step chains, launching it, taking in the step before, and
    settling the step in flight wherever the plain path's state is needed. Mixed into Scheduler, whose state
    (running requests, KV, outputs) it works on."""

    forward_thread: ForwardThread | None
    in_flight: InFlight | None

    def _forward_and_sample(self, fb, rows: list[SamplingRow]) -> Launched:
        """A launched step, on the forward thread."""
        logits = self.runner.forward(fb)
        return Launched(PendingSample(logits, rows), self.runner.last_forward_graph)

    def _chains(self) -> bool:
        """Whether this step is plain decode the forward thread can run one step ahead (the module says when)."""
        return (
            self.forward_thread is not None
            and self.spec is None
            and self.runner.state_pool is None
            and distributed.tp_size() == 1
            and not self.waiting
            and self.chunked is None
            and bool(self.running)
            and all(chainable(r) for r in self.running)
            and self.kv.decode_fits(len(self.running))
        )

    def _overlap_decode(self) -> None:
        """Launch the next decode step, then process the one in flight while it runs."""
        self.last_was_prefill = False
        # the step in flight stays in self.in_flight until the next is launched: whatever raises before that
        # leaves it where fail_all finds it
        before = self.in_flight
        reqs = next_rows(self.running, before, self.limits.context_len)
        slots = self.kv.alloc_decode(reqs) if reqs else None
        if reqs and slots is None:  # no room after all: the step in flight is processed, then the plain path
            self.drain()
            self.run_plan(self.schedule_decode())
            return
        launched = None
        if reqs:
            # the input ids of rows in flight are stale here: the forward thread fills them in
            plan = decode_plan(reqs, self.kv.table, slots)
            launched = self.forward_thread.launch(reqs, plan.batch, plain_rows(reqs), before, plan)
        self.in_flight = launched
        if before is not None:
            self._take_step(before)

    def _take_step(self, step: InFlight) -> None:
        """A launched step's tokens, taken in: rows of requests that ended meanwhile give back their extra slot."""
        try:
            result = step.result.result()
            sampled = result.sampled.result()
        except Exception as e:
            self._fail_steps(step, e)
            return
        live = []
        for i, r in enumerate(step.reqs):
            if r.finished:
                self._cache_extra_row(r)
            else:
                live.append(i)
        if live:
            assert step.plan is not None, "a step the scheduler launched carries its plan"
            ids, logprobs, top = sampled.next_token_ids, sampled.logprobs, sampled.top_logprobs
            picked = SampleOutput([ids[i] for i in live], [logprobs[i] for i in live], [top[i] for i in live])
            plan = step.plan
            rows = replace(
                plan,
                reqs=tuple(plan.reqs[i] for i in live),
                new_tokens=tuple(plan.new_tokens[i] for i in live),
                starts=tuple(plan.starts[i] for i in live),
                sampled=tuple(range(len(live))),
            )  # the plan's rows still running: the others ended while this step ran
            self.update(rows, StepResult(picked, graphed=result.graphed))

    def _cache_extra_row(self, req: Req) -> None:
        """A request that ended (EOS, a stop) after the next step had been launched with it: that step's row is
        dropped with its slot, and the request's KV is cached as at any finish."""
        if req.table_idx is None:
            return
        self.kv.trim(req, req.kv_len - 1, req.kv_len)
        self.kv.cache_finished(req)

    def _fail_steps(self, step: InFlight, exc: Exception) -> None:
        """A launched step failed: the one launched after it fails with it (it waited on these tokens)."""
        later, self.in_flight = self.in_flight, None
        failed = self._settle(step)
        if later is not None:
            failed += [r for r in self._settle(later) if all(r is not x for x in failed)]
        self.fail_batch(failed, exc)

    def _abandon_in_flight(self) -> None:
        """The step in flight waited for and its tokens left untaken (everything is about to fail)."""
        step, self.in_flight = self.in_flight, None
        if step is not None:
            self._settle(step)

    def _settle(self, step: InFlight) -> list[Req]:
        """Waits for a step whose tokens will not be taken (for its launch: its device work runs on in stream
        order, before anything launched later) and drops the extra rows of its requests that already ended; returns
        the others (a failed step's error is the caller's to report)."""
        step.result.exception()
        for r in step.reqs:
            if r.finished:
                self._cache_extra_row(r)
        return [r for r in step.reqs if not r.finished]

    def drain(self) -> None:
        """Process the step in flight, if any: afterwards the scheduler's state is that of the plain path."""
        while self.in_flight is not None:
            step, self.in_flight = self.in_flight, None
            self._take_step(step)

    def close(self) -> None:
        self.drain()
        if self.forward_thread is not None:
            self.forward_thread.shutdown()
