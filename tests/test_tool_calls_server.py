"""Tool calling through a real `kiln serve` and the official openai client: the tools and the conversation's
calls reach the chat template (the prompt's token count is the template's, rendered with them), and
tool_choice required comes back as tool_calls, whole and streamed, from a random-weight model constrained by
the grammar."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ServerProcess

pytestmark = pytest.mark.server

# renders the tools, and reads an earlier call's arguments as an object (`arguments.city`)
TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool.function.name }}{{ tool.function.parameters | tojson }}"
    "{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<call>{{ call.function.name }}({{ call.function.arguments.city }})</call>"
    "{% endfor %}\n{% endfor %}<|assistant|>"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
MESSAGES = [
    {"role": "user", "content": "Weather in Oslo?"},
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
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "user", "content": "And the time?"},
]


@pytest.fixture(scope="module")
def tool_server(tiny_llama, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tools")
    template = directory / "template.jinja"
    template.write_text(TEMPLATE)
    args = ["--model-path", tiny_llama, "--chat-template", str(template), "--max-total-tokens", "4096"]
    srv = ServerProcess(
        [*args, "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"], directory / "log"
    )
    try:
        srv.wait_ready(timeout=180)
        yield srv, template
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(tool_server):
    import openai

    return openai.OpenAI(base_url=tool_server[0].url + "/v1", api_key="x", timeout=120, max_retries=0)


def expected_prompt_tokens(tiny_llama: str, template: Path, tools: list[dict] | None) -> int:
    from kiln.text.tokenizer import apply_chat_template, load_tokenizer

    tokenizer = load_tokenizer(tiny_llama, chat_template=str(template))
    messages = json.loads(json.dumps(MESSAGES))
    messages[1]["content"] = ""
    messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo"}
    return len(apply_chat_template(tokenizer, messages, tools=tools))


def test_tools_and_calls_reach_the_template(client, tool_server, tiny_llama):
    _, template = tool_server
    model = client.models.list().data[0].id
    with_tools = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=1, temperature=0
    )
    without = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0)
    none = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=[WEATHER, CLOCK],
        tool_choice="none",
        max_tokens=1,
        temperature=0,
    )
    assert with_tools.usage.prompt_tokens == expected_prompt_tokens(tiny_llama, template, [WEATHER, CLOCK])
    assert without.usage.prompt_tokens == expected_prompt_tokens(tiny_llama, template, None)
    # tool_choice none renders no tools (as SGLang)
    assert none.usage.prompt_tokens == without.usage.prompt_tokens
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens


def _no_blanks(tiny_llama: str) -> dict[str, int]:
    """A logit bias banning whitespace tokens: a call's schema allows whitespace between tokens, where a random
    model could spend every token."""
    from kiln.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    return {
        str(i): -100 for i in range(len(tokenizer)) if (text := tokenizer.decode([i])) and not text.strip()
    }


def _named_call(client, tiny_llama, tools: list[dict], name: str) -> dict:
    model = client.models.list().data[0].id
    return dict(
        model=model,
        messages=MESSAGES,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": name}},
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
        logit_bias=_no_blanks(tiny_llama),
    )


def test_a_tool_without_parameters_is_called_with_none(client, tiny_llama):
    """OpenAI's tool without `parameters` takes none: the grammar closes its arguments to {} (an open object let
    the model invent some and run out of tokens)."""
    ping = {"type": "function", "function": {"name": "ping", "description": "Takes no arguments."}}
    choice = client.chat.completions.create(**_named_call(client, tiny_llama, [ping], "ping")).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "ping" and json.loads(call.function.arguments) == {}


def test_named_tool_choice_gives_tool_calls(client, tiny_llama):
    """The grammar holds the random-weight model to the call's schema (its whitespace tokens banned)."""
    body = _named_call(client, tiny_llama, [WEATHER, CLOCK], "get_time")
    response = client.chat.completions.create(**body)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}
    chunks = list(client.chat.completions.create(**body, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            assert delta.id in (None, entry["id"])  # the id comes once, with the name
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_time", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _read_stream(chunks) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


def test_a_call_cut_by_max_tokens_reads_the_same_whole_and_streamed(client, tiny_llama):
    """max_tokens ends the output inside the call: the call stands with the arguments written so far (OpenAI's
    cut call, finish_reason "length"), whole as streamed; the stream repeated the call's markup as content."""
    body = {**_named_call(client, tiny_llama, [WEATHER, CLOCK], "get_weather"), "max_tokens": 12}
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "length", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith('{"')
    whole = (choice.message.content or "", [(call.function.name, call.function.arguments)], "length")
    assert _read_stream(client.chat.completions.create(**body, stream=True)) == whole
