"""Prompt logprobs (issue 49, item 3): SGLang's logprob_start_len on /generate and the in-process Engine, OpenAI's
echo with logprobs on /v1/completions. On a tiny random float32 Llama they equal transformers' log_softmax of the
same positions within 1e-4 and their top ids its top-k, in one prefill and over prefill chunks, after a radix-cache
hit of the same prompt (which then covers only the prompt before the start), and over HTTP; bad starts and counts
are 400s naming the parameter, and the server keeps serving."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from conftest import ServerProcess, served
from test_correctness import load_hf, make_prompt, token_stream

import kiln
from kiln.runner.prompt_logprobs import score_rows
from kiln.sampling_params import InvalidParam

pytestmark = pytest.mark.engine

CHUNK = 32  # --chunked-prefill-size: the long prompt takes three prefill steps
TOP = 5
ATOL = 1e-4


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    stream = token_stream()
    return {"short": make_prompt(stream, 20, 3), "long": make_prompt(stream, 90, 41)}


@pytest.fixture(scope="module")
def ref(tiny_llama: str, prompts: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """transformers' log_softmax at every position of each prompt: row p scores token p + 1."""
    model = load_hf(tiny_llama)
    with torch.inference_mode():
        return {
            k: torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for k, p in prompts.items()
        }


@pytest.fixture(scope="module")
def engine(tiny_llama: str) -> Iterator[kiln.Engine]:
    eng = kiln.Engine(
        model_path=tiny_llama,
        max_total_tokens=4096,
        num_threads=1,
        disable_cuda_graph=True,
        chunked_prefill_size=CHUNK,
    )
    yield eng
    eng.shutdown()
    gc.collect()


def expected(ref: torch.Tensor, prompt: list[int], start: int) -> tuple[list[float], list[list[int]]]:
    """The logprobs of prompt[start + 1:] and the top-TOP ids at their rows."""
    rows = ref[start : len(prompt) - 1]
    values = rows.gather(1, torch.tensor(prompt[start + 1 :]).unsqueeze(-1)).squeeze(-1)
    return values.tolist(), rows.topk(TOP, dim=-1).indices.tolist()


def check(
    got: list[float], top_ids: list[list[int]], ref: torch.Tensor, prompt: list[int], start: int
) -> None:
    want, want_top = expected(ref, prompt, start)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=ATOL)
    assert top_ids == want_top


def check_engine(meta: dict, ref: torch.Tensor, prompt: list[int], start: int) -> None:
    """The Engine's meta_info: (logprob, id) pairs and (id, logprob) tops from the start, the first one null."""
    got, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert got[0] == (None, prompt[start]) and tops[0] is None  # SGLang's: nothing before the start scores it
    assert [t for _, t in got] == prompt[start:]
    check([v for v, _ in got[1:]], [[i for i, _ in top] for top in tops[1:]], ref, prompt, start)


def engine_prompt_logprobs(eng: kiln.Engine, prompt: list[int], start: int) -> dict:
    params = {"max_new_tokens": 2, "temperature": 0.0, "logprobs": True, "top_logprobs_num": TOP}
    return eng.generate(input_ids=prompt, sampling_params={**params, "logprob_start_len": start})["meta_info"]


@pytest.mark.parametrize("kind", ["short", "long"])  # one prefill step; three chunks (CHUNK)
@pytest.mark.parametrize("start", [0, 7])
def test_engine_matches_transformers(engine, prompts, ref, kind: str, start: int) -> None:
    prompt = prompts[kind]
    engine.scheduler.flush_cache()
    check_engine(engine_prompt_logprobs(engine, prompt, start), ref[kind], prompt, start)
    assert engine.check_integrity()["in_use"] == 0


def test_radix_hit_stops_at_the_start(engine, prompts, ref) -> None:
    """A cached prompt: the hit covers the tokens before the start only (SGLang caps the prefix there), so every
    scored row is computed; the cache itself is left whole for the next request."""
    prompt, start = prompts["long"], 40
    engine.scheduler.flush_cache()
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    meta = engine_prompt_logprobs(engine, prompt, start)
    assert 0 < meta["cached_tokens"] <= start
    check_engine(meta, ref["long"], prompt, start)
    again = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert "input_token_logprobs" not in again["meta_info"]  # without logprob_start_len: none


def test_engine_refuses_starts_outside_the_prompt(engine, prompts) -> None:
    prompt = prompts["short"]
    for start in (len(prompt), -2):
        with pytest.raises(InvalidParam) as refused:
            engine_prompt_logprobs(engine, prompt, start)
        assert refused.value.param == "logprob_start_len"


@pytest.mark.unit
def test_rows_are_scored_a_chunk_at_a_time() -> None:
    """The head sees at most `chunk` rows a call, and the chunked scores are the whole log_softmax's."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(11, 8), torch.randn(50, 8)
    targets = torch.randint(0, 50, (11,))
    seen: list[int] = []

    def head(h: torch.Tensor) -> torch.Tensor:
        seen.append(h.shape[0])
        return h @ weight.T

    scores = score_rows(head, hidden, targets, top_n=3, chunk=4)
    assert seen == [4, 4, 3]
    full = torch.log_softmax(hidden @ weight.T, -1)
    want = full.gather(1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(scores.logprobs), want, rtol=0, atol=1e-6)
    assert [[i for i, _ in top] for top in scores.top] == full.topk(3, dim=-1).indices.tolist()


# ---------------------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(tiny_llama: str, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("prompt-logprobs") / "serve.log"
    args = ["--model-path", tiny_llama, "--max-total-tokens", "4096", "--num-threads", "1"]
    yield from served([*args, "--chunked-prefill-size", str(CHUNK)], log)


def generate(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=body, timeout=120)


@pytest.mark.server
@pytest.mark.parametrize("start", [0, 5])
def test_native_generate(server, prompts, ref, start: int) -> None:
    prompt = prompts["long"]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    body |= {"return_logprob": True, "logprob_start_len": start, "top_logprobs_num": TOP}
    meta = generate(server, {**body, "return_text_in_logprobs": True}).json()["meta_info"]
    got, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert got[0][:2] == [None, prompt[start]] and isinstance(got[0][2], str) and tops[0] is None
    assert [entry[1] for entry in got] == prompt[start:] and len(tops) == len(got)
    check(
        [entry[0] for entry in got[1:]], [[e[1] for e in top] for top in tops[1:]], ref["long"], prompt, start
    )
    assert len(meta["output_token_logprobs"]) == 2


@pytest.mark.server
def test_native_default_start_is_the_last_prompt_token(server, prompts) -> None:
    """SGLang's -1 (its default) with return_logprob: the prompt's last token alone, its logprob null."""
    prompt = prompts["short"]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
    meta = generate(server, {**body, "top_logprobs_num": 2}).json()["meta_info"]
    assert meta["input_token_logprobs"] == [[None, prompt[-1], None]] and meta["input_top_logprobs"] == [None]


@pytest.mark.server
def test_openai_echo_with_logprobs(server, prompts, ref) -> None:
    prompt = prompts["long"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)
    args = {
        "model": "default",
        "prompt": prompt,
        "echo": True,
        "logprobs": TOP,
        "max_tokens": 2,
        "temperature": 0.0,
    }
    lp = client.completions.create(**args).choices[0].logprobs
    n = len(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    want, _ = expected(ref["long"], prompt, 0)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:n]), torch.tensor(want), rtol=0, atol=ATOL)
    best = ref["long"][: n - 1].topk(TOP, dim=-1).values
    for top, values in zip(lp.top_logprobs[1:n], best.tolist()):  # keys are token texts, which may coincide
        assert max(top.values()) == pytest.approx(values[0], abs=ATOL)
        assert all(min(abs(v - w) for w in values) < ATOL for v in top.values())
    assert all(v is not None for v in lp.token_logprobs[n:])
    chunks = [c.choices[0].logprobs for c in client.completions.create(**args, stream=True) if c.choices]
    streamed = [v for c in chunks if c is not None for v in c.token_logprobs]
    assert streamed == lp.token_logprobs  # the prompt's first, once
    assert [o for c in chunks if c is not None for o in c.text_offset] == lp.text_offset


@pytest.mark.server
def test_bad_input_is_a_400_naming_the_parameter(server, prompts) -> None:
    prompt = prompts["short"]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
    for extra, param in [
        ({"logprob_start_len": len(prompt)}, "logprob_start_len"),
        ({"logprob_start_len": -2}, "logprob_start_len"),
        ({"logprob_start_len": [0, 1]}, "logprob_start_len"),
        ({"top_logprobs_num": 21}, "top_logprobs_num"),
    ]:
        r = generate(server, {**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    cmpl = {"model": "default", "prompt": prompt, "echo": True, "max_tokens": 1, "logprobs": 21}
    r = httpx.post(f"{server.url}/v1/completions", json=cmpl, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert generate(server, body).status_code == 200  # still serving
