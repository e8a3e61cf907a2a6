"""--sampling-defaults (issue 46, part 2; SGLang's flag): under `model` (the default) a request's unset temperature,
top_p, top_k, min_p and repetition_penalty take the model's generation_config.json values, a parameter the request
sends keeps its value (even at the plain default), `openai` ignores the file, and /model_info reports the
defaults in use. The reading and the merge are unit tests; the request paths run in process over a recording
engine client; one `kiln serve` of a tiny Llama whose file says top_k 1 shows the default reach the sampler."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from starlette.testclient import TestClient

from kiln.config import ServerArgs
from kiln.loader.generation_config import read_sampling_defaults, sampling_defaults
from kiln.sampling_params import SamplingParams
from kiln.scheduler.io import OutputAccumulator, ReqOutput
from kiln.scheduler.validate import Limits
from kiln.server.app import ServerState, create_app
from kiln.server.openai_api import OpenAIServing
from kiln.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from kiln.server.sglang_routes import model_info
from kiln.server.startup import StartupState

pytestmark = pytest.mark.unit

# every field SGLang reads, each away from its plain default, beside fields it does not read
FILE = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "do_sample": False,  # not read (SGLang does not): the temperature above still samples
    "max_new_tokens": 5,
    "bos_token_id": 1,
}
MODEL = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
PLAIN = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def model_with(tmp_path: Path, generation_config: dict | str | None) -> str:
    """A model directory holding a config.json and, unless None, this generation_config.json."""
    directory = tmp_path / "m"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if generation_config is not None:
        text = generation_config if isinstance(generation_config, str) else json.dumps(generation_config)
        (directory / "generation_config.json").write_text(text)
    return str(directory)


def sampled(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in PLAIN}


# ------------------------------------------------------------------------------ reading the file
def test_the_model_defaults_are_the_five_fields_the_file_sets(tmp_path):
    path = model_with(tmp_path, FILE)
    assert read_sampling_defaults(path) == MODEL
    assert sampling_defaults("model", path) == MODEL
    assert sampling_defaults("model", str(Path(path) / "config.json")) == MODEL  # beside a config.json path
    assert sampling_defaults("openai", path) == {}  # openai ignores the file
    assert read_sampling_defaults(model_with(tmp_path / "partial", {"temperature": 0.7, "top_p": None})) == {
        "temperature": 0.7
    }


def test_no_file_a_gguf_and_no_model_give_no_defaults(tmp_path):
    assert sampling_defaults("model", model_with(tmp_path, None)) == {}
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "generation_config.json").write_text(json.dumps(FILE))  # beside it, not in it: not read
    assert sampling_defaults("model", str(gguf)) == {}
    assert sampling_defaults("model", None) == {}
    with pytest.raises(ValueError, match="--sampling-defaults greedy"):
        sampling_defaults("greedy", str(gguf))


def test_values_kiln_cannot_sample_with_are_dropped_with_a_warning(tmp_path, caplog):
    bad = {"temperature": "hot", "top_p": 0.95, "top_k": 0, "repetition_penalty": 5.0, "min_p": True}
    with caplog.at_level(logging.WARNING, logger="kiln"):
        # top_k 0 is transformers' "no top-k", Kiln's -1; the others would 400 every request, or are not numbers
        assert read_sampling_defaults(model_with(tmp_path, bad)) == {"top_p": 0.95, "top_k": -1}
    assert "temperature='hot'" in caplog.text and "repetition_penalty=5.0" in caplog.text
    assert "min_p=True" in caplog.text
    assert read_sampling_defaults(model_with(tmp_path / "x", {"top_k": 2.5})) == {}
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert read_sampling_defaults(model_with(tmp_path / "y", "{not json")) == {}
    assert "cannot be read" in caplog.text


# ------------------------------------------------------------------------------ the merge, per request body
def test_unset_fields_take_the_model_defaults_and_sent_ones_are_kept():
    cmpl = CompletionRequest.model_validate({"prompt": "x"})
    assert sampled(cmpl.sampling_params(16, False, 0, MODEL)) == MODEL
    assert sampled(cmpl.sampling_params(16, False, 0, {})) == PLAIN  # openai: SamplingParams' own
    # sent at the plain default is still sent: unset and "1.0" differ
    cmpl = CompletionRequest.model_validate({"prompt": "x", "temperature": 1.0, "top_k": -1})
    assert sampled(cmpl.sampling_params(16, False, 0, MODEL)) == {**MODEL, "temperature": 1.0, "top_k": -1}
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "top_p": 0.5}
    )
    assert sampled(chat.sampling_params(8, False, 0, MODEL)) == {**MODEL, "top_p": 0.5}
    native = GenerateRequest.model_validate({"text": "x"})  # no sampling_params at all
    assert sampled(native.params(MODEL)) == MODEL
    native = GenerateRequest.model_validate(
        {"text": "x", "sampling_params": {"min_p": 0.0, "max_new_tokens": 4}}
    )
    params = native.params(MODEL)
    assert sampled(params) == {**MODEL, "min_p": 0.0} and params.max_new_tokens == 4
    assert sampled(native.params()) == {**PLAIN, "min_p": 0.0}


# ------------------------------------------------------------------------------ in process: routes and report
class RecordingClient:
    """The EngineClient surface the serving layer uses: records each request's params, answers one token."""

    def __init__(self):
        self.params: list[SamplingParams] = []
        self.queues: dict[str, object] = {}
        self.num_active = 0

    async def collect(self, input_ids, params, rid=None, deadline=None, lora_path=None) -> OutputAccumulator:
        self.params.append(params)
        result = OutputAccumulator()
        result.add(ReqOutput("r", [7], "a", True, {"type": "length", "length": 1}, len(input_ids), 1, 0))
        return result

    async def prefill_only(self, input_ids, lora_path=None) -> None:
        return None


@pytest.fixture(scope="module")
def tokenizer():
    from conftest import default_tokenizer_source

    from kiln.text.tokenizer import load_tokenizer

    return load_tokenizer(default_tokenizer_source())


def app_with(tokenizer, mode: str, path: str) -> tuple[TestClient, RecordingClient]:
    """The real app over a recording client, wired as Launcher wires it: the defaults read once, for both."""
    state = ServerState(ServerArgs(model_path=path, sampling_defaults=mode), StartupState())
    state.model_name = "m"
    state.sampling_defaults = sampling_defaults(mode, path)
    client = RecordingClient()
    limits = Limits(len(tokenizer), 2048, 16384)
    state.serving = OpenAIServing(client, tokenizer, limits, "m", sampling_defaults=state.sampling_defaults)
    return TestClient(create_app(state)), client


@pytest.mark.parametrize("mode", ["model", "openai"])
def test_every_generation_route_takes_the_defaults_and_model_info_reports_them(tokenizer, tmp_path, mode):
    http, client = app_with(tokenizer, mode, model_with(tmp_path, FILE))
    expected = MODEL if mode == "model" else PLAIN
    bodies = [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "top_p": 0.5}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_p": 0.5}),
        ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"top_p": 0.5, "max_new_tokens": 1}}),
    ]
    for path, body in bodies:
        assert http.post(path, json=body).status_code == 200, path
    assert [sampled(p) for p in client.params] == [{**expected, "top_p": 0.5}] * 3
    for route in ("/model_info", "/get_model_info"):
        info = http.get(route).json()
        assert info["sampling_defaults"] == mode and info["default_sampling_params"] == expected


def test_model_info_of_a_model_without_a_file_reports_the_plain_defaults(tmp_path):
    info = model_info(ServerArgs(model_path=model_with(tmp_path, None)), "m", {})
    assert info["sampling_defaults"] == "model" and info["default_sampling_params"] == PLAIN


def test_the_flag_parses_with_sglang_s_name_and_default():
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli(parser.parse_args([])).sampling_defaults == "model"
    args = ServerArgs.from_cli(parser.parse_args(["--sampling-defaults", "openai"]))
    assert args.sampling_defaults == "openai" and args.foreign_flags == ()
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--sampling-defaults", "vllm"])


# ------------------------------------------------------------------------------ one real server
@pytest.fixture(scope="module")
def greedy_by_default(tiny_llama, tmp_path_factory):
    """`kiln serve` of the tiny Llama whose generation_config.json says top_k 1: unset top_k decodes greedily."""
    root = tmp_path_factory.mktemp("sampling-defaults")
    path = root / "model"
    shutil.copytree(tiny_llama, path)
    (path / "generation_config.json").write_text(
        json.dumps({"top_k": 1, "temperature": 0.8, "do_sample": True})
    )
    flags = ["--model-path", str(path), "--max-total-tokens", "4096", "--max-running-requests", "8"]
    server = ServerProcess([*flags, "--skip-server-warmup"], root / "serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.mark.server
def test_a_served_model_s_top_k_1_makes_unset_top_k_greedy(greedy_by_default):
    url = greedy_by_default.url

    def generate(**sampling) -> list[int]:
        body = {"input_ids": [1, 400, 500, 600], "sampling_params": {"max_new_tokens": 12, **sampling}}
        response = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["output_ids"]

    greedy = generate(temperature=0.0)
    # temperature 1 sent, top_k left to the model: greedy, whatever the seed
    assert generate(temperature=1.0, sampling_seed=1) == generate(temperature=1.0, sampling_seed=2) == greedy
    # top_k sent (at the plain default) is kept: the random model's near-flat distribution is sampled
    assert generate(temperature=1.0, top_k=-1, sampling_seed=1) != greedy
    completion = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "Hello there", "max_tokens": 8, "temperature": 1.0, "seed": 3},
        timeout=120,
    ).json()
    reference = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "Hello there", "max_tokens": 8, "temperature": 0},
        timeout=120,
    ).json()
    assert completion["choices"][0]["text"] == reference["choices"][0]["text"]
    info = httpx.get(f"{url}/model_info", timeout=30).json()
    assert info["sampling_defaults"] == "model"
    assert info["default_sampling_params"] == {**PLAIN, "top_k": 1, "temperature": 0.8}
