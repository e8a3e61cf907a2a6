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
    verify step feeds the target first); `num_draft` is how many draft tokens the step can verify for it;
    `hidden` is the target's last hidden state for that token when the drafter asked for it.
    """

    rid: str
    token_ids: list[int]
    num_draft: int
    hidden: torch.Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    """Proposes a chain of draft tokens per request; the target decides which are kept."""

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        """One chain per input, at most `num_draft` long; shorter or empty when there is nothing to guess."""
        ...

    def accepted(self, rid: str, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """The tokens the target kept for `rid` at the last verify (accepted drafts plus the bonus token)."""
        ...

    def release(self, rid: str) -> None:
        """Forget `rid`'s state: it finished, was aborted, or was retracted (it starts over if it returns)."""
        ...
