"""The prefix-cache interface the scheduler uses, and the no-op cache for ``--disable-radix-cache``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kiln.memory.allocator import TokenAllocator


@dataclass
class MatchResult:
    """Slots of the longest cached prefix (page-aligned length) and a handle for lock/unlock."""

    indices: torch.Tensor
    node: Any


class PrefixCache(ABC):
    """Maps token-id prefixes to KV slots it owns; evicts unlocked entries back to the allocator.

    Ownership: ``insert`` returns how many leading tokens were already cached; the caller frees its own
    duplicate slots in that range (those it did not get from ``acquire_prefix``), the cache takes the rest of
    the page-aligned prefix, and slots past the page-aligned length stay the caller's.
    """

    page_size: int

    @abstractmethod
    def acquire_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``, made usable: refreshes its LRU time, and a tiered
        cache brings it onto the device. The scheduler calls it where it admits a request, nowhere else."""

    @abstractmethod
    def match_prefix(self, key: list[int]) -> int:
        """How many leading tokens of ``key`` acquire_prefix would find (a tier's rows counted), changing
        nothing: no LRU refresh, no split, no load, no collective."""

    @abstractmethod
    def lock(self, node: Any) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted)."""

    @abstractmethod
    def unlock(self, node: Any) -> None:
        """Undo one ``lock(node)``."""

    @abstractmethod
    def insert(self, key: list[int], indices: torch.Tensor) -> int:
        """Cache the page-aligned prefix of ``key``; returns the number of leading tokens already cached."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` (if possible) from unlocked entries, LRU first; returns tokens freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held in unlocked entries."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held in locked entries."""

    def total_size(self) -> int:
        """All tokens held by the cache."""
        return self.evictable_size() + self.protected_size()

    def match_stored(self, key: list[int]) -> MatchResult:
        """The longest page-aligned prefix of ``key`` the cache stores, whether or not a request could start from
        it (a request re-locking the tokens it has just inserted). Only a hybrid model's cache tells the two apart:
        its ``acquire_prefix`` stops where a state checkpoint is."""
        return self.acquire_prefix(key)

    def states_serve_one_earlier(self) -> bool:
        """Whether a state kept after token n also restarts a request at token n - 1 (window rings, which still
        hold the window before it; not a linear layer's state, which has taken token n - 1 in)."""
        return False

    def restore_state(self, node: Any, slot: int) -> None:
        """A request starts in working slot ``slot`` from the prefix matched at ``node`` (None: from no tokens):
        a hybrid model's cache puts the linear layers' state there. Nothing to do for KV-only models."""
        return None

    def keep_state(self, node: Any, slot: int) -> None:
        """The state in working slot ``slot`` covers exactly the tokens up to the end of ``node``: a hybrid model's
        cache keeps a copy there as a checkpoint. Nothing to do for KV-only models."""
        return None

    def keeps_states(self) -> bool:
        """Whether the cache keeps state checkpoints (a hybrid model's, with spare state slots)."""
        return False

    def wants_checkpoint(self, num_tokens: int) -> bool:
        """Whether a request whose state covers ``num_tokens`` tokens should leave a checkpoint now."""
        return False

    def poll(self) -> None:
        """Once a scheduler step: finish what the cache's background copies have done (the host tier's stores
        land in the host pool). Nothing to do for a one-tier cache."""
        return None

    @abstractmethod
    def reset(self) -> None:
        """Free everything back to the allocator (nothing may be locked)."""

    @abstractmethod
    def debug_check(self) -> None:
        """Assert internal consistency (raises AssertionError naming what drifted)."""


class NoPrefixCache(PrefixCache):
    """Caches nothing: matches are empty and ``insert`` hands every slot back to the caller to free."""

    def __init__(self, allocator: TokenAllocator | None = None, page_size: int | None = None) -> None:
        if page_size is None:
            page_size = allocator.page_size if allocator is not None else 1
        if allocator is not None and allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.page_size = page_size
        self.device = allocator.device if allocator is not None else torch.device("cpu")
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)

    def acquire_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(indices=self._empty, node=None)

    def match_prefix(self, key: list[int]) -> int:
        return 0

    def lock(self, node: Any) -> None:
        pass

    def unlock(self, node: Any) -> None:
        pass

    def insert(self, key: list[int], indices: torch.Tensor) -> int:
        return len(key) // self.page_size * self.page_size

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def debug_check(self) -> None:
        pass
