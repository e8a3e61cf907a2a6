"""The speculative decode step: the drafter proposes a chain of tokens per running request, the target runs
ONE forward over each request's last token and its drafts (decode rows on top of its KV, logits at every row), the
verify rules of kiln.speculative.verify decide what is kept, the rejected drafts' KV slots go back to the pool,
and the kept tokens are appended one by one through the OutputProcessor, so stop ids, stop strings and
max_new_tokens end the request exactly where plain decoding would.

Grammar-constrained requests are not speculated: they take no drafts (their row is sampled under the grammar
mask as in plain decoding). A step where no request has drafts is a plain decode step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

import kiln.distributed as distributed
from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.memory.req_to_token import ReqToTokenPool
from kiln.runner.model_runner import ModelRunner
from kiln.runner.sampler import SamplingRow
from kiln.scheduler.io import ReqOutput, RequestCounters
from kiln.scheduler.kv import KVManager
from kiln.scheduler.output import OutputProcessor
from kiln.scheduler.req import Req
from kiln.speculative.base import Drafter, DraftInput
from kiln.speculative.verify import Chain, Verdict, verify_batch

logger = logging.getLogger("kiln")


class Scheduler(Protocol):
    """What the step uses of kiln.scheduler.scheduler.Scheduler (which imports this module)."""

    runner: ModelRunner
    kv: KVManager
    out: OutputProcessor
    counters: RequestCounters
    running: list[Req]
    outbox: list[ReqOutput]

    def _sample_and_process(self, reqs: list[Req], logits: torch.Tensor) -> None: ...

    def _finish(self, req: Req) -> None: ...

    def _fail_batch(self, reqs: list[Req], exc: Exception) -> None: ...


@dataclass
class SpecCounts:
    """Verify steps a request took part in, and the drafts of it the target accepted."""

    verify_ct: int = 0
    accepted_drafts: int = 0


@dataclass
class SpecTotals:
    """Server-wide: request-verifies (one per request per decode step) and accepted drafts, since startup."""

    verify_ct: int = 0
    accepted_drafts: int = 0
    per_request: dict[str, SpecCounts] = field(default_factory=dict)


def build_verify(reqs: list[Req], drafts: list[list[int]], table: ReqToTokenPool) -> ForwardBatch:
    """Each request's last token and its drafts at positions kv_len.. (their slots already in the table), as
    decode rows: row j of a request attends to its first kv_len + j + 1 slots, the drafts before it included
    (every row's KV is written before any row attends). Each row is then computed exactly as plain decoding
    computes that token, which is what keeps greedy output identical; an extend would round differently."""
    ids: list[int] = []
    owners, lengths = [], []
    for r, draft in zip(reqs, drafts):
        ids.append(r.last_token)
        ids.extend(draft)
        owners.extend([r.table_idx] * (len(draft) + 1))
        lengths.extend(range(r.kv_len + 1, r.kv_len + len(draft) + 2))
    rows = torch.tensor(owners, dtype=torch.int64)
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    new_slots = table.req_to_token[rows, seq_lens - 1]
    kv_table, mask = table.decode_table(rows, seq_lens)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=seq_lens - 1,
        out_cache_loc=new_slots,
        logits_index=torch.arange(len(ids)),
        kv_table=kv_table,
        kv_mask=mask,
    )


class SpecDecoder:
    """Runs the scheduler's decode steps with a drafter; `num_draft` drafts per request at most."""

    def __init__(self, drafter: Drafter, num_draft: int, num_draft_tokens: int):
        self.drafter = drafter
        self.num_draft = num_draft
        self.num_draft_tokens = num_draft_tokens  # the flag's value, which SGLang's accept rate divides by
        self.totals = SpecTotals()

    # ------------------------------------------------------------------ drafting
    def _room(self, sched: Scheduler, r: Req) -> int:
        """Drafts worth verifying for r: none under a grammar; never past max_new_tokens or the context."""
        if r.matcher is not None:
            return 0
        context_room = sched.out.context_len - 1 - r.kv_len
        return max(0, min(self.num_draft, r.remaining_new_tokens() - 1, context_room))

    def _drafts(self, sched: Scheduler, reqs: list[Req]) -> list[list[int]]:
        rooms = [self._room(sched, r) for r in reqs]
        inputs = [DraftInput(r.rid, r.fill_ids, room) for r, room in zip(reqs, rooms)]
        proposed = self.drafter.propose(inputs)
        drafts = [list(d[:room]) for d, room in zip(proposed, rooms)]
        page = sched.kv.page_size
        need = sum(-(-(len(d) + 1) // page) * page for d in drafts)
        if need > sched.kv.free_tokens() + sched.kv.evictable_tokens():
            return [[] for _ in reqs]  # the pool is short: this step decodes plainly
        return drafts

    # ------------------------------------------------------------------ the step
    def run(self, sched: Scheduler) -> int | None:
        """One speculative decode step over sched.running: the tokens it produced (0 when the forward failed
        and its requests were failed); None when no request has drafts, and the caller decodes plainly."""
        reqs = list(sched.running)
        drafts = self._drafts(sched, reqs)
        if not any(drafts):
            return None
        counts = [len(d) + 1 for d in drafts]
        if not sched.kv.alloc_verify(reqs, counts):
            return None
        fb = build_verify(reqs, drafts, sched.kv.table)
        bases = [r.kv_len for r in reqs]
        for r, count in zip(reqs, counts):  # the new slots are the request's own: a failure releases them
            r.kv_len += count
        try:
            logits = sched.runner.forward(fb)
        except Exception as e:
            sched._fail_batch(reqs, e)
            return 0
        hidden = getattr(sched.runner, "last_hidden", None)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        plain = [i for i, d in enumerate(drafts) if not d]
        drafted = [i for i, d in enumerate(drafts) if d]
        verdicts = self._verdicts(
            sched, [reqs[i] for i in drafted], [drafts[i] for i in drafted], logits, starts, drafted
        )
        produced = 0
        for i, verdict in zip(drafted, verdicts):
            produced += self._apply(
                sched,
                reqs[i],
                verdict,
                bases[i],
                bases[i] + counts[i],
                _rows(hidden, starts[i], len(verdict.tokens)),
            )
        produced += self._plain_rows(
            sched, [reqs[i] for i in plain], logits, [starts[i] for i in plain], hidden
        )
        return produced

    def _verdicts(
        self,
        sched: Scheduler,
        reqs: list[Req],
        drafts: list[list[int]],
        logits: torch.Tensor,
        starts: list[int],
        index: list[int],
    ) -> list[Verdict]:
        chains = []
        for r, draft, i in zip(reqs, drafts, index):
            rows = [
                SamplingRow(
                    r.params, r.generator, r.input_ids, r.output_ids + draft[:j], sched.out.banned_ids(r, j)
                )
                for j in range(len(draft) + 1)
            ]
            chains.append(Chain(logits[starts[i] : starts[i] + len(draft) + 1], rows, draft))
        verdicts = verify_batch(chains)
        if distributed.tp_size() == 1:
            return verdicts
        return _rank0_verdicts(verdicts, drafts)

    def _apply(
        self,
        sched: Scheduler,
        r: Req,
        verdict: Verdict,
        base: int,
        allocated: int,
        hidden: torch.Tensor | None,
    ) -> int:
        """Append the verdict's tokens until the request ends, keep their KV, tell the drafter."""
        kept: list[int] = []
        for j, token in enumerate(verdict.tokens):
            sched.out.append_token(r, token, verdict.logprobs[j], verdict.top_logprobs[j])
            sched.counters.generation_tokens += r.log_metrics
            kept.append(token)
            if r.finished:
                break
        # plain decoding's invariant: every token but the newest has its KV
        sched.kv.trim(r, base + len(kept), allocated)
        self._count(r.rid, len(kept) - 1)
        if not r.finished:  # a finished request is released instead
            self.drafter.accepted(r.rid, kept, hidden)
        if r.finished:
            sched.running.remove(r)
            sched._finish(r)
        elif sched.out.should_stream(r):
            sched.outbox.append(sched.out.flush_output(r))
        return len(kept)

    def _plain_rows(
        self,
        sched: Scheduler,
        reqs: list[Req],
        logits: torch.Tensor,
        starts: list[int],
        hidden: torch.Tensor | None,
    ) -> int:
        """Requests without drafts in a verify step: their one row is sampled as plain decoding samples it."""
        if not reqs:
            return 0
        before = {r.rid: len(r.output_ids) for r in reqs}
        sched._sample_and_process(reqs, logits[starts])
        for r, start in zip(reqs, starts):
            self._count(r.rid, 0)
            if not r.finished and len(r.output_ids) > before[r.rid]:
                self.drafter.accepted(r.rid, r.output_ids[-1:], _rows(hidden, start, 1))
        return len(reqs)

    def after_plain_decode(self, reqs: list[Req], hidden: torch.Tensor | None) -> None:
        """A decode step ran without drafts: each request took part in it, and the drafter hears its token."""
        for i, r in enumerate(reqs):
            self._count(r.rid, 0)
            if not r.finished and r.output_ids:
                self.drafter.accepted(r.rid, r.output_ids[-1:], _rows(hidden, i, 1))

    # ------------------------------------------------------------------ bookkeeping
    def _count(self, rid: str, accepted: int) -> None:
        counts = self.totals.per_request.setdefault(rid, SpecCounts())
        counts.verify_ct += 1
        counts.accepted_drafts += accepted
        self.totals.verify_ct += 1
        self.totals.accepted_drafts += accepted

    def release(self, rid: str) -> None:
        """The request left the running batch (finished, aborted, retracted): the drafter forgets it."""
        self.drafter.release(rid)

    def annotate(self, outputs: list[ReqOutput]) -> None:
        """Give each output its request's verify count and accepted drafts; forget a request once it ended."""
        for out in outputs:
            counts = self.totals.per_request.get(out.rid)
            if counts is None:
                continue
            out.spec_verify_ct = counts.verify_ct
            out.spec_accepted_drafts = counts.accepted_drafts
            if out.finished:
                del self.totals.per_request[out.rid]

    def accept_length(self) -> float:
        """SGLang's spec_accept_length: tokens produced per request-verify (accepted drafts + the bonus)."""
        totals = self.totals
        return (totals.accepted_drafts + totals.verify_ct) / totals.verify_ct if totals.verify_ct else 0.0

    def accept_rate(self) -> float:
        """SGLang's spec_accept_rate: accepted drafts over the drafts a full chain would verify."""
        proposed = self.totals.verify_ct * max(1, self.num_draft_tokens - 1)
        return self.totals.accepted_drafts / proposed if self.totals.verify_ct else 0.0


def _rows(hidden: torch.Tensor | None, start: int, count: int) -> torch.Tensor | None:
    """The target's hidden rows of the inputs that produced the kept tokens (row i produced token i)."""
    if not isinstance(hidden, torch.Tensor):
        return None
    return hidden[start : start + count]


def _rank0_verdicts(verdicts: list[Verdict], drafts: list[list[int]]) -> list[Verdict]:
    """Rank 0's kept tokens on every rank (as plain decoding broadcasts its sampled ids): each request's
    tokens padded with -1 to its chain length + 1."""
    flat: list[int] = []
    for verdict, draft in zip(verdicts, drafts):
        flat.extend(verdict.tokens + [-1] * (len(draft) + 1 - len(verdict.tokens)))
    flat = distributed.broadcast_token_ids(flat)
    out, start = [], 0
    for verdict, draft in zip(verdicts, drafts):
        tokens = [t for t in flat[start : start + len(draft) + 1] if t >= 0]
        start += len(draft) + 1
        n = len(tokens)
        logprobs = (verdict.logprobs + [None] * n)[:n]
        top = (verdict.top_logprobs + [None] * n)[:n]
        out.append(Verdict(tokens, n - 1, logprobs, top))
    return out
