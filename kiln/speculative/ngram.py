"""NGRAM drafting: no draft model. The request's own prompt and output are searched for the longest earlier
occurrence of their last tokens (a suffix of up to `max_match` tokens, at least `min_match`), and the tokens
that followed it are proposed. Text that copies from its prompt (code edits, quotes, lists repeated with
changes) is then decoded several tokens per target pass.

Where nothing repeats, a proposal is a wasted verify: after `patience` verify steps in a row accepting no draft,
the request proposes nothing for a cool-down of steps that doubles each time it backs off again (up to
`max_cooldown`) and resets once a draft is accepted, so text with nothing to copy decodes almost as it would
without speculation.

How many tokens a request proposes follows its recent acceptance: a verify of k drafts costs the target k more rows
(each a decode row's matmuls and attention), and on a fast kernel the rows it rejects cost about as much as the
accepted ones save. A request starts at FIRST_BUDGET drafts; a step that accepts every draft doubles its budget (up
to num_draft_tokens - 1), one that rejects some sets it to the accepted count plus one. A long copy so verifies
long chains, a short or failing match short ones.

With a breadth above 1 (--speculative-eagle-topk) the proposal is a tree, as SGLang's NGRAM builds it from its
trie (match type BFS): for each suffix that occurred earlier, longest first, a breadth-first walk over the tokens
that followed its occurrences, most recent first, taking at most `breadth` of them per node, the breadth starting
wide for a short suffix and narrow for a long one and narrowing with depth; the walks merge into one tree of at
most `max_nodes` nodes. A long match so gives the chain above, and the spare nodes go to the alternatives shorter
matches offer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from kiln.speculative.base import DraftInput, DraftTree

# SGLang's NGRAM query window: the last 1 to 12 tokens of prompt + output
MIN_MATCH = 1
MAX_MATCH = 12
PATIENCE = 3
FIRST_COOLDOWN = 8
MAX_COOLDOWN = 256
MIN_BREADTH = 1  # SGLang's --speculative-ngram-min-bfs-breadth
FIRST_BUDGET = 4  # drafts a request proposes before its acceptance is known


@dataclass
class _Backoff:
    """One request's recent luck: misses in a row, the current cool-down and the steps left in it, and how many
    drafts it proposes next (its budget)."""

    misses: int = 0
    cooldown: int = FIRST_COOLDOWN
    waiting: int = 0
    proposed: int = 0
    budget: int = FIRST_BUDGET

    def settle(self, accepted: int) -> None:
        """The last verify accepted `accepted` of the `proposed` drafts: grow the budget on a clean sweep,
        shrink it to what was accepted plus one otherwise."""
        self.budget = self.budget * 2 if accepted >= self.proposed else accepted + 1


def suffix_matches(tokens: np.ndarray, max_match: int) -> tuple[np.ndarray, np.ndarray]:
    """The earlier positions holding the last token, ascending (their continuation is inside the sequence),
    and how many tokens (up to max_match) of the sequence's suffix match there, ending at each."""
    n = tokens.shape[0]
    if n < 2:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    length = np.ones(ends.shape[0], dtype=np.int64)
    if ends.size == 0:
        return ends, length
    alive = np.ones(ends.shape[0], dtype=bool)
    for k in range(1, max_match):
        if k >= n:
            break
        back = ends - k
        alive &= back >= 0
        alive[alive] &= tokens[back[alive]] == tokens[n - 1 - k]
        if not alive.any():
            break
        length += alive
    return ends, length


def longest_suffix_match(tokens: np.ndarray, min_match: int, max_match: int) -> tuple[int, int]:
    """(start of the continuation, match length) of the most recent earlier occurrence of the longest suffix
    of tokens (min_match..max_match long); (-1, 0) when there is none."""
    ends, length = suffix_matches(tokens, max_match)
    if ends.size == 0:
        return -1, 0
    best = int(length.max())
    if best < min_match:
        return -1, 0
    end = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest
    return end + 1, best


def _continuations(tokens: np.ndarray, starts: np.ndarray, breadth: int) -> list[tuple[int, np.ndarray]]:
    """The `breadth` most recently seen distinct tokens at positions `starts` (ascending), each with the
    positions after its occurrences that are inside the sequence."""
    seen = tokens[starts]
    distinct, last = np.unique(seen[::-1], return_index=True)  # index in the reversed order: recency
    out = []
    for k in np.argsort(last)[:breadth]:
        token = int(distinct[k])
        following = starts[seen == token] + 1
        out.append((token, following[following < tokens.shape[0]]))
    return out


@dataclass(frozen=True)
class TreeShape:
    """How wide and how large an NGRAM tree grows: SGLang's BFS breadths, its node budget, its deepest path."""

    min_breadth: int
    max_breadth: int
    max_nodes: int
    max_depth: int


def bfs_tree(tokens: np.ndarray, shape: TreeShape, min_match: int, max_match: int) -> DraftTree:
    """SGLang's BFS draft tree over the request's own tokens (see the module docstring)."""
    ends, length = suffix_matches(tokens, max_match)
    deepest_match = max(1, max_match - 1)
    scale = (shape.max_breadth - shape.min_breadth) / deepest_match
    node_tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node: the walks of several matches merge
    longest = int(length.max()) if length.size else 0
    for match in range(longest, min_match - 1, -1):
        starts = ends[length >= match] + 1
        queue = deque([(-1, (deepest_match - match) * scale + shape.min_breadth, starts)])
        while queue and len(node_tokens) < shape.max_nodes:
            parent, breadth, starts = queue.popleft()
            level = depths[parent] + 1 if parent >= 0 else 1
            if level > shape.max_depth:
                continue
            for token, following in _continuations(tokens, starts, max(1, int(breadth))):
                node = index.get((parent, token))
                if node is None:
                    if len(node_tokens) >= shape.max_nodes:
                        break
                    node = index[(parent, token)] = len(node_tokens)
                    node_tokens.append(token)
                    parents.append(parent)
                    depths.append(level)
                if following.size:
                    queue.append((node, breadth - scale, following))
        if len(node_tokens) >= shape.max_nodes:
            break
    return DraftTree(tuple(node_tokens), tuple(parents))


class NgramDrafter:
    """Drafts from n-gram matches in each request's own tokens; see the module docstring."""

    def __init__(
        self,
        min_match: int = MIN_MATCH,
        max_match: int = MAX_MATCH,
        patience: int = PATIENCE,
        max_cooldown: int = MAX_COOLDOWN,
        max_breadth: int = 1,
        max_nodes: int | None = None,
    ):
        """max_breadth: --speculative-eagle-topk (1: a chain); max_nodes: the tree's node budget, num_draft_tokens
        - 1 (None: each input's num_draft)."""
        self.min_match = min_match
        self.max_match = max_match
        self.patience = patience
        self.max_cooldown = max_cooldown
        self.max_breadth = max_breadth
        self.max_nodes = max_nodes
        self.state: dict[str, _Backoff] = {}

    def propose(self, inputs: list[DraftInput]) -> list[list[int] | DraftTree]:
        return [self._propose_one(item) for item in inputs]

    def _propose_one(self, item: DraftInput) -> list[int] | DraftTree:
        state = self.state.setdefault(item.rid, _Backoff())
        state.proposed = 0
        if item.num_draft <= 0:
            return []
        if state.waiting > 0:
            state.waiting -= 1
            return []
        tokens = np.asarray(item.token_ids, dtype=np.int64)
        limit = self.max_nodes if self.max_nodes is not None else item.num_draft
        state.budget = min(state.budget, limit)
        if self.max_breadth > 1:
            shape = TreeShape(MIN_BREADTH, self.max_breadth, state.budget, item.num_draft)
            tree = bfs_tree(tokens, shape, self.min_match, self.max_match)
            state.proposed = len(tree)
            return tree
        start, _ = longest_suffix_match(tokens, self.min_match, self.max_match)
        if start < 0:
            return []
        draft = tokens[start : start + min(item.num_draft, state.budget)].tolist()
        state.proposed = len(draft)
        return draft

    def accepted(self, rid: str, tokens: list[int], hidden: torch.Tensor | None) -> None:
        state = self.state.get(rid)
        if state is None or state.proposed == 0:
            return
        state.settle(len(tokens) - 1)
        if len(tokens) > 1:  # a draft was kept: speculation pays here
            state.misses, state.cooldown = 0, FIRST_COOLDOWN
            return
        state.misses += 1
        if state.misses >= self.patience:
            state.waiting = state.cooldown
            state.misses = 0
            state.cooldown = min(self.max_cooldown, state.cooldown * 2)

    def release(self, rid: str) -> None:
        self.state.pop(rid, None)
