"""A cursor over model output that reads tool-call markup and JSON, telling apart text that is cut short
(`Incomplete`: more output may still complete it) from text that can never become a call (`Malformed`).
Streaming rests on that distinction: incomplete markup is held back from the client, malformed markup is
released as ordinary content."""

from __future__ import annotations

import json
import re

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_GROWING = re.compile(r"[.eE][+-]?")
_PLAIN_CHARS = re.compile(r'[^"\\\x00-\x1f]*')  # a string's characters up to a quote, escape or control


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


# strict JSON: NaN and Infinity, which Python's decoder takes by default, are refused
_DECODER = json.JSONDecoder(parse_constant=_no_constants)
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
# nesting deeper than this is refused rather than risking Python's recursion limit on hostile output
_MAX_DEPTH = 200


class Incomplete(Exception):
    """The text ends inside the construct being read."""


class Malformed(Exception):
    """The text cannot be the construct being read, however it continues."""


class Cursor:
    def __init__(self, text: str, pos: int = 0, final: bool = False):
        self.text = text
        self.pos = pos
        self.final = final  # the whole output: a literal cut short at its end can no longer arrive

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def peek(self) -> str:
        if self.at_end():
            raise Incomplete
        return self.text[self.pos]

    def skip_space(self) -> None:
        """Skips JSON's whitespace (only these four: what is skipped inside arguments stays in their text)."""
        while self.pos < len(self.text) and self.text[self.pos] in " \t\n\r":
            self.pos += 1

    def starts_with(self, literal: str) -> bool:
        """Whether `literal` is next; Incomplete while the text ends inside a prefix of it."""
        rest = self.text[self.pos : self.pos + len(literal)]
        if rest == literal:
            return True
        if literal.startswith(rest) and not self.final:
            raise Incomplete
        return False

    def expect(self, literal: str) -> None:
        if not self.starts_with(literal):
            raise Malformed
        self.pos += len(literal)

    def until(self, literal: str, allowed: re.Pattern[str]) -> str:
        """The text before the next `literal`, which must match `allowed` entirely (a name, an id)."""
        end = self.text.find(literal, self.pos)
        seen = self.text[self.pos :] if end < 0 else self.text[self.pos : end]
        if end < 0:
            # the literal may be arriving: what is there so far must still fit
            before = seen[: len(seen) - _partial_suffix(seen, literal)]
            if before and allowed.fullmatch(before) is None:
                raise Malformed
            raise Incomplete
        if not seen or allowed.fullmatch(seen) is None:
            raise Malformed
        self.pos = end + len(literal)
        return seen

    # ------------------------------------------------------------------ JSON
    def json_string(self) -> str:
        """Reads a JSON string; returns its decoded value."""
        start = self.pos
        self.expect('"')
        text, i = self.text, self.pos
        while True:
            i = _PLAIN_CHARS.match(text, i).end()
            if i >= len(text):
                raise Incomplete
            ch = text[i]
            if ch == '"':
                break
            if ch != "\\":
                raise Malformed  # a control character
            i = _escape_end(text, i)
        self.pos = i + 1
        return json.loads(text[start : self.pos])

    def json_value(self, depth: int = 0) -> None:
        """Reads one JSON value of any kind, leaving the cursor after it."""
        if depth > _MAX_DEPTH:
            raise Malformed
        if self._whole_value():
            return
        ch = self.peek()
        if ch == "{":
            self._json_object(depth)
        elif ch == "[":
            self._json_array(depth)
        elif ch == '"':
            self.json_string()
        elif ch == "-" or ch.isdigit():
            self._json_number()
        else:
            for word in ("true", "false", "null"):
                if self.starts_with(word):
                    self.pos += len(word)
                    return
            raise Malformed

    def _whole_value(self) -> bool:
        """Reads a value that is already whole with the C decoder (streaming reads the output again at every
        piece, and most of it is whole values); False, having read nothing, for one cut short or not JSON,
        which the reader below tells apart. A bare number is left to that reader too: the decoder takes the
        longest number it can (1.5 of 1.5e, with more to come), where only the whole token may be judged."""
        try:
            value, end = _DECODER.raw_decode(self.text, self.pos)
        except (ValueError, RecursionError):
            return False
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return False
        self.pos = end
        return True

    def _json_object(self, depth: int) -> None:
        self.expect("{")
        self.skip_space()
        if self.peek() == "}":
            self.pos += 1
            return
        while True:
            self.skip_space()
            self.json_string()
            self.skip_space()
            self.expect(":")
            self.skip_space()
            self.json_value(depth + 1)
            if not self.list_goes_on("}"):
                return

    def _json_array(self, depth: int) -> None:
        self.expect("[")
        self.skip_space()
        if self.peek() == "]":
            self.pos += 1
            return
        while True:
            self.skip_space()
            self.json_value(depth + 1)
            if not self.list_goes_on("]"):
                return

    def list_goes_on(self, close: str) -> bool:
        """After an item of an object or array: True at a comma, False (consumed) at the closing bracket."""
        self.skip_space()
        ch = self.peek()
        self.pos += 1
        if ch == ",":
            return True
        if ch == close:
            return False
        raise Malformed

    def _json_number(self) -> None:
        match = _NUMBER.match(self.text, self.pos)
        if match is None:
            if self.text[self.pos :] == "-":
                raise Incomplete
            raise Malformed
        rest = self.text[match.end() : match.end() + 3]
        if not rest or _NUMBER_GROWING.fullmatch(rest):
            # a number at the very end may still grow (1 -> 12, 1. -> 1.5, 1e -> 1e5)
            raise Incomplete
        if rest[0] in ".eE":
            raise Malformed
        self.pos = match.end()


def _escape_end(text: str, i: int) -> int:
    """Index just past the escape sequence starting at text[i] (a backslash)."""
    if i + 1 >= len(text):
        raise Incomplete
    kind = text[i + 1]
    if kind not in _ESCAPES:
        raise Malformed
    if kind != "u":
        return i + 2
    digits = text[i + 2 : i + 6]
    if not all(d in _HEX for d in digits):
        raise Malformed
    if len(digits) < 4:
        raise Incomplete
    return i + 6


def _partial_suffix(text: str, literal: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `literal`."""
    for size in range(min(len(text), len(literal) - 1), 0, -1):
        if literal.startswith(text[-size:]):
            return size
    return 0


def partial_suffix(text: str, literals: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could be the start of one of `literals`."""
    return max((_partial_suffix(text, literal) for literal in literals), default=0)
