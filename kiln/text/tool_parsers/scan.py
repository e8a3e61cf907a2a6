"""One reading of model output as content and tool calls, shared by the whole-output parse and the streaming
one so that streamed deltas always add up to what the whole output parses to.

A region of call markup that reads whole becomes calls, and the whitespace around it is dropped; one that can
never read whole (malformed, an undeclared name) stays in the content as the text it is. A region the output ends
inside (max_tokens cut it) keeps the calls whose names were whole, with the arguments written so far, as OpenAI's
API gives a cut call (finish_reason "length" tells): they had streamed already, so the whole parse and the stream
agree; a region cut before any name is content. While streaming, a region still arriving is held back, as are a
trailing prefix of a marker and trailing whitespace (it is dropped if a call follows): so content sent is never
taken back."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.text.tool_parsers.cursor import Cursor, Incomplete, Malformed, partial_suffix
from kiln.text.tool_parsers.formats import Draft, ToolCallFormat


@dataclass(frozen=True)
class CallDraft:
    """A call as far as the output shows it: its name once whole, and its arguments' JSON text so far."""

    name: str | None
    arguments: str
    complete: bool


@dataclass(frozen=True)
class Checkpoint:
    """Where a later reading of a longer output may start: everything before `pos` reads the same however the
    output goes on (after the last whole region, or the content already sent after it)."""

    pos: int = 0
    after_call: bool = False
    content: str = ""
    calls: tuple[CallDraft, ...] = ()


@dataclass(frozen=True)
class Scan:
    content: str
    calls: tuple[CallDraft, ...]
    checkpoint: Checkpoint


def scan(
    fmt: ToolCallFormat, text: str, names: frozenset[str], final: bool, start: Checkpoint | None = None
) -> Scan:
    """Reads `text` (the output so far; all of it when `final`) from `start`."""
    start = start or Checkpoint()
    pos, after_call, checkpoint = start.pos, start.after_call, start
    pieces, calls = [start.content], list(start.calls)
    while True:
        begin = fmt.region_start(text, pos)
        if begin is None:
            lead, piece = _plain_tail(fmt, text[pos:], after_call, final)
            pieces.append(piece)
            if piece and not final:  # sent text is settled: later readings start after it
                checkpoint = Checkpoint(pos + lead + len(piece), False, "".join(pieces), tuple(calls))
            break
        before = text[pos:begin].lstrip() if after_call else text[pos:begin]
        # the whole output is first read as the stream read it: a region it ends inside keeps its named calls
        cut = _cut_short(fmt, text, begin, names) if final else None
        cursor, drafts = Cursor(text, begin, final), []
        if cut is None:
            try:
                fmt.read_region(cursor, names, drafts)
            except (Incomplete, Malformed) as error:
                if final or isinstance(error, Malformed):
                    pieces.append(before + text[begin])
                    pos, after_call = begin + 1, False
                    continue
                cut = drafts  # still arriving: held back while streaming
        if cut is not None:
            pieces.append(before.rstrip())
            calls.extend(_call_drafts(text, cut))
            break
        pieces.append(before.rstrip())
        calls.extend(_call_drafts(text, drafts))
        pos, after_call = cursor.pos, True
        checkpoint = Checkpoint(pos, True, "".join(pieces), tuple(calls))
    return Scan("".join(pieces), tuple(calls), checkpoint)


def _cut_short(fmt: ToolCallFormat, text: str, begin: int, names: frozenset[str]) -> list[Draft] | None:
    """The calls of a region the whole output ends inside, as the stream read them (its cursor waits for more
    where a final one finds a literal missing, or a format ends its calls early): those whose names were whole;
    None where there are none, or where the region does not run to the end."""
    drafts: list[Draft] = []
    try:
        fmt.read_region(Cursor(text, begin), names, drafts)
    except Incomplete:
        return [draft for draft in drafts if draft.name is not None] or None
    except Malformed:
        pass
    return None


def _plain_tail(fmt: ToolCallFormat, tail: str, after_call: bool, final: bool) -> tuple[int, str]:
    """Text after the last region: where its content starts in `tail`, and the content."""
    lead = len(tail) - len(tail.lstrip()) if after_call else 0
    tail = tail[lead:]
    if final:
        return lead, tail
    tail = tail[: len(tail) - partial_suffix(tail, fmt.markers)]
    return lead, tail.rstrip()


def _call_drafts(text: str, drafts: list[Draft]) -> list[CallDraft]:
    out = []
    for draft in drafts:
        if draft.arguments_start is None:
            arguments = "{}" if draft.done else ""
        else:
            arguments = text[draft.arguments_start : draft.arguments_end or len(text)]
        out.append(CallDraft(draft.name, arguments, draft.done))
    return out
