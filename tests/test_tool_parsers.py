"""Tool-call parsers on outputs recorded in each family's format: single and parallel calls, text before them,
malformed or undeclared calls left as text; streamed deltas (the output fed in pieces of several sizes) add up
to the whole output's parse, and content streamed never holds a piece of markup."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.config import ServerArgs
from kiln.text.reasoning_parsers import REASONING_PARSER_NAMES
from kiln.text.tool_parsers import CONSTRAINED, PARSER_NAMES, ToolCall, ToolCallStream, parse_tool_calls

pytestmark = pytest.mark.unit

TOOLS = ("get_weather", "search")
PARIS = '{"city": "Paris", "days": [1, 2], "metric": true}'
QUERY = '{"q": "kiln \\"ovens\\"", "limit": -1.5e2}'
WEATHER, SEARCH = ToolCall("get_weather", PARIS), ToolCall("search", QUERY)


def qwen(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def deepseek(calls: list[tuple[str, str]]) -> str:
    body = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
        for name, args in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def kimi(calls: list[tuple[str, str]]) -> str:
    body = "".join(
        f"<|tool_call_begin|>functions.{name}:{k}<|tool_call_argument_begin|>{args}<|tool_call_end|>"
        for k, (name, args) in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def call_object(name: str, args: str, key: str = "arguments") -> str:
    return f'{{"name": "{name}", "{key}": {args}}}'


BOTH = [WEATHER, SEARCH]
TWO_QWEN = f"{qwen('get_weather', PARIS)}\n{qwen('search', QUERY)}"
TWO_LLAMA = f"{call_object('get_weather', PARIS, 'parameters')}; {call_object('search', QUERY, 'parameters')}"
MISTRAL_ARRAY = f'[{call_object("get_weather", PARIS)}, {{"arguments": {QUERY}, "name": "search"}}]'
JSON_ARRAY = (
    f"[{call_object('get_weather', PARIS, 'parameters')}, {call_object('search', QUERY, 'parameters')}]"
)
TWO_CALLS = [("get_weather", PARIS), ("search", QUERY)]

# (parser, output, content, calls)
RECORDED = [
    ("qwen25", qwen("get_weather", PARIS), "", [WEATHER]),
    ("qwen", f"Let me look.\n\n{TWO_QWEN}", "Let me look.", BOTH),
    ("hermes", f"{qwen('search', QUERY)}\nDone.", "Done.", [SEARCH]),
    ("llama3", call_object("get_weather", PARIS, "parameters"), "", [WEATHER]),
    ("llama3", f"Sure. <|python_tag|>{TWO_LLAMA}", "Sure.", BOTH),
    (
        "llama3",
        f"{call_object('search', QUERY, 'parameters')}; and that is all",
        "; and that is all",
        [SEARCH],
    ),
    ("llama3", f'{{"type": "function", "name": "search", "parameters": {QUERY}}}', "", [SEARCH]),
    ("mistral", f"[TOOL_CALLS] [{call_object('get_weather', PARIS)}]", "", [WEATHER]),
    ("mistral", f"Checking. [TOOL_CALLS] {MISTRAL_ARRAY}", "Checking.", BOTH),
    ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{PARIS}[TOOL_CALLS]search[ARGS]{QUERY}", "", BOTH),
    ("deepseekv3", deepseek([("get_weather", PARIS)]), "", [WEATHER]),
    ("deepseekv3", "Two calls:\n" + deepseek(TWO_CALLS), "Two calls:", BOTH),
    ("kimi_k2", kimi([("get_weather", PARIS)]), "", [WEATHER]),
    ("kimi_k2", "Looking it up." + kimi(TWO_CALLS), "Looking it up.", BOTH),
    (CONSTRAINED, JSON_ARRAY, "", BOTH),
    ("qwen25", "No tools needed: the answer is 4.", "No tools needed: the answer is 4.", []),
    ("llama3", "I can't call < tools > today.", "I can't call < tools > today.", []),
]

# outputs that are no call: they stay content, exactly as written
MALFORMED = [
    # a brace short
    ("qwen25", 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'),
    # not a declared tool
    ("qwen25", qwen("unknown_tool", "{}")),
    # arguments not an object
    ("qwen25", qwen("search", '"q=1"')),
    # cut short by the end of the output before the call's name was whole
    ("qwen25", '<tool_call>\n{"name": "sea'),
    # JSON, but no call
    ("llama3", '{"answer": 42}'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": Paris}}]'),
    ("deepseekv3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\nnot json"),
    ("kimi_k2", kimi([("search", "{}")]).replace(":0", "")),
    (CONSTRAINED, '[{"name": "get_wea'),
]

# outputs that max_tokens cut inside a call whose name was whole: the call stands with the arguments so far, as
# OpenAI's API gives a cut call (and as they streamed)
CUT_SHORT = [
    (
        "qwen25",
        'Hi <tool_call>\n{"name": "search", "arguments": {"q": 1}}',
        "Hi",
        [ToolCall("search", '{"q": 1}')],
    ),
    (
        "qwen25",
        '<tool_call>\n{"name": "search", "arguments": {"q": "ki',
        "",
        [ToolCall("search", '{"q": "ki')],
    ),
    (
        CONSTRAINED,
        '[{"name": "get_weather", "parameters": {"city": "Par',
        "",
        [ToolCall("get_weather", '{"city": "Par')],
    ),
    (CONSTRAINED, '[{"name": "get_weather", "parameters"', "", [ToolCall("get_weather", "")]),
    (CONSTRAINED, f'[{call_object("search", QUERY, "parameters")}, {{"name": "get_w', "", [SEARCH]),
    (
        "llama3",
        'Sure. <|python_tag|>{"name": "search", "parameters": {"q',
        "Sure.",
        [ToolCall("search", '{"q')],
    ),
]


def stream(parser: str, text: str, size: int) -> tuple[str, list[ToolCall], list[str]]:
    """Feeds `text` in pieces of `size` characters; returns the content, the calls and the content seen after
    each piece."""
    reader = ToolCallStream(parser, TOOLS)
    content, names, arguments, seen = "", [], [], []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for delta in [*(reader.feed(piece) for piece in pieces), reader.finish()]:
        content += delta.content
        seen.append(content)
        for call in delta.calls:
            if call.name is not None:
                assert call.index == len(names) and not call.arguments  # the name first, indices in order
                names.append(call.name)
                arguments.append("")
            arguments[call.index] += call.arguments
    return content, [ToolCall(n, a) for n, a in zip(names, arguments)], seen


@pytest.mark.parametrize(("parser", "text", "content", "calls"), RECORDED)
def test_whole_output(parser, text, content, calls):
    parsed = parse_tool_calls(parser, text, TOOLS)
    assert parsed.content == content
    assert list(parsed.calls) == calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), RECORDED)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 10_000])
def test_streamed_deltas_add_up_to_the_whole(parser, text, content, calls, size):
    got_content, got_calls, seen = stream(parser, text, size)
    assert (got_content, got_calls) == (content, calls)
    for earlier in seen:  # content sent is never taken back, so no piece of markup was ever in it
        assert content.startswith(earlier)


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_stays_text(parser, text):
    parsed = parse_tool_calls(parser, text, TOOLS)
    assert parsed.calls == ()
    assert parsed.content == text


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_streamed_ends_as_text(parser, text):
    content, calls, _ = stream(parser, text, 3)
    if not calls:  # a call whose name streamed before its markup broke cannot be taken back (as in SGLang)
        assert content == text


CUT_SHORT.append(
    (
        "llama3",
        f'Sure. <|python_tag|>{call_object("get_weather", PARIS, "parameters")}; {{"name": "search", "parameters": {{"q"',
        "Sure.",
        [WEATHER, ToolCall("search", '{"q"')],
    )
)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CUT_SHORT)
@pytest.mark.parametrize("size", [1, 3, 10_000])
def test_a_call_cut_short_stands_whole_and_streamed(parser, text, content, calls, size):
    parsed = parse_tool_calls(parser, text, TOOLS)
    assert (parsed.content, list(parsed.calls)) == (content, calls)
    assert stream(parser, text, size)[:2] == (content, calls)


@pytest.mark.parametrize(("parser", "text"), [(parser, text) for parser, text, _, _ in RECORDED])
def test_every_cut_of_an_output_reads_the_same_whole_and_streamed(parser, text):
    """max_tokens may end an output anywhere: each prefix parses whole to what its stream adds up to."""
    for end in range(len(text) + 1):
        parsed = parse_tool_calls(parser, text[:end], TOOLS)
        assert stream(parser, text[:end], 3)[:2] == (parsed.content, list(parsed.calls)), text[:end]


def test_partial_marker_is_held_back_until_it_resolves():
    reader = ToolCallStream("qwen25", TOOLS)
    assert reader.feed("Hello <tool_c").content == "Hello"
    assert reader.feed("ar> is a tag").content == " <tool_car> is a tag"


def test_arguments_stream_before_the_call_ends():
    reader = ToolCallStream("qwen25", TOOLS)
    first = reader.feed('<tool_call>\n{"name": "search", "arguments": {"q": "ki')
    assert [(c.index, c.name) for c in first.calls] == [(0, "search"), (0, None)]
    assert first.calls[1].arguments == '{"q": "ki'
    assert reader.feed('ln"}}\n</tool_call>').calls[0].arguments == 'ln"}'


def test_server_flag_choices_are_the_parsers():
    choices = {
        f.name: f.metadata["choices"] for f in dataclasses.fields(ServerArgs) if f.name.endswith("_parser")
    }
    assert tuple(choices["tool_call_parser"]) == PARSER_NAMES
    assert tuple(choices["reasoning_parser"]) == REASONING_PARSER_NAMES


MARKUP = ["<tool_call>", "</tool_call>", "<tool", "_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"]
MARKUP += ["<｜tool▁calls▁begin｜>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>"]
JSON_PIECES = [*'\n {}[],:;"x1', '"name"', '"search"', '"arguments"', '"parameters"']
WHOLE_CALLS = [qwen("search", QUERY), call_object("search", QUERY, "parameters"), JSON_ARRAY]
WHOLE_CALLS += [f"[TOOL_CALLS] {MISTRAL_ARRAY}", deepseek(TWO_CALLS), kimi(TWO_CALLS)]
PIECES = [*MARKUP, *JSON_PIECES, *WHOLE_CALLS]


@settings(max_examples=300, deadline=None)
@given(
    parser=st.sampled_from([*PARSER_NAMES, CONSTRAINED]),
    pieces=st.lists(st.sampled_from(PIECES), max_size=40),
    size=st.integers(1, 6),
)
def test_any_output_streams_to_its_whole_parse(parser, pieces, size):
    """Whatever the model writes, streaming never fails, and where no call's name went out before its markup
    broke, the stream adds up to the whole output's parse."""
    text = "".join(pieces)
    parsed = parse_tool_calls(parser, text, TOOLS)
    content, calls, _ = stream(parser, text, size)
    if not calls or calls == list(parsed.calls):
        assert (content, calls) == (parsed.content, list(parsed.calls))
