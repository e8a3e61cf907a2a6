"""What a request asks its output to match: one of SGLang's json_schema, regex or ebnf, as plain text."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.sampling_params import SamplingParams

# The kinds a request may carry, in the order they are looked up (the SamplingParams field of each)
KINDS = ("json_schema", "regex", "ebnf")

# OpenAI's response_format {type: json_object}: any JSON object, whatever its keys
ANY_JSON_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """The backend refused a spec: its syntax, or a feature it cannot enforce (the message names it)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    text: str


def spec_of(params: SamplingParams) -> GrammarSpec | None:
    """The constraint a request carries, or None for free text (SamplingParams.validate allows at most one)."""
    for kind in KINDS:
        text = getattr(params, kind)
        if text is not None:
            return GrammarSpec(kind, text)
    return None
