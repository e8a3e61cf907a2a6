"""A step as data (vLLM v1's SchedulerOutput and ModelRunnerOutput). `Scheduler.schedule` decides a StepPlan: which
requests run, the tokens each computes, their KV slots already allocated (and a cache tier's rows already brought
back, by admission's prefix match); `Scheduler.execute` runs it and gives a StepResult (tokens sampled, drafts
verified, or the error the forward raised), changing no request; `Scheduler.update` commits it, through
`Scheduler.commit`, the one place tokens join requests. The overlap schedule launches the same decode plans a step
ahead and commits them through the same function."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from kiln.core.forward_batch import ForwardBatch
from kiln.memory.req_to_token import ReqToTokenPool
from kiln.runner.sampler import SampleOutput
from kiln.scheduler.batch import build_decode
from kiln.scheduler.io import TokenLogprob
from kiln.scheduler.pooling import PoolRows
from kiln.scheduler.prompt_logprobs import PromptRows
from kiln.scheduler.req import Req
from kiln.speculative.base import DraftTree
from kiln.speculative.verify import Verdict


class StepKind(Enum):
    PREFILL = "prefill"  # prompts, or chunks of them, on top of their cached prefixes
    DECODE = "decode"  # one token per running request
    VERIFY = "verify"  # speculative decoding: each running request's last token and its drafts


@dataclass(frozen=True)
class StepPlan:
    """One step, decided: its requests in row order, the tokens whose KV each writes (already allocated: a
    request's kv_len counts them from here, so a failure releases them with it), each one's kv_len before the
    step, the forward batch, the requests whose row gives a sampled token (a prompt's last chunk that asks for
    tokens, every decode row, a verify step's rows without drafts), a verify step's draft trees, and a prefill's
    rows that score prompt tokens (prompt logprobs; their batch rows are batch.hidden_index, in the same order)."""

    kind: StepKind
    reqs: tuple[Req, ...]
    new_tokens: tuple[int, ...]
    starts: tuple[int, ...]
    batch: ForwardBatch
    sampled: tuple[int, ...]
    drafts: tuple[DraftTree, ...] = ()
    prompt_rows: tuple[PromptRows, ...] = ()
    pool_rows: tuple[PoolRows, ...] = ()  # the rows pooled (PoolSpec), kept after the prompt-logprob rows

    @property
    def rows(self) -> list[int]:
        """Each request's first row in the forward's logits of a verify step (every row gives logits there)."""
        return [sum(self.new_tokens[:i]) for i in range(len(self.reqs))]


def decode_plan(reqs: list[Req], table: ReqToTokenPool, slots: torch.Tensor) -> StepPlan:
    """A decode step over `reqs`, one new slot each (`slots`, already in their table rows): the batch built, then
    each request's kv_len counting its slot (a failure or a release frees it with the request)."""
    batch = build_decode(reqs, table, slots)
    starts = tuple(r.kv_len for r in reqs)
    for r in reqs:
        r.kv_len += 1
    every = tuple(range(len(reqs)))
    return StepPlan(StepKind.DECODE, tuple(reqs), (1,) * len(reqs), starts, batch, every)


@dataclass(frozen=True)
class StepResult:
    """A plan executed: the tokens of its `sampled` requests, less those `blocked` (indices into `sampled`: a
    grammar that allows no token ends them unsampled); a verify step's verdicts, one per request with drafts; the
    hidden states drafters read; whether a captured graph ran; the prompt tokens scored, one list per share of the
    plan's prompt_rows. Or the error the forward raised, and nothing else."""

    sampled: SampleOutput | None = None
    blocked: tuple[int, ...] = ()
    verdicts: tuple[Verdict, ...] = ()
    hidden: torch.Tensor | None = None
    graphed: bool = False
    prompt_logprobs: tuple[list[TokenLogprob], ...] = ()
    pooled: tuple[torch.Tensor, ...] = ()  # one vector per share of the plan's pool_rows
    error: Exception | None = None
