"""Reasoning parsers on outputs recorded in each family's format, whole and streamed in pieces of several
sizes (the pieces add up to the whole parse), and the chat glue that turns engine text into the response's
reasoning_content, content and tool_calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.sampling_params import InvalidParam, SamplingParams
from kiln.server.constraints import check_tool_parameters
from kiln.server.protocol import ChatCompletionRequest
from kiln.server.tool_calls import ChatTools, template_messages
from kiln.text.reasoning_parsers import ReasoningStream, reasoning_format, split_reasoning

pytestmark = pytest.mark.unit

R1 = "The user wants 2+2.\nThat is 4."
CALL = '<tool_call>\n{"name": "w"}'

# (parser, prompt opened the think block, output, reasoning, content)
RECORDED = [
    ("deepseek-r1", False, f"{R1}</think>\n\nThe answer is 4.", R1, "\n\nThe answer is 4."),
    ("deepseek-r1", False, "<think>Short.</think>Four.", "Short.", "Four."),
    ("deepseek-r1", False, "Cut short by max_tokens", "Cut short by max_tokens", ""),
    ("qwen3", False, "<think>\nLet me think.\n</think>\n\nParis.", "\nLet me think.\n", "\n\nParis."),
    ("qwen3", False, "Paris, without thinking.", "", "Paris, without thinking."),
    ("qwen3", True, "Opened by the template.</think>Paris.", "Opened by the template.", "Paris."),
    ("qwen3", False, f"<think>I need the weather.{CALL}", "I need the weather.", CALL),
    ("kimi", False, "◁think▷Hmm.◁/think▷Done.", "Hmm.", "Done."),
    ("kimi", False, "No thinking here.", "", "No thinking here."),
]


def stream(parser: str, opened: bool, text: str, size: int, stream_reasoning: bool = True):
    reader = ReasoningStream(reasoning_format(parser), opened, stream_reasoning)
    reasoning, content, seen = "", "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for delta in [*(reader.feed(piece) for piece in pieces), reader.finish()]:
        reasoning += delta.reasoning
        content += delta.content
        seen.append((reasoning, content))
    return reasoning, content, seen


@pytest.mark.parametrize(("parser", "opened", "text", "reasoning", "content"), RECORDED)
def test_whole_output(parser, opened, text, reasoning, content):
    split = split_reasoning(reasoning_format(parser), text, opened)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize(("parser", "opened", "text", "reasoning", "content"), RECORDED)
@pytest.mark.parametrize("size", [1, 2, 5, 10_000])
def test_streamed_pieces_add_up_to_the_whole(parser, opened, text, reasoning, content, size):
    got_reasoning, got_content, seen = stream(parser, opened, text, size)
    assert (got_reasoning, got_content) == (reasoning, content)
    for earlier_reasoning, earlier_content in seen:  # never a piece of a tag
        assert reasoning.startswith(earlier_reasoning) and content.startswith(earlier_content)


TAGS = ["<think>", "</think>", "<th", "</th", "ink>", "<tool_call>", "<tool", "◁think▷", "◁/think▷", "◁th"]


@settings(max_examples=300, deadline=None)
@given(
    parser=st.sampled_from(["deepseek-r1", "qwen3", "kimi"]),
    opened=st.booleans(),
    stream_reasoning=st.booleans(),
    pieces=st.lists(st.sampled_from([*TAGS, "a", " ", "\n", "b c"]), max_size=12),
    size=st.integers(1, 5),
)
def test_any_output_streams_to_its_whole_split(parser, opened, stream_reasoning, pieces, size):
    text = "".join(pieces)
    whole = split_reasoning(reasoning_format(parser), text, opened)
    reasoning, content, seen = stream(parser, opened, text, size, stream_reasoning)
    assert (reasoning, content) == (whole.reasoning, whole.content)
    assert all(whole.reasoning.startswith(r) and whole.content.startswith(c) for r, c in seen)


def test_stream_reasoning_off_sends_the_reasoning_in_one_piece():
    reader = ReasoningStream(reasoning_format("qwen3"), stream_reasoning=False)
    assert reader.feed("<think>a b").reasoning == ""
    assert reader.feed(" c</think>x").reasoning == "a b c"


# ------------------------------------------------------------------------------------ the chat glue
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time"}}
STRICT_TOOL = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})


def finished(tools: ChatTools, text: str, reason: str = "stop") -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
    tools.reader().rewrite_choice(choice)
    return choice


def streamed(tools: ChatTools, text: str, size: int = 3) -> tuple[list[dict], dict]:
    """The stream's choices, and the message they add up to."""
    reader, choices = tools.reader(), []
    for i in range(0, len(text), size):
        choices += reader.chunk_choices(0, text[i : i + size], False, None, None)
    choices += reader.chunk_choices(0, "", True, "stop", None)
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    for choice in choices:
        delta = choice["delta"]
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls", []):
            if "id" in call:
                message["tool_calls"].append({"id": call["id"], **call["function"]})
            else:
                message["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
    return choices, message


def test_reasoning_and_tool_calls_whole_and_streamed():
    tools = ChatTools.of(chat(tools=[WEATHER_TOOL]), "qwen25", "qwen3")
    text = '<think>Weather needed.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    choice = finished(tools, text)
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    assert message["reasoning_content"] == "Weather needed." and message["content"] is None
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    choices, whole = streamed(tools, text)
    assert whole["reasoning_content"] == "Weather needed." and whole["content"] == ""
    assert [(c["name"], c["arguments"]) for c in whole["tool_calls"]] == [("get_weather", '{"city": "Oslo"}')]
    assert choices[0]["delta"]["role"] == "assistant"
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"]
    ids = {call["id"] for c in choices for call in c["delta"].get("tool_calls", []) if "id" in call}
    assert len(ids) == 1


def test_without_parsers_the_message_is_untouched():
    tools = ChatTools.of(chat(tools=[WEATHER_TOOL]), None, None)
    assert finished(tools, "<think>x</think>y")["message"] == {
        "role": "assistant",
        "content": "<think>x</think>y",
    }
    choices, _ = streamed(tools, "abc", size=10)
    assert [c["delta"] for c in choices] == [{"role": "assistant", "content": "abc"}, {}]


def test_kimi_ids_count_the_conversation_calls():
    earlier_call = {"id": "functions.get_time:0", "function": {"name": "get_time", "arguments": "{}"}}
    earlier = {"role": "assistant", "tool_calls": [earlier_call]}
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}, earlier], "tools": [WEATHER_TOOL, CLOCK_TOOL]}
    )
    tools = ChatTools.of(request, "kimi_k2", None)
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
        '{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    [call] = finished(tools, text)["message"]["tool_calls"]
    assert call["id"] == "functions.get_weather:1"


def test_required_and_named_constrain_to_sglang_schema():
    tools = ChatTools.of(chat(tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice="required"), None, None)
    params = SamplingParams()
    assert tools.constrain(params) == "tool_choice" and not params.skip_special_tokens
    schema = json.loads(params.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [
        ["get_weather"],
        ["get_time"],
    ]
    # a tool without parameters takes none: SGLang's empty object, closed (tests/test_tool_calls_server.py)
    no_parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == no_parameters
    named = chat(
        tools=[WEATHER_TOOL, CLOCK_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    tools = ChatTools.of(named, "qwen25", None)
    params = SamplingParams()
    tools.constrain(params)
    schema = json.loads(params.json_schema)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"]["enum"] == ["get_weather"]
    assert [t["function"]["name"] for t in tools.template_kwargs(None)["tools"]] == ["get_weather"]
    # the constrained output (a JSON array) is read back into calls, whatever the model's own format
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert finished(tools, text)["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_tool_choice_none_renders_no_tools_and_parses_nothing():
    tools = ChatTools.of(chat(tools=[WEATHER_TOOL], tool_choice="none"), "qwen25", None)
    assert tools.template_kwargs({"x": 1}) == {"x": 1}
    params = SamplingParams()
    assert tools.constrain(params) == "response_format" and params.skip_special_tokens
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert finished(tools, text)["message"]["content"] == text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [CLOCK_TOOL, STRICT_TOOL]}, "tools.1.function.strict"),
    ],
)
def test_tool_choice_refusals(body, param):
    with pytest.raises(InvalidParam) as refused:
        ChatTools.of(chat(**body), "qwen25", None)
    assert refused.value.param == param


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "objec"},
        {"type": "array", "items": {}},
        {"type": ["object", "nul"]},
        {"type": "object", "required": "a"},
        {"type": "object", "properties": ["a"]},
        {"type": "object", "properties": {"a": 5}},
    ],
)
def test_tool_parameters_that_are_no_object_schema_are_refused(parameters):
    with pytest.raises(InvalidParam) as refused:
        check_tool_parameters(chat(tools=[CLOCK_TOOL, _tool(parameters)]).tools)
    assert refused.value.param == "tools.1.function.parameters"


@pytest.mark.parametrize(
    "parameters",
    [
        {"properties": {}},
        {"type": ["object", "null"]},
        # valid JSON Schema that llguidance does not enforce: a template renders it; required would refuse it
        {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
        {"type": "object", "properties": {"u": {"type": "string", "pattern": "^(?=.*a).+$"}}},
        {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
    ],
)
def test_tool_parameters_the_grammar_cannot_enforce_pass_under_auto(parameters):
    check_tool_parameters(chat(tools=[_tool(parameters)]).tools)


def test_constrained_arguments_are_an_object_when_the_schema_names_no_type():
    tools = ChatTools.of(chat(tools=[_tool({"properties": {"a": {}}})], tool_choice="required"), None, None)
    params = SamplingParams()
    tools.constrain(params)
    [item] = json.loads(params.json_schema)["items"]["anyOf"]
    assert item["properties"]["parameters"] == {"type": "object", "properties": {"a": {}}}
    tools = ChatTools.of(
        chat(tools=[_tool({"type": ["object", "null"]})], tool_choice="required"), None, None
    )
    tools.constrain(params := SamplingParams())
    assert json.loads(params.json_schema)["items"]["anyOf"][0]["properties"]["parameters"] == {
        "type": "object"
    }


def test_strict_tools_are_enforced_when_required():
    tools = ChatTools.of(chat(tools=[STRICT_TOOL], tool_choice="required"), "qwen25", None)
    params = SamplingParams()
    tools.constrain(params)
    [item] = json.loads(params.json_schema)["items"]["anyOf"]
    assert item["properties"]["parameters"] == WEATHER_TOOL["function"]["parameters"]


def test_required_with_response_format_is_refused():
    tools = ChatTools.of(chat(tools=[WEATHER_TOOL], tool_choice="required"), None, None)
    with pytest.raises(InvalidParam):
        tools.constrain(SamplingParams(json_schema="{}"))


def test_template_messages_keep_calls_with_object_arguments():
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
            ]
        }
    )
    user, assistant, tool = template_messages(request.messages)
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"}
    bad = request.model_copy(deep=True)
    bad.messages[1].tool_calls[0].function.arguments = "[1, 2]"
    with pytest.raises(InvalidParam) as refused:
        template_messages(bad.messages)
    assert refused.value.param == "messages.1.tool_calls.0.function.arguments"
