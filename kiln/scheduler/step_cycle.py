"""The scheduler's step cycle (kiln.scheduler.step has its data): `schedule` decides the next StepPlan, `execute`
runs it into a StepResult without changing a request, `update` commits it, and `commit` is the one place a token
joins a request, whichever step produced it (a prefill's first token, plain decode, the overlap schedule's launched
steps, a verify step's accepted drafts). Mixed into Scheduler, whose state (queues, KV, outputs) it works on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

import kiln.distributed as distributed
from kiln.runner.device_sampler import sample_step
from kiln.runner.sampler import SampleOutput, SamplingRow
from kiln.scheduler import pooling, prompt_logprobs
from kiln.scheduler.batch import build_extend
from kiln.scheduler.req import Req, ReqState
from kiln.scheduler.step import StepKind, StepPlan, StepResult, decode_plan
from kiln.structured.masks import batch_masks, blocked_finish

if TYPE_CHECKING:
    from kiln.runner.model_runner import ModelRunner
    from kiln.scheduler.adapters import AdapterPins
    from kiln.scheduler.io import ReqOutput, RequestCounters
    from kiln.scheduler.kv import KVManager
    from kiln.scheduler.output import OutputProcessor
    from kiln.scheduler.spec_step import SpecDecoder

logger = logging.getLogger("kiln")


class StepCycle:
    """Plan, execute, update: the scheduler's steps as data (the module says how)."""

    runner: ModelRunner
    kv: KVManager
    out: OutputProcessor
    spec: SpecDecoder | None
    running: list[Req]
    outbox: list[ReqOutput]
    counters: RequestCounters
    last_was_prefill: bool
    lora_slots: AdapterPins

    def schedule(self) -> StepPlan | None:
        """The next step, decided (kiln.scheduler.step): a prefill of the requests admission takes or, every other
        step while requests run, a decode (or speculative verify) step over them. None when nothing can run."""
        if not (self.last_was_prefill and self.running):
            reqs = self._build_prefill()
            if reqs:
                return self._prefill_plan(reqs)
        return self.schedule_decode() if self.running else None

    def _prefill_plan(self, reqs: list[Req]) -> StepPlan:
        batch = build_extend(reqs, self.kv.table)
        kept, shares = prompt_logprobs.plan_rows(reqs)
        pooled_rows, pools = pooling.plan_rows(reqs, len(kept))
        kept += pooled_rows
        if kept:
            batch = replace(batch, hidden_index=torch.tensor(kept, dtype=torch.int64))
        starts, new = tuple(r.kv_len for r in reqs), tuple(r.extend_len for r in reqs)
        for r in reqs:  # the extend's slots are the request's from here: a failure releases them
            r.kv_len += r.extend_len
        sampled = tuple(i for i, r in enumerate(reqs) if r.prefill_done and r.params.max_new_tokens > 0)
        return StepPlan(
            StepKind.PREFILL, tuple(reqs), new, starts, batch, sampled, prompt_rows=shares, pool_rows=pools
        )

    def schedule_decode(self) -> StepPlan | None:
        """A decode step over the running requests (a verify step where the drafter proposes), retracting the
        least advanced first when the pool cannot take a token more for each."""
        if not self.kv.decode_fits(len(self.running)):
            self._retract()
        if not self.running:
            return None
        plan = self.spec.plan(self) if self.spec is not None else None
        if plan is not None:
            return plan
        reqs = list(self.running)
        slots = self.kv.alloc_decode(reqs)
        if slots is None:
            return None
        return decode_plan(reqs, self.kv.table, slots)

    def run_plan(self, plan: StepPlan | None) -> None:
        if plan is not None:
            self.update(plan, self.execute(plan))

    def execute(self, plan: StepPlan) -> StepResult:
        """Runs a plan: the forward, then the sampling of its rows that give a token (a verify step's drafts
        checked). Changes no request: a forward that raises comes back as the result's error."""
        try:
            logits = self.runner.forward(plan.batch)
            scored = prompt_logprobs.score(self.runner, plan.prompt_rows)
            pooled = pooling.compute(self.runner, plan.pool_rows)
        except Exception as e:  # one bad batch fails its requests, never the loop
            return StepResult(error=e)
        hidden, graphed = getattr(self.runner, "last_hidden", None), self.runner.last_forward_graph
        if plan.kind == StepKind.VERIFY:
            assert self.spec is not None
            return self.spec.verify(self, plan, logits, hidden, graphed)
        rows = logits[list(plan.sampled)] if plan.kind == StepKind.PREFILL else logits
        sampled, blocked = self.sample([plan.reqs[i] for i in plan.sampled], rows)
        return StepResult(
            sampled, blocked, hidden=hidden, graphed=graphed, prompt_logprobs=scored, pooled=pooled
        )

    def update(self, plan: StepPlan, result: StepResult) -> None:
        """Commits an executed plan: KV published to the prefix cache, tokens committed (Scheduler.commit), the
        finished requests ended, the drafter told; where the forward failed, its requests fail."""
        reqs = list(plan.reqs)
        if result.error is not None:
            self.fail_batch(reqs, result.error)
            return
        if plan.kind == StepKind.PREFILL:
            self._update_prefill(plan, result)
            return
        if plan.kind == StepKind.VERIFY:
            assert self.spec is not None
            produced = self.spec.update(self, plan, result)
        else:
            self.kv.track_states(reqs)  # hybrid models: state checkpoints every --mamba-track-interval tokens
            self.commit_sampled(reqs, result)
            if self.spec is not None:
                self.spec.after_plain_decode(reqs, result.hidden)
            produced = len(reqs)
        self._decoded(produced, result.graphed)

    def _update_prefill(self, plan: StepPlan, result: StepResult) -> None:
        reqs = list(plan.reqs)
        prompt_logprobs.record(plan.reqs, plan.prompt_rows, result.prompt_logprobs)  # before any output
        pooling.record(plan.reqs, plan.pool_rows, result.pooled)
        for r in reqs:
            if not r.prefill_done:
                self.kv.cache_unfinished(r)
        self._log_prefill(reqs, int(plan.batch.input_ids.numel()), sum(plan.starts))
        for r in reqs:
            if r.prefill_done and r.params.max_new_tokens == 0:  # prefill only
                r.finish_reason = {"type": "length", "length": 0}
                self._finish(r)
        sampled = [reqs[i] for i in plan.sampled]
        for r in sampled:  # publish the prompt's KV now, so requests arriving meanwhile share it
            self.kv.cache_unfinished(r)
            self.kv.keep_prompt_state(r)
            r.state = ReqState.RUNNING
            self.running.append(r)
        self.commit_sampled(sampled, result)
        if self.spec is not None:
            self._prefilled_for_drafter(reqs, plan.starts, result.hidden)

    def _prefilled_for_drafter(
        self, reqs: list[Req], starts: tuple[int, ...], hidden: torch.Tensor | None
    ) -> None:
        """A drafter reading the target's hidden states (EAGLE) hears each prefilled chunk: its rows' hidden
        states and the tokens they predicted (the sequence's next tokens, the sampled one last)."""
        row = 0
        if hidden is None:
            return
        for r, start in zip(reqs, starts):
            count = r.kv_len - start
            if not r.finished:
                tokens = r.fill_ids[start + 1 : r.kv_len + 1]
                self.spec.drafter.accepted(r.rid, tokens, hidden[row : row + count])
            row += count

    def sample(self, reqs: list[Req], logits: torch.Tensor) -> tuple[SampleOutput | None, tuple[int, ...]]:
        """Each request's next token from its row of `logits`, under its grammar's mask and its banned ids; the
        requests whose grammar allows no token are not sampled, their indices returned (commit_sampled ends them:
        every rank computes the same masks, so every rank ends the same ones)."""
        if not reqs:
            return None, ()
        banned = [self.out.banned_ids(r) for r in reqs]
        masks = batch_masks([r.matcher for r in reqs], banned, logits.shape[-1])
        blocked = tuple(masks.blocked)
        keep = [i for i in range(len(reqs)) if i not in set(blocked)]
        if not keep:
            return None, blocked
        rows = [
            SamplingRow(reqs[i].params, reqs[i].generator, reqs[i].input_ids, reqs[i].output_ids, banned[i],
                        masks.masks[i])
            for i in keep
        ]  # fmt: skip
        return sample_step(logits[keep] if blocked else logits, rows), blocked

    def commit_sampled(self, reqs: list[Req], result: StepResult) -> None:
        """The tokens sampled for `reqs` (a plan's sampled requests, in order) committed; those their grammar
        blocked end unsampled."""
        for i in result.blocked:
            self._end_blocked(reqs[i])
        kept = [r for i, r in enumerate(reqs) if i not in set(result.blocked)]
        if kept:
            assert result.sampled is not None
            self._take_tokens(kept, result.sampled)

    def _take_tokens(self, reqs: list[Req], result: SampleOutput) -> None:
        """Each request's sampled token committed (plain decode, a prefill's first token, the overlap schedule's
        steps, a verify step's rows without drafts)."""
        next_ids = distributed.broadcast_token_ids(result.next_token_ids)  # rank 0's tokens on every rank
        for i, r in enumerate(reqs):
            self.commit(r, [next_ids[i]], [result.logprobs[i]], [result.top_logprobs[i]])

    def commit(
        self,
        req: Req,
        tokens: list[int],
        logprobs: list,
        top_logprobs: list,
        place_kv: Callable[[int], None] | None = None,
    ) -> int:
        """The one place a step's tokens join a request, whatever produced them (a sampled row, a verified draft
        path): each appended with its logprobs, the grammar advanced and the stops checked, until the request
        ends; then `place_kv(kept)` puts the kept tokens' KV where decoding expects it (a verify step's accepted
        path), and the request either ends (its KV cached, its output sent) or streams. Returns the tokens kept."""
        kept = 0
        for token, logprob, top in zip(tokens, logprobs, top_logprobs):
            self.out.append_token(req, token, logprob, top)
            self.out.follow_grammar(req, token)
            self.counters.generation_tokens += req.log_metrics
            kept += 1
            if req.finished:
                break
        if place_kv is not None:
            place_kv(kept)
        if req.finished:
            self.running.remove(req)
            self._finish(req)
        elif self.out.should_stream(req):
            self.outbox.append(self.out.flush_output(req))
        return kept

    def _end_blocked(self, req: Req) -> None:
        """A constrained request whose grammar allows no token now ends before sampling (see blocked_finish)."""
        assert req.matcher is not None
        req.finish_reason = blocked_finish(req.matcher)
        req.pending_text += req.detok.flush(self.out.stops_live(req))
        self.running.remove(req)
        if req.finish_reason["type"] == "abort":
            self.counters.aborted += 1
        self._finish(req)

    def _finish(self, req: Req) -> None:
        if self.in_flight is None or all(r is not req for r in self.in_flight.reqs):
            self.kv.cache_finished(req)
        # else the step in flight still writes its extra row: its KV is cached when that step is in (_take_step)
        self._emit(req)

    def _emit(self, req: Req) -> None:
        req.state = ReqState.FINISHED
        self.reqs.pop(req.rid, None)
        self.lora_slots.unpin(req)
        self.lora_slots.retire(list(self.reqs.values()))
        if self.spec is not None:
            self.spec.release(req.rid)
        # both at the end, as SGLang counts them: a hit rate over a window reads them together
        if req.log_metrics:
            self.counters.prompt_tokens += len(req.input_ids)
            self.counters.cached_tokens += req.cached_tokens
        self.outbox.append(self.out.flush_output(req))

    def fail_all(self, error: str) -> None:
        self._abandon_in_flight()
        for r in list(self.reqs.values()):
            self._finish_abort(r, "internal error", error=error)

    def fail_request(self, rid: str, input_len: int, error: str) -> None:
        """A request that failed before it was queued (its message could not be handled): answered with the
        error and counted as failed, like one that failed inside a step."""
        self.counters.failed += 1
        self.outbox.append(self.out.error_output(rid, input_len, error))

    def fail_batch(self, reqs: list[Req], exc: Exception) -> None:
        logger.exception(f"forward failed for {len(reqs)} request(s): {exc!r}")
        for r in reqs:
            self._finish_abort(r, "internal error", error=f"{type(exc).__name__}: {exc}")
