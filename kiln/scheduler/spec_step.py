"""The speculative decode step: the drafter proposes a chain or a tree of tokens per running request, the target
runs ONE forward over each request's last token and its drafts (decode rows on top of its KV, logits at every
row; a tree node's row sees only its own path), the verify rules of kiln.speculative.verify decide what is kept,
the accepted path's KV is moved to the columns plain decoding would have written, the rejected drafts' KV slots go
back to the pool, and the kept tokens are appended one by one through the OutputProcessor, so stop ids, stop
strings and max_new_tokens end the request exactly where plain decoding would.

Grammar-constrained requests are not speculated: they take no drafts (their row is sampled under the grammar
mask as in plain decoding). A step where no request has drafts is a plain decode step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

import kiln.distributed as distributed
from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.memory.req_to_token import ReqToTokenPool
from kiln.runner.model_runner import ModelRunner
from kiln.runner.sampler import SampleOutput, SamplingRow
from kiln.scheduler.io import ReqOutput
from kiln.scheduler.kv import KVManager
from kiln.scheduler.output import OutputProcessor
from kiln.scheduler.req import Req
from kiln.scheduler.step import StepKind, StepPlan, StepResult
from kiln.speculative.base import Drafter, DraftInput, DraftTree
from kiln.speculative.verify import Chain, Tree, Verdict, verify_batch

logger = logging.getLogger("kiln")


class Scheduler(Protocol):
    """What the step uses of kiln.scheduler.scheduler.Scheduler (which imports this module)."""

    runner: ModelRunner
    kv: KVManager
    out: OutputProcessor
    running: list[Req]

    def sample(
        self, reqs: list[Req], logits: torch.Tensor
    ) -> tuple[SampleOutput | None, tuple[int, ...]]: ...

    def commit_sampled(self, reqs: list[Req], result: StepResult) -> None: ...

    def commit(
        self,
        req: Req,
        tokens: list[int],
        logprobs: list,
        top_logprobs: list,
        place_kv: Callable[[int], None] | None = None,
    ) -> int: ...

    def fail_batch(self, reqs: list[Req], exc: Exception) -> None: ...


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


def build_verify(reqs: list[Req], trees: list[DraftTree], table: ReqToTokenPool) -> ForwardBatch:
    """Each request's last token (the root) at column kv_len and its draft node i at column kv_len + 1 + i (their
    slots already in the table), as decode rows: the root's row attends to the first kv_len + 1 columns, node i's
    to those plus the columns of its path (its ancestors and itself, in order), at position kv_len + depth(i).
    Every row's KV is written before any row attends. Each row is then computed exactly as plain decoding
    computes that token after that path, which is what keeps greedy output identical (an extend would round
    differently); a chain's rows are the first kv_len + j + 1 columns, the table's own order."""
    ids: list[int] = []
    owners, lengths, columns = [], [], []
    # (batch row, first path column, path columns) of the rows whose path leaves the table's column order
    detours: list[tuple[int, int, list[int]]] = []
    for r, tree in zip(reqs, trees):
        base = r.kv_len
        ids.append(r.last_token)
        ids.extend(tree.tokens)
        owners.extend([r.table_idx] * (len(tree) + 1))
        columns.extend(range(base, base + len(tree) + 1))
        lengths.append(base + 1)
        paths: list[list[int]] = []
        for node, parent in enumerate(tree.parents):
            path = (paths[parent] if parent >= 0 else []) + [base + 1 + node]
            paths.append(path)
            lengths.append(base + 1 + len(path))
            if node != len(path) - 1:  # not a chain's node: its path leaves the table's column order
                detours.append((len(lengths) - 1, base + 1, path))
    rows = torch.tensor(owners, dtype=torch.int64)
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    new_slots = table.req_to_token[rows, torch.tensor(columns, dtype=torch.int64)]
    kv_table, mask = table.decode_table(rows, seq_lens)
    for row, first, path in detours:
        index = torch.tensor(path, dtype=torch.int64, device=table.device)
        kv_table[row, first : first + len(path)] = table.req_to_token[owners[row], index]
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=seq_lens - 1,
        out_cache_loc=new_slots,
        logits_index=torch.arange(len(ids)),
        kv_table=kv_table,
        kv_mask=mask,
    )


def sampling_rows(
    r: Req, tree: DraftTree, banned_ids: Callable[[Req, int], Sequence[int]]
) -> list[SamplingRow]:
    """The sampling row of each verify row of r: the root's as plain decoding's next row, node i's as if its
    path's tokens were already output (penalties, min_new_tokens bans by depth); `banned_ids(r, depth)`."""
    outputs: list[list[int]] = []
    rows = [SamplingRow(r.params, r.generator, r.input_ids, list(r.output_ids), banned_ids(r, 0))]
    for node, parent in enumerate(tree.parents):
        path_tokens = (outputs[parent] if parent >= 0 else []) + [tree.tokens[node]]
        outputs.append(path_tokens)
        rows.append(
            SamplingRow(
                r.params,
                r.generator,
                r.input_ids,
                r.output_ids + path_tokens,
                banned_ids(r, len(path_tokens)),
            )
        )
    return rows


class SpecDecoder:
    """Runs the scheduler's decode steps with a drafter; `num_draft` drafts per request at most."""

    def __init__(self, drafter: Drafter, num_draft: int, num_draft_tokens: int):
        self.drafter = drafter
        self.num_draft = num_draft
        self.num_draft_tokens = num_draft_tokens  # the flag's value, which SGLang's accept rate divides by
        self.totals = SpecTotals()

    # ------------------------------------------------------------------ drafting
    def _room(self, sched: Scheduler, r: Req) -> tuple[int, int]:
        """(deepest path, most nodes) worth verifying for r: none under a grammar; no path past max_new_tokens,
        no node's column past the context."""
        if r.matcher is not None:
            return 0, 0
        context_room = sched.out.context_len - 1 - r.kv_len
        nodes = max(0, min(self.num_draft, context_room))
        depth = max(0, min(nodes, r.remaining_new_tokens() - 1))
        return depth, nodes if depth else 0

    def _drafts(self, sched: Scheduler, reqs: list[Req]) -> list[DraftTree]:
        """Each request's proposal as a tree cut to its room (DraftTree.cut); all empty when the pool is short."""
        rooms = [self._room(sched, r) for r in reqs]
        table = sched.kv.table.req_to_token
        inputs = [
            DraftInput(r.rid, r.fill_ids, depth, kv_slots=table[r.table_idx, : r.kv_len])
            for r, (depth, _) in zip(reqs, rooms)
        ]
        proposed = self.drafter.propose(inputs)
        trees = [DraftTree.of(p).cut(nodes, depth) for p, (depth, nodes) in zip(proposed, rooms)]
        page = sched.kv.page_size
        need = sum(-(-(len(t) + 1) // page) * page for t in trees)
        if need > sched.kv.free_tokens() + sched.kv.evictable_tokens():
            return [DraftTree((), ()) for _ in reqs]  # the pool is short: this step decodes plainly
        return trees

    # ------------------------------------------------------------------ the step
    def plan(self, sched: Scheduler) -> StepPlan | None:
        """A verify step over sched.running: each request's last token and its drafts, their slots allocated (the
        request's from here: a failure releases them); the rows without drafts sample as plain decoding does.
        None when no request has drafts, and the scheduler plans a plain decode."""
        reqs = list(sched.running)
        trees = self._drafts(sched, reqs)
        if not any(len(t) for t in trees):
            return None
        counts = [len(t) + 1 for t in trees]
        if not sched.kv.alloc_verify(reqs, counts):
            return None
        batch = build_verify(reqs, trees, sched.kv.table)
        starts = tuple(r.kv_len for r in reqs)
        for r, count in zip(reqs, counts):
            r.kv_len += count
        plain = tuple(i for i, t in enumerate(trees) if not len(t))
        return StepPlan(StepKind.VERIFY, tuple(reqs), tuple(counts), starts, batch, plain, tuple(trees))

    def verify(
        self,
        sched: Scheduler,
        plan: StepPlan,
        logits: torch.Tensor,
        hidden: torch.Tensor | None,
        graphed: bool,
    ) -> StepResult:
        """An executed verify step's result: the verdict on each request's drafts, and the rows without drafts
        sampled as plain decoding samples them."""
        rows = plan.rows
        drafted = [i for i, t in enumerate(plan.drafts) if len(t)]
        verdicts = self._verdicts(
            sched, [plan.reqs[i] for i in drafted], [plan.drafts[i] for i in drafted], logits, rows, drafted
        )
        plain = list(plan.sampled)
        sampled, blocked = sched.sample([plan.reqs[i] for i in plain], logits[[rows[i] for i in plain]])
        return StepResult(sampled, blocked, tuple(verdicts), hidden, graphed)

    def update(self, sched: Scheduler, plan: StepPlan, result: StepResult) -> int:
        """Commits a verify step: each verdict's tokens (their KV onto the accepted path, the rejected drafts'
        slots freed) and the plain rows' tokens; returns the tokens it produced."""
        rows, produced = plan.rows, 0
        drafted = [i for i, t in enumerate(plan.drafts) if len(t)]
        for i, verdict in zip(drafted, result.verdicts):
            span = (plan.starts[i], plan.starts[i] + plan.new_tokens[i])
            produced += self._apply(
                sched, plan.reqs[i], verdict, plan.drafts[i], span, (result.hidden, rows[i])
            )
        return produced + self._plain_rows(sched, plan, result, rows)

    def _verdicts(
        self,
        sched: Scheduler,
        reqs: list[Req],
        trees: list[DraftTree],
        logits: torch.Tensor,
        starts: list[int],
        index: list[int],
    ) -> list[Verdict]:
        items: list[Chain | Tree] = []
        for r, tree, i in zip(reqs, trees, index):
            rows = sampling_rows(r, tree, sched.out.banned_ids)
            rows_logits = logits[starts[i] : starts[i] + len(tree) + 1]
            # a chain keeps chain verification: the same draws, and a drafter's q where it gives one
            items.append(
                Chain(rows_logits, rows, list(tree.tokens))
                if tree.is_chain()
                else Tree(rows_logits, rows, tree)
            )
        verdicts = verify_batch(items)
        if distributed.tp_size() == 1:
            return verdicts
        return _rank0_verdicts(verdicts, [len(t) for t in trees])

    def _apply(
        self,
        sched: Scheduler,
        r: Req,
        verdict: Verdict,
        tree: DraftTree,
        span: tuple[int, int],
        hidden_rows: tuple[torch.Tensor | None, int],
    ) -> int:
        """Append the verdict's tokens until the request ends, keep their KV, tell the drafter. `span`: the
        request's kv_len before the step and after its allocation; `hidden_rows`: the forward's hidden states
        and the request's first row in them."""
        base, allocated = span

        def place(kept: int) -> None:
            # plain decoding's invariant: every token but the newest has its KV, at its own column
            tokens = verdict.tokens[:kept]
            path = tree.follow(tokens[:-1])
            _place_path(sched, r, path, base)
            sched.kv.trim(r, base + kept, allocated)
            self._count(r.rid, kept - 1)
            if not r.finished:  # a finished request is released instead
                hidden, start = hidden_rows
                self.drafter.accepted(r.rid, tokens, _path_hidden(hidden, start, path))

        return sched.commit(r, verdict.tokens, verdict.logprobs, verdict.top_logprobs, place)

    def _plain_rows(self, sched: Scheduler, plan: StepPlan, result: StepResult, rows: list[int]) -> int:
        """Requests without drafts in a verify step: their one row's sampled token committed."""
        reqs = [plan.reqs[i] for i in plan.sampled]
        if not reqs:
            return 0
        before = {r.rid: len(r.output_ids) for r in reqs}
        sched.commit_sampled(reqs, result)
        for r, i in zip(reqs, plan.sampled):
            self._count(r.rid, 0)
            if not r.finished and len(r.output_ids) > before[r.rid]:
                self.drafter.accepted(r.rid, r.output_ids[-1:], _rows(result.hidden, rows[i], 1))
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


def _place_path(sched: Scheduler, r: Req, path: list[int], base: int) -> None:
    """Move the KV of the accepted nodes `path` (node i sits at column base + 1 + i) to columns base + 1 ..
    base + len(path), where plain decoding writes them, so later steps, the radix cache and trim see plain
    decoding's layout; a chain's nodes are already there. Sources lie at or after their destinations, and
    copy_slots reads every source before it writes."""
    moves = [(base + 1 + node, base + 1 + k) for k, node in enumerate(path) if node != k]
    if not moves:
        return
    slots = sched.kv.table.req_to_token[r.table_idx]
    src = slots[torch.tensor([m[0] for m in moves], dtype=torch.int64, device=slots.device)]
    dst = slots[torch.tensor([m[1] for m in moves], dtype=torch.int64, device=slots.device)]
    sched.runner.kv_pool.copy_slots(src, dst)


def _path_hidden(hidden: torch.Tensor | None, start: int, path: list[int]) -> torch.Tensor | None:
    """The target's hidden rows that predicted the kept tokens: the root's, then each accepted node's."""
    if not isinstance(hidden, torch.Tensor):
        return None
    if path == list(range(len(path))):  # a chain: consecutive rows
        return hidden[start : start + len(path) + 1]
    index = torch.tensor(
        [start] + [start + 1 + node for node in path], dtype=torch.int64, device=hidden.device
    )
    return hidden.index_select(0, index)


def _rank0_verdicts(verdicts: list[Verdict], sizes: list[int]) -> list[Verdict]:
    """Rank 0's kept tokens on every rank (as plain decoding broadcasts its sampled ids): each request's
    tokens padded with -1 to its draft count + 1 (every rank then follows the same path down its tree)."""
    flat: list[int] = []
    for verdict, size in zip(verdicts, sizes):
        flat.extend(verdict.tokens + [-1] * (size + 1 - len(verdict.tokens)))
    flat = distributed.broadcast_token_ids(flat)
    out, start = [], 0
    for verdict, size in zip(verdicts, sizes):
        tokens = [t for t in flat[start : start + size + 1] if t >= 0]
        start += size + 1
        n = len(tokens)
        logprobs = (verdict.logprobs + [None] * n)[:n]
        top = (verdict.top_logprobs + [None] * n)[:n]
        out.append(Verdict(tokens, n - 1, logprobs, top))
    return out
