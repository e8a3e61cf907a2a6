"""Per-request sampling parameters (SGLang's names and defaults)."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

# the parameters a model's generation_config.json gives defaults for under --sampling-defaults model (SGLang's
# list, ModelConfig.get_default_sampling_params); kiln.loader.generation_config reads them
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GREEDY_TEMPERATURE = 1e-6  # SGLang's _SAMPLING_EPS: below it a request decodes greedily


class InvalidParam(ValueError):
    """A sampling parameter is out of range; `param` names it for the 400 response."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs_num: int = 0
    # SGLang's logprob_start_len: the first prompt token of the prompt logprobs, for a request asking for logprobs
    # (-1: none; the scheduler computes them from there on, and no prefix-cache hit covers that part)
    logprob_start_len: int = -1
    logit_bias: dict[int, float] | None = None
    # constrained decoding (SGLang's names): the output matches this JSON schema, regex or EBNF grammar
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def is_greedy(self) -> bool:
        """SGLang's rule: a temperature below 1e-6 is greedy (dividing logits by it would overflow to inf)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def prompt_logprob_start(self) -> int | None:
        """Where the prompt logprobs start (logprob_start_len), when the request asks for logprobs at all: as
        SGLang, the start alone asks for nothing."""
        wanted = self.logprobs or self.top_logprobs_num > 0
        return self.logprob_start_len if wanted and self.logprob_start_len >= 0 else None

    @property
    def needs_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def fill_unset(self, defaults: Mapping[str, float], given: Collection[str]) -> SamplingParams:
        """Each of `defaults` (the model's, see MODEL_DEFAULT_FIELDS) for a parameter the request did not send:
        `given` names those it sent, so one sent at the plain default (temperature 1.0) keeps it."""
        for name, value in defaults.items():
            if name not in given:
                setattr(self, name, value)
        return self

    def normalize(self) -> SamplingParams:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        return self

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidParam naming the first parameter that is out of range."""
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 0, "must be >= 0"),
            ("min_new_tokens", 0 <= self.min_new_tokens, "must be >= 0"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "must be -1 (disabled) or >= 1"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0, "must be in (0, 2]"),
            ("n", 1 <= self.n <= 128, "must be in [1, 128]"),
            ("top_logprobs_num", 0 <= self.top_logprobs_num <= 20, "must be in [0, 20]"),
            ("logprob_start_len", self.logprob_start_len >= -1, "must be -1 (no prompt logprobs) or >= 0"),
        ]
        for name, ok, msg in checks:
            value = getattr(self, name)
            if isinstance(value, float) and math.isnan(value):
                ok = False
            if not ok:
                raise InvalidParam(name, f"{name}={value!r} {msg}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidParam("seed", f"seed={self.seed} must fit in 64 bits")
        self.validate_constraint()
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidParam(
                "min_new_tokens",
                f"min_new_tokens={self.min_new_tokens} must be <= max_new_tokens={self.max_new_tokens}",
            )
        if vocab_size is not None:
            for tid in self.stop_token_ids:
                if not 0 <= tid < vocab_size:
                    raise InvalidParam(
                        "stop_token_ids", f"token id {tid} is outside the vocabulary [0, {vocab_size})"
                    )
            for tid, bias in (self.logit_bias or {}).items():
                if not 0 <= int(tid) < vocab_size:
                    raise InvalidParam(
                        "logit_bias", f"token id {tid} is outside the vocabulary [0, {vocab_size})"
                    )
                if not (-100.0 <= float(bias) <= 100.0):
                    raise InvalidParam("logit_bias", f"bias {bias} for token {tid} must be in [-100, 100]")

    def validate_constraint(self) -> None:
        """At most one of json_schema, regex and ebnf, each a non-empty string (compiled later, by the backend)."""
        given = [name for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None]
        for name in given:
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise InvalidParam(name, f"{name} must be a non-empty string")
        if len(given) > 1:
            raise InvalidParam(
                given[1], f"give at most one of json_schema, regex and ebnf (got {', '.join(given)})"
            )
