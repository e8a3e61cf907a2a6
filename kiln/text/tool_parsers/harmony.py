"""GPT-OSS's harmony format (SGLang's `gpt-oss` parsers): the output is a run of messages,
`[<|start|>ROLE] <|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>json] <|message|>BODY <|end|> | <|call|> |
<|return|>`. The analysis channel is reasoning; final and commentary (a preamble) are content; a message with a
recipient is a tool call, kept in the content as the markup it is so that the tool-call parser reads it
(SGLang's reasoning parser passes it on raw the same way). A message without its terminator ends where the next
one starts, or with the output (the EOS token <|return|> or <|call|> is not in the text). The markers are
special tokens: the chat path keeps them in the text (kiln/server/tool_calls.py), as SGLang does for gpt-oss.

`split_harmony` reads text the stream has so far (or all of it, `final`) and never takes back what an earlier
reading gave: a message counts once its header is whole, and a trailing prefix of a marker is held back."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from kiln.text.tool_parsers.cursor import Cursor, Incomplete, Malformed, partial_suffix
from kiln.text.tool_parsers.formats import Draft, ToolCallFormat, read_arguments

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
OPENERS = (START, CHANNEL)
TERMINATORS = (END, CALL, RETURN)
# a body also ends where the next message opens (SGLang's implicit close)
BODY_ENDS = (*TERMINATORS, *OPENERS)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_WORD = re.compile(r"\s*([^\s<]*)")


class Kind(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"
    DROPPED = "dropped"  # another author's message, or an unknown channel (SGLang skips them)


@dataclass(frozen=True)
class Header:
    kind: Kind
    recipient: str | None
    body: int  # where the body starts, past <|message|>


def read_header(text: str, opener: int) -> Header | int | None:
    """The header of the message opening at `opener`: a Header; None while it is still arriving; or, for a
    header that a stray marker breaks, where reading goes on (past a terminator, at an opener)."""
    pos = opener + (len(START) if text.startswith(START, opener) else len(CHANNEL))
    has_channel = text.startswith(CHANNEL, opener)
    while (marker := _find(text, pos, MARKERS)) is not None:
        at, token = marker
        if token == MESSAGE:
            return _classify(text[opener:at], at + len(MESSAGE))
        if token == CONSTRAIN or (token == CHANNEL and not has_channel):
            has_channel = has_channel or token == CHANNEL
            pos = at + len(token)
            continue
        return at + len(token) if token in TERMINATORS else at
    return None


def _find(text: str, pos: int, literals: tuple[str, ...]) -> tuple[int, str] | None:
    """Where the first of `literals` (markers, all starting `<`) is at or after `pos`, and which: finding one
    character is memchr, quick over the text between markers, which the stream reads again at every piece."""
    while (at := text.find("<", pos)) >= 0:
        for literal in literals:
            if text.startswith(literal, at):
                return at, literal
        pos = at + 1
    return None


def _classify(header: str, body: int) -> Header:
    role_part, _, channel_part = header.partition(CHANNEL)
    role = _WORD.match(role_part.removeprefix(START)).group(1)
    channel = _WORD.match(channel_part.replace(CONSTRAIN, " ")).group(1).lower()
    found = _RECIPIENT.search(header)
    recipient = found.group(1) if found else None
    if role and role != "assistant":  # e.g. a tool's result (`<|start|>functions.f to=assistant`)
        kind = Kind.DROPPED
    elif recipient is not None:
        kind = Kind.CALL
    elif channel == "analysis":
        kind = Kind.REASONING
    elif channel in ("final", "commentary", ""):
        kind = Kind.CONTENT
    else:
        kind = Kind.DROPPED
    return Header(kind, recipient, body)


@dataclass(frozen=True)
class HarmonySplit:
    reasoning: str
    content: str
    in_reasoning: bool  # the text ends inside an analysis message


def split_harmony(text: str, final: bool, opened: bool = False) -> HarmonySplit:
    """Reasoning and content of `text`; `opened`: the prompt ended inside an analysis message."""
    reasoning: list[str] = []
    content: list[str] = []
    pos = 0
    # (kind, where its message opened) of the body being read at pos; None between messages
    message: tuple[Kind, int] | None = (Kind.REASONING, 0) if opened else None
    while True:
        if message is None:
            opener = _find(text, pos, OPENERS)
            if opener is None:  # outside any message: content as written (plain text is left alone)
                content.append(_held(text[pos:], OPENERS, final))
                return HarmonySplit("".join(reasoning), "".join(content), False)
            content.append(text[pos : opener[0]])
            header = read_header(text, opener[0])
            if header is None:  # held back until it is whole; a header the output ends in says nothing
                return HarmonySplit("".join(reasoning), "".join(content), False)
            if isinstance(header, int):  # broken by a stray marker: dropped
                pos = header
                continue
            message, pos = (header.kind, opener[0]), header.body
            continue
        kind, opener_at = message
        end = _find(text, pos, BODY_ENDS)
        if end is None:
            tail = text[max(pos, len(text) - len(CONSTRAIN)) :]  # as long as the longest marker: no copy
            stop = len(text) - (0 if final else partial_suffix(tail, BODY_ENDS))
        else:
            # a terminator belongs to its message (a call keeps its <|call|>); an opener starts the next one
            stop = end[0] + len(end[1]) if end[1] in TERMINATORS else end[0]
        body = text[pos : end[0] if end is not None else stop]
        if kind is Kind.CALL:
            content.append(text[opener_at:stop])
        elif kind is Kind.REASONING:
            reasoning.append(body)
        elif kind is Kind.CONTENT:
            content.append(body)
        if end is None:
            return HarmonySplit("".join(reasoning), "".join(content), kind is Kind.REASONING)
        message, pos = None, stop


def _held(text: str, literals: tuple[str, ...], final: bool) -> str:
    """`text` without a trailing prefix of one of `literals` while more output may complete it."""
    return text if final else text[: len(text) - partial_suffix(text, literals)]


class GptOssFormat(ToolCallFormat):
    """GPT-OSS: a call is a harmony message to a function, `<|start|>assistant<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`; calls are read in what the user sees of the
    output (the reasoning is not: SGLang's detector drops it too)."""

    markers = OPENERS

    def visible(self, text: str, final: bool) -> str:
        return split_harmony(text, final).content

    def read_region(self, cursor: Cursor, names: frozenset[str], drafts: list[Draft]) -> None:
        header = read_header(cursor.text, cursor.pos)
        if header is None:
            raise Incomplete
        if isinstance(header, int) or header.kind is not Kind.CALL or header.recipient is None:
            raise Malformed
        draft = Draft()
        drafts.append(draft)
        name = header.recipient.removeprefix("functions.")
        if name not in names:
            raise Malformed
        draft.name = name
        cursor.pos = header.body
        cursor.skip_space()
        if not _call_ends(cursor):  # a call may carry no arguments (SGLang reads them as {})
            read_arguments(cursor, draft)
            cursor.skip_space()
            if not _call_ends(cursor):
                raise Malformed
        draft.done = True


def _call_ends(cursor: Cursor) -> bool:
    """At the end of a call's body: its terminator (consumed), the next message, or the end of the output."""
    for terminator in TERMINATORS:
        if cursor.starts_with(terminator):
            cursor.pos += len(terminator)
            return True
    if cursor.final and cursor.at_end():
        return True
    return any(cursor.starts_with(opener) for opener in OPENERS)
