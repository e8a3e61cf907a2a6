"""Constrained decoding at the HTTP front: OpenAI's response_format turned into SGLang's json_schema, and every
constraint checked by the grammar backend before the request is queued, so a spec it refuses is a 400 naming
the feature (never a 500, never a weaker constraint)."""

from __future__ import annotations

import functools
import json

from prometheus_client.core import HistogramMetricFamily

from kiln.sampling_params import InvalidParam, SamplingParams
from kiln.scheduler.io import SchedulerStats
from kiln.server.protocol import ResponseFormat, Tool
from kiln.structured.backend import check_spec
from kiln.structured.cache import COMPILE_BUCKETS
from kiln.structured.spec import ANY_JSON_OBJECT, GrammarError, GrammarSpec, spec_of


def response_format_schema(response_format: ResponseFormat | None) -> str | None:
    """The JSON schema (as text) that response_format asks for; None for free text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return ANY_JSON_OBJECT
    fmt = response_format.json_schema
    if fmt is None:
        raise InvalidParam("response_format", "response_format json_schema needs its json_schema object")
    if fmt.schema_ is None:
        return ANY_JSON_OBJECT
    return json.dumps(fmt.schema_)


@functools.lru_cache(maxsize=256)
def _refusal(kind: str, text: str) -> str | None:
    """The backend's refusal of a spec, or None; cached so that a schema sent again is checked once."""
    try:
        check_spec(GrammarSpec(kind, text))
    except GrammarError as e:
        return str(e)
    return None


def check_constraint(params: SamplingParams, grammar_backend: str, param: str | None = None) -> None:
    """Refuse (InvalidParam) a constraint the backend cannot enforce or a server without a backend.

    `param` names the request field the constraint came from (response_format); without it, the
    sampling_params field itself (sampling_params.json_schema)."""
    spec = spec_of(params)
    if spec is None:
        return
    where = param or f"sampling_params.{spec.kind}"
    if grammar_backend == "none":
        raise InvalidParam(where, "constrained decoding is off on this server (--grammar-backend none)")
    refusal = _refusal(spec.kind, spec.text)
    if refusal is not None:
        raise InvalidParam(where, refusal)


def check_tool_parameters(tools: list[Tool] | None) -> None:
    """Refuse a tool whose parameters are no JSON schema of an object, whatever tool_choice is (as OpenAI's API):
    the chat template renders it, and a call's arguments must read back as an object. Only the shape is checked
    here (type, properties, required): a keyword, pattern or remote $ref the grammar backend cannot enforce is
    fine where nothing constrains the output, and a constrained tool_choice has the backend check it all."""
    for i, tool in enumerate(tools or []):
        problem = _object_schema_problem(tool.function.parameters)
        if problem is not None:
            raise InvalidParam(f"tools.{i}.function.parameters", f"not a JSON schema of an object: {problem}")


def _object_schema_problem(schema: dict) -> str | None:
    kind = schema.get("type", "object")
    kinds = kind if isinstance(kind, list) else [kind]
    if "object" not in kinds:
        return f"type {kind!r} (a function's arguments are an object)"
    if not all(k in _JSON_TYPES for k in kinds):
        return f"type {kind!r} names no JSON type (one of {', '.join(sorted(_JSON_TYPES))})"
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(v, dict | bool) for v in properties.values()):
        return "properties must map each argument's name to its schema"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        return "required must be a list of argument names"
    return None


_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})


def grammar_compile_histogram(stats: SchedulerStats) -> HistogramMetricFamily:
    """kiln:grammar_compile_seconds from the engine's bucket counts (empty until the first compile)."""
    counts = stats.grammar_compile_buckets or (0,) * (len(COMPILE_BUCKETS) + 1)
    bounds = [str(bound) for bound in COMPILE_BUCKETS] + ["+Inf"]
    return HistogramMetricFamily(
        "kiln:grammar_compile_seconds",
        "seconds to compile a constraint into a grammar (cache misses only)",
        buckets=list(zip(bounds, counts, strict=True)),
        sum_value=stats.grammar_compile_seconds_sum,
    )
