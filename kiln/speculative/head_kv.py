"""A draft head's KV in the target's own slots, so a prefix the target reads from its radix cache is one the head
has too (as SGLang's EAGLE draft shares the target's token-to-slot map).

An EAGLE or NEXTN head's position p reads the target's hidden state at p, which the target computes only once:
a prompt prefix it later reads from its cache hands the head no hidden states. If the head's KV for that prefix
sits in the draft pool at the target's slot of each position, it survives the request that computed it exactly
as long as the target's KV does, and a request hitting the cache finds both. The draft pool is laid out for it:
slots 1 .. T - 1 (T: the target pool's rows) mirror the target's and are never handed out by the draft's
allocator; the slots above them hold the draft's guesses.

A slot's head KV is trusted only for the content it was computed for: each written slot is stamped with a hash
of the token prefix that determined it (tokens 0 .. p + 1 for position p), and a request joins after a cached
prefix only where every stamp of the prefix matches its own tokens; otherwise the head starts after the prefix,
as it did before. A stale or colliding stamp can only cost draft quality: the target verifies every draft.
"""

from __future__ import annotations

import torch

from kiln.core.graph_shapes import head_guess_tokens
from kiln.runner.model_runner import ModelRunner, PoolSizes

_MODULUS = (1 << 61) - 1
_BASE = 1_000_003


def prefix_hashes(tokens: list[int], known: list[int]) -> list[int]:
    """`known` (hashes of tokens[0 .. i] for i < len(known)) extended to every token: entry i hashes the whole
    prefix tokens[0 .. i], so two sequences share entry i exactly when they share that prefix (up to collisions)."""
    h = known[-1] if known else 0
    for token in tokens[len(known) :]:
        h = (h * _BASE + token + 1) % _MODULUS
        known.append(h)
    return known


def head_pool_sizes(target: ModelRunner, sizes: PoolSizes, num_steps: int, topk: int) -> PoolSizes:
    """A head's pool: the target's slots mirrored, then room for every running request's guesses (`topk`
    branches a step for a tree, one a step for a chain); pages of one token."""
    running = sizes.max_running_requests
    guesses = running * head_guess_tokens(num_steps, topk)
    return PoolSizes(target_pool_rows(target) - 1 + guesses, running, sizes.context_len + num_steps, 1)


def target_pool_rows(target: ModelRunner) -> int:
    allocator = target.allocator
    return (allocator.num_pages + 1) * allocator.page_size


class TargetSlotKV:
    """Mixed into a ChainDrafter whose model is a head: catch-up KV goes to the target's slots (see above).
    Until `share_target_slots` is called (a head on a pool of another layout) it drafts as a ChainDrafter."""

    runner: ModelRunner
    sequences: dict
    stamps: torch.Tensor | None = None
    mirrored = 0

    def share_target_slots(self, target_rows: int) -> None:
        """Reserve the draft pool's slots 1 .. target_rows - 1 (a fresh allocator hands pages out in order), so
        draft slot s is target slot s; set up the stamps."""
        self.mirrored = target_rows
        reserved = self.runner.allocator.alloc(target_rows - 1)
        assert reserved is not None and bool((reserved.cpu() == torch.arange(1, target_rows)).all()), (
            "the draft pool must start fresh, with room for the target's slots"
        )
        self.stamps = torch.zeros(target_rows, dtype=torch.int64)
        self.target_slots: dict[str, torch.Tensor] = {}
        self.hashes: dict[str, list[int]] = {}

    def _note_input(self, inp) -> None:
        """What the request's catch-ups need: its target slots and its prefix hashes."""
        if self.stamps is None:
            return
        if inp.kv_slots is None:
            self.target_slots.pop(inp.rid, None)
            return
        self.target_slots[inp.rid] = inp.kv_slots.to("cpu", torch.int64)
        prefix_hashes(inp.token_ids, self.hashes.setdefault(inp.rid, []))

    def _join_cached_prefix(self, seq, inp, prefix: int) -> bool:
        """A new sequence whose first `prefix` positions the target read from its cache: start after them with
        their head KV in place when every one of them is stamped with this request's prefix."""
        if self.stamps is None:
            return False
        slots = self.target_slots.get(inp.rid)
        if slots is None or slots.numel() < prefix:
            return False
        want = torch.tensor(self.hashes[inp.rid][1 : prefix + 1], dtype=torch.int64)
        if not bool((self.stamps[slots[:prefix]] == want).all()):
            return False
        self.runner.table.req_to_token[seq.table_idx, :prefix] = slots[:prefix].to(
            self.runner.table.req_to_token.device
        )
        seq.base, seq.kept = 0, prefix
        return True

    def _catch_up_slots(self, work: list) -> torch.Tensor | None:
        """The target's slots of each catch-up's positions where the request handed them over (stamped as they
        are written), a guess slot of the draft's own otherwise."""
        if self.stamps is None:
            return super()._catch_up_slots(work)  # type: ignore[misc]
        parts = []
        for c in work:
            slots = self.target_slots.get(c.rid)
            end = c.start + len(c.ids)
            if slots is not None and slots.numel() >= end:
                mine = slots[c.start : end]
                hashes = self.hashes[c.rid]
                self.stamps[mine] = torch.tensor(hashes[c.start + 1 : end + 1], dtype=torch.int64)
            else:
                mine = self.runner.allocator.alloc(len(c.ids))
                if mine is None:
                    for part in parts:
                        self._free(part)
                    return None
            parts.append(mine.to(self.runner.allocator.device))
        return torch.cat(parts) if parts else None

    def _free(self, slots: torch.Tensor) -> None:
        """Only the draft's own slots go back: a mirrored slot is the target's to reuse."""
        own = slots[slots >= self.mirrored]
        if own.numel():
            self.runner.allocator.free(own)

    def _forget(self, rid: str) -> None:
        if self.stamps is not None:
            self.target_slots.pop(rid, None)
            self.hashes.pop(rid, None)
