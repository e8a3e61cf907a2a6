"""Reasoning split from the answer, by `--reasoning-parser` (SGLang's names): the text inside the model's
think block is reasoning_content, the rest is content; the whole output at once (`split_reasoning`) or as it
streams (`ReasoningStream`), reading the output the same way so that streamed pieces add up to the whole."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.text.tool_parsers.cursor import partial_suffix
from kiln.text.tool_parsers.harmony import split_harmony


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    # reasoning from the first token even with no opening tag (DeepSeek-R1 templates open the block themselves)
    always_opens: bool = False
    # a tool call's opening tag also ends the reasoning (Qwen 3 sometimes calls a tool without closing it)
    tool_start: str | None = None
    # GPT-OSS's harmony channels (kiln/text/tool_parsers/harmony.py), read by their own rules: reasoning may
    # come back after content, and the markup is special tokens, which the chat path then keeps in the text
    harmony: bool = False


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat("<think>", "</think>", always_opens=True),
    "qwen3": ReasoningFormat("<think>", "</think>", tool_start="<tool_call>"),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷"),
    "gpt-oss": ReasoningFormat("<|channel|>analysis<|message|>", "<|end|>", harmony=True),
}
REASONING_PARSER_NAMES = tuple(REASONING_FORMATS)


def reasoning_format(name: str) -> ReasoningFormat:
    if name not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}: one of {', '.join(REASONING_PARSER_NAMES)}")
    return REASONING_FORMATS[name]


@dataclass(frozen=True)
class Split:
    reasoning: str
    content: str
    closed: bool  # the reasoning has ended: what follows is all content


def split_reasoning(fmt: ReasoningFormat, text: str, opened: bool = False, final: bool = True) -> Split:
    """Reasoning and content of `text` (the output so far; all of it when `final`). `opened`: the prompt
    itself ends by opening the think block, so the output starts inside it."""
    if fmt.harmony:
        harmony = split_harmony(text, final, opened)
        return Split(harmony.reasoning, harmony.content, not harmony.in_reasoning)
    body = text.lstrip()
    if body.startswith(fmt.start):
        while body.startswith(fmt.start):
            body = body[len(fmt.start) :]
        if not final and fmt.start.startswith(body):
            return Split("", "", False)  # the opening tag again (DeepSeek-R1 repeats it), or more reasoning
    elif not final and fmt.start.startswith(body):
        return Split("", "", False)  # the opening tag may be arriving
    elif not (opened or fmt.always_opens):
        return Split("", text, True)
    end = body.find(fmt.end)
    tool = body.find(fmt.tool_start) if fmt.tool_start is not None else -1
    if tool >= 0 and (end < 0 or tool < end):  # whichever comes first, as a stream meets them
        return Split(body[:tool], body[tool:], True)
    if end >= 0:
        return Split(body[:end], body[end + len(fmt.end) :], True)
    if final:
        return Split(body, "", False)
    tags = (fmt.end,) if fmt.tool_start is None else (fmt.end, fmt.tool_start)
    return Split(body[: len(body) - partial_suffix(body, tags)], "", False)


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """Output deltas in, reasoning and content deltas out. With `stream_reasoning` off (SGLang's field), the
    reasoning comes in one piece once it ends."""

    def __init__(self, fmt: ReasoningFormat, opened: bool = False, stream_reasoning: bool = True):
        self.format = fmt
        self.opened = opened
        self.stream_reasoning = stream_reasoning
        self.text = ""
        self.sent_reasoning = ""
        self.sent_content = ""
        self.closed = False

    def feed(self, delta: str) -> ReasoningDelta:
        if self.closed:  # once the reasoning has ended, the rest of the output is content as it comes
            return ReasoningDelta(content=delta)
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        return ReasoningDelta() if self.closed else self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        split = split_reasoning(self.format, self.text, self.opened, final)
        reasoning = ""
        if (self.stream_reasoning or split.closed or final) and split.reasoning.startswith(
            self.sent_reasoning
        ):
            reasoning = split.reasoning[len(self.sent_reasoning) :]
            self.sent_reasoning = split.reasoning
        content = ""
        if split.content.startswith(self.sent_content):
            content = split.content[len(self.sent_content) :]
            self.sent_content = split.content
        # past the reasoning the rest is content as it comes, but for harmony, which may reason again
        self.closed = split.closed and self.sent_reasoning == split.reasoning and not self.format.harmony
        return ReasoningDelta(reasoning, content)
