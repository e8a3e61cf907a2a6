"""NGRAM drafting: no draft model. The request's own prompt and output are searched for the longest earlier
occurrence of their last tokens (a suffix of up to `max_match` tokens, at least `min_match`), and the tokens
that followed it are proposed. Text that copies from its prompt (code edits, quotes, lists repeated with
changes) is then decoded several tokens per target pass.

Where nothing repeats, a proposal is a wasted verify: after `patience` verify steps in a row accepting no draft,
the request proposes nothing for a cool-down of steps that doubles each time it backs off again (up to
`max_cooldown`) and resets once a draft is accepted, so text with nothing to copy decodes almost as it would
without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.speculative.base import DraftInput

# SGLang's NGRAM query window: the last 1 to 12 tokens of prompt + output
MIN_MATCH = 1
MAX_MATCH = 12
PATIENCE = 3
FIRST_COOLDOWN = 8
MAX_COOLDOWN = 256


@dataclass
class _Backoff:
    """One request's recent luck: misses in a row, the current cool-down and the steps left in it."""

    misses: int = 0
    cooldown: int = FIRST_COOLDOWN
    waiting: int = 0
    proposed: int = 0


def longest_suffix_match(tokens: np.ndarray, min_match: int, max_match: int) -> tuple[int, int]:
    """(start of the continuation, match length) of the most recent earlier occurrence of the longest suffix
    of tokens (min_match..max_match long); (-1, 0) when there is none."""
    n = tokens.shape[0]
    if n < 2:
        return -1, 0
    # candidate ends: earlier positions holding the last token, whose continuation is inside the sequence
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    if ends.size == 0:
        return -1, 0
    length = np.ones(ends.shape[0], dtype=np.int64)
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
    best = int(length.max())
    if best < min_match:
        return -1, 0
    end = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest
    return end + 1, best


class NgramDrafter:
    """Drafts from n-gram matches in each request's own tokens; see the module docstring."""

    def __init__(
        self,
        min_match: int = MIN_MATCH,
        max_match: int = MAX_MATCH,
        patience: int = PATIENCE,
        max_cooldown: int = MAX_COOLDOWN,
    ):
        self.min_match = min_match
        self.max_match = max_match
        self.patience = patience
        self.max_cooldown = max_cooldown
        self.state: dict[str, _Backoff] = {}

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        return [self._propose_one(item) for item in inputs]

    def _propose_one(self, item: DraftInput) -> list[int]:
        state = self.state.setdefault(item.rid, _Backoff())
        state.proposed = 0
        if item.num_draft <= 0:
            return []
        if state.waiting > 0:
            state.waiting -= 1
            return []
        tokens = np.asarray(item.token_ids, dtype=np.int64)
        start, _ = longest_suffix_match(tokens, self.min_match, self.max_match)
        if start < 0:
            return []
        draft = tokens[start : start + item.num_draft].tolist()
        state.proposed = len(draft)
        return draft

    def accepted(self, rid: str, tokens: list[int], hidden: torch.Tensor | None) -> None:
        state = self.state.get(rid)
        if state is None or state.proposed == 0:
            return
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
