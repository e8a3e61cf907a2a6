"""The overlap scheduler's step: decode steps run one ahead of the scheduler on a forward thread (SGLang's overlap
schedule and its forward thread).

In steady decode the scheduler launches step N+1 before it has read step N's tokens: N+1's input ids are N's
sampled tokens, which the forward thread fills in when N is done (a future token per row, resolved on the thread
that owns the device). While N+1 runs, the scheduler appends N's tokens, detokenizes, checks stops and streams. A
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
from dataclasses import dataclass

from kiln.core.forward_batch import ForwardBatch
from kiln.runner.sampler import SampleOutput, SamplingRow
from kiln.scheduler.req import Req


@dataclass
class InFlight:
    """A launched decode step: its requests (row order) and its sampled tokens, when they come."""

    reqs: list[Req]
    tokens: Future[SampleOutput]


class ForwardThread:
    """One thread that runs decode steps in launch order: forward, then sampling."""

    def __init__(self, step: Callable[[ForwardBatch, list[SamplingRow]], SampleOutput]):
        self.step = step  # forward + sample: the scheduler's runner and sampler
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-forward")

    def launch(
        self, reqs: list[Req], fb: ForwardBatch, rows: list[SamplingRow], after: InFlight | None
    ) -> InFlight:
        """Runs the step once `after` (the step in flight, or None) has its tokens; each request that was in it
        reads its input id from them."""
        source = None
        if after is not None:
            row_of = {id(r): i for i, r in enumerate(after.reqs)}
            source = [row_of.get(id(r)) for r in reqs]
        return InFlight(reqs, self.pool.submit(self._run, fb, rows, after, source))

    def _run(
        self,
        fb: ForwardBatch,
        rows: list[SamplingRow],
        after: InFlight | None,
        source: list[int | None] | None,
    ) -> SampleOutput:
        if after is not None:
            # raises where that step failed: this one fails with it
            tokens = after.tokens.result().next_token_ids
            for j, i in enumerate(source):
                if i is not None:
                    fb.input_ids[j] = tokens[i]
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
