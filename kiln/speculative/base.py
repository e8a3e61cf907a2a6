"""Plain types shared by every drafter and the verify step.

A drafter only proposes: the scheduler owns the target's KV and decides what is kept, then tells the drafter
through `accepted` so a stateful drafter (a draft model with its own KV, an EAGLE head fed the target's
hidden states) advances by exactly the tokens the target kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class DraftInput:
    """What a drafter sees of one request at a verify step.

    `token_ids` is the request's prompt followed by every output token so far (the last one is the token the
    verify step feeds the target first); `num_draft` is how many draft tokens the step can verify for it down
    one path (a chain's length, a tree's depth; a tree's node budget is num_draft_tokens - 1, and the step cuts
    what does not fit its room);
    `hidden` is the target's last hidden state for that token when the drafter asked for it; `kv_slots` the
    target's KV slots of every token but the last (the request's table row), for a head that keeps its own KV in
    the same slots.
    """

    rid: str
    token_ids: list[int]
    num_draft: int
    hidden: torch.Tensor | None = None
    kv_slots: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens as a tree over the request's last token (the root, not listed): node i is `tokens[i]`, its
    parent `parents[i]` (-1: the root, else an earlier node: parents come before children). A chain is the tree
    whose parents are -1, 0, 1, ...; siblings hold distinct tokens, most likely first."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    @staticmethod
    def chain(tokens: list[int] | tuple[int, ...]) -> DraftTree:
        return DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def depth(self, node: int) -> int:
        """Tokens from the root's child down to `node`, both included (a child of the root has depth 1)."""
        d = 0
        while node >= 0:
            node, d = self.parents[node], d + 1
        return d

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`, in order."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def children(self, node: int) -> list[int]:
        """`node`'s children (-1: the root's) in order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))

    def cut(self, max_nodes: int, max_depth: int) -> DraftTree:
        """The tree a verify step has room for: the nodes no deeper than `max_depth`, the first `max_nodes` of
        them (parents come first, so every kept node keeps its parent)."""
        kept: dict[int, int] = {}  # old index -> new index
        depths: list[int] = []
        for node, parent in enumerate(self.parents):
            if len(kept) >= max_nodes:
                break
            if parent >= 0 and parent not in kept:
                continue
            depth = depths[kept[parent]] + 1 if parent >= 0 else 1
            if depth <= max_depth:
                kept[node] = len(kept)
                depths.append(depth)
        if len(kept) == len(self.tokens):
            return self
        return DraftTree(
            tuple(self.tokens[i] for i in kept),
            tuple(kept[self.parents[i]] if self.parents[i] >= 0 else -1 for i in kept),
        )

    def follow(self, tokens: list[int]) -> list[int]:
        """The nodes `tokens` walk down from the root, taking at each step the first child holding the token
        (the one a verdict accepts); it stops where no child does."""
        path: list[int] = []
        node = -1
        for token in tokens:
            child = next((c for c in self.children(node) if self.tokens[c] == token), None)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    @staticmethod
    def of(proposal: list[int] | DraftTree) -> DraftTree:
        """A drafter's proposal for one request as a tree (a list is a chain)."""
        return proposal if isinstance(proposal, DraftTree) else DraftTree.chain(proposal)


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens per request, a chain or a tree; the target decides which are kept."""

    def propose(self, inputs: list[DraftInput]) -> list[list[int] | DraftTree]:
        """One chain or tree per input, at most `num_draft` nodes deep; empty when there is nothing to guess (the
        verify step cuts a larger one to its room)."""
        ...

    def accepted(self, rid: str, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """The tokens the target kept for `rid` at the last verify (accepted drafts plus the bonus token)."""
        ...

    def release(self, rid: str) -> None:
        """Forget `rid`'s state: it finished, was aborted, or was retracted (it starts over if it returns)."""
        ...
