"""Constrained decoding: the grammar backend's refusals, the compile cache, the sampler's vocabulary masks, and
(slow) the default model served with response_format, SGLang's json_schema / regex / ebnf and the OpenAI SDK's
`.parse()`: every constrained output parses and validates, streaming or not, next to unconstrained requests."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema_rs
import pydantic
import pytest
import torch

from kiln.runner.sampler import SamplingRow, sample
from kiln.sampling_params import InvalidParam, SamplingParams
from kiln.scheduler.io import GenerateReq
from kiln.structured.backend import check_spec
from kiln.structured.masks import DEAD_END_MESSAGE, batch_masks, blocked_finish
from kiln.structured.spec import GrammarError, GrammarSpec, spec_of

pytestmark = pytest.mark.server

GREEDY = SamplingParams(temperature=0.0)


# ---------------------------------------------------------------------------------------------- requests
@pytest.mark.unit
def test_at_most_one_constraint_named():
    SamplingParams(regex="a+").validate()
    with pytest.raises(InvalidParam) as e:
        SamplingParams(regex="a+", ebnf='root ::= "a"').validate()
    assert e.value.param == "ebnf"
    with pytest.raises(InvalidParam) as e:
        SamplingParams(json_schema="").validate()
    assert e.value.param == "json_schema"
    assert spec_of(SamplingParams(regex="a+")) == GrammarSpec("regex", "a+")
    assert spec_of(SamplingParams()) is None


@pytest.mark.parametrize(
    ("kind", "text", "named"),
    [
        ("json_schema", '{"type": "array", "uniqueItems": true}', "uniqueItems"),
        ("json_schema", '{"type": "string", "format": "ipv9"}', "ipv9"),
        ("json_schema", '{"type": ', "not valid JSON"),
        ("regex", "[a-", "unclosed character class"),
    ],
)
@pytest.mark.unit
def test_backend_refuses_what_it_cannot_enforce(kind, text, named):
    with pytest.raises(GrammarError) as e:
        check_spec(GrammarSpec(kind, text))
    assert named in str(e.value)


@pytest.mark.unit
def test_backend_accepts_the_usual_schema_keywords():
    schema = {
        "title": "P",
        "description": "a person",
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 5, "pattern": "^[a-z]+$", "default": "x"}},
        "required": ["name"],
        "additionalProperties": False,
    }
    check_spec(GrammarSpec("json_schema", json.dumps(schema)))
    check_spec(GrammarSpec("ebnf", 'root ::= "yes" | "no"'))


# ---------------------------------------------------------------------------------------------- masks
class FakeMatcher:
    def __init__(self, allowed: list[int], accepting: bool):
        self._allowed, self.is_accepting = allowed, accepting

    def allowed(self, width: int) -> torch.Tensor:
        mask = torch.zeros(width, dtype=torch.bool)
        mask[self._allowed] = True
        return mask


@pytest.mark.unit
def test_blocked_rows_end_before_sampling():
    free, done, dead, ok = None, FakeMatcher([2], True), FakeMatcher([], False), FakeMatcher([5, 7], False)
    masks = batch_masks([free, done, dead, ok], [[], [2], [], [2]], 10)
    assert masks.blocked == [1, 2]  # done: only EOS (2) allowed and banned by min_new_tokens
    assert masks.masks[0] is None and masks.masks[3].nonzero().flatten().tolist() == [5, 7]
    assert blocked_finish(done) == {"type": "stop", "matched": None}
    assert blocked_finish(dead) == {"type": "abort", "message": DEAD_END_MESSAGE}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.unit
def test_sampler_respects_the_mask_and_leaves_free_rows_alone(temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, 64)
    mask = torch.zeros(64, dtype=torch.bool)
    mask[[3, 40]] = True
    params = SamplingParams(temperature=temperature)
    rows = [
        SamplingRow(params, torch.Generator().manual_seed(1), [1], [], vocab_mask=mask),
        SamplingRow(GREEDY, None, [1], []),
        SamplingRow(params, torch.Generator().manual_seed(2), [1], [], vocab_mask=mask),
    ]
    out = sample(logits, rows).next_token_ids
    assert out[0] in (3, 40) and out[2] in (3, 40)
    assert out[1] == int(logits[1].argmax())
    if temperature == 0.0:
        assert out[0] == (3 if logits[0, 3] > logits[0, 40] else 40)


@pytest.mark.unit
def test_mask_leaves_padding_ids_out(default_model):
    from kiln.structured.backend import make_backend
    from kiln.structured.cache import GrammarCache
    from kiln.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model)
    cache = GrammarCache(make_backend("llguidance", tokenizer, [tokenizer.eos_token_id]))
    spec = GrammarSpec("regex", "[0-9]+")
    matcher = cache.submit(spec).result(timeout=60)
    cache.submit(spec).result(timeout=60)
    assert (cache.counters.hits, cache.counters.misses, cache.counters.compiles) == (1, 1, 1)
    width = len(tokenizer) + 64  # a model whose logits are wider than its tokenizer
    mask = matcher.allowed(width)
    allowed = mask.nonzero().flatten().tolist()
    assert not mask[len(tokenizer) :].any() and allowed
    assert all(tokenizer.decode([t]).isdigit() for t in allowed)
    assert matcher.accept(allowed[0]) and matcher.is_accepting
    cache.close()


@pytest.mark.unit
def test_the_compile_cache_is_bounded_and_its_histogram_counts(default_model, monkeypatch):
    """A server fed ever new schemas keeps at most MAX_CACHED_GRAMMARS compiled (least recently used dropped); the
    histogram's counts are kept as they come, not recomputed per snapshot."""
    import kiln.structured.cache as grammar_cache
    from kiln.structured.backend import make_backend
    from kiln.text.tokenizer import load_tokenizer

    monkeypatch.setattr(grammar_cache, "MAX_CACHED_GRAMMARS", 2)
    tokenizer = load_tokenizer(default_model)
    cache = grammar_cache.GrammarCache(make_backend("llguidance", tokenizer, [tokenizer.eos_token_id]))
    specs = [GrammarSpec("regex", f"[0-9]{{{n}}}") for n in (1, 2, 3)]
    for spec in (
        specs[0],
        specs[1],
        specs[0],
        specs[2],
        specs[1],
    ):  # specs[1] was the least recent at specs[2]
        cache.submit(spec).result(timeout=60)
    counters = cache.counters
    assert (counters.hits, counters.misses, counters.compiles) == (1, 4, 4)
    buckets = counters.buckets()
    assert buckets[-1] == 4 and list(buckets) == sorted(buckets) and counters.compile_seconds_sum > 0
    cache.close()


# ---------------------------------------------------------------------------------------------- scheduler
class ParityMatcher:
    """A fake grammar over test_scheduler's fake model: the k-th output token must have parity k % 2 and the
    output ends after `length` tokens; `stuck_at` makes the grammar allow nothing from that position on."""

    def __init__(self, length: int, stuck_at: int | None = None):
        self.accepted: list[int] = []
        self.length, self.stuck_at = length, stuck_at

    def allowed(self, width: int) -> torch.Tensor:
        mask = torch.zeros(width, dtype=torch.bool)
        if len(self.accepted) != self.stuck_at:
            mask[len(self.accepted) % 2 :: 2] = True
        return mask

    def accept(self, token: int) -> bool:
        assert token % 2 == len(self.accepted) % 2, (token, self.accepted)
        self.accepted.append(token)
        return True

    @property
    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length

    is_accepting = is_terminated


class ParityGrammars:
    """Stands for GrammarCache: the spec's text is the output length (or `stuck:N`)."""

    def __init__(self) -> None:
        from kiln.structured.cache import GrammarCounters

        self.matchers: dict[str, ParityMatcher] = {}
        self.counters = GrammarCounters()

    def submit(self, spec: GrammarSpec):
        from concurrent.futures import Future

        future: Future = Future()
        stuck = spec.text.startswith("stuck:")
        matcher = ParityMatcher(99, int(spec.text[6:])) if stuck else ParityMatcher(int(spec.text))
        self.matchers[spec.text] = matcher
        future.set_result(matcher)
        return future


@pytest.mark.unit
def test_constrained_rows_survive_retraction_beside_free_ones():
    from test_scheduler import drive, expected, final, ids, make, prompt

    s = make(pool=256, max_running=8)
    grammars = s.grammars = ParityGrammars()  # type: ignore[assignment]
    prompts = [prompt(10 + k, k) for k in range(8)]
    rids = []
    for k, p in enumerate(prompts):
        rid = f"g{k}"
        regex = str(40 + k) if k % 2 else None  # every other request constrained, each its own length
        s.add_request(GenerateReq(rid, p, SamplingParams(max_new_tokens=64, temperature=0.0, regex=regex)))
        rids.append(rid)
    outs = drive(s)
    assert s.make_stats().retracted > 0
    for k, (rid, p) in enumerate(zip(rids, prompts, strict=True)):
        if k % 2 == 0:  # free rows: the fake model's own tokens, untouched by the masks next to them
            assert ids(outs[rid]) == expected(p, 64)
            continue
        matcher = grammars.matchers[str(40 + k)]
        assert ids(outs[rid]) == matcher.accepted and len(matcher.accepted) == 40 + k
        assert final(outs[rid]).finish_reason == {"type": "stop", "matched": matcher.accepted[-1]}


@pytest.mark.unit
def test_dead_end_grammar_ends_the_request_cleanly():
    from test_scheduler import drive, final, ids, make, prompt

    s = make()
    s.grammars = ParityGrammars()  # type: ignore[assignment]
    s.add_request(
        GenerateReq("dead", prompt(5, 1), SamplingParams(max_new_tokens=16, temperature=0.0, regex="stuck:3"))
    )
    outs = drive(s)
    assert len(ids(outs["dead"])) == 3
    assert final(outs["dead"]).finish_reason == {"type": "abort", "message": DEAD_END_MESSAGE}


# ---------------------------------------------------------------------------------------------- served (slow)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "integer", "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "address"],
    "additionalProperties": False,
}
SCHEMAS = {
    "nested": PERSON,
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 10},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "note": {"type": "string", "maxLength": 10},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
}
CHAT_PROMPT = [{"role": "user", "content": "Reply with a JSON object about a book or a person."}]


def _chat(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=180)


def _schema_body(schema: dict, stream: bool) -> dict:
    return {
        "messages": CHAT_PROMPT,
        "temperature": 0.0,
        "max_tokens": 120,
        "stream": stream,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        },
    }


def _streamed_text(response: httpx.Response) -> tuple[str, str | None]:
    text, finish = "", None
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    return text, finish


def test_every_schema_parses_and_validates_streaming_or_not(server):
    cases = [(name, stream) for name in SCHEMAS for stream in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:  # one batch: constrained rows decode together
        responses = list(pool.map(lambda c: _chat(server, _schema_body(SCHEMAS[c[0]], c[1])), cases))
    for (name, stream), response in zip(cases, responses, strict=True):
        assert response.status_code == 200, (name, response.text)
        if stream:
            text, finish = _streamed_text(response)
        else:
            choice = response.json()["choices"][0]
            text, finish = choice["message"]["content"], choice["finish_reason"]
        assert finish == "stop", (name, stream, text)
        jsonschema_rs.validate(SCHEMAS[name], json.loads(text))


def test_constrained_and_free_requests_batch_together(server):
    free = {"text": "The capital of France is", "sampling_params": {"temperature": 0.0, "max_new_tokens": 16}}
    regex = {
        "text": "The year is",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "regex": "[0-9]{4}\\."},
    }
    ebnf = {
        "text": "Answer yes or no: is water wet?",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ebnf": 'root ::= "yes" | "no"'},
    }

    def post(body: dict) -> dict:
        r = httpx.post(f"{server.url}/generate", json=body, timeout=180)
        assert r.status_code == 200, r.text
        return r.json()

    alone = post(free)["text"]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(post, [regex, free, ebnf, regex]))
    assert got[1]["text"] == alone  # the free row's greedy output is unchanged by its constrained neighbours
    for out in (got[0], got[3]):
        assert len(out["text"]) == 5 and out["text"][:4].isdigit() and out["text"][4] == ".", out
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert got[2]["text"] in ("yes", "no"), got[2]
    assert got[0]["text"] == got[3]["text"]


def test_grammar_complete_before_min_tokens_ends_cleanly(server):
    body = {
        "text": "Say:",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "min_new_tokens": 8, "regex": "ab"},
    }
    r = httpx.post(f"{server.url}/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == "ab" and out["meta_info"]["finish_reason"]["type"] == "stop", out


def test_sdk_parse_returns_the_pydantic_object(client, model):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=16)
        country: str = pydantic.Field(max_length=16)
        population_millions: int = pydantic.Field(ge=0, le=100)

    completion = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0.0,
        max_tokens=80,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City), completion


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": CHAT_PROMPT,
                "max_tokens": 8,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                },
            },
            "response_format",
        ),
        (
            "/generate",
            {
                "text": "hi",
                "sampling_params": {
                    "max_new_tokens": 8,
                    "json_schema": '{"type": "string", "format": "ipv9"}',
                },
            },
            "sampling_params.json_schema",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 8, "regex": "[a-"}},
            "sampling_params.regex",
        ),
    ],
)
def test_refused_feature_is_a_400_naming_it(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert any(word in error["message"] for word in ("uniqueItems", "ipv9", "unclosed")), error


def test_json_object_and_metrics(server):
    body = {
        "messages": CHAT_PROMPT,
        "temperature": 0.0,
        "max_tokens": 16,
        "response_format": {"type": "json_object"},
    }
    for _ in range(2):  # the second use of the same grammar is a cache hit
        assert _chat(server, body).status_code == 200
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("kiln:grammar")
    }
    assert values["kiln:grammar_cache_hits_total"] >= 1
    assert values["kiln:grammar_cache_misses_total"] >= 1
    assert values["kiln:grammar_compile_seconds_count"] >= 1
