"""Tools and reasoning at /v1/chat/completions, as SGLang's serving_chat handles them: the tools and the
conversation's calls reach the chat template; tool_choice `required` or a named function constrains the output
to a JSON array of calls (SGLang's schema); the output is read back into reasoning_content, content and
tool_calls, whole or streamed (deltas in OpenAI's shape, each call with a stable index and id)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from kiln.sampling_params import InvalidParam, SamplingParams
from kiln.server.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, NamedToolChoice, Tool
from kiln.text.reasoning_parsers import ReasoningFormat, ReasoningStream, reasoning_format, split_reasoning
from kiln.text.tool_parsers import CONSTRAINED, CallDelta, ToolCallStream, parse_tool_calls

# how many prompt tokens are decoded to see whether the template itself opened the think block
_PROMPT_TAIL_TOKENS = 8


@dataclass(frozen=True)
class ChatTools:
    """What one chat request's tools and reasoning settings ask of the prompt, the sampling and the output."""

    template_tools: list[dict] | None  # what the chat template renders
    schema: dict | None  # the constraint of tool_choice required / named
    parser: str | None  # how the output is read for calls (None: it is not)
    names: frozenset[str]  # the functions a call may name
    reasoning: ReasoningFormat | None
    stream_reasoning: bool
    kimi_ids: bool  # Kimi K2 numbers its calls across the conversation (functions.NAME:K)
    history_calls: int
    # GPT-OSS's harmony markup is special tokens, which its parsers read (SGLang keeps them for gpt-oss too)
    keeps_special_tokens: bool = False

    @classmethod
    def of(cls, req: ChatCompletionRequest, tool_call_parser: str | None, reasoning_parser: str | None):
        choice = _tool_choice(req)
        tools = list(req.tools or [])
        if choice == "none":
            template_tools, parser = None, None
        elif isinstance(choice, NamedToolChoice):
            template_tools = [tool.model_dump(exclude_none=True) for tool in tools if _named(tool, choice)]
            parser = CONSTRAINED
        else:
            template_tools = [tool.model_dump(exclude_none=True) for tool in tools] or None
            parser = CONSTRAINED if choice == "required" else tool_call_parser if tools else None
        named = [tool for tool in tools if not isinstance(choice, NamedToolChoice) or _named(tool, choice)]
        splits = reasoning_parser is not None and req.separate_reasoning
        return cls(
            template_tools=template_tools,
            schema=constraint_schema(tools, choice, req.parallel_tool_calls),
            parser=parser,
            names=frozenset(tool.function.name for tool in named),
            reasoning=reasoning_format(reasoning_parser) if splits else None,
            stream_reasoning=req.stream_reasoning,
            kimi_ids=tool_call_parser == "kimi_k2",
            history_calls=sum(len(m.tool_calls or []) for m in req.messages if m.role == "assistant"),
            keeps_special_tokens=reasoning_parser is not None and reasoning_format(reasoning_parser).harmony,
        )

    def template_kwargs(self, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """The chat template's keyword arguments: the client's chat_template_kwargs and the tools."""
        merged = dict(kwargs or {})
        if self.template_tools is not None:
            merged["tools"] = self.template_tools
        return merged

    def constrain(self, params: SamplingParams) -> str:
        """Sets what the tools ask of sampling; returns the request field a refused constraint is blamed on."""
        if self.template_tools is not None or self.keeps_special_tokens:
            params.skip_special_tokens = False  # the markup of calls is often special tokens (SGLang's too)
        if self.schema is None:
            return "response_format"
        if params.json_schema is not None:
            raise InvalidParam(
                "tool_choice",
                "tool_choice required or a named function constrains the output to tool calls: "
                "it cannot be combined with response_format",
            )
        params.json_schema = json.dumps(self.schema)
        return "tool_choice"

    def reader(self, tokenizer: Any = None, prompt: list[int] | None = None) -> ChoiceReader:
        """A reader of one choice's output; the prompt tells whether the template opened the think block."""
        opened = False
        if self.reasoning is not None and tokenizer is not None and prompt:
            tail = tokenizer.decode(prompt[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
            opened = tail.rstrip().endswith(self.reasoning.start)
        return ChoiceReader(self, opened)


def _tool_choice(req: ChatCompletionRequest) -> str | NamedToolChoice:
    choice = req.tool_choice if req.tool_choice is not None else "auto" if req.tools else "none"
    if choice == "required" and not req.tools:
        raise InvalidParam("tool_choice", "tool_choice required needs tools")
    if isinstance(choice, NamedToolChoice) and not any(_named(t, choice) for t in req.tools or []):
        raise InvalidParam(
            "tool_choice", f"tool_choice names {choice.function.name!r}, which is not among the tools"
        )
    strict = [i for i, tool in enumerate(req.tools or []) if tool.function.strict]
    if choice == "auto" and strict:  # fail-closed: a guarantee Kiln cannot give is refused, never dropped
        raise InvalidParam(
            f"tools.{strict[0]}.function.strict",
            "strict tools are enforced only with tool_choice required or a named function (the grammar then "
            "holds every call to its schema); with tool_choice auto Kiln cannot: set strict to false, or "
            "choose required or a function",
        )
    return choice


def _named(tool: Tool, choice: NamedToolChoice) -> bool:
    return tool.function.name == choice.function.name


def constraint_schema(tools: list[Tool], choice: str | NamedToolChoice, parallel: bool) -> dict | None:
    """SGLang's schema for tool_choice required (any of the tools) or named (that one): an array of
    {"name", "parameters"} objects, at least one, at most one without parallel_tool_calls."""
    if isinstance(choice, NamedToolChoice):
        items = next(_call_schema(t) for t in tools if _named(t, choice))
    elif choice == "required":
        items = {"type": "object", "anyOf": [_call_schema(t) for t in tools]}
    else:
        return None
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    definitions = _shared_definitions(tools)
    if definitions:
        schema["$defs"] = definitions
    return schema


def _call_schema(tool: Tool) -> dict:
    """SGLang's, and closed: an object with only these two keys, so that every output the grammar allows is
    read back as calls (without "type", an item could be any JSON value; so could arguments whose schema names
    no type or several, and arguments are read back only as an object)."""
    parameters = {**tool.function.parameters, "type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _shared_definitions(tools: list[Tool]) -> dict:
    """The tools' $defs, hoisted to the schema's root where their "#/$defs/..." references point."""
    found: dict[str, Any] = {}
    for tool in tools:
        for name, schema in (tool.function.parameters.get("$defs") or {}).items():
            if found.setdefault(name, schema) != schema:
                raise InvalidParam(
                    "tools", f"tools define $defs {name!r} differently: give each its own name"
                )
    return found


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template reads them: every field the client sent, content as text, and the
    arguments of earlier calls as objects (templates iterate over them, as SGLang and vLLM give them)."""
    out = []
    for i, message in enumerate(messages):
        rendered = message.model_dump(exclude_none=True)
        rendered["content"] = message.text()
        if message.tool_calls:
            rendered["tool_calls"] = [
                {**call.model_dump(exclude_none=True), "function": _template_function(call.function, i, j)}
                for j, call in enumerate(message.tool_calls)
            ]
        out.append(rendered)
    return out


def _template_function(function: FunctionCall, i: int, j: int) -> dict:
    arguments = function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        raise InvalidParam(
            f"messages.{i}.tool_calls.{j}.function.arguments", "a call's arguments must be a JSON object"
        )
    return {**function.model_dump(exclude_none=True), "arguments": arguments}


class ChoiceReader:
    """Reads one choice's output: reasoning first, then calls in what is left, whole or as deltas."""

    def __init__(self, tools: ChatTools, opened: bool):
        self.tools = tools
        self.opened = opened
        self.reasoning = (
            ReasoningStream(tools.reasoning, opened, tools.stream_reasoning) if tools.reasoning else None
        )
        self.calls = ToolCallStream(tools.parser, tools.names) if tools.parser else None
        self.ids: list[str] = []
        self.sent_role = False

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.calls is not None

    def finish_reason(self, reason: str | None) -> str | None:
        """SGLang's: a generation that stopped by itself after calling tools finished with "tool_calls"."""
        return "tool_calls" if reason == "stop" and self.ids else reason

    # ------------------------------------------------------------------ the whole output
    def rewrite_choice(self, choice: dict) -> None:
        """Turns a finished choice's text (its message's content) into reasoning, content and calls."""
        if not self.active:
            return
        text, reasoning, calls = choice["message"]["content"], None, []
        if self.tools.reasoning is not None:
            split = split_reasoning(self.tools.reasoning, text, self.opened)
            reasoning, text = split.reasoning or None, split.content
        if self.tools.parser is not None:
            parsed = parse_tool_calls(self.tools.parser, text, self.tools.names)
            text = parsed.content
            calls = [self._call(index, call.name, call.arguments) for index, call in enumerate(parsed.calls)]
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if self.tools.reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        choice["message"] = message
        reason = self.finish_reason(choice["finish_reason"])
        if reason != choice["finish_reason"]:
            choice["finish_reason"], choice["matched_stop"] = reason, None

    def _call(self, index: int, name: str, arguments: str) -> dict:
        function = {"name": name, "arguments": arguments}
        return {"id": self._id(index, name), "index": index, "type": "function", "function": function}

    def _id(self, index: int, name: str) -> str:
        if index == len(self.ids):
            if self.tools.kimi_ids:
                self.ids.append(f"functions.{name}:{self.tools.history_calls + index}")
            else:
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return self.ids[index]

    # ------------------------------------------------------------------ streaming
    def deltas(self, text: str, finished: bool) -> list[dict]:
        """The OpenAI deltas for the next piece of output (`finished`: the last piece)."""
        if not self.active:
            return [{"content": text}] if text else []
        out: list[dict] = []
        if self.reasoning is not None:
            piece = self.reasoning.feed(text)
            reasoning, text = piece.reasoning, piece.content
            if finished:
                end = self.reasoning.finish()
                reasoning, text = reasoning + end.reasoning, text + end.content
            if reasoning:
                out.append({"reasoning_content": reasoning})
        if self.calls is None:
            return out + ([{"content": text}] if text else [])
        pieces = [self.calls.feed(text)] + ([self.calls.finish()] if finished else [])
        for piece in pieces:
            if piece.content:
                out.append({"content": piece.content})
            out.extend({"tool_calls": [self._call_delta(call)]} for call in piece.calls)
        return out

    def _call_delta(self, call: CallDelta) -> dict:
        if call.name is not None:
            function = {"name": call.name, "arguments": ""}
            return {
                "index": call.index,
                "id": self._id(call.index, call.name),
                "type": "function",
                "function": function,
            }
        return {"index": call.index, "function": {"arguments": call.arguments}}

    def chunk_choices(
        self, index: int, text: str, finished: bool, finish: str | None, logprobs: dict | None
    ) -> list[dict]:
        """The stream's choices for one engine output: the role first of all, the logprobs with the first
        piece, the finish reason (`finish`, once `finished`) with the last."""
        pieces = self.deltas(text, finished)
        if not self.sent_role:
            self.sent_role = True
            first = pieces[0] if pieces else {}
            pieces = [{"role": "assistant", "content": "", **first}, *pieces[1:]]
        pieces = pieces or [{}]
        choices = []
        for k, delta in enumerate(pieces):
            last = k == len(pieces) - 1
            choice = {
                "index": index,
                "delta": delta,
                "finish_reason": self.finish_reason(finish) if last else None,
                "logprobs": logprobs if k == 0 else None,
            }
            if delta or (last and finished) or (k == 0 and logprobs and logprobs.get("content")):
                choices.append(choice)
        return choices
