"""Prefill admission: which waiting requests join the next extend batch, within the token budgets and the
KV pool (free + evictable, minus what running requests are expected to still decode)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kiln.scheduler.kv import KVManager
from kiln.scheduler.req import Req

CLIP_MAX_NEW_TOKENS = 4096  # reservation per request is capped, as a long max_tokens rarely runs out


@dataclass
class PrefillBudget:
    rem_total: float  # KV tokens left after the running requests' expected decode
    rem_input: int  # --max-prefill-tokens left in this batch
    rem_chunk: int | None  # --chunked-prefill-size left in this batch (None: no chunking)
    rem_reqs: int  # table rows left under --max-running-requests
    reqs: list[Req] = field(default_factory=list)
    chunked: Req | None = None


class PrefillAdder:
    def __init__(
        self,
        kv: KVManager,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        max_running_requests: int,
    ):
        reserve = sum(min(r.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * new_token_ratio for r in running)
        self.kv = kv
        self.running = running
        self.page = kv.page_size
        self.budget = PrefillBudget(
            rem_total=kv.free_tokens() + kv.evictable_tokens() - reserve,
            rem_input=max_prefill_tokens,
            rem_chunk=chunked_prefill_size,
            rem_reqs=max_running_requests - len(running),
        )

    def add(self, req: Req) -> bool:
        """Try to admit req (allocating its KV); False stops admission for this batch."""
        b = self.budget
        if b.rem_reqs <= 0 or b.chunked is not None:
            return False
        # the lookup changes nothing (KVManager.match); admission's own match may find less (a host node with no
        # device room to come back to), so what it took is checked again below
        cached = req.kv_len if req.table_idx is not None else self.kv.match(req)
        ext = req.seq_len - cached
        expected = ext + min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS)
        alone = not b.reqs and not self.running
        if expected > b.rem_total and not alone:
            return False
        if b.reqs and ext > b.rem_input:
            return False
        if b.rem_chunk is not None and ext > b.rem_chunk and b.rem_chunk < self.page:
            return False
        fresh = req.table_idx is None
        if not self.kv.admit(req, b.rem_chunk):
            return False
        ext = req.extend_len
        if fresh and ext > req.seq_len - cached and b.reqs and ext > b.rem_input:
            self.kv.release(req)  # the prefix it brought back stays cached for the next batch
            return False
        if not req.admitted:
            req.admitted, req.cached_tokens = True, req.cached_len
            req.queue_time = time.time() - req.created
        b.reqs.append(req)
        b.rem_total -= expected
        b.rem_input -= ext
        b.rem_reqs -= 1
        if b.rem_chunk is not None:
            b.rem_chunk -= ext
        if req.kv_len + ext < req.seq_len:
            b.chunked = req
        return True
