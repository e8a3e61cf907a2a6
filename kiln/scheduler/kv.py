"""A request's KV slots over their lifetime: prefix match, allocation, caching, release, and the
pool-wide integrity invariant (free + cached + in use == total)."""

from __future__ import annotations

import torch

from kiln.memory.allocator import TokenAllocator
from kiln.memory.hiradix_cache import HiRadixCache
from kiln.memory.prefix_cache import PrefixCache
from kiln.memory.req_to_token import ReqToTokenPool
from kiln.memory.state_checkpoints import HybridRadixCache
from kiln.scheduler.req import Req

# a LoRA adapter's tokens are keyed apart from the base model's and every other adapter's: KV computed under one
# adapter is never another's, so each adapter's prefixes live in their own namespace of the tree
_NAMESPACE_SHIFT = 32


def cache_key(req: Req, n: int) -> list[int]:
    """The prefix cache's key of the request's first n tokens: the token ids, in its adapter's namespace."""
    ids = req.fill_ids[:n]
    if not req.lora_uid:
        return ids
    offset = req.lora_uid << _NAMESPACE_SHIFT
    return [t + offset for t in ids]


class KVManager:
    def __init__(
        self, allocator: TokenAllocator, table: ReqToTokenPool, cache: PrefixCache, radix_enabled: bool
    ):
        self.allocator = allocator
        self.table = table
        self.cache = cache
        self.radix_enabled = radix_enabled
        self.page_size = allocator.page_size

    # ---- capacity
    def free_tokens(self) -> int:
        return self.allocator.available_size()

    def evictable_tokens(self) -> int:
        return self.cache.evictable_size()

    def cache_tokens(self) -> int:
        """Tokens held by the prefix cache, locked or not."""
        return self.cache.total_size()

    def ensure_free(self, n: int) -> bool:
        short = n - self.allocator.available_size()
        if short > 0:
            self.cache.evict(short)
        return self.allocator.available_size() >= n

    def _pages(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    # ---- admission
    def match(self, req: Req) -> int:
        """Length of the cached prefix usable by req (at least its last token is always computed), by a lookup that
        changes nothing (PrefixCache.match_prefix): sorting the queue and budgeting admission move no KV."""
        key = cache_key(req, req.prefix_limit)
        return self.cache.match_prefix(key) if key else 0

    def admit(self, req: Req, limit: int | None = None) -> bool:
        """Take a table row and the cached prefix (its match here is where a tier's KV comes back, the load the
        admission plans), lock it, and allocate slots for the rest of the sequence: all of it when it is no longer
        than `limit`, else a page-aligned piece of at most `limit` tokens (a chunk)."""
        if req.table_idx is None:
            idx = self.table.alloc()
            if idx is None:
                return False
            req.table_idx = idx
            key = cache_key(req, req.prefix_limit)
            m = self.cache.acquire_prefix(key) if key else None
            if m is not None and m.indices.numel():
                n = int(m.indices.numel())
                self.table.req_to_token[idx, :n] = m.indices
                self.cache.lock(m.node)
                req.node, req.cached_len, req.kv_len = m.node, n, n
            self.cache.restore_state(req.node, idx)  # hybrid models: the checkpoint the match ends at
        rest = req.seq_len - req.kv_len
        extend_len = rest if limit is None or rest <= limit else limit // self.page_size * self.page_size
        if extend_len <= 0 or not self._alloc_extend(req, extend_len):
            if req.kv_len == 0 or req.kv_len == req.cached_len:
                self.release(req)
            return False
        return True

    def _alloc_extend(self, req: Req, n: int) -> bool:
        if not self.ensure_free(self._pages(req.kv_len + n) - self._pages(req.kv_len)):
            return False
        last = int(self.table.req_to_token[req.table_idx, req.kv_len - 1]) if req.kv_len else -1
        slots = self.allocator.alloc_extend([req.kv_len], [last], [n])
        if slots is None:
            return False
        self.table.req_to_token[req.table_idx, req.kv_len : req.kv_len + n] = slots
        req.extend_len = n
        return True

    def alloc_decode(self, reqs: list[Req]) -> torch.Tensor | None:
        """One slot per request for its next token, written into its table row. With pages of one token nothing
        here waits for the device: the overlap schedule calls it while the step before runs."""
        if not self.ensure_free(len(reqs) * self.page_size):
            return None
        rows = [r.table_idx for r in reqs]
        lens = [r.kv_len for r in reqs]
        last = None
        if self.page_size > 1:  # where in its page each token goes: read back from the table
            last = self.table.req_to_token[torch.tensor(rows), torch.tensor(lens) - 1].tolist()
        slots = self.allocator.alloc_decode(lens, last)
        if slots is not None:
            self.table.write(rows, lens, slots)
        return slots

    def alloc_verify(self, reqs: list[Req], counts: list[int]) -> bool:
        """Slots for counts[i] tokens past each request's kv_len (a verify step: the last token and its drafts),
        written into the table rows; False, with nothing taken, when they do not fit."""
        lens = [r.kv_len for r in reqs]
        if not self.ensure_free(sum(self._pages(n + c) - self._pages(n) for n, c in zip(lens, counts))):
            return False
        rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
        last = self.table.req_to_token[rows, torch.tensor(lens, dtype=torch.int64) - 1].tolist()
        slots = self.allocator.alloc_extend(lens, last, counts)
        if slots is None:
            return False
        for r, piece in zip(reqs, slots.split(counts)):
            self.table.req_to_token[r.table_idx, r.kv_len : r.kv_len + piece.numel()] = piece
        return True

    def trim(self, req: Req, keep: int, allocated: int) -> None:
        """After a verify: the request keeps the KV of its first `keep` tokens; the slots of rejected drafts up
        to `allocated` go back to the pool (whole pages only: the page holding token keep - 1 stays)."""
        start = self._pages(keep)
        if allocated > start:
            self.allocator.free(self.table.req_to_token[req.table_idx, start:allocated].clone())
        req.kv_len = keep

    def decode_fits(self, n_reqs: int) -> bool:
        return self.allocator.available_size() + self.cache.evictable_size() >= n_reqs * self.page_size

    # ---- caching and release
    def _slots(self, req: Req, n: int) -> torch.Tensor:
        return self.table.req_to_token[req.table_idx, :n].clone()

    def cache_unfinished(self, req: Req) -> None:
        """After a chunk: publish the computed prefix so it is shared, and hold it locked."""
        if not self.radix_enabled:
            return
        key = cache_key(req, req.kv_len)
        slots = self._slots(req, req.kv_len)
        already = self.cache.insert(key, slots)
        if already > req.cached_len:
            self.allocator.free(slots[req.cached_len : already])
        m = self.cache.match_stored(key)
        n = int(m.indices.numel())
        self.table.req_to_token[req.table_idx, :n] = m.indices
        self.cache.lock(m.node)
        if req.node is not None:
            self.cache.unlock(req.node)
        req.node, req.cached_len = m.node, n
        if n == req.kv_len and self.cache.wants_checkpoint(n):
            self.cache.keep_state(m.node, req.table_idx)

    def keep_prompt_state(self, req: Req) -> None:
        """Window rings: the rings after a prompt's last token still hold the window before it, so they also serve
        a restart at that token, which is where the same prompt sent again restarts (its last token is always
        computed): kept there too, on a node ending one token short."""
        n = req.kv_len - 1
        if (
            not self.radix_enabled
            or n <= 0
            or n % self.page_size
            or not self.cache.states_serve_one_earlier()
        ):
            return
        m = self.cache.match_stored(cache_key(req, n))
        if int(m.indices.numel()) == n:
            self.cache.keep_state(m.node, req.table_idx)

    def track_states(self, reqs: list[Req]) -> None:
        """After a decode step: hybrid models' requests whose state reached a checkpoint point publish their
        tokens and leave a copy of the state with them in the prefix cache."""
        if not self.radix_enabled:
            return
        for req in reqs:
            if self.cache.wants_checkpoint(req.kv_len):
                self.cache_unfinished(req)

    def cache_finished(self, req: Req) -> None:
        """At the end: hand the sequence's KV to the prefix cache, free the rest and the table row."""
        if req.table_idx is None:
            return
        slots = self._slots(req, req.kv_len)
        aligned = req.kv_len // self.page_size * self.page_size
        already = self.cache.insert(cache_key(req, req.kv_len), slots)
        if already > req.cached_len:
            self.allocator.free(slots[req.cached_len : already])
        if req.kv_len > aligned:
            self.allocator.free(slots[aligned:])
        self._keep_final_state(req, aligned)
        self._drop(req)

    def _keep_final_state(self, req: Req, aligned: int) -> None:
        """Hybrid models: a finished request's state covers all its tokens; kept when they end on a page, so a
        follow-up turn that extends the conversation starts from it."""
        if not self.radix_enabled or aligned != req.kv_len or aligned == 0 or not self.cache.keeps_states():
            return
        self.cache.keep_state(self.cache.match_stored(cache_key(req, aligned)).node, req.table_idx)

    def release(self, req: Req) -> None:
        """Free the request's own slots without caching them (retraction, abort, failure)."""
        if req.table_idx is None:
            return
        if req.kv_len > req.cached_len:
            self.allocator.free(self._slots(req, req.kv_len)[req.cached_len :])
        self._drop(req)

    def _drop(self, req: Req) -> None:
        if req.node is not None:
            self.cache.unlock(req.node)
        self.table.free(req.table_idx)
        req.table_idx, req.node, req.cached_len, req.kv_len = None, None, 0, 0

    def tier_stats(self) -> dict:
        """The hierarchical cache's figures, by SchedulerStats field; empty with one tier."""
        cache = self.cache
        return cache.tier_stats() if isinstance(cache, HiRadixCache) else {}

    def flush(self) -> None:
        self.cache.reset()

    # ---- invariant
    def private_tokens(self, reqs: list[Req]) -> int:
        return sum(self._pages(r.kv_len - r.cached_len) for r in reqs if r.table_idx is not None)

    def integrity(self, live: list[Req]) -> dict:
        free = self.allocator.available_size()
        cached = self.cache.total_size()
        in_use = self.private_tokens(live)
        total = self.allocator.size
        report = {
            "free": free,
            "cached": cached,
            "in_use": in_use,
            "total": total,
            "ok": free + cached + in_use == total
            and self.table.available_size() + len(live) == self.table.size,
        }
        if isinstance(self.cache, HiRadixCache):  # the host tier: every host slot held by a node or free
            host = self.cache.host_integrity()
            report.update(host=host, ok=report["ok"] and host["ok"])
        if isinstance(self.cache, HybridRadixCache):  # the state pool: working slots, checkpoints, free
            states = self.cache.state_integrity(self.table.available_size(), len(live))
            report.update(states=states, ok=report["ok"] and states["ok"])
        return report
