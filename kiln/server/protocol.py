"""OpenAI-compatible and native request bodies (pydantic). Unknown parameters are refused, never ignored; known
ones that cannot change the output (user, metadata, ...) are accepted and ignored."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from kiln.sampling_params import InvalidParam, SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus SGLang's extras)."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    # OpenAI's fields that do not change what is generated: accepted and ignored
    user: str | None = None
    metadata: dict[str, str] | None = None
    # store: true asks the provider to keep the completion for its dashboard; Kiln keeps nothing, whatever it says
    store: bool | None = None
    service_tier: str | None = None  # Kiln has one tier
    prompt_cache_key: str | None = None  # the radix cache reuses any shared prefix without a routing hint
    safety_identifier: str | None = None
    # extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    include_stop_str_in_output: bool = False  # vLLM's name for no_stop_trim
    rid: str | None = None
    lora_path: str | list[str | None] | None = None  # SGLang's; refused unless null (sglang_fields)
    # SGLang's router (sglang-router) sends its own defaults for SGLang fields Kiln does not implement: they are
    # accepted at those values only, and refused at any other
    return_hidden_states: Literal[False] = False

    def param_names(self) -> dict[str, str]:
        """SamplingParams' names (and the shared checks' "max_tokens") of the fields this body sends under
        another name: a refusal must name the field the client sent, in its message too."""
        return {
            "min_new_tokens": "min_tokens",
            "max_new_tokens": "max_tokens",
            "top_logprobs_num": "logprobs",
        }

    @contextmanager
    def own_names(self) -> Iterator[None]:
        """An InvalidParam raised inside, in SamplingParams' names, is raised again in this body's names."""
        try:
            yield
        except InvalidParam as e:
            names = self.param_names()
            words = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
            message = words.sub(lambda m: names[m.group()], str(e))
            raise InvalidParam(names.get(e.param, e.param), message) from None

    def sampling_params(
        self,
        max_new_tokens: int,
        logprobs: bool,
        top_logprobs: int,
        defaults: Mapping[str, float] | None = None,
    ) -> SamplingParams:
        """`defaults` (--sampling-defaults model) fill the fields this body left out: pydantic's
        model_fields_set tells a field sent at its default from one not sent."""
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise InvalidParam(
                    "logit_bias", "logit_bias keys must be token ids (integers as strings)"
                ) from None
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim or self.include_stop_str_in_output,
            seed=self.seed,
            n=self.n,
            logprobs=logprobs,
            top_logprobs_num=top_logprobs,
            logit_bias=bias,
        )
        return params.fill_unset(defaults or {}, self.model_fields_set).normalize()


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None  # refused unless null (fill-in-the-middle is not supported)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """An assistant message's call as the client sends it back: arguments a JSON object's text (or the object)."""

    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


_INPUT_KINDS = {"image_url": "image input", "input_audio": "audio input", "file": "file input"}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """A part that is not text (an image, audio, a file) is refused as such, not as "not a string"."""
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise PydanticCustomError(
                    "unsupported_content",
                    "{what} is not supported: Kiln serves text-only models, send text content parts only",
                    {"what": _INPUT_KINDS.get(kind, f"{kind!r} content")},
                )
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class JsonSchemaFormat(_Strict):
    """response_format's json_schema: OpenAI's fields; the schema is enforced whatever `strict` says."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    # a JSON schema; none given is OpenAI's empty parameter list: an empty object, closed (an open one would let a
    # constrained call invent arguments), and one the chat template can render
    parameters: dict[str, Any] = Field(default_factory=lambda: dict(NO_PARAMETERS))
    strict: bool | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _none_is_no_parameters(cls, value: Any) -> Any:
        return dict(NO_PARAMETERS) if value is None else value


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    # None: "auto" with tools, "none" without (OpenAI's default)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # SGLang's: with a reasoning parser, whether reasoning_content is split out, and streamed as it comes
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # SGLang's and vLLM's: the model continues the last (assistant) message instead of starting a new one
    continue_final_message: bool = False

    def param_names(self) -> dict[str, str]:
        # the token limit is max_completion_tokens where the client sent that (it wins over max_tokens)
        limit = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return {
            **super().param_names(),
            "max_new_tokens": limit,
            "max_tokens": limit,
            "top_logprobs_num": "top_logprobs",
        }


class NativeSamplingParams(_Strict):
    """/generate's sampling_params, typed (SGLang's names and defaults)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    logit_bias: dict[int, float] | None = None
    # SGLang's: sampling_seed is its name for seed; the others are refused unless at their defaults
    sampling_seed: int | None = None
    stop_regex: str | list[str] | None = None
    spaces_between_special_tokens: bool = True
    stream_interval: int | None = None
    custom_params: dict[str, Any] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


# NativeSamplingParams' fields that SamplingParams does not take (sampling_seed is read as seed)
NATIVE_ONLY_SAMPLING_FIELDS = {
    "sampling_seed",
    "stop_regex",
    "spaces_between_special_tokens",
    "stream_interval",
    "custom_params",
}


class GenerateRequest(_Strict):
    """The native /generate body (SGLang's shape)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    logprob_start_len: int | list[int] | None = None  # -1 (None): the output's logprobs only
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    # SGLang's GenerateReqInput fields Kiln takes only at their defaults (kiln.server.sglang_fields says why)
    token_ids_logprob: list[int] | list[list[int]] | None = None
    lora_path: str | list[str | None] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    modalities: list[str] | None = None
    input_embeds: Any = None
    session_id: str | None = None
    session_params: dict[str, Any] | None = None
    return_routed_experts: bool = False
    return_prompt_token_ids: bool = False
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    priority: int | None = None
    extra_key: str | list[str] | None = None
    custom_labels: dict[str, str] | None = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    require_reasoning: bool = False
    max_thinking_tokens: int | None = None
    # the router's defaults (see _SamplingFields); `model` names what the router routed on
    model: str | None = None
    return_hidden_states: Literal[False] = False
    return_bytes: Literal[False] = False
    return_entropy: Literal[False] = False
    background: Literal[False] = False
    log_metrics: Literal[True] = True
    no_logs: Literal[False] = False

    def params(self, defaults: Mapping[str, float] | None = None) -> SamplingParams:
        """`defaults` (--sampling-defaults model) fill the sampling_params fields the body left out."""
        sp = self.sampling_params.model_dump(exclude=NATIVE_ONLY_SAMPLING_FIELDS)
        if sp["seed"] is None:
            sp["seed"] = self.sampling_params.sampling_seed
        sp["stop"] = sp["stop"] or []
        sp["stop_token_ids"] = sp["stop_token_ids"] or []
        return (
            SamplingParams(**sp, logprobs=self.return_logprob, top_logprobs_num=self.top_logprobs_num)
            .fill_unset(defaults or {}, self.sampling_params.model_fields_set)
            .normalize()
        )


class AbortRequest(BaseModel):
    """/abort_request's body (SGLang's): one request by its id, or all of them; other fields are ignored."""

    rid: str | None = None
    abort_all: bool = False


def error_body(
    message: str,
    param: str | None = None,
    type_: str = "invalid_request_error",
    code: str | int | None = None,
) -> dict:
    return {
        "error": {"message": message, "type": type_, "param": param, "code": code},
        "object": "error",
        "message": message,
    }
