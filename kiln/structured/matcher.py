"""One request's position in its grammar: the next token's mask, the tokens sampled, the end."""

from __future__ import annotations

import numpy as np
import torch


class GrammarMatcher:
    """Wraps an llguidance matcher. Token i is allowed when bit i % 32 of word i // 32 of the mask is set."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    def allowed(self, width: int) -> torch.Tensor:
        """The tokens the grammar allows next as a bool [width] on the CPU; ids at or beyond the tokenizer's
        vocabulary (the model's padding rows) are never allowed."""
        words = self._words
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        # little-endian words, least significant bit first: numpy unpacks them in token order (torch's
        # element-wise shifts are far slower at this size)
        bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")
        mask = np.zeros(width, dtype=np.bool_)
        count = min(width, bits.shape[0])
        mask[:count] = bits[:count]
        return torch.from_numpy(mask)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False when the grammar refuses it (the matcher is then in error)."""
        return bool(self._matcher.consume_token(token))

    def rollback(self, count: int) -> None:
        self._matcher.rollback(count)

    @property
    def is_terminated(self) -> bool:
        """No token can follow: the output is complete (or the matcher failed; see `error`)."""
        return bool(self._matcher.is_stopped())

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (more may still follow)."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None if self._matcher.is_error() else None
