"""One request's state inside the scheduler."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from typing import Any

import torch

from kiln.sampling_params import SamplingParams
from kiln.scheduler.io import PoolSpec
from kiln.structured.matcher import GrammarMatcher


class ReqState(enum.Enum):
    """Where a request is in its life (vLLM's RequestStatus): the scheduler moves it between states as it moves it
    between its queues, and the integrity check holds each live request's state to the queue it is in."""

    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its grammar compiling, in the grammar queue
    WAITING = "waiting"  # in the waiting queue, never admitted
    PREFILLING = "prefilling"  # admitted, its prompt being computed (a chunk a step when chunked)
    RUNNING = "running"  # decoding
    PREEMPTED = "preempted"  # retracted: its KV freed, back in the waiting queue
    FINISHED = "finished"  # finish_reason says why


class Req:
    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        detokenizer,
        generator: torch.Generator | None,
        stream: bool = False,
        deadline: float | None = None,
        log_metrics: bool = True,
    ):
        self.rid = rid
        self.input_ids = input_ids
        self.params = params
        self.detok = detokenizer
        self.generator = generator
        self.stream = stream
        self.deadline = deadline
        self.log_metrics = log_metrics
        # LoRA: the adapter's name and uid (its prefix-cache namespace; 0: the base model), and the slot it is pinned
        # in from admission to its end (None: not pinned, or the base model)
        self.lora_name: str | None = None
        self.lora_uid = 0
        self.lora_slot: int | None = None
        self.output_ids: list[int] = []
        self.state = ReqState.WAITING
        # KV bookkeeping: slots of tokens [0, kv_len) are in the request's table row; the first cached_len of
        # them belong to the prefix cache (locked through `node`), the rest are the request's own.
        self.table_idx: int | None = None
        self.kv_len = 0
        self.cached_len = 0
        self.node: Any = None
        self.extend_len = 0  # tokens computed in the current extend step
        self.admitted = False
        self.cached_tokens = 0  # prefix-cache hit at first admission (meta_info.cached_tokens)
        self.num_retractions = 0
        self.finish_reason: dict | None = None
        self.error: str | None = None
        self.created = time.time()
        self.queue_time: float | None = None  # set at first admission, reported once
        # outputs not yet sent
        self.pending_ids: list[int] = []
        self.pending_text = ""
        self.pending_logprobs: list = []
        # prompt logprobs (SGLang's input logprobs, from params.logprob_start_len): each scored prompt token's
        # TokenLogprob as its prefill chunks compute them, then the whole list once, with the next output
        self.input_logprobs: list = []
        self.input_logprobs_done = False  # computed (a retracted request's second prefill computes none)
        self.pending_input_logprobs: list | None = None
        # constrained decoding: the matcher being compiled (the request waits in the grammar queue), then the
        # matcher itself, which has consumed exactly output_ids (retraction keeps both, so they stay in step)
        self.grammar: Future | None = None
        self.matcher: GrammarMatcher | None = None
        # a prefill-only request's pooled output (kiln.scheduler.pooling): its PoolSpec, each computed chunk's
        # float32 part by the chunk's first position (a row, or mean pooling's sum), and the result once its
        # prompt is computed, sent at its end
        self.pool: PoolSpec | None = None
        self.pool_parts: dict[int, torch.Tensor] = {}
        self.embedding: list[float] | None = None

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.input_ids[-1]

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_logprob_start(self) -> int | None:
        """The first prompt token of the prompt logprobs while they are still to be computed, else None."""
        return None if self.input_logprobs_done else self.params.prompt_logprob_start

    @property
    def prefix_limit(self) -> int:
        """How much of the sequence a prefix-cache hit may cover: all but its last token, whose logits give the next
        one, and, while prompt logprobs are to be computed, nothing from their start on (a cached prefix has no
        hidden states to score; SGLang's cap, Req.init_next_round_input); nothing for mean or first-token
        pooling."""
        start = self.prompt_logprob_start
        if self.pool is not None and self.pool.mode in ("mean", "cls"):
            start = 0  # they pool the first token's hidden state too, which a cached prefix does not have
        return self.seq_len - 1 if start is None else min(self.seq_len - 1, start)

    @property
    def prefill_done(self) -> bool:
        return self.kv_len >= self.seq_len

    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - len(self.output_ids))

    def __repr__(self) -> str:
        return f"Req({self.rid}, in={len(self.input_ids)}, out={len(self.output_ids)}, kv={self.kv_len})"
