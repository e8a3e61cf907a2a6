"""Bad input to a real `kiln serve`: an OpenAI-style error JSON with the right 4xx naming the parameter, and the
server keeps serving (a good request right after succeeds)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from conftest import ServerProcess

pytestmark = pytest.mark.server

CMPL, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "Hi"}]
VOCAB = 49152  # the default model's vocabulary (checked against /get_server_info below)


def post(url: str, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(url + path, json=body, timeout=60)


def check_error(resp: httpx.Response, status: int, params: str | tuple[str, ...], *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json"), resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    names = (params,) if isinstance(params, str) else params
    # the parameter itself or a part of it ("sampling_params.logit_bias.abc.[key]")
    assert any(err["param"] == n or str(err["param"]).startswith(n + ".") for n in names), err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


def assert_still_serving(url: str, prompt: str | list[int] = "Hi") -> None:
    r = post(url, CMPL, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def nan(field: str, path: str = CMPL) -> tuple:
    body = b'{"messages": [{"role": "user", "content": "Hi"}]' if path == CHAT else b'{"prompt": "Hi"'
    return (path, body + f', "{field}": NaN}}'.encode(), 400, field)


CASES = {
    # malformed bodies
    "malformed-json": (CMPL, b'{"prompt": "Hi", ', 400, "body"),
    "malformed-json-chat": (CHAT, b'{"messages": [', 400, "body"),
    "malformed-json-generate": (GEN, b'{"text": "Hi"', 400, "body"),
    "body-not-an-object": (CMPL, b"[1, 2]", 400, "body"),
    "body-not-utf8": (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "body"),
    "body-nested-without-end": (GEN, b"[" * 100_000 + b"]" * 100_000, 400, "body"),
    "body-integer-too-long": (CMPL, b'{"prompt": "Hi", "seed": ' + b"7" * 5000 + b"}", 400, "body"),
    "wrong-type": (CMPL, {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    "bad-role": (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    # empty prompts
    "empty-prompt": (CMPL, {"prompt": ""}, 400, "prompt"),
    "empty-prompt-ids": (CMPL, {"prompt": []}, 400, "prompt"),
    "empty-messages": (CHAT, {"messages": []}, 400, "messages"),
    "empty-text-generate": (GEN, {"text": ""}, 400, ("text", "prompt")),
    # max_tokens
    "max-tokens-past-context": (CMPL, {"prompt": "Hi", "max_tokens": 8192}, 400, "max_tokens"),
    "max-tokens-past-context-chat": (CHAT, {"messages": MSG, "max_tokens": 9000}, 400, "max_tokens"),
    "negative-max-tokens": (CMPL, {"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    "negative-max-tokens-chat": (CHAT, {"messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    # out-of-range sampling values
    "temperature-negative": (CMPL, {"prompt": "Hi", "temperature": -0.5}, 400, "temperature"),
    "temperature-huge": (CHAT, {"messages": MSG, "temperature": 1000}, 400, "temperature"),
    "top-p-zero": (CMPL, {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    "top-p-above-one": (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    "top-k-zero": (CMPL, {"prompt": "Hi", "top_k": 0}, 400, "top_k"),
    "min-p-above-one": (CMPL, {"prompt": "Hi", "min_p": 1.5}, 400, "min_p"),
    "presence-penalty": (CMPL, {"prompt": "Hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    "frequency-penalty": (CHAT, {"messages": MSG, "frequency_penalty": -3}, 400, "frequency_penalty"),
    "repetition-penalty": (CMPL, {"prompt": "Hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    "n-zero": (CMPL, {"prompt": "Hi", "n": 0}, 400, "n"),
    "logprobs-too-many": (CMPL, {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    "top-logprobs-too-many": (
        CHAT,
        {"messages": MSG, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    "top-logprobs-without-logprobs": (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    "generate-temperature": (GEN, {"text": "Hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    # NaN / Infinity (Python's json accepts them)
    "nan-temperature": nan("temperature"),
    "nan-top-p": nan("top_p"),
    "nan-presence-penalty-chat": nan("presence_penalty", CHAT),
    "infinite-frequency-penalty": (
        CMPL,
        b'{"prompt": "Hi", "frequency_penalty": Infinity}',
        400,
        "frequency_penalty",
    ),
    # token ids outside the vocabulary
    "prompt-id-past-vocab": (CMPL, {"prompt": [1, VOCAB]}, 400, "prompt"),
    "prompt-id-negative": (CMPL, {"prompt": [-1, 5]}, 400, "prompt"),
    "batched-prompt-id-past-vocab": (CMPL, {"prompt": [[1, 2], [3, VOCAB + 7]]}, 400, "prompt"),
    "generate-input-id-past-vocab": (GEN, {"input_ids": [10**6]}, 400, ("input_ids", "prompt")),
    "logit-bias-id-past-vocab": (CMPL, {"prompt": "Hi", "logit_bias": {str(VOCAB): 1.0}}, 400, "logit_bias"),
    "logit-bias-id-past-vocab-chat": (
        CHAT,
        {"messages": MSG, "logit_bias": {"999999": 1}},
        400,
        "logit_bias",
    ),
    "logit-bias-key-not-an-id": (CMPL, {"prompt": "Hi", "logit_bias": {"abc": 1.0}}, 400, "logit_bias"),
    "logit-bias-value-range": (CMPL, {"prompt": "Hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    "stop-token-id-past-vocab": (CMPL, {"prompt": "Hi", "stop_token_ids": [VOCAB]}, 400, "stop_token_ids"),
    # unknown parameters
    "unknown-param": (CMPL, {"prompt": "Hi", "foo": 1}, 400, "foo"),
    "unknown-param-chat": (CHAT, {"messages": MSG, "bar": True}, 400, "bar"),
    "unknown-param-generate": (GEN, {"text": "Hi", "bogus": 1}, 400, "bogus"),
    "unknown-sampling-param": (
        GEN,
        {"text": "Hi", "sampling_params": {"foo": 1}},
        400,
        "sampling_params.foo",
    ),
    # native sampling_params with values of the wrong type
    "generate-wrong-type": (
        GEN,
        {"text": "Hi", "sampling_params": {"temperature": "hot"}},
        400,
        ("temperature", "sampling_params.temperature", "sampling_params"),
    ),
    "generate-logit-bias-key": (
        GEN,
        {"text": "Hi", "sampling_params": {"logit_bias": {"abc": 1}}},
        400,
        ("logit_bias", "sampling_params.logit_bias"),
    ),
    # a tool's parameters that are no JSON schema of an object, under tool_choice auto too (as OpenAI's API)
    "tool-parameters-bad-type": (
        CHAT,
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
        },
        400,
        "tools.0.function.parameters",
    ),
    "tool-parameters-not-an-object": (
        CHAT,
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
        },
        400,
        "tools.0.function.parameters",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_is_refused_and_server_keeps_serving(server, case):
    path, body, status, params = CASES[case]
    check_error(post(server.url, path, body), status, params)
    assert_still_serving(server.url)


def test_vocab_size_is_the_one_the_cases_assume(server):
    assert httpx.get(f"{server.url}/get_server_info", timeout=30).json()["vocab_size"] == VOCAB


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_unknown_model_is_served_but_not_listed(server, path):
    """As SGLang: a request's `model` names no other model (one is served), but /v1/models/<name> is 404; a
    "<model>:<adapter>" name asks for a LoRA adapter, refused by name."""
    body = {"model": "no-such-model", "max_tokens": 1}
    body |= {"prompt": "Hi"} if path == CMPL else {"messages": MSG}
    assert post(server.url, path, body).status_code == 200
    check_error(post(server.url, path, {**body, "model": "no-such-model:adapter"}), 400, "model", "LoRA")
    err = check_error(httpx.get(f"{server.url}/v1/models/no-such-model", timeout=30), 404, "model")
    assert err["code"] == "model_not_found"
    assert_still_serving(server.url)


def test_unknown_paths_and_methods_get_the_error_shape(server):
    """The router's own 404 and 405 (a path no route matches, such as a model name with a newline, which the
    model route's pattern does not take) come in the OpenAI error shape too."""
    for path in ("/v1/no-such-route", "/v1/models/a%0Ab"):
        r = httpx.get(server.url + path, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]
    r = httpx.get(server.url + CMPL, timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    assert "POST" in r.headers["allow"]
    assert_still_serving(server.url)


def test_prompt_longer_than_context_names_the_numbers(server):
    ctx = httpx.get(f"{server.url}/get_server_info", timeout=30).json()["context_len"]
    check_error(
        post(server.url, CMPL, {"prompt": [42] * (ctx + 5), "max_tokens": 1}),
        400,
        "prompt",
        str(ctx + 5),
        str(ctx),
    )
    err = check_error(
        post(server.url, CMPL, {"prompt": [42] * 10, "max_tokens": ctx}), 400, "max_tokens", str(ctx)
    )
    assert str(ctx - 10) in err["message"]  # says what would fit
    assert_still_serving(server.url)


def test_chat_max_tokens_zero_is_not_silently_one(server):
    """max_tokens=0 is either refused naming max_tokens or honoured (no tokens); never turned into 1 token."""
    r = post(server.url, CHAT, {"messages": MSG, "max_tokens": 0, "temperature": 0})
    if r.status_code == 400:
        check_error(r, 400, ("max_tokens", "max_completion_tokens"))
    else:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 0, r.json()
    assert_still_serving(server.url)


# OpenAI's fields that cannot change the output: accepted (and ignored), so clients that send them work
IGNORED_FIELDS = {
    "user": "u-1",
    "metadata": {"team": "search"},
    "store": True,
    "service_tier": "auto",
    "prompt_cache_key": "k-1",
    "safety_identifier": "s-1",
}


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_fields_that_do_not_change_output_are_accepted(server, path):
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    body |= {"prompt": "Hi"} if path == CMPL else {"messages": MSG}
    plain = post(server.url, path, body)
    with_fields = post(server.url, path, {**body, **IGNORED_FIELDS})
    assert plain.status_code == 200 and with_fields.status_code == 200, with_fields.text
    key = "text" if path == CMPL else "message"
    assert with_fields.json()["choices"][0][key] == plain.json()["choices"][0][key]


@pytest.mark.parametrize(
    "field, value",
    [
        ("reasoning_effort", "high"),
        ("prediction", {"type": "content", "content": "x"}),
        ("modalities", ["audio"]),
    ],
)
def test_fields_that_would_change_output_are_refused_by_name(server, field, value):
    resp = post(server.url, CHAT, {"messages": MSG, "max_tokens": 1, field: value})
    err = check_error(resp, 400, field, f"{field} is not supported by Kiln")
    assert err["param"] == field
    assert_still_serving(server.url)


def test_image_content_part_is_refused_as_image_input(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    content = [{"type": "text", "text": "What is this?"}, image]
    resp = post(server.url, CHAT, {"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    err = check_error(resp, 400, "messages.0.content", "image input is not supported", "text-only")
    assert err["param"] == "messages.0.content"
    assert_still_serving(server.url)


def test_continue_final_message_needs_an_assistant_message_last(server):
    resp = post(server.url, CHAT, {"messages": MSG, "max_tokens": 1, "continue_final_message": True})
    check_error(resp, 400, "continue_final_message", "assistant")
    assert_still_serving(server.url)


def test_chat_template_kwargs_win_over_kilns_own_and_a_clash_is_a_400(server):
    """vLLM's order: the client's chat_template_kwargs override the options Kiln passes the template (here: no
    assistant turn opened, so the prompt is shorter); a key the template call cannot take is the client's error."""
    body = {"messages": MSG, "max_tokens": 1, "temperature": 0}
    opened = post(server.url, CHAT, body)
    closed = post(server.url, CHAT, {**body, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert opened.status_code == 200 and closed.status_code == 200, closed.text
    assert closed.json()["usage"]["prompt_tokens"] < opened.json()["usage"]["prompt_tokens"]
    clash = post(server.url, CHAT, {**body, "chat_template_kwargs": {"conversation": []}})
    check_error(clash, 400, "chat_template_kwargs", "conversation")
    # the field's own key there too: the same rule for the last message, no clash with Kiln's
    continued = {"chat_template_kwargs": {"continue_final_message": True}}
    prefill = [*MSG, {"role": "assistant", "content": "The answer is"}]
    assert post(server.url, CHAT, {**body, **continued, "messages": prefill}).status_code == 200
    check_error(post(server.url, CHAT, {**body, **continued}), 400, "continue_final_message", "assistant")
    assert_still_serving(server.url)


def test_openai_client_sees_the_error_fields(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=60, max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=None, prompt="Hi", temperature=-1)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    ok = client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=1)
    assert ok.usage.completion_tokens == 1


# ---------------------------------------------------------------------------------------------- a tiny KV pool
TINY_POOL = ["--max-total-tokens", "256", "--max-running-requests", "4"]


def test_pool_smaller_than_context_is_a_valid_setup(tiny_llama):
    """As in SGLang, a KV pool smaller than the context length is allowed: requests that cannot fit the pool are
    refused one by one (below), the server itself starts."""
    cmd = [
        sys.executable,
        "-m",
        "kiln.cli",
        "plan",
        "--model-path",
        tiny_llama,
        *TINY_POOL,
        "--context-length",
        "2048",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-1500:]


@pytest.fixture(scope="module")
def tiny_pool_server(tiny_llama, tmp_path_factory):
    """A 256-token KV pool under the tiny model's 4096-token context."""
    srv = ServerProcess(
        ["--model-path", tiny_llama, *TINY_POOL], tmp_path_factory.mktemp("tiny-pool") / "serve.log"
    )
    try:
        srv.wait_ready(timeout=180)
        yield srv
    finally:
        srv.stop()


def test_request_that_never_fits_the_pool_is_refused_with_numbers(tiny_pool_server):
    url = tiny_pool_server.url
    data = httpx.get(f"{url}/get_server_info", timeout=30).json()
    assert data["max_total_num_tokens"] == 256 and data["context_len"] > 300
    # fits the context but never the pool: refused up front with the numbers, not queued forever
    err = check_error(
        post(url, CMPL, {"prompt": [5] * 300, "max_tokens": 8}), 400, ("prompt", "max_tokens"), "256"
    )
    assert "300" in err["message"]
    err = check_error(
        post(url, CMPL, {"prompt": [5] * 100, "max_tokens": 200}), 400, "max_tokens", "256", "300"
    )
    assert "156" in err["message"]  # the largest max_tokens that would fit
    check_error(post(url, CHAT, {"messages": MSG, "max_tokens": 400}), 400, "max_tokens", "256")
    resp = post(url, GEN, {"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": 200}})
    check_error(resp, 400, ("max_new_tokens", "max_tokens"), "256")
    ok = post(url, CMPL, {"prompt": [5] * 100, "max_tokens": 100, "temperature": 0, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 100
    integrity = httpx.get(f"{url}/get_server_info", timeout=30).json()["integrity"]
    assert integrity["ok"] and integrity["in_use"] == 0
