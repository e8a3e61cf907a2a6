"""Incremental detokenizer with UTF-8 and stop-string hold-back.

Each step decodes only a short window of ids (prefix offset .. end) and emits the text past the read offset,
so SentencePiece/byte-level spaces come out as a full decode would. Text is held back while it ends in an
incomplete UTF-8 sequence (U+FFFD) or while its tail could still grow into a stop string.

While stop strings may not end the request yet (min_new_tokens, vLLM's min_tokens), text is not matched against
them but a tail that could start one is still held back: a stop that completes once they may end it is then
trimmed with nothing of it streamed, and a stop that completed earlier is never matched later (vLLM matches only
stops that end in new text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def find_stop(text: str, stops: Sequence[str], after: int = 0) -> tuple[int, str] | None:
    """(start, stop) of the earliest stop occurrence in text (shortest stop on a tie) that ends past its first
    `after` characters, or None."""
    found: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, after - len(s) + 1))
        if i >= 0 and (found is None or i < found[0] or (i == found[0] and len(s) < len(found[1]))):
            found = (i, s)
    return found


class IncrementalDetokenizer:
    """Streams text for generated ids; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self.matched_stop: str | None = None
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (context for spaces)
        self._read_offset = 0  # ids before this are already turned into text
        self._held = ""  # decoded text not emitted yet (possible stop-string start)
        self._unmatchable = 0  # leading characters of _held decoded while stops were off: no match ends there
        self._chunks: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    @property
    def output_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def finished(self) -> bool:
        return self._finished

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _window_delta(self, final: bool) -> str:
        """New text past the read offset; empty while it ends in an incomplete UTF-8 sequence (unless final)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if not final and (len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR)):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text

    def _consume(self, final: bool, check_stop: bool) -> str:
        """Move newly decoded text through the stop-string filter; returns the text to emit now."""
        buf = self._held + self._window_delta(final)
        hit = find_stop(buf, self.stop, self._unmatchable) if self.stop and check_stop else None
        if hit is not None:
            start, s = hit
            self.matched_stop = s
            self._finished = True
            self._held = ""
            return self._emit(buf[: start + len(s)] if self.no_stop_trim else buf[:start])
        keep = 0 if final or not self.stop else stop_prefix_len(buf, self.stop)
        emitted = len(buf) - keep
        self._held = buf[emitted:] if keep else ""
        self._unmatchable = len(self._held) if not check_stop else max(0, self._unmatchable - emitted)
        return self._emit(buf[:emitted])

    def add(self, token_ids: Sequence[int], check_stop: bool = True) -> tuple[str, str | None]:
        """Append generated ids; returns (text safe to emit now, matched stop string or None). With
        `check_stop` False (below min_new_tokens) no stop string is matched, in this text or later."""
        if self._finished:  # contract: not called after a stop matched; harmless if it is
            return "", self.matched_stop
        self._ids.extend(int(t) for t in token_ids)
        out = self._consume(final=False, check_stop=check_stop)
        return out, self.matched_stop

    def flush(self, check_stop: bool = True) -> str:
        """Release everything held back (a never-completed UTF-8 tail decodes as the tokenizer does)."""
        if self._finished:
            return ""
        out = self._consume(final=True, check_stop=check_stop)
        self._finished = True
        return out
