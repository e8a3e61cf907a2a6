"""The next token's masks for a batch's constrained rows, and the rows whose grammar allows nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.structured.matcher import GrammarMatcher

DEAD_END_MESSAGE = "grammar dead end: no token can continue the constrained output"


@dataclass(frozen=True)
class BatchMasks:
    masks: list[torch.Tensor | None]  # per row: bool [width] of the allowed tokens, None for free rows
    blocked: list[int]  # rows where no allowed token is left once the banned ids are taken out


def batch_masks(
    matchers: Sequence[GrammarMatcher | None], banned: Sequence[Sequence[int]], width: int
) -> BatchMasks:
    """Every constrained row's mask over `width` logits (padding ids beyond the tokenizer never allowed). A row
    whose grammar allows only ids banned this step (EOS below min_new_tokens) or nothing at all is blocked: it
    must end before sampling, since any token drawn for it would break the grammar."""
    masks: list[torch.Tensor | None] = []
    blocked: list[int] = []
    for row, matcher in enumerate(matchers):
        if matcher is None:
            masks.append(None)
            continue
        mask = matcher.allowed(width)
        if len(banned[row]):
            mask[torch.as_tensor(list(banned[row]), dtype=torch.long)] = False
        if not bool(mask.any()):
            blocked.append(row)
        masks.append(mask)
    return BatchMasks(masks, blocked)


def blocked_finish(matcher: GrammarMatcher) -> dict:
    """The finish reason of a blocked row: a complete match ends as a stop (EOS was only banned by
    min_new_tokens); anything else is a dead end, an abort that says so rather than output the grammar refuses."""
    if matcher.is_accepting:
        return {"type": "stop", "matched": None}
    return {"type": "abort", "message": DEAD_END_MESSAGE}
