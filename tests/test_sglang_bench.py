"""SGLang's benchmark against Kiln, and `kiln bench serve` with SGLang's defaults.

`python -m sglang.bench_serving` cannot be imported in Kiln's test environment: the `sglang` package's
`__init__` imports its runtime utilities, which need triton (a GPU compiler) and other GPU-side packages even for
the benchmark client. So these tests replay, field for field, the HTTP requests that bench_serving (the
`sglang.benchmark.serving` module of SGLang 0.5.23) sends with its default flags for `--backend sglang` and
`--backend sglang-oai`, and read the answers the way its code does: the readiness probe and model name
(/v1/models), the tokenizer (/model_info), the warm-up request, `--flush-cache`, the benchmark requests and the
/server_info reads that follow the run."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import httpx
import pytest

from kiln.bench.cli import main as bench_main
from kiln.bench.serve import RequestInput, build_body, default_output_file
from kiln.bench.workloads import Conversation, Turn, apply_chat_template, build_workload, sharegpt_workload

pytestmark = pytest.mark.server

PROMPT = "Write a short story about a lighthouse keeper and a storm."
OUTPUT_LEN = 8
WARMUP_OUTPUT_LEN = min(OUTPUT_LEN, 32)  # bench_serving's warm-up asks for min(output_len, 32) tokens


# ------------------------------------------------------------------------------------- bench_serving's requests
def sglang_generate_payload(prompt: str, output_len: int) -> dict:
    """async_request_sglang_generate's body with bench_serving's default flags (temperature 0, top_p 1, EOS
    ignored, streamed, no LoRA, no logprobs)."""
    return {
        "text": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }


def openai_completions_payload(model: str, prompt: str, output_len: int) -> dict:
    """async_request_openai_completions's body with the default flags (`--backend sglang-oai`)."""
    return {
        "model": model,
        "prompt": prompt,
        "best_of": 1,
        "max_tokens": output_len,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def data_lines(response: httpx.Response):
    """The stream's chunks as bench_serving reads them: stripped lines, the `data: ` prefix removed."""
    for line in response.iter_lines():
        chunk = line.strip()
        if chunk:
            yield chunk.removeprefix("data: ")


def read_sglang_stream(response: httpx.Response) -> tuple[str, int, int]:
    """(generated text, output_len, token-carrying chunks) as async_request_sglang_generate computes them."""
    text, output_len, chunks = "", 0, 0
    for chunk in data_lines(response):
        if chunk == "[DONE]":
            continue
        data = json.loads(chunk)
        if "text" in data and data["text"]:
            text = data["text"]  # cumulative
            output_len = data["meta_info"]["completion_tokens"]
            chunks += 1
    return text, output_len, chunks


def read_openai_stream(response: httpx.Response) -> tuple[str, int]:
    """(generated text, token-carrying chunks) as async_request_openai_completions computes them: it indexes
    choices[0] of every chunk, so a chunk without choices would fail the request."""
    text, chunks = "", 0
    for chunk in data_lines(response):
        if chunk == "[DONE]":
            continue
        data = json.loads(chunk)
        piece = data["choices"][0]["text"]
        if piece:
            text += piece
            chunks += 1
    return text, chunks


def bench_serving_preamble(url: str) -> tuple[str, str]:
    """The ready check and model name (GET /v1/models), then the tokenizer path (GET /model_info)."""
    models = httpx.get(f"{url}/v1/models", timeout=30)
    assert models.status_code == 200
    model = models.json().get("data", [])[0]["id"]
    info = httpx.get(f"{url}/model_info", timeout=5)
    assert info.status_code == 200
    tokenizer = info.json().get("tokenizer_path") or info.json().get("model_path")
    assert tokenizer and os.path.exists(tokenizer), info.json()
    return model, tokenizer


def bench_serving_epilogue(url: str, backend: str) -> None:
    """After the run: the accept length read from /server_info (sglang backends), then /server_info stored in
    the result record, both read as bench_serving reads them."""
    info = httpx.get(f"{url}/server_info", timeout=30)
    assert info.status_code == 200
    body = info.json()
    if "sglang" in backend:
        if "decode" in body:
            body = body["decode"][0]
        if "internal_states" in body and body["internal_states"]:
            body["internal_states"][0].get("avg_spec_accept_length", None)
    json.dumps(body)  # the record holds it as JSON


def flush_cache_as_bench_serving(url: str) -> None:
    """`--flush-cache` after the warm-up: POST /flush_cache with SGLang's timeout parameter, must be 2xx."""
    httpx.post(f"{url}/flush_cache", params={"timeout": 60.0}, timeout=90).raise_for_status()


def test_bench_serving_backend_sglang_replayed(server):
    url = server.url
    bench_serving_preamble(url)
    for i, output_len in enumerate((WARMUP_OUTPUT_LEN, OUTPUT_LEN)):  # the warm-up, then a benchmark request
        body = sglang_generate_payload(PROMPT, output_len)
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            text, got_len, chunks = read_sglang_stream(r)
        assert got_len == output_len and text, (got_len, text)  # EOS ignored: the length asked for
        assert chunks > 1  # streamed: bench_serving measures its ITL between chunks
        if i == 0:
            flush_cache_as_bench_serving(url)
    bench_serving_epilogue(url, "sglang")


def test_bench_serving_backend_sglang_oai_replayed(server):
    url = server.url
    model, _ = bench_serving_preamble(url)
    for i, output_len in enumerate((WARMUP_OUTPUT_LEN, OUTPUT_LEN)):
        body = openai_completions_payload(model, PROMPT, output_len)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            text, chunks = read_openai_stream(r)
        assert text and chunks > 1  # bench_serving counts output_len as asked (no usage in its stream)
        if i == 0:
            flush_cache_as_bench_serving(url)
    bench_serving_epilogue(url, "sglang-oai")


# ------------------------------------------------------------------------------------- kiln bench serve
class WordTokenizer:
    """Words as tokens, and a chat template that wraps the message: enough for the workload code."""

    bos_token = "<s>"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        return f"<s>[USER] {messages[0]['content']} [ASSISTANT]"


def write_sharegpt(path, pairs: list[tuple[str, str]], extra: list | None = None) -> str:
    data = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in pairs]
    path.write_text(json.dumps(data + (extra or [])))
    return str(path)


@pytest.mark.unit
def test_sharegpt_sampling(tmp_path):
    pairs = [(f"question number {i} about lighthouses", " ".join(["word"] * (3 + i))) for i in range(6)]
    extra = [
        {"conversations": [{"from": "human", "value": "alone"}]},
        {"conversations": [{"value": "hi"}] * 2},
    ]
    path = write_sharegpt(tmp_path / "sg.json", pairs, extra)
    tok = WordTokenizer()
    convs = sharegpt_workload(tok, path, num_prompts=4, seed=1)
    assert len(convs) == 4  # single-turn and one-word conversations are dropped
    for conv in convs:
        (turn,) = conv.turns
        assert turn.prompt.startswith("question number")
        i = int(turn.prompt.split()[2])
        assert (turn.prompt_len, turn.output_len) == (5, 3 + i)  # the reference answer's length
    assert [c.turns[0].prompt for c in sharegpt_workload(tok, path, 4, seed=1)] == [
        c.turns[0].prompt for c in convs
    ]
    fixed = sharegpt_workload(tok, path, num_prompts=10, seed=2, output_len=7, context_len=12)
    assert len(fixed) == 6 and {c.turns[0].output_len for c in fixed} == {7}
    assert sharegpt_workload(tok, path, num_prompts=10, seed=2, output_len=7, context_len=11) == []
    with pytest.raises(ValueError, match="at least 4"):
        sharegpt_workload(tok, path, 1, 1, output_len=3)


@pytest.mark.unit
def test_chat_template_applies_to_completion_backends_only(tmp_path):
    tok = WordTokenizer()
    convs = [Conversation([Turn("tell me a story", 4, 8)])]
    (templated,) = apply_chat_template(tok, convs)
    assert templated.turns[0].prompt == "[USER] tell me a story [ASSISTANT]"  # BOS left to the server
    assert templated.turns[0].prompt_len == 6 and templated.turns[0].output_len == 8
    path = write_sharegpt(tmp_path / "sg.json", [("tell me a story", "once upon a time")])
    args = SimpleNamespace(dataset_name="sharegpt", dataset_path=path, num_prompts=1, seed=1, apply_chat_template=True,
                           sharegpt_output_len=None, sharegpt_context_len=None, backend="sglang")  # fmt: skip
    assert build_workload(args, tok)[0].turns[0].prompt.startswith("[USER]")
    args.backend = "openai-chat"
    assert build_workload(args, tok)[0].turns[0].prompt == "tell me a story"


def test_eos_is_ignored_unless_disabled():
    from kiln.cli import build_parser

    def parse(*argv: str):
        return build_parser().parse_args(["bench", "serve", *argv])

    assert parse().ignore_eos is True
    assert parse("--ignore-eos").ignore_eos is True
    assert parse("--disable-ignore-eos").ignore_eos is False
    inp = RequestInput("hi", 1, 4)
    assert build_body("kiln", "", inp, True, {})["sampling_params"]["ignore_eos"] is True
    assert "ignore_eos" not in build_body("openai", "m", inp, False, {})
    args = parse("--output-json", "x.jsonl")
    assert args.output_file == "x.jsonl"  # the old flag name still works


@pytest.mark.unit
def test_default_output_file_is_sglangs_name():
    args = SimpleNamespace(backend="sglang", dataset_name="random", num_prompts=10, random_input_len=64,
                           random_output_len=32)  # fmt: skip
    assert re.fullmatch(r"sglang_\d{4}_10_64_32\.jsonl", default_output_file(args))
    args.dataset_name = "sharegpt"
    assert re.fullmatch(r"sglang_\d{4}_10_sharegpt\.jsonl", default_output_file(args))


def test_kiln_bench_serve_with_sglangs_defaults(server, tmp_path, monkeypatch):
    """No --tokenizer (the served model's, from /model_info), no --ignore-eos (ignored by default), no
    --output-file (SGLang's name in the current directory), a ShareGPT file, the chat template, a cache flush."""
    pairs = [(f"Question {i}: why is the sea {c}?", "Because of the sky. " * 20) for i, c in enumerate("ab")]
    path = write_sharegpt(tmp_path / "sharegpt.json", pairs)
    monkeypatch.chdir(tmp_path)
    argv = ["serve", "--base-url", server.url, "--backend", "sglang", "--dataset-name", "sharegpt",
            "--dataset-path", path, "--num-prompts", "2", "--sharegpt-output-len", "8", "--apply-chat-template",
            "--flush-cache", "--max-concurrency", "2", "--disable-tqdm", "--request-timeout", "120",
            "--total-timeout", "300"]  # fmt: skip
    assert bench_main(argv) == 0
    (written,) = [p for p in os.listdir(tmp_path) if p.endswith(".jsonl")]
    assert re.fullmatch(r"sglang_\d{4}_2_sharegpt\.jsonl", written)
    (line,) = (tmp_path / written).read_text().splitlines()
    rec = json.loads(line)
    assert rec["completed"] == 2 and rec["failed"] == 0, rec["errors"]
    assert rec["total_output_tokens"] == 2 * 8  # EOS ignored by default
    info = httpx.get(f"{server.url}/model_info", timeout=30).json()
    assert rec["tokenizer"] == (info.get("tokenizer_path") or info["model_path"])
    assert rec["ignore_eos"] is True and rec["apply_chat_template"] is True and rec["flush_cache"] is True
