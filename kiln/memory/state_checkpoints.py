"""Prefix caching for hybrid linear-attention models: the radix tree keeps state checkpoints.

A linear-attention layer's state after token n depends on every token before it, so cached KV alone cannot
restart a request mid-sequence: it needs the state at exactly the point it restarts from. The tree therefore keeps
copies of requests' states (checkpoints) in the state pool's spare slots, one per node at most, covering the
tokens up to that node's end; a prefix match stops at the deepest node that has one, and the request copies that
state into its working slot before its extend (the tokens past it are recomputed).

Checkpoints are taken every --mamba-track-interval tokens (page-aligned) as a request prefills or decodes, and
when it finishes. They belong to the tree: a node's eviction frees its slot, and when the spare slots run out the
least recently used checkpoint makes room. Working slots are the request-table rows (slots [0, rows) of the
pool), so retraction, abort and finish free them with the row; checkpoints use slots [rows, num_slots).
"""

from __future__ import annotations

from kiln.memory.allocator import TokenAllocator
from kiln.memory.prefix_cache import MatchResult
from kiln.memory.radix_cache import RadixCache, TreeNode
from kiln.memory.state_pool import StatePool
from kiln.memory.window_pool import WindowPool


class CheckpointSlots:
    """The state pool's slots past the request table's rows, handed out to checkpoints."""

    def __init__(self, first: int, end: int) -> None:
        self.first, self.end = first, end
        self._free = list(range(end - 1, first - 1, -1))  # pop() hands out the lowest slot first

    @property
    def total(self) -> int:
        return self.end - self.first

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def free_slots(self) -> list[int]:
        return list(self._free)


class HybridRadixCache(RadixCache):
    """The radix tree over the KV pool whose nodes may also own a state checkpoint (see the module docstring)."""

    def __init__(
        self,
        allocator: TokenAllocator,
        page_size: int,
        states: StatePool | WindowPool,
        working_slots: int,
        track_interval: int,
    ) -> None:
        if track_interval < 1 or track_interval % page_size:
            raise ValueError(
                f"--mamba-track-interval {track_interval} must be a multiple of --page-size {page_size}"
            )
        self.states = states
        self.track_interval = track_interval
        self.slots = CheckpointSlots(working_slots, states.num_slots)
        self._holders: dict[int, TreeNode] = {}  # checkpoint slot -> the node owning it
        self._stored = False  # match_stored: the walk is not cut back to a checkpoint
        super().__init__(allocator, page_size)

    # ---------------------------------------------------------------- matching

    def match_stored(self, key: list[int]) -> MatchResult:
        self._stored = True
        try:
            return self.acquire_prefix(key)
        finally:
            self._stored = False

    def _match_end(self, path: list[tuple[TreeNode, int, bool]]) -> int:
        """As the match: at the deepest node wholly matched that keeps a state."""
        return next((pos for node, pos, whole in reversed(path) if whole and node.checkpoint is not None), 0)

    def _beyond_tree(self, key: list[int], node: TreeNode, pos: int, values: list) -> tuple[TreeNode, int]:
        """A request can start only where a state was kept: back up to the deepest node with a checkpoint."""
        if self._stored:
            return node, pos
        while node is not self.root_node and node.checkpoint is None:
            values.pop()
            pos -= len(node.key)
            node = node.parent  # type: ignore[assignment]
        return node, pos

    # ---------------------------------------------------------------- states

    def keeps_states(self) -> bool:
        return self.slots.total > 0

    def states_serve_one_earlier(self) -> bool:
        return isinstance(self.states, WindowPool) and self.keeps_states()

    def wants_checkpoint(self, num_tokens: int) -> bool:
        return num_tokens > 0 and num_tokens % self.track_interval == 0 and self.slots.total > 0

    def restore_state(self, node: TreeNode | None, slot: int) -> None:
        if node is None or node is self.root_node:
            self.states.zero([slot])
            return
        assert node.checkpoint is not None, "a request starts from a node without a state checkpoint"
        self.states.copy([node.checkpoint], [slot])

    def keep_state(self, node: TreeNode | None, slot: int) -> None:
        if node is None or node is self.root_node or node.checkpoint is not None or not self.slots.total:
            return
        checkpoint = self.slots.alloc()
        if checkpoint is None:
            checkpoint = self._reclaim()
        self.states.copy([slot], [checkpoint])
        node.checkpoint = checkpoint
        self._holders[checkpoint] = node

    def _reclaim(self) -> int:
        """The slot of the least recently used checkpoint, taken from its node (the node keeps its KV)."""
        victim = min(self._holders.values(), key=lambda n: n.last_access_time)
        slot = victim.checkpoint
        assert slot is not None
        victim.checkpoint = None
        del self._holders[slot]
        return slot

    def _drop_checkpoint(self, node: TreeNode) -> None:
        if node.checkpoint is not None:
            del self._holders[node.checkpoint]
            self.slots.free(node.checkpoint)
            node.checkpoint = None

    # ---------------------------------------------------------------- eviction and reset

    def _remove_leaf(self, node: TreeNode) -> None:
        self._drop_checkpoint(node)
        super()._remove_leaf(node)

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"cannot reset the prefix cache: {self._protected} tokens are locked")
        for node in list(self._holders.values()):
            self._drop_checkpoint(node)
        super().reset()

    # ---------------------------------------------------------------- inspection

    def checkpoint_count(self) -> int:
        return len(self._holders)

    def state_integrity(self, table_free: int, live: int) -> dict:
        """The state pool's invariant: free + cached (checkpoints) + in use (working slots) == total."""
        free = table_free + self.slots.available()
        cached, total = len(self._holders), self.states.num_slots
        return {
            "free": free,
            "cached": cached,
            "in_use": live,
            "total": total,
            "ok": free + cached + live == total and self.slots.available() + cached == self.slots.total,
        }

    def debug_check(self) -> None:
        super().debug_check()
        held = {n.checkpoint: n for n in self._iter_nodes() if n.checkpoint is not None}
        assert held.keys() == self._holders.keys(), "checkpoint owners drifted from the tree"
        assert all(self._holders[s] is n for s, n in held.items()), "a checkpoint slot has two owners"
        free = self.slots.free_slots()
        assert len(set(free)) == len(free) and not set(free) & held.keys(), (
            "a checkpoint slot is free and held"
        )
        assert all(self.slots.first <= s < self.slots.end for s in [*free, *held]), (
            "checkpoint slot out of range"
        )
        assert len(free) + len(held) == self.slots.total, "checkpoint slots lost"
