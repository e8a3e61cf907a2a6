"""Tool calls read from model output, by `--tool-call-parser` (SGLang's names for the families Kiln loads):
the whole output at once (`parse_tool_calls`), or as it streams (`ToolCallStream`, whose deltas add up to the
same calls and content). Arguments are the JSON text the model wrote."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kiln.text.tool_parsers.formats import (
    DeepSeekV3Format,
    HermesFormat,
    JsonArrayFormat,
    KimiK2Format,
    Llama3Format,
    MistralFormat,
    ToolCallFormat,
)
from kiln.text.tool_parsers.harmony import GptOssFormat
from kiln.text.tool_parsers.scan import CallDraft, Checkpoint, scan

FORMATS: dict[str, type[ToolCallFormat]] = {
    "llama3": Llama3Format,
    "qwen25": HermesFormat,
    "qwen": HermesFormat,
    "hermes": HermesFormat,
    "mistral": MistralFormat,
    "deepseekv3": DeepSeekV3Format,
    "kimi_k2": KimiK2Format,
    "gpt-oss": GptOssFormat,
}
PARSER_NAMES = tuple(FORMATS)
# what tool_choice `required` or a named function constrains the output to, whatever the model's family
CONSTRAINED = "json_array"


def tool_call_format(name: str) -> ToolCallFormat:
    if name == CONSTRAINED:
        return JsonArrayFormat()
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}: one of {', '.join(PARSER_NAMES)}")
    return FORMATS[name]()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class CallDelta:
    """A piece of call `index`: its name (first, with no arguments), or a further piece of its arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""
    calls: tuple[CallDelta, ...] = ()


def parse_tool_calls(parser: str, text: str, tools: Iterable[str]) -> ParsedOutput:
    """The whole output's content and calls; `tools` are the names the request declares."""
    fmt = tool_call_format(parser)
    read = scan(fmt, fmt.visible(text, final=True), frozenset(tools), final=True)
    return ParsedOutput(read.content, tuple(ToolCall(c.name or "", c.arguments) for c in read.calls))


class ToolCallStream:
    """Turns output deltas into content and call deltas: a call's name once it is whole, then its arguments as
    they arrive. Content sent is never taken back; markup still arriving is held back."""

    def __init__(self, parser: str, tools: Iterable[str]):
        self.format = tool_call_format(parser)
        self.names = frozenset(tools)
        self.text = ""
        self.checkpoint = Checkpoint()
        self.sent_content = ""
        self.sent_names: list[str] = []  # per call whose name was sent
        self.sent_arguments: list[str] = []

    @property
    def calls_sent(self) -> int:
        return len(self.sent_arguments)

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        """At the end of the output: what it parses to that was not sent yet."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> StreamDelta:
        text = self.format.visible(self.text, final)
        read = scan(self.format, text, self.names, final, self.checkpoint)
        self.checkpoint = read.checkpoint
        content = ""
        if read.content.startswith(self.sent_content):
            content = read.content[len(self.sent_content) :]
            self.sent_content = read.content
        return StreamDelta(content, tuple(self._call_deltas(read.calls)))

    def _call_deltas(self, calls: tuple[CallDraft, ...]) -> list[CallDelta]:
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self.sent_arguments):
                if call.name is None:
                    break
                self.sent_names.append(call.name)
                self.sent_arguments.append("")
                deltas.append(CallDelta(index, name=call.name))
            if call.name != self.sent_names[index]:  # a region read otherwise once it ended: never retracted
                break
            sent = self.sent_arguments[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                deltas.append(CallDelta(index, arguments=call.arguments[len(sent) :]))
                self.sent_arguments[index] = call.arguments
        return deltas
