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
    duplicate slots in that range (those it did not get from ``match_prefix``), the cache takes the rest of
    the page-aligned prefix, and slots past the page-aligned length stay the caller's.
    """

    page_size: int

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``; refreshes its LRU time."""

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

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(indices=self._empty, node=None)

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
