"""GPT-OSS's harmony format (`--reasoning-parser gpt-oss`, `--tool-call-parser gpt-oss`): outputs written in
the format are split into reasoning_content, content and tool_calls whole, streamed one character at a time, in
two pieces at every character boundary, and cut short anywhere (max_tokens, or the EOS token <|return|> /
<|call|> left out of the text); streamed pieces add up to the whole reading and never take back what they sent.
The chat path keeps the special tokens the markup is made of."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.config import ServerArgs
from kiln.sampling_params import SamplingParams
from kiln.server.protocol import ChatCompletionRequest
from kiln.server.tool_calls import ChatTools
from kiln.text.reasoning_parsers import ReasoningStream, reasoning_format, split_reasoning
from kiln.text.tool_parsers import ToolCall, ToolCallStream, parse_tool_calls

pytestmark = pytest.mark.unit

TOOLS = ("get_weather", "search")
THINK = "The user wants the weather in SF.\nCall the tool."
ANSWER = "It is sunny in SF."
SF, QUERY = '{"location": "SF"}', '{"q": "harmony <format>", "n": [1, 2.5e3]}'


def analysis(text: str) -> str:
    return f"<|channel|>analysis<|message|>{text}<|end|>"


def final(text: str, end: str = "<|return|>") -> str:
    return f"<|start|>assistant<|channel|>final<|message|>{text}{end}"


def call(name: str, args: str, end: str = "<|call|>") -> str:
    return (
        f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}{end}"
    )


PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
ROLE_RECIPIENT = f"<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{QUERY}<|call|>"
CUT_CALL = call("get_weather", SF, end="")[: -len('F"}')]

# (output, prompt opened the analysis, reasoning, content after the reasoning parser, content after both, calls)
RECORDED = [
    # analysis + final
    (analysis(THINK) + final(ANSWER), False, THINK, ANSWER, ANSWER, []),
    (analysis(THINK) + "<|channel|>final<|message|>Four.<|return|>", False, THINK, "Four.", "Four.", []),
    # analysis + a tool call: the call stays markup for the tool-call parser, as SGLang passes it on
    (
        analysis(THINK) + call("get_weather", SF),
        False,
        THINK,
        call("get_weather", SF),
        "",
        [ToolCall("get_weather", SF)],
    ),
    # two tool calls
    (
        analysis(THINK) + call("get_weather", SF) + call("search", QUERY),
        False,
        THINK,
        call("get_weather", SF) + call("search", QUERY),
        "",
        [ToolCall("get_weather", SF), ToolCall("search", QUERY)],
    ),
    # a preamble on the commentary channel is content; the recipient may sit in the role's header
    (
        analysis(THINK) + PREAMBLE + ROLE_RECIPIENT,
        False,
        THINK,
        "Checking." + ROLE_RECIPIENT,
        "Checking.",
        [ToolCall("search", QUERY)],
    ),
    # plain final only, and text with no harmony markup at all: left alone
    ("<|channel|>final<|message|>Paris.<|return|>", False, "", "Paris.", "Paris.", []),
    ("Just text, <no> channels.", False, "", "Just text, <no> channels.", "Just text, <no> channels.", []),
    # truncated: no <|return|> (EOS left out of the text, or max_tokens), in the final or the analysis
    (analysis(THINK) + final("It is sun", end=""), False, THINK, "It is sun", "It is sun", []),
    ("<|channel|>analysis<|message|>The user wan", False, "The user wan", "", "", []),
    # a call without its <|call|> (the EOS token), and one cut inside its arguments: the arguments so far
    (
        analysis(THINK) + call("get_weather", SF, end=""),
        False,
        THINK,
        call("get_weather", SF, end=""),
        "",
        [ToolCall("get_weather", SF)],
    ),
    (CUT_CALL, False, "", CUT_CALL, "", [ToolCall("get_weather", '{"location": "S')]),
    # a message without its terminator ends where the next one opens (SGLang's implicit close)
    ("<|channel|>analysis<|message|>Hmm.<|channel|>final<|message|>Yes.", False, "Hmm.", "Yes.", "Yes.", []),
    (
        call("get_weather", SF, end="") + call("search", QUERY),
        False,
        "",
        call("get_weather", SF, end="") + call("search", QUERY),
        "",
        [ToolCall("get_weather", SF), ToolCall("search", QUERY)],
    ),
    # the prompt ended inside the analysis message
    (THINK + "<|end|>" + final(ANSWER), True, THINK, ANSWER, ANSWER, []),
]
GPT_OSS = reasoning_format("gpt-oss")


def stream_reasoning(pieces: list[str], opened: bool, stream: bool = True) -> tuple[str, str, list]:
    reader = ReasoningStream(GPT_OSS, opened, stream)
    reasoning, content, seen = "", "", []
    for delta in [*(reader.feed(piece) for piece in pieces), reader.finish()]:
        reasoning, content = reasoning + delta.reasoning, content + delta.content
        seen.append((reasoning, content))
    return reasoning, content, seen


def stream_calls(pieces: list[str]) -> tuple[str, list[ToolCall], list[str]]:
    reader = ToolCallStream("gpt-oss", TOOLS)
    content, names, arguments, seen = "", [], [], []
    for delta in [*(reader.feed(piece) for piece in pieces), reader.finish()]:
        content += delta.content
        seen.append(content)
        for piece in delta.calls:
            if piece.name is not None:
                assert piece.index == len(names) and not piece.arguments
                names.append(piece.name)
                arguments.append("")
            arguments[piece.index] += piece.arguments
    return content, [ToolCall(n, a) for n, a in zip(names, arguments)], seen


def splits(text: str) -> list[list[str]]:
    """One character at a time, and two pieces at every character boundary."""
    return [list(text), *([text[:i], text[i:]] for i in range(len(text) + 1))]


@pytest.mark.parametrize(("text", "opened", "reasoning", "content", "after_both", "calls"), RECORDED)
def test_reasoning_whole_and_streamed(text, opened, reasoning, content, after_both, calls):
    split = split_reasoning(GPT_OSS, text, opened)
    assert (split.reasoning, split.content) == (reasoning, content)
    for pieces in splits(text):
        got_reasoning, got_content, seen = stream_reasoning(pieces, opened)
        assert (got_reasoning, got_content) == (reasoning, content), pieces
        # never a piece of a marker: nothing sent is taken back
        assert all(reasoning.startswith(r) and content.startswith(c) for r, c in seen)


@pytest.mark.parametrize(("text", "opened", "reasoning", "content", "after_both", "calls"), RECORDED)
def test_tool_calls_whole_and_streamed(text, opened, reasoning, content, after_both, calls):
    # after the reasoning parser, and alone on the whole output (the reasoning dropped, as SGLang's detector;
    # an output whose prompt opened the analysis needs the reasoning parser to say so)
    for source in (content,) if opened else (content, text):
        parsed = parse_tool_calls("gpt-oss", source, TOOLS)
        assert (parsed.content, list(parsed.calls)) == (after_both, calls)
        for pieces in splits(source):
            got_content, got_calls, seen = stream_calls(pieces)
            assert (got_content, got_calls) == (after_both, calls), pieces
            assert all(after_both.startswith(earlier) for earlier in seen)


@pytest.mark.parametrize("text", [text for text, opened, *_ in RECORDED if not opened])
def test_every_cut_reads_the_same_whole_and_streamed(text):
    """max_tokens may end an output anywhere: each prefix streams to what it parses to whole."""
    for end in range(len(text) + 1):
        cut = text[:end]
        split = split_reasoning(GPT_OSS, cut)
        assert stream_reasoning([cut[i : i + 3] for i in range(0, end, 3)], False)[:2] == (
            split.reasoning,
            split.content,
        )
        parsed = parse_tool_calls("gpt-oss", cut, TOOLS)
        assert stream_calls([cut[i : i + 3] for i in range(0, end, 3)])[:2] == (
            parsed.content,
            list(parsed.calls),
        )


def test_a_call_to_an_undeclared_function_stays_text():
    text = call("delete_everything", "{}")
    assert parse_tool_calls("gpt-oss", text, TOOLS) == parse_tool_calls("gpt-oss", text, ()) and not (
        parse_tool_calls("gpt-oss", text, TOOLS).calls
    )
    assert parse_tool_calls("gpt-oss", text, TOOLS).content == text


def test_reasoning_streams_before_its_end_and_comes_back_after_content():
    reader = ReasoningStream(GPT_OSS)
    assert reader.feed("<|channel|>analysis<|mess").reasoning == ""
    assert reader.feed("age|>Let me th").reasoning == "Let me th"
    assert reader.feed("ink.<|e").reasoning == "ink."
    piece = reader.feed("nd|><|start|>assistant<|channel|>commentary<|message|>One moment.<|end|>")
    assert (piece.reasoning, piece.content) == ("", "One moment.")
    assert reader.feed("<|channel|>analysis<|message|>More.<|end|>").reasoning == "More."


def test_stream_reasoning_off_sends_each_analysis_whole():
    pieces = list(analysis("a b") + final("c"))
    reasoning, content, seen = stream_reasoning(pieces, False, stream=False)
    assert (reasoning, content) == ("a b", "c")
    assert {r for r, _ in seen} == {"", "a b"}


# ------------------------------------------------------------------------------------ the chat glue
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})


def test_chat_reads_reasoning_content_and_calls_whole_and_streamed():
    tools = ChatTools.of(chat(tools=[WEATHER_TOOL]), "gpt-oss", "gpt-oss")
    text = analysis(THINK) + PREAMBLE + call("get_weather", SF)
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    tools.reader().rewrite_choice(choice)
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert (message["reasoning_content"], message["content"]) == (THINK, "Checking.")
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": SF}]
    for size in (1, 4):
        reader, deltas = tools.reader(), []
        for i in range(0, len(text), size):
            deltas += reader.deltas(text[i : i + size], False)
        deltas += reader.deltas("", True)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == THINK
        assert "".join(d.get("content", "") for d in deltas) == "Checking."
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "get_weather"
        assert "".join(c["function"]["arguments"] for c in calls) == SF


@pytest.mark.parametrize(
    ("tools", "reasoning", "kept"),
    [([], "gpt-oss", True), ([WEATHER_TOOL], None, True), ([], "qwen3", False), ([], None, False)],
)
def test_the_chat_path_keeps_the_special_tokens_harmony_is_made_of(tools, reasoning, kept):
    params = SamplingParams()
    ChatTools.of(chat(tools=tools or None), "gpt-oss", reasoning).constrain(params)
    assert params.skip_special_tokens is not kept


def test_the_server_flags_take_gpt_oss():
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli(
        parser.parse_args(["--reasoning-parser", "gpt-oss", "--tool-call-parser", "gpt-oss"])
    )
    assert (args.reasoning_parser, args.tool_call_parser) == ("gpt-oss", "gpt-oss")


# ------------------------------------------------------------------------------------ any output
MARKUP = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"]
MARKUP += [
    "<|",
    "<|st",
    "|>",
    "<|channel|>analysis<|message|>",
    "<|start|>assistant<|channel|>final<|message|>",
]
WORDS = [
    "assistant",
    "analysis",
    "final",
    "commentary",
    " to=functions.search ",
    " to=functions.nope",
    "json",
]
WORDS += ["functions.search to=assistant", "a", " ", "\n", "{", "}", '"q"', ":", QUERY, call("search", QUERY)]


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(MARKUP + WORDS), max_size=24),
    opened=st.booleans(),
    stream=st.booleans(),
    size=st.integers(1, 6),
)
def test_any_output_streams_to_its_whole_reading(pieces, opened, stream, size):
    text = "".join(pieces)
    chunks = [text[i : i + size] for i in range(0, len(text), size)]
    whole = split_reasoning(GPT_OSS, text, opened)
    reasoning, content, seen = stream_reasoning(chunks, opened, stream)
    assert (reasoning, content) == (whole.reasoning, whole.content)
    assert all(whole.reasoning.startswith(r) and whole.content.startswith(c) for r, c in seen)
    parsed = parse_tool_calls("gpt-oss", text, TOOLS)
    content, calls, _ = stream_calls(chunks)
    if not calls or calls == list(parsed.calls):  # a name sent before its markup broke is not taken back
        assert (content, calls) == (parsed.content, list(parsed.calls))
