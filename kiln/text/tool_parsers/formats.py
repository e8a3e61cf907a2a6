"""The tool-call formats of the model families Kiln loads, each as a reader of one region of markup (SGLang's
detectors of the same names describe them). A reader appends a draft per call as it goes, so that a region cut
short still tells how far each call has come; it raises Incomplete or Malformed as the Cursor does."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.text.tool_parsers.cursor import Cursor, Malformed

_NAME_CHARS = re.compile(r"[\w.\-]+")
_KIMI_ID_CHARS = re.compile(r"[\w.\-:\s]+")
_KIMI_ID = re.compile(r"\s*(?:functions\.)?(?P<name>[\w.\-]+):\d+\s*")
_ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class Draft:
    """One call as far as it has been read: its name once whole, where its JSON arguments start and end."""

    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None
    done: bool = False


class ToolCallFormat:
    """A family's markup: `markers` open a region of calls (text ending in a prefix of one is held back while
    streaming); `read_region` reads one region from its marker to its end."""

    markers: tuple[str, ...] = ()

    def visible(self, text: str, final: bool) -> str:
        """The output as calls are read in: all of it, but where it mixes channels (harmony) what the user sees.
        A longer output's reading must extend a shorter one's, as the stream reads it again at every piece."""
        return text

    def region_start(self, text: str, pos: int) -> int | None:
        found = [i for i in (text.find(marker, pos) for marker in self.markers) if i >= 0]
        return min(found) if found else None

    def read_region(self, cursor: Cursor, names: frozenset[str], drafts: list[Draft]) -> None:
        raise NotImplementedError


def read_call_object(
    cursor: Cursor,
    names: frozenset[str],
    drafts: list[Draft],
    argument_keys: tuple[str, ...] = _ARGUMENT_KEYS,
) -> None:
    """A call written as a JSON object {"name": ..., "arguments" | "parameters": {...}}, keys in any order;
    a name the request did not declare, or any other key (but "type": "function"), is no call."""
    draft = Draft()
    drafts.append(draft)
    cursor.skip_space()
    cursor.expect("{")
    while True:
        cursor.skip_space()
        key = cursor.json_string()
        cursor.skip_space()
        cursor.expect(":")
        cursor.skip_space()
        if key == "name" and draft.name is None:
            draft.name = _declared(cursor.json_string(), names)
        elif key in argument_keys and draft.arguments_start is None:
            read_arguments(cursor, draft)
        elif key == "type" and argument_keys == _ARGUMENT_KEYS:  # Llama 3.2 may add "type": "function"
            if cursor.json_string() != "function":
                raise Malformed
        else:
            raise Malformed
        if not cursor.list_goes_on("}"):
            break
    if draft.name is None:
        raise Malformed
    draft.done = True


def read_arguments(cursor: Cursor, draft: Draft) -> None:
    """The arguments: a JSON object, its start recorded before it is read so that a part of it can stream."""
    cursor.skip_space()
    if cursor.peek() != "{":
        raise Malformed
    draft.arguments_start = cursor.pos
    cursor.json_value()
    draft.arguments_end = cursor.pos


def _declared(name: str, names: frozenset[str]) -> str:
    if name not in names:
        raise Malformed
    return name


class HermesFormat(ToolCallFormat):
    """Qwen 2.5 / Qwen 3 and Hermes: each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

    markers = ("<tool_call>",)

    def read_region(self, cursor: Cursor, names: frozenset[str], drafts: list[Draft]) -> None:
        cursor.expect("<tool_call>")
        read_call_object(cursor, names, drafts)
        cursor.skip_space()
        cursor.expect("</tool_call>")


class Llama3Format(ToolCallFormat):
    """Llama 3.x JSON tool calling: `<|python_tag|>` (or nothing, when the output starts with the object), then
    objects {"name": ..., "parameters": {...}} separated by `;`."""

    markers = ("<|python_tag|>",)

    def region_start(self, text: str, pos: int) -> int | None:
        if pos == 0 and text.startswith("{"):
            return 0
        return super().region_start(text, pos)

    def read_region(self, cursor: Cursor, names: frozenset[str], drafts: list[Draft]) -> None:
        if cursor.starts_with("<|python_tag|>"):
            cursor.pos += len("<|python_tag|>")
        read_call_object(cursor, names, drafts)
        while True:
            end = cursor.pos
            cursor.skip_space()
            if not cursor.starts_with(";"):
                return
            cursor.pos += 1
            try:
                read_call_object(cursor, names, drafts)
            except Malformed:  # the calls end at the last whole one; the rest is text (as SGLang reads them)
                drafts.pop()
                cursor.pos = end
                return


class MistralFormat(ToolCallFormat):
    """Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, or the compact
    `[TOOL_CALLS]name[ARGS]{...}` of newer templates (one call per marker)."""

    markers = ("[TOOL_CALLS]",)

    def read_region(self, cursor: Cursor, names: frozenset[str], drafts: list[Draft]) -> None:
        cursor.expect("[TOOL_CALLS]")
        cursor.skip_space()
        if cursor.starts_with("["):
            cursor.pos += 1
            while True:
                read_call_object(cursor, names, drafts)
                if not cursor.list_goes_on("]"):
                    return
        draft = Draft()
        drafts.append(draft)
        draft.name = _declared(cursor.until("[ARGS]", _NAME_CHARS), names)
        read_arguments(cursor, draft)
        draft.done = True


class DeepSeekV3Format(ToolCallFormat):
    """DeepSeek V3: `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
    {...}\\n```<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`."""

    begin, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    markers = (begin,)

    def read_region(self, cursor: Cursor, names: frozenset[str], drafts: list[Draft]) -> None:
        cursor.expect(self.begin)
        while True:
            cursor.skip_space()
            cursor.expect("<｜tool▁call▁begin｜>")
            cursor.until("<｜tool▁sep｜>", _NAME_CHARS)
            draft = Draft()
            drafts.append(draft)
            draft.name = _declared(cursor.until("\n", _NAME_CHARS), names)
            cursor.expect("```json")
            read_arguments(cursor, draft)
            cursor.skip_space()
            cursor.expect("```")
            cursor.skip_space()
            cursor.expect("<｜tool▁call▁end｜>")
            draft.done = True
            if _section_ends(cursor, self.end):
                return


class KimiK2Format(ToolCallFormat):
    """Kimi K2: `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:K
    <|tool_call_argument_begin|>{...}<|tool_call_end|>`, then `<|tool_calls_section_end|>`."""

    begin, end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    markers = (begin,)

    def read_region(self, cursor: Cursor, names: frozenset[str], drafts: list[Draft]) -> None:
        cursor.expect(self.begin)
        while True:
            cursor.skip_space()
            cursor.expect("<|tool_call_begin|>")
            draft = Draft()
            drafts.append(draft)
            ident = _KIMI_ID.fullmatch(cursor.until("<|tool_call_argument_begin|>", _KIMI_ID_CHARS))
            if ident is None:
                raise Malformed
            draft.name = _declared(ident["name"], names)
            read_arguments(cursor, draft)
            cursor.skip_space()
            cursor.expect("<|tool_call_end|>")
            draft.done = True
            if _section_ends(cursor, self.end):
                return


class JsonArrayFormat(ToolCallFormat):
    """What tool_choice `required` or a named function constrains the output to (SGLang's schema): a JSON array
    of {"name": ..., "parameters": {...}} objects, and nothing else."""

    def region_start(self, text: str, pos: int) -> int | None:
        first = len(text) - len(text.lstrip())
        return first if pos == 0 and text[first : first + 1] == "[" else None

    def read_region(self, cursor: Cursor, names: frozenset[str], drafts: list[Draft]) -> None:
        cursor.expect("[")
        while True:
            read_call_object(cursor, names, drafts, ("parameters",))
            if not cursor.list_goes_on("]"):
                return


def _section_ends(cursor: Cursor, end: str) -> bool:
    """After a call: the section's closing marker ends it, as does the end of the output (some models stop
    without it)."""
    cursor.skip_space()
    if cursor.starts_with(end):
        cursor.pos += len(end)
        return True
    if cursor.final and cursor.at_end():
        return True
    return False
