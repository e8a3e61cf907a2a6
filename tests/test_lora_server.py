"""Multi-LoRA serving over HTTP, on one `kiln serve` of a tiny random Llama with PEFT-built adapters: /generate's
lora_path (a list per batch item, null for the base) and OpenAI's model "BASE:ADAPTER" give transformers' greedy ids
with the adapter merged; adapters load and unload at runtime while requests run, none failing; the refusals are
400s naming the parameter and the adapter; /v1/models, /get_server_info and /metrics list the adapters."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import served
from lora_models import build_adapter, build_adapters, merged_model
from test_correctness import hf_greedy, make_prompt, token_stream

pytestmark = pytest.mark.server

NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama: str, tmp_path_factory) -> dict[str, str]:
    return build_adapters(tiny_llama, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def server(tiny_llama: str, adapters, tmp_path_factory):
    flags = [
        "--model-path",
        tiny_llama,
        "--lora-paths",
        f"alpha={adapters['alpha']}",
        f"beta={adapters['beta']}",
    ]
    flags += ["--max-loras-per-batch", "2", "--max-lora-rank", "8", "--max-total-tokens", "4096"]
    log = tmp_path_factory.mktemp("lora") / "serve.log"
    yield from served([*flags, "--max-running-requests", "32"], log, ready_timeout=240)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    stream = token_stream()
    return [make_prompt(stream, n, 71 * i + 3) for i, n in enumerate((5, 23))]


def reference(base: str, adapter: str | None, prompts: list[list[int]]) -> list[list[int]]:
    model = merged_model(base, adapter)
    with torch.inference_mode():
        return [hf_greedy(model, p, NEW, set())[0] for p in prompts]


def generate(url: str, prompts, lora_path) -> httpx.Response:
    params = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    body = {"input_ids": prompts, "sampling_params": params, "lora_path": lora_path}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def check_400(resp: httpx.Response, param: str, *words: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_generate_mixed_batch_equals_transformers(server, tiny_llama, adapters, prompts) -> None:
    want = {
        name: reference(tiny_llama, adapters.get(name or ""), prompts) for name in (None, "alpha", "beta")
    }
    batch = [(p, name) for p in prompts for name in (None, "alpha", "beta")]
    resp = generate(server.url, [p for p, _ in batch], [n for _, n in batch])
    assert resp.status_code == 200, resp.text
    got = [o["output_ids"] for o in resp.json()]
    assert got == [want[n][prompts.index(p)] for p, n in batch]
    single = generate(server.url, prompts[0], "beta").json()  # one prompt, one adapter name
    assert single["output_ids"] == want["beta"][0]


def test_openai_model_names_the_adapter(server, prompts) -> None:
    """model "BASE:ADAPTER" on /v1/completions is the adapter's /generate; the base name alone is the base."""
    served = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    for model, lora in ((f"{served}:alpha", "alpha"), (served, None), (f"{served}:beta", "beta")):
        body = {
            "model": model,
            "prompt": prompts[1],
            "max_tokens": NEW,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == generate(server.url, prompts[1], lora).json()["text"]


def test_load_and_unload_under_load(server, tiny_llama, adapters, tmp_path, prompts) -> None:
    """Requests on both adapters and the base run while a third adapter is loaded, used and unloaded: every one
    succeeds, and the third's outputs are transformers' with it merged."""
    stream = token_stream()
    load = [make_prompt(stream, 30 + i, 13 * i) for i in range(12)]
    names = [None, "alpha", "beta"]

    def one(i: int) -> int:
        return generate(server.url, load[i], names[i % 3]).status_code

    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(one, i) for i in range(len(load))]
        loaded = httpx.post(
            f"{server.url}/load_lora_adapter",
            json={"lora_name": "gamma", "lora_path": adapters["gamma"]},
            timeout=120,
        )
        gamma = [pool.submit(lambda p: generate(server.url, p, "gamma"), p) for p in prompts]
        more = [pool.submit(one, i) for i in range(len(load))]
        statuses = [f.result() for f in running + more]
        gamma_out = [f.result() for f in gamma]
    assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
    assert statuses == [200] * len(statuses)
    assert [r.json()["output_ids"] for r in gamma_out] == reference(tiny_llama, adapters["gamma"], prompts)
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(one, i) for i in range(6)]
        unloaded = httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "gamma"}, timeout=120)
        assert [f.result() for f in running] == [200] * 6
    assert unloaded.status_code == 200 and set(unloaded.json()["loaded_adapters"]) == {"alpha", "beta"}
    check_400(generate(server.url, prompts[0], "gamma"), "lora_path", "'gamma'", "not loaded")


def test_refusals_name_the_parameter_and_the_adapter(server, tiny_llama, prompts, tmp_path) -> None:
    check_400(generate(server.url, prompts[0], "nope"), "lora_path", "'nope'", "alpha, beta")
    check_400(generate(server.url, prompts, ["alpha"]), "lora_path", "1 entries for 2 prompts")
    body = {"model": "base:nope", "prompt": "Hi", "max_tokens": 2}
    check_400(httpx.post(f"{server.url}/v1/completions", json=body), "model", "'nope'")
    big = build_adapter(tiny_llama, tmp_path / "big", 9, r=16, lora_alpha=16, target_modules=["o_proj"])
    resp = httpx.post(
        f"{server.url}/load_lora_adapter", json={"lora_name": "big", "lora_path": big}, timeout=60
    )
    check_400(resp, "lora_name", "'big'", "rank 16", "--max-lora-rank 8")
    resp = httpx.post(
        f"{server.url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")}
    )
    check_400(resp, "lora_name", "'x'", "adapter_config.json")
    check_400(httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "x"}), "lora_name", "'x'")


def test_adapters_are_listed_and_counted(server) -> None:
    cards = httpx.get(f"{server.url}/v1/models").json()["data"]
    base = cards[0]["id"]
    assert {c["id"]: c.get("parent") for c in cards[1:]} == {f"{base}:alpha": base, f"{base}:beta": base}
    info = httpx.get(f"{server.url}/get_server_info").json()
    assert set(info["lora_adapters"]) == {"alpha", "beta"}
    check = next(
        r for r in info["memory_check"] if r["name"] == "lora_slots"
    )  # the ledger's line vs allocated
    assert check["measured"] > 0 and abs(check["error"]) <= 0.01, check
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'kiln:lora_requests_total{lora_name="alpha"}' in metrics
    assert 'kiln:lora_tokens_total{kind="generation",lora_name="beta"}' in metrics
