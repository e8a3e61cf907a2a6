"""SGLang's requests and routes against Kiln (issue 23, points 2 and 3): model names as SGLang takes them, the
native /generate fields SGLang's clients send (honoured, or refused by name), logprob triples, the OpenAI
extension fields, echo and suffix, an engine error mid-stream as an SSE error event the OpenAI SDK raises,
/v1/tokenize, /v1/detokenize, /health_generate, /model_info, /server_info, and logprob bytes.

The in-process tests run the real FastAPI app over a fake engine client (no server); the slow ones use the
shared `kiln serve` of conftest.py (the default model)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from kiln.config import ServerArgs
from kiln.sampling_params import InvalidParam
from kiln.scheduler.io import OutputAccumulator, ReqOutput, TokenLogprob
from kiln.scheduler.validate import Limits
from kiln.server.app import ServerState, create_app
from kiln.server.native import LogprobShape, native_body
from kiln.server.openai_api import OpenAIServing
from kiln.server.protocol import GenerateRequest
from kiln.server.responses import completion_chars, logprobs_completion
from kiln.server.sglang_fields import check_model_name, refuse_unsupported
from kiln.server.sglang_routes import health_generate
from kiln.server.startup import StartupState
from kiln.server.token_bytes import TokenBytes

pytestmark = pytest.mark.server

CMPL, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    from kiln.loader.default_model import default_model_path
    from kiln.text.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


# ---------------------------------------------------------------------------------------------- in process
def output(rid: str, ids: list[int], text: str, finished: bool, error: str | None = None) -> ReqOutput:
    reason = {"type": "abort", "message": "internal error"} if error else {"type": "length", "length": 1}
    return ReqOutput(rid, ids, text, finished, reason if finished else None, 3, len(ids), 0, error=error)


class FakeEngineClient:
    """The EngineClient surface the serving layer uses; every request gets the same scripted outputs."""

    def __init__(self, script: list[ReqOutput], hang: bool = False):
        self.script = script
        self.hang = hang
        self.queues: dict[str, object] = {}
        self.num_active = 0
        self.last_output_time = 0.0

    async def generate(
        self,
        input_ids,
        params,
        stream=False,
        rid=None,
        deadline=None,
        observe=True,
        pool=None,
        lora_path=None,
    ):
        if self.hang:
            await asyncio.sleep(3600)
        for out in self.script:
            yield out

    async def collect(
        self, input_ids, params, rid=None, deadline=None, pool=None, lora_path=None
    ) -> OutputAccumulator:
        result = OutputAccumulator()
        async for out in self.generate(input_ids, params):
            result.add(out)
        return result

    async def prefill_only(self, input_ids, lora_path=None) -> None:
        return None


def app_over(tokenizer, script: list[ReqOutput]) -> TestClient:
    state = ServerState(ServerArgs(), StartupState())
    state.model_name = "kiln-test"
    state.serving = OpenAIServing(
        FakeEngineClient(script), tokenizer, Limits(49152, 2048, 16384), "kiln-test"
    )
    return TestClient(create_app(state))


FAILING = [output("r", [42], " Paris", False), output("r", [], "", True, error="CUDA error: boom")]


def test_engine_error_mid_stream_is_an_sse_error_event_the_sdk_raises(tokenizer):
    http = app_over(tokenizer, FAILING)
    with http.stream("POST", CMPL, json={"prompt": "Hi", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == 500 and "error id" in error["message"]
    assert "boom" not in error["message"]  # the engine's words stay in the log
    assert all('"finish_reason": "abort"' not in line for line in lines)
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    for create in (
        lambda: sdk.completions.create(model="any", prompt="Hi", stream=True),
        lambda: sdk.chat.completions.create(model="any", messages=MSG, stream=True),
    ):
        with pytest.raises(openai.APIError, match="error id"):
            for _ in create():
                pass
    with http.stream("POST", GEN, json={"text": "Hi", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert "error" in json.loads(lines[-2][6:]) and lines[-1] == "data: [DONE]"


@pytest.mark.unit
def test_health_generate_is_healthy_only_when_a_token_comes(tokenizer):
    async def probe(client) -> bool:
        return await health_generate(client, timeout=0.5)

    assert asyncio.run(probe(FakeEngineClient([output("h", [7], "x", True)])))
    assert not asyncio.run(probe(FakeEngineClient([output("h", [], "", True, error="boom")])))
    assert not asyncio.run(probe(FakeEngineClient([], hang=True)))


@pytest.mark.unit
def test_unsupported_fields_are_refused_by_name_and_defaults_pass():
    sglang_bench = {"text": "Hi", "lora_path": None, "return_logprob": False, "return_routed_experts": False}
    refuse_unsupported(GenerateRequest.model_validate({**sglang_bench, "logprob_start_len": -1}))
    refuse_unsupported(GenerateRequest.model_validate({"text": "Hi", "lora_path": [None, None]}))
    for field, value in [
        ("lora_path", "my-adapter"),
        ("image_data", "http://x/cat.png"),
        ("custom_logit_processor", "{}"),
        ("token_ids_logprob", [1, 2]),
        ("return_routed_experts", True),
        ("routed_dp_rank", 1),
    ]:
        with pytest.raises(InvalidParam) as refused:
            refuse_unsupported(GenerateRequest.model_validate({"text": "Hi", field: value}))
        assert refused.value.param == field and "Kiln" in str(refused.value)
    with pytest.raises(InvalidParam) as refused:
        refuse_unsupported(
            GenerateRequest.model_validate({"text": "Hi", "sampling_params": {"stop_regex": "a+"}})
        )
    assert refused.value.param == "sampling_params.stop_regex"
    seeded = GenerateRequest.model_validate({"text": "Hi", "sampling_params": {"sampling_seed": 7}})
    assert seeded.params().seed == 7


@pytest.mark.unit
def test_model_names_as_sglang():
    for name in (None, "default", "gpt-4o", "kiln-test", "org/kiln:v1"):
        check_model_name(name, "org/kiln:v1")
    with pytest.raises(InvalidParam) as refused:
        check_model_name("kiln-test:my-adapter", "kiln-test")
    assert refused.value.param == "model" and "my-adapter" in str(refused.value)


@pytest.mark.unit
def test_native_logprobs_are_sglang_triples(tokenizer):
    result = OutputAccumulator()
    lps = [TokenLogprob(42, -0.5, [(42, -0.5), (7, -1.5)])]
    result.add(ReqOutput("r", [42], "x", True, {"type": "length", "length": 1}, 3, 1, 0, logprobs=lps))
    meta = native_body(tokenizer, result, LogprobShape(2, with_text=True))["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 42, tokenizer.decode([42])]]
    assert meta["output_top_logprobs"] == [
        [[-0.5, 42, tokenizer.decode([42])], [-1.5, 7, tokenizer.decode([7])]]
    ]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
    meta = native_body(tokenizer, result, LogprobShape(0, with_text=False))["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 42, None]] and "output_top_logprobs" not in meta
    assert "output_token_logprobs" not in native_body(tokenizer, result, None)["meta_info"]


@pytest.mark.unit
def test_logprob_bytes_of_byte_level_tokens(tokenizer):
    """GPT-2 byte-level tokens that are parts of one character give their own bytes, which join to the text."""
    text = "héllo — ✓ 你好"
    ids = tokenizer.encode(text)
    token_bytes = TokenBytes(tokenizer)
    assert b"".join(bytes(token_bytes(i)) for i in ids) == text.encode("utf-8")
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # the case that matters is in the text


@pytest.mark.unit
def test_logprob_bytes_of_byte_fallback_tokens():
    """SentencePiece byte fallback: <0xE2> stands for the byte 0xE2."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "▁a": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes(3 + 0xE2) == [0xE2] and token_bytes(3 + 0x41) == [0x41]
    assert token_bytes(2) == list(tokenizer.decode([2]).encode("utf-8"))


def sse_choices(http: TestClient, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [c for e in events[:-1] for c in json.loads(e)["choices"]]


STOPPED = [
    ReqOutput("r", [42], " Paris", False, None, 3, 1, 0),
    ReqOutput("r", [13], ".", True, {"type": "stop", "matched": " It"}, 3, 2, 0),
]


@pytest.mark.unit
def test_stream_finishing_chunk_carries_matched_stop(tokenizer):
    """SGLang's stream choices carry matched_stop (null until the finishing one), as the non-streamed choice."""
    http = app_over(tokenizer, STOPPED)
    for path, body in ((CMPL, {"prompt": "Hi", "stop": [" It"]}), (CHAT, {"messages": MSG, "stop": [" It"]})):
        whole = http.post(path, json=body).json()["choices"][0]
        assert whole["finish_reason"] == "stop" and whole["matched_stop"] == " It"
        chunks = sse_choices(http, path, body)
        assert len(chunks) >= 2 and all("matched_stop" in c for c in chunks)
        assert [c["matched_stop"] for c in chunks] == [None] * (len(chunks) - 1) + [" It"]
        assert chunks[-1]["finish_reason"] == "stop"
    # a token id that ended it is named as the non-streamed choice names it; a length finish names none
    http = app_over(tokenizer, [ReqOutput("r", [2], "", True, {"type": "stop", "matched": 2}, 3, 1, 0)])
    assert sse_choices(http, CMPL, {"prompt": "Hi"})[-1]["matched_stop"] == 2
    http = app_over(tokenizer, [ReqOutput("r", [7], "x", True, {"type": "length", "length": 1}, 3, 1, 0)])
    assert sse_choices(http, CHAT, {"messages": MSG})[-1]["matched_stop"] is None


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        (CMPL, {"prompt": "Hi", "min_tokens": -1}, "min_tokens", "min_tokens=-1 must be >= 0"),
        (CMPL, {"prompt": "Hi", "max_tokens": 4, "min_tokens": 9}, "min_tokens", "min_tokens=9 must be <= max_tokens=4"),
        (CHAT, {"messages": MSG, "max_tokens": 4, "min_tokens": 9}, "min_tokens", "<= max_tokens=4"),
        (CHAT, {"messages": MSG, "max_completion_tokens": 4, "min_tokens": 9}, "min_tokens", "<= max_completion_tokens=4"),
        (CHAT, {"messages": MSG, "max_completion_tokens": 5000}, "max_completion_tokens", "max_completion_tokens=5000"),
        (GEN, {"text": "Hi", "sampling_params": {"min_new_tokens": -1}}, "min_new_tokens", "min_new_tokens=-1"),
    ],
)  # fmt: skip
@pytest.mark.unit
def test_refusals_name_the_field_as_the_endpoint_spells_it(tokenizer, path, body, param, words):
    """The OpenAI endpoints take min_tokens (vLLM's name for min_new_tokens): a refusal says min_tokens, and the
    token limit under the name the client sent it; /generate keeps SGLang's names."""
    r = app_over(tokenizer, []).post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    if path != GEN:
        assert "new_tokens" not in error["message"]


CAT = " 猫 and 🐱 ok"


def token_bytes_of(token: str) -> bytes:
    """A legacy completions token back to its bytes, as an OpenAI client reads the "bytes:" form."""
    if token.startswith("bytes:"):
        return token[len("bytes:") :].encode("latin-1").decode("unicode_escape").encode("latin-1")
    return token.encode("utf-8")


def cat_logprobs(tokenizer) -> list[TokenLogprob]:
    """The greedy token first, then the ids around it: several byte tokens that each decode alone to U+FFFD."""
    return [TokenLogprob(t, -0.25, [(t, -0.25), (t + 1, -1.0), (t - 1, -2.0)]) for t in tokenizer.encode(CAT)]


@pytest.mark.unit
def test_completion_logprobs_of_partial_utf8_tokens(tokenizer):
    """A token that is only part of a character is OpenAI's "bytes:\\xNN" string, distinct from its
    neighbours; text_offset is the character where its first byte lies, never past the text."""
    lps = cat_logprobs(tokenizer)
    assert sum(tokenizer.decode([lp.token_id]) == "\ufffd" for lp in lps) >= 3  # the case that matters
    lp = logprobs_completion(tokenizer, lps)
    assert "\ufffd" not in "".join(lp["tokens"])
    assert b"".join(token_bytes_of(t) for t in lp["tokens"]).decode("utf-8") == CAT
    assert "bytes: \\xf0\\x9f" in lp["tokens"]  # " " and the emoji's first two bytes
    assert [len(top) for top in lp["top_logprobs"]] == [3] * len(lps)
    assert all(top[token] == -0.25 for token, top in zip(lp["tokens"], lp["top_logprobs"]))
    # " 猫" from 0, its other bytes inside 猫 (1), " and" 2, " 🐱" 6, its other bytes 7, " ok" 8
    starts = [0, 1, 1, 2, 6, 7, 7, 8]
    assert [tokenizer.decode([t]) for t in tokenizer.encode(CAT)][3] == " and" and lp["text_offset"] == starts
    assert all(o < len(CAT) for o in lp["text_offset"])
    # a stream's chunks, cut anywhere (inside a character too), join into the same lists
    for cut in range(len(lps) + 1):
        head = logprobs_completion(tokenizer, lps[:cut])
        tail = logprobs_completion(tokenizer, lps[cut:], completion_chars(tokenizer, lps[:cut]))
        assert {k: head[k] + tail[k] for k in lp} == lp


@pytest.mark.unit
def test_completion_stream_logprobs_equal_the_non_streamed_ones_on_partial_utf8(tokenizer):
    lps = cat_logprobs(tokenizer)
    cut = 2  # inside 猫: its first chunk's text is held back until the character completes
    script = [
        ReqOutput("r", [lp.token_id for lp in lps[:cut]], "", False, None, 3, cut, 0, logprobs=lps[:cut]),
        ReqOutput("r", [lp.token_id for lp in lps[cut:]], CAT, True, {"type": "length", "length": len(lps)}, 3,
                  len(lps), 0, logprobs=lps[cut:]),
    ]  # fmt: skip
    http = app_over(tokenizer, script)
    body = {"prompt": "Hi", "logprobs": 3, "max_tokens": len(lps)}
    whole = http.post(CMPL, json=body).json()["choices"][0]
    chunks = sse_choices(http, CMPL, body)
    assert whole["logprobs"] == logprobs_completion(tokenizer, lps)
    assert {k: [x for c in chunks for x in c["logprobs"][k]] for k in whole["logprobs"]} == whole["logprobs"]


# ---------------------------------------------------------------------------------------------- a real server
def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def refused(resp: httpx.Response, param: str) -> dict:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    return error


def test_any_model_name_is_served_and_models_lists_the_served_one(server, client, model):
    for name in ("default", "no-such-model"):
        assert client.completions.create(model=name, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
        chat = client.chat.completions.create(model=name, messages=MSG, max_tokens=1)
        assert chat.model == model
    assert [m.id for m in client.models.list().data] == [model]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    error = refused(post(server, CMPL, {"model": f"{model}:adapter", "prompt": "Hi"}), "model")
    assert "LoRA" in error["message"]


def test_sglang_bench_generate_payload_and_refusals(server):
    """The body SGLang's bench_serving sends (backend sglang), then the fields Kiln refuses by name."""
    body = {
        "text": "The capital of France is",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
        "stream": False,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }
    r = post(server, GEN, body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4
    for field, value in [("lora_path", "adapter"), ("image_data", "x.png")]:
        error = refused(post(server, GEN, {**body, field: value}), field)
        assert "Kiln" in error["message"]


def test_generate_logprob_triples_with_text(server):
    body = {
        "text": "The capital of France is",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    r = post(server, GEN, body)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == out["output_ids"]
    assert "".join(entry[2] for entry in meta["output_token_logprobs"]) == out["text"]
    assert all(len(top) == 2 and len(top[0]) == 3 for top in meta["output_top_logprobs"])
    # SGLang's default logprob_start_len (-1): the prompt's last token alone, its logprob null
    (last,) = meta["input_token_logprobs"]
    assert last[0] is None and isinstance(last[1], int) and meta["input_top_logprobs"] == [None]
    plain = post(server, GEN, {**body, "return_text_in_logprobs": False}).json()["meta_info"]
    assert all(entry[2] is None for entry in plain["output_token_logprobs"])


def test_openai_extension_fields_echo_and_suffix(server, client, model):
    greedy = {"temperature": 0.0, "max_tokens": 3}
    extras = {"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True}
    extras |= {"skip_special_tokens": True, "stop_token_ids": [0], "include_stop_str_in_output": True}
    done = client.completions.create(model=model, prompt="Hi", extra_body=extras, **greedy)
    assert done.usage.completion_tokens == 3
    plain = client.completions.create(model=model, prompt="The capital of France is", **greedy)
    echoed = client.completions.create(model=model, prompt="The capital of France is", echo=True, **greedy)
    assert echoed.choices[0].text == "The capital of France is" + plain.choices[0].text
    stream = client.completions.create(model=model, prompt="Hello", echo=True, stream=True, **greedy)
    assert "".join(c.choices[0].text for c in stream if c.choices).startswith("Hello")
    echo_lp = post(server, CMPL, {"prompt": "Hi", "echo": True, "logprobs": 1, "max_tokens": 1}).json()
    assert echo_lp["choices"][0]["logprobs"]["token_logprobs"][0] is None  # the prompt's first token
    refused(post(server, CMPL, {"prompt": "Hi", "suffix": "end"}), "suffix")
    refused(post(server, CMPL, {"prompt": "Hi", "no_such_field": 1}), "no_such_field")


def test_tokenize_and_detokenize(server):
    one = post(server, "/v1/tokenize", {"prompt": "Hello world"}).json()
    assert one["count"] == len(one["tokens"]) > 0 and one["max_model_len"] > 0
    assert post(server, "/v1/detokenize", {"tokens": one["tokens"]}).json() == {"text": "Hello world"}
    many = post(server, "/tokenize", {"prompt": ["a", "b c"], "return_token_strs": True}).json()
    assert many["count"] == [len(ids) for ids in many["tokens"]] and len(many["token_strs"]) == 2
    texts = post(server, "/detokenize", {"tokens": many["tokens"]}).json()["text"]
    assert texts == ["a", "b c"]
    chat = post(server, "/v1/tokenize", {"messages": MSG}).json()
    assert chat["count"] > one["count"]
    refused(post(server, "/v1/detokenize", {"tokens": [10**9]}), "tokens")
    refused(post(server, "/v1/tokenize", {"prompt": "a", "messages": MSG}), "prompt")


def test_health_generate_model_info_and_server_info(server, model):
    def counters() -> dict:
        return httpx.get(server.url + "/get_server_info", timeout=30).json()["stats"]

    before = counters()
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    after = counters()  # the probe is no client's request: SGLang leaves it out of the counters too
    assert (after["prompt_tokens"], after["generation_tokens"]) == (
        before["prompt_tokens"],
        before["generation_tokens"],
    )
    info = httpx.get(server.url + "/model_info", timeout=30).json()
    assert info["model_path"] == model and info["is_generation"] is True
    assert {"tokenizer_path", "served_model_name", "weight_version", "architectures"} <= set(info)
    assert httpx.get(server.url + "/get_model_info", timeout=30).json() == info
    server_info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert server_info["version"] and server_info["internal_states"][0]["memory_usage"]["token_capacity"] > 0
    assert server_info["max_req_input_len"] > 0 and server_info["max_total_num_tokens"] > 0
    # resolved as SGLang resolves it, though the flag was not given: the ledger's fraction
    assert server_info["mem_fraction_static"] == server_info["ledger"]["mem_fraction_static"] > 0
    # SGLang's flat arguments, beside Kiln's own fields (which stay)
    assert server_info["model_path"] == model and server_info["chunked_prefill_size"] == 512
    assert server_info["server_args"]["model_path"] == model and "context_len" in server_info


def test_chat_logprob_bytes_join_to_the_text(client, model):
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write 你好 and ✓ three times."}],
        max_tokens=8,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    joined = b"".join(bytes(entry.bytes) for entry in content)
    assert joined.decode("utf-8", errors="replace") == chat.choices[0].message.content
