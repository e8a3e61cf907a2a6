"""OpenAI-compatible and native request bodies (pydantic). Unknown parameters are refused, never ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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
    user: str | None = None
    # extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | None = None
    # SGLang's router (sglang-router) sends its own defaults for SGLang fields Kiln does not implement: they are
    # accepted at those values only, and refused at any other
    return_hidden_states: Literal[False] = False

    def sampling_params(self, max_new_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise InvalidParam(
                    "logit_bias", "logit_bias keys must be token ids (integers as strings)"
                ) from None
        return SamplingParams(
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
            no_stop_trim=self.no_stop_trim,
            seed=self.seed,
            n=self.n,
            logprobs=logprobs,
            top_logprobs_num=top_logprobs,
            logit_bias=bias,
        ).normalize()


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False
    best_of: int | None = None
    suffix: None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # the router's defaults (see _SamplingFields); with no reasoning parser, SGLang ignores the reasoning ones too
    continue_final_message: Literal[False] = False
    separate_reasoning: Literal[True] = True
    stream_reasoning: Literal[True] = True


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


class GenerateRequest(_Strict):
    """The native /generate body (SGLang's shape)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    rid: str | list[str] | None = None
    # the router's defaults (see _SamplingFields); `model` names what the router routed on
    model: str | None = None
    return_text_in_logprobs: Literal[False] = False
    return_hidden_states: Literal[False] = False
    return_bytes: Literal[False] = False
    return_entropy: Literal[False] = False
    background: Literal[False] = False
    log_metrics: Literal[True] = True
    no_logs: Literal[False] = False

    def params(self) -> SamplingParams:
        sp = self.sampling_params.model_dump()
        sp["stop"] = sp["stop"] or []
        sp["stop_token_ids"] = sp["stop_token_ids"] or []
        return SamplingParams(
            **sp, logprobs=self.return_logprob, top_logprobs_num=self.top_logprobs_num
        ).normalize()


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
