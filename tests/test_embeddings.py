"""Embeddings, scores and reranking (docs/architecture.md "Pooled outputs") on a tiny random Qwen3: saved as
Qwen3-Embedding lays itself out (transformers' base Qwen3Model, no lm_head, with sentence-transformers' modules.json,
1_Pooling/config.json last-token pooling and a Normalize module), it is served as an embedding model without
--is-embedding and its /v1/embeddings and /encode agree with transformers' normalised last hidden state; saved as a
Qwen3ForCausalLM, its /v1/score and /v1/rerank agree with transformers' next-token probabilities. Bad input is a 400
naming the field, and the server goes on serving. Two servers in all; the Engine's encode and mean pooling
in-process."""

from __future__ import annotations

import base64
import gc
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import ServerProcess, served
from model_equality import random_model

import kiln
from kiln.loader.pooling_config import read_pooling_config
from kiln.sampling_params import InvalidParam
from kiln.server.scoring import RERANK_PREFIX, RERANK_SUFFIX, rerank_prompt

pytestmark = pytest.mark.server

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False,
)  # fmt: skip
CHUNK, CONTEXT = (
    32,
    256,
)  # prompts longer than a chunk pool across chunks; CONTEXT makes an overlong input cheap
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "a",
    "Kiln embeds text, one vector each.",
]
POOLING = {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False}
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
SERVE = ["--max-total-tokens", "4096", "--num-threads", "1", "--chunked-prefill-size", str(CHUNK)]


def sentence_transformers_dir(out: Path, base, tok, pooling: dict, normalize: bool = True) -> Path:
    """`base` (a Qwen3Model) saved as Qwen3-Embedding is: its architecture named Qwen3ForCausalLM, no lm_head."""
    base.save_pretrained(out)
    tok.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    modules = MODULES if normalize else MODULES[:2]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    (out / "2_Normalize").mkdir()
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model, tok = random_model(Qwen3Config, Qwen3ForCausalLM, 3, **TINY)
    model.eval()
    root = tmp_path_factory.mktemp("embeddings")
    model.save_pretrained(root / "causal")
    tok.save_pretrained(root / "causal")
    embedding = sentence_transformers_dir(root / "embedding", model.model, tok, POOLING)
    mean = {**POOLING, "pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True}
    return {
        "model": model, "tok": tok, "causal": str(root / "causal"), "embedding": str(embedding),
        "mean": str(sentence_transformers_dir(root / "mean", model.model, tok, mean, normalize=False)),
    }  # fmt: skip


@torch.inference_mode()
def hidden(models: dict, ids: list[int]) -> torch.Tensor:
    """transformers' float32 last hidden state (Qwen3Model's, normed) of each position."""
    return models["model"].model(torch.tensor([ids])).last_hidden_state[0].float()


def reference(models: dict, ids: list[int], dimensions: int | None = None) -> torch.Tensor:
    vector = hidden(models, ids)[-1]
    return torch.nn.functional.normalize(vector[:dimensions] if dimensions else vector, dim=0)


@torch.inference_mode()
def next_logprobs(models: dict, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(models["model"](torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), torch.as_tensor(b), dim=0).item()


def serve(path: str, log: Path, *extra: str) -> Iterator[ServerProcess]:
    yield from served(["--model-path", path, *SERVE, *extra], log)


@pytest.fixture(scope="module")
def emb_server(models, tmp_path_factory) -> Iterator[ServerProcess]:
    """No --is-embedding: the sentence-transformers config makes it an embedding server."""
    log = tmp_path_factory.mktemp("emb") / "serve.log"
    yield from serve(models["embedding"], log, "--context-length", str(CONTEXT))


@pytest.fixture(scope="module")
def gen_server(models, tmp_path_factory) -> Iterator[ServerProcess]:
    yield from serve(models["causal"], tmp_path_factory.mktemp("gen") / "serve.log")


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def embed(server: ServerProcess, **body) -> list:
    r = post(server, "/v1/embeddings", body)
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


# ---------------------------------------------------------------------------------------------- embeddings
def test_embeddings_match_transformers(emb_server, models) -> None:
    r = post(emb_server, "/v1/embeddings", {"input": TEXTS, "model": "anything"})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [models["tok"].encode(t) for t in TEXTS]
    assert body["object"] == "list" and body["usage"] == {
        "prompt_tokens": sum(map(len, ids)),
        "total_tokens": sum(map(len, ids)),
    }
    assert max(map(len, ids)) > CHUNK  # one input pools across prefill chunks
    for i, (data, prompt) in enumerate(zip(body["data"], ids, strict=True)):
        assert (
            data["object"] == "embedding"
            and data["index"] == i
            and len(data["embedding"]) == TINY["hidden_size"]
        )
        assert cosine(data["embedding"], reference(models, prompt)) >= 0.9999
        assert abs(torch.tensor(data["embedding"]).norm().item() - 1) < 1e-5
    info = httpx.get(f"{emb_server.url}/model_info").json()
    assert info["is_generation"] is False


def test_a_batch_equals_its_inputs_one_by_one_and_token_ids_equal_text(emb_server, models) -> None:
    batch = embed(emb_server, input=TEXTS)
    for text, vector in zip(TEXTS, batch, strict=True):
        torch.testing.assert_close(
            torch.tensor(embed(emb_server, input=text)[0]), torch.tensor(vector), rtol=0, atol=1e-5
        )
    ids = [models["tok"].encode(t) for t in TEXTS]
    torch.testing.assert_close(
        torch.tensor(embed(emb_server, input=ids)), torch.tensor(batch), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        torch.tensor(embed(emb_server, input=ids[1])[0]), torch.tensor(batch[1]), rtol=0, atol=1e-5
    )


def test_base64_and_dimensions(emb_server, models) -> None:
    floats = embed(emb_server, input=TEXTS[:2])
    packed = embed(emb_server, input=TEXTS[:2], encoding_format="base64")
    for text, vector in zip(packed, floats, strict=True):
        raw = base64.b64decode(text)
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vector, abs=1e-6)
    cut = embed(emb_server, input=TEXTS[1], dimensions=16)[0]
    assert len(cut) == 16 and abs(torch.tensor(cut).norm().item() - 1) < 1e-5  # cut, then normalised again
    assert cosine(cut, reference(models, models["tok"].encode(TEXTS[1]), 16)) >= 0.9999


def test_encode_in_sglang_shape(emb_server, models) -> None:
    one = post(emb_server, "/encode", {"text": TEXTS[0]}).json()
    assert set(one) == {"embedding", "meta_info"}
    assert one["meta_info"]["prompt_tokens"] == len(models["tok"].encode(TEXTS[0]))
    assert cosine(one["embedding"], embed(emb_server, input=TEXTS[0])[0]) >= 0.99999
    many = post(emb_server, "/encode", {"input_ids": [[5, 6, 7], [8, 9]], "dimensions": 8}).json()
    assert [len(b["embedding"]) for b in many] == [8, 8]
    assert cosine(many[1]["embedding"], reference(models, [8, 9], 8)) >= 0.9999


def refusal(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": []}, "input", "empty"),
        ({"input": ""}, "input", "empty"),
        ({"input": ["fine", "  "]}, "input", "input[1]"),
        ({"input": [1, 2, 10**6]}, "input", "outside the vocabulary"),
        ({"input": [[1] * (CONTEXT + 10)]}, "input", "context length"),
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
        ({"input": ["a", 1]}, "input", "one kind"),
        ({"input": "a", "dimensions": 0}, "dimensions", "[1, 64]"),
        ({"input": "a", "dimensions": 65}, "dimensions", "[1, 64]"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", ""),
        ({"input": "a", "temperature": 0}, "temperature", "not supported"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(emb_server, body, param, words) -> None:
    assert words in refusal(post(emb_server, "/v1/embeddings", body), param)
    assert len(embed(emb_server, input="still serving")[0]) == TINY["hidden_size"]


def test_an_embedding_server_refuses_generation(emb_server) -> None:
    for path, body in [
        ("/generate", {"text": "hi"}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [1]}),
    ]:
        assert "embedding model" in refusal(post(emb_server, path, body), "model")
    assert "text or input_ids" in refusal(post(emb_server, "/encode", {}), "text")


# ---------------------------------------------------------------------------------------------- in-process
def test_engine_encode_agrees_and_mean_pooling(models, emb_server) -> None:
    args = dict(max_total_tokens=4096, num_threads=1, chunked_prefill_size=CHUNK, disable_cuda_graph=True)
    eng = kiln.Engine(model_path=models["embedding"], is_embedding=True, **args)
    try:
        one = eng.encode(TEXTS[1])
        assert one["meta_info"]["prompt_tokens"] == len(models["tok"].encode(TEXTS[1]))
        assert cosine(one["embedding"], embed(emb_server, input=TEXTS[1])[0]) >= 0.99999
        assert [len(o["embedding"]) for o in eng.encode(input_ids=[[3, 4], [5]], dimensions=10)] == [10, 10]
        with pytest.raises(InvalidParam, match="encode"):
            eng.generate("hi")
    finally:
        eng.shutdown()
    eng = kiln.Engine(
        model_path=models["mean"], **args
    )  # mean pooling, not normalised: every row, every chunk
    try:
        for text in (TEXTS[1], TEXTS[1], TEXTS[0]):  # the second time its prefix is cached: not used
            want = hidden(models, models["tok"].encode(text)).mean(dim=0)
            torch.testing.assert_close(
                torch.tensor(eng.encode(text)["embedding"]), want, rtol=1e-4, atol=1e-4
            )
    finally:
        eng.shutdown()
        gc.collect()


# ---------------------------------------------------------------------------------------------- score, rerank
def test_score_is_transformers_next_token_probability(gen_server, models) -> None:
    tok, labels = models["tok"], [10407, 4607, 11]
    query, items = "Is the sky blue? Answer:", [" yes", " no", " the sky is a colour"]
    r = post(gen_server, "/v1/score", {"query": query, "items": items, "label_token_ids": labels})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "scoring" and len(body["scores"]) == len(items)
    for item, got in zip(items, body["scores"], strict=True):
        want = next_logprobs(models, tok.encode(query + item))[labels].exp()
        torch.testing.assert_close(
            torch.tensor(got, dtype=torch.float64), want.double(), rtol=1e-4, atol=1e-7
        )
    soft = post(gen_server, "/v1/score", {"query": [5, 6], "items": [[7], [8, 9]], "label_token_ids": labels,
                                         "apply_softmax": True, "item_first": True}).json()["scores"]  # fmt: skip
    for item, got in zip([[7], [8, 9]], soft, strict=True):
        want = torch.softmax(next_logprobs(models, item + [5, 6])[labels], dim=0)
        torch.testing.assert_close(
            torch.tensor(got, dtype=torch.float64), want.double(), rtol=1e-4, atol=1e-6
        )


def test_rerank_is_p_yes_best_first(gen_server, models) -> None:
    tok, yes, no = models["tok"], 10407, 4607
    query, docs = (
        "what is a kiln?",
        ["A kiln is an oven for firing pottery.", "Bananas are yellow.", "Ovens bake."],
    )
    r = post(gen_server, "/v1/rerank", {"query": query, "documents": docs})
    assert r.status_code == 200, r.text
    results = r.json()
    assert sorted(e["index"] for e in results) == [0, 1, 2]
    assert [e["score"] for e in results] == sorted((e["score"] for e in results), reverse=True)
    for entry in results:
        prompt = rerank_prompt(tok.chat_template, query, docs[entry["index"]], None)
        lp = next_logprobs(models, tok.encode(prompt))
        want = torch.softmax(torch.stack([lp[yes], lp[no]]), dim=0)[0].item()
        assert entry["score"] == pytest.approx(want, abs=1e-5) and entry["document"] == docs[entry["index"]]
    top = post(
        gen_server, "/v1/rerank", {"query": query, "documents": docs, "top_n": 1, "return_documents": False}
    )
    assert top.json() == [{"score": results[0]["score"], "index": results[0]["index"]}]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/score", {"query": "a", "items": ["b"]}, "label_token_ids"),
        ("/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [49152]}, "label_token_ids"),
        ("/v1/score", {"query": "a", "items": [[1]], "label_token_ids": [1]}, "items"),
        ("/v1/score", {"query": "a", "items": [], "label_token_ids": [1]}, "items"),
        ("/v1/rerank", {"query": " ", "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/v1/embeddings", {"input": "a"}, "model"),
    ],
)
def test_bad_scoring_input_is_a_400(gen_server, path, body, param) -> None:
    message = refusal(post(gen_server, path, body), param)
    if path == "/v1/embeddings":
        assert "--is-embedding" in message


# ---------------------------------------------------------------------------------------------- unit
@pytest.mark.unit
def test_rerank_prompt_renders_a_reranker_template_as_sglang_and_else_qwen3_rerankers() -> None:
    template = (
        'Say "yes" or "no": the answer can only be "yes" or "no".|{{ instruct | default("find") }}|'
        '{{ messages[0]["content"] }}|{{ messages[1]["content"] }}'
    )
    assert (
        rerank_prompt(template, "q", "d", None)
        == 'Say "yes" or "no": the answer can only be "yes" or "no".|find|q|d'
    )
    assert rerank_prompt(template, "q", "d", "judge").split("|")[1] == "judge"
    plain = rerank_prompt("{{ messages }}", "q", "d", None)
    assert plain.startswith(RERANK_PREFIX) and plain.endswith(RERANK_SUFFIX)
    assert "<Instruct>: Given a web search query" in plain and "<Query>: q\n<Document>: d" in plain


@pytest.mark.unit
def test_pooling_configs(tmp_path: Path) -> None:
    assert read_pooling_config(str(tmp_path)) == read_pooling_config("/nonexistent")  # last, normalised
    (tmp_path / "modules.json").write_text(json.dumps(MODULES[:2]))
    (tmp_path / "1_Pooling").mkdir()
    for switch, mode in [("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean")]:
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({switch: True}))
        config = read_pooling_config(str(tmp_path))
        assert (config.mode, config.normalize) == (mode, False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_pooling_config(str(tmp_path))
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    (tmp_path / "modules.json").write_text(json.dumps([*MODULES[:2], dense]))
    with pytest.raises(ValueError, match="Dense"):
        read_pooling_config(str(tmp_path))
    shutil.rmtree(tmp_path / "1_Pooling")


@pytest.mark.unit
def test_plan_of_an_embedding_deployment_has_no_decode_graphs(models, capsys) -> None:
    """Found from the pooling config or asked for with --is-embedding, the plan captures no decode graph (its
    requests end with their prefill) where the same model served for generation captures them."""
    import kiln.plan as plan

    def planned(*extra: str) -> dict:
        argv = ["--device", "cpu", "--max-total-tokens", "4096", "--cuda-graph-max-bs", "4", "--json", *extra]
        assert plan.main(argv) == 0
        return json.loads(capsys.readouterr().out)

    generation = planned("--model-path", models["causal"])
    assert not generation["is_embedding"] and generation["graph_batch_sizes"] == [1, 2, 4]
    for extra in (
        ["--model-path", models["embedding"]],
        ["--model-path", models["causal"], "--is-embedding"],
    ):
        embedding = planned(*extra)
        assert embedding["is_embedding"] and embedding["graph_batch_sizes"] == []
        assert embedding["graph_reserve_bytes"] < generation["graph_reserve_bytes"], (embedding, generation)
    assert (
        plan.main(["--device", "cpu", "--model-path", models["embedding"], "--max-total-tokens", "4096"]) == 0
    )
    assert "embedding model (prefill only, no decode graphs)" in capsys.readouterr().out
