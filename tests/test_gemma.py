"""Gemma 2 and Gemma 3 (text) on tiny random configs whose sliding window (24 tokens) is far shorter than most
prompts, served by the Engine token-identical to transformers' float32 greedy output (logits within 1e-4): the
shared scenarios of tests/model_equality.py (alone, batched, radix-cache hits, chunked prefill across the window,
retraction); the comparison sees the window and the softcaps (transformers without them answers otherwise); the
windowed and softcapped attention against transformers' eager attention through each backend, in an extend on a
cached prefix, a fresh prompt and a decode step; Gemma 3's two rope tables; `kiln plan` on both, which fit over a
context longer than their window, with a ledger that counts the weights the engine holds."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from model_equality import (  # the fixtures among these apply to this module by being imported
    EngineEquality,
    engine_fixture,  # noqa: F401
    generate,
    ids_of,
    one_torch_thread,  # noqa: F401
    random_model,
    reference_fixture,  # noqa: F401
    reference_logits,
    spy_logits,
)

import kiln
import kiln.plan as plan
from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.layers.cpu_gemm import has_cpu_decode_attention
from kiln.layers.rotary import RotaryEmbedding
from kiln.memory.kv_pool import KVPool
from kiln.runner.attention import CpuKernelBackend, TorchSdpaBackend, windowed

pytestmark = pytest.mark.engine

WINDOW = 24
SLIDING, FULL = "sliding_attention", "full_attention"
_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=4096, sliding_window=WINDOW, query_pre_attn_scalar=24,
)  # fmt: skip
# softcaps small enough to matter on the tiny model's small scores and logits
TINY_GEMMA2 = dict(_SHAPE, attn_logit_softcapping=2.0, final_logit_softcapping=5.0)
TINY_GEMMA3 = dict(
    _SHAPE,
    layer_types=[SLIDING, FULL, SLIDING, FULL],
    rope_parameters={
        FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        SLIDING: {"rope_type": "default", "rope_theta": 1000.0},
    },
)
# seeds whose greedy steps in the scenarios have no near tie (top-2 logits 1.5e-3 apart or more)
SEEDS = {"gemma2": 4, "gemma3": 0}


def classes(kind: str) -> tuple[type, type]:
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    if kind == "gemma2":
        return Gemma2Config, Gemma2ForCausalLM
    return Gemma3TextConfig, Gemma3ForCausalLM


def build(kind: str, out_dir: Path, seed: int) -> Path:
    """A random Gemma saved with transformers, with the default model's tokenizer; its norms' weights random
    too (transformers starts them at 0, which would not tell 1 + weight from weight)."""
    model, tok = random_model(*classes(kind), seed, **{"gemma2": TINY_GEMMA2, "gemma3": TINY_GEMMA3}[kind])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def model_path(request, tmp_path_factory) -> str:
    return str(build(request.param, tmp_path_factory.mktemp(request.param), SEEDS[request.param]))


class TestGemmaMatchesTransformers(EngineEquality):
    """The shared end-to-end scenarios, but HTTP's: the server does not depend on the family."""

    test_over_http = None


def test_the_comparison_sees_the_window_and_the_softcaps(engine: kiln.Engine, ref, model_path: str) -> None:
    """transformers without the window (or without a softcap) answers a 150-token prompt otherwise than Kiln,
    which matches it with them (test_logits_match_transformers)."""
    from transformers import AutoModelForCausalLM

    prompt = ref.prompts[6]
    assert len(prompt) > 4 * WINDOW
    got, out = spy_logits(engine, prompt)
    torch.testing.assert_close(got, ref.logits(prompt, out), rtol=0, atol=1e-4)
    changes: list[dict] = [{"sliding_window": 4096}]
    if ref.model.config.model_type == "gemma2":
        changes += [{"attn_logit_softcapping": None}, {"final_logit_softcapping": None}]
    for change in changes:
        other = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **change).eval()
        assert (reference_logits(other, prompt, out) - got).abs().max() > 1e-2, change


def test_the_layers_are_the_configs(engine: kiln.Engine, model_path: str) -> None:
    model = engine.scheduler.runner.model
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.window for a in attns] == [WINDOW, None, WINDOW, None]
    gemma2 = type(model).__name__ == "Gemma2ForCausalLM"
    assert [a.softcap for a in attns] == [2.0 if gemma2 else None] * 4
    assert all(a.qk_norm != gemma2 and a.scale == 24**-0.5 for a in attns)
    assert model.final_softcap == (5.0 if gemma2 else None) and model.normalizer == 8.0


def test_the_ledger_counts_what_the_model_holds(engine: kiln.Engine, model_path: str, capsys) -> None:
    assert plan.main(["--model-path", model_path, "--device", "cpu", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    runner, lines = engine.scheduler.runner, {line["name"]: line["bytes"] for line in planned["lines"]}
    # the LM head is tied: the prepacked copy beside the embedding is a line of its own
    assert lines["weights"] == runner.measured["weights"]
    assert lines["packed lm head"] == runner.measured["packed_lm_head"]
    assert planned["weight_bytes"] == lines["weights"] + lines["packed lm head"]
    per_token = runner.measured["kv_pool"] // (runner.kv_pool.num_tokens + runner.kv_pool.page_size)
    assert planned["kv_bytes_per_token"] == per_token


# ---------------------------------------------------------------------------------------------- attention

HQ, HK, D = 4, 2, 16


def _eager(q, k, v, window: int | None, softcap: float | None, scale: float) -> torch.Tensor:
    """transformers' eager attention over one whole sequence ([n, H, D] each) under its sliding mask."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    n = q.shape[0]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    if window is not None:
        allowed &= ~torch.ones(n, n, dtype=torch.bool).tril(-window)
    mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=HQ // HK, training=False, head_dim=D)
    heads = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
    out, _ = eager_attention_forward(module, *heads, mask[None, None], scaling=scale, softcap=softcap)
    return out[0]  # [n, Hq, D]


@pytest.mark.unit
@pytest.mark.parametrize("backend_cls", [TorchSdpaBackend, CpuKernelBackend, "triton"])
@pytest.mark.parametrize("window, softcap", [(5, None), (None, 2.0), (5, 2.0)])
def test_windowed_attention_matches_transformers_eager(backend_cls, window, softcap, monkeypatch) -> None:
    """Request A extends 12 tokens on a 30-token cached prefix while B prefills 20 afresh, in query blocks of 8;
    then both decode a token. Every row equals transformers' eager attention over the whole sequence."""
    monkeypatch.setattr(windowed, "QUERY_BLOCK", 8)
    torch.manual_seed(0)
    pool = KVPool(128, 1, 1, HK, D, torch.float32)
    if backend_cls is CpuKernelBackend and not has_cpu_decode_attention(pool.k[0]):
        pytest.skip("Kiln's CPU decode kernel is not built here")
    if backend_cls == "triton":  # its decode kernel takes the window (softcapped scores go to the torch path)
        from kiln.layers import triton_attention
        from kiln.runner.attention.triton_backend import TritonBackend

        if not triton_attention.available():
            pytest.skip("Triton is not installed")
        backend_cls = TritonBackend
    backend, scale = backend_cls(pool, HQ), 0.3
    lens, prefixes = {"a": 43, "b": 21}, {"a": 30, "b": 0}
    slots = {"a": torch.arange(1, 44), "b": torch.arange(60, 81)}
    qkv = {r: (torch.randn(n, HQ, D), torch.randn(n, HK, D), torch.randn(n, HK, D)) for r, n in lens.items()}
    want = {r: _eager(*qkv[r], window, softcap, scale) for r in lens}
    pool.write(0, slots["a"][:30], qkv["a"][1][:30], qkv["a"][2][:30])

    def rows(part: dict[str, slice]) -> list[torch.Tensor]:
        return [torch.cat([qkv[r][i][part[r]] for r in lens]) for i in range(3)]

    def run(fb: ForwardBatch, part: dict[str, slice]) -> torch.Tensor:
        fb = replace(fb, attn=backend.prepare_metadata(fb))
        q, k, v = rows(part)
        return backend.forward(0, q, k, v, fb, scale, window, softcap).view(-1, HQ, D)

    ext = {"a": slice(30, 42), "b": slice(0, 20)}
    positions = torch.cat([torch.arange(s.start, s.stop) for s in ext.values()])
    fb = ForwardBatch(
        ForwardMode.EXTEND, positions, positions, torch.cat([slots[r][ext[r]] for r in lens]), None,
        extend_lens=[12, 20], prefix_lens=[prefixes[r] for r in lens], seq_slots=[slots[r][:-1] for r in lens],
    )  # fmt: skip
    got = run(fb, ext)
    torch.testing.assert_close(got, torch.cat([want[r][ext[r]] for r in lens]), rtol=1e-5, atol=1e-5)
    table = torch.stack([slots["a"], torch.nn.functional.pad(slots["b"], (0, 22))])
    mask = (torch.arange(43) < torch.tensor([[43], [21]])).view(2, 1, 1, 43)
    last = {"a": slice(42, 43), "b": slice(20, 21)}
    positions = torch.tensor([42, 20])
    fb = ForwardBatch(
        ForwardMode.DECODE, positions, positions, torch.stack([slots[r][-1] for r in lens]), None,
        kv_table=table, kv_mask=mask,
    )  # fmt: skip
    got = run(fb, last)
    torch.testing.assert_close(got, torch.cat([want[r][last[r]] for r in lens]), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- rope and plan


@pytest.mark.unit
def test_gemma3_turns_each_layer_type_by_its_own_rope() -> None:
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    cfg = Gemma3TextConfig(**TINY_GEMMA3)
    theirs, half, tables = Gemma3RotaryEmbedding(cfg), D // 2, {}
    for kind in (SLIDING, FULL):
        cos, sin = theirs(torch.zeros(1), torch.arange(50)[None], kind)
        tables[kind] = RotaryEmbedding(cfg, 64, kind).cos_sin_for(torch.arange(50), torch.float32)[:, :, 0]
        want = torch.stack((cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)))
        torch.testing.assert_close(tables[kind], want, rtol=0, atol=1e-6)
    assert not torch.allclose(tables[SLIDING], tables[FULL])


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_plan_serves_the_window_over_a_longer_context(kind: str, capsys, model_dir) -> None:
    config = classes(kind)[0](**{"gemma2": TINY_GEMMA2, "gemma3": TINY_GEMMA3}[kind], vocab_size=320)
    config.architectures = [f"Gemma{kind[-1]}ForCausalLM"]
    assert plan.main(["--model-path", model_dir(config.to_dict(), kind), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits" in out and "context_len=4096" in out


@pytest.mark.unit
def test_each_family_windows_the_layers_transformers_does() -> None:
    """Mistral and Qwen3-MoE window every layer, Qwen2 those past max_window_layers and only with
    use_sliding_window, Llama none whatever its config holds: as transformers' attention of each applies
    sliding_window (kiln.models.llama.layer_windows)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3MoeConfig

    from kiln.models.llama import layer_windows
    from kiln.models.registry import MODELS

    shape = dict(num_hidden_layers=4, sliding_window=WINDOW)
    cases = [
        (MistralConfig(**shape), "MistralForCausalLM", [WINDOW] * 4),
        (Qwen3MoeConfig(**shape, use_sliding_window=True), "Qwen3MoeForCausalLM", [WINDOW] * 4),
        (Qwen3MoeConfig(**shape), "Qwen3MoeForCausalLM", [None] * 4),
        (
            Qwen2Config(**shape, use_sliding_window=True, max_window_layers=2),
            "Qwen2ForCausalLM",
            [None] * 2 + [WINDOW] * 2,
        ),
        (Qwen2Config(**shape, max_window_layers=2), "Qwen2ForCausalLM", [None] * 4),
        (LlamaConfig(num_hidden_layers=4), "LlamaForCausalLM", [None] * 4),
    ]
    for config, arch, want in cases:
        config.sliding_window = getattr(config, "sliding_window", None)  # Llama's config has none
        assert layer_windows(config, MODELS[arch].windowed) == want, arch
    llama = LlamaConfig(num_hidden_layers=4)
    llama.sliding_window = WINDOW  # a stray field transformers' Llama ignores
    assert layer_windows(llama, MODELS["LlamaForCausalLM"].windowed) == [None] * 4


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path: Path) -> None:
    """Gemma 3 from 4B up ships as Gemma3ForConditionalGeneration (its language model under language_model.*
    beside a vision tower): Kiln serves the text, token-identical to transformers' whole model on text prompts."""
    from test_correctness import hf_greedy, make_prompt, token_stream
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {k: v for k, v in TINY_GEMMA3.items() if k != "rope_parameters"}
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28
    )
    model, tok = random_model(
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        0,
        text_config=text,
        vision_config={**vision, "patch_size": 14},
    )
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    stream = token_stream()
    prompts = [make_prompt(stream, n, 5 * n) for n in (9, 40, 77)]
    want = [hf_greedy(model.eval(), p, 8, set())[0] for p in prompts]
    eng = kiln.Engine(model_path=str(tmp_path), max_total_tokens=2048, num_threads=1, disable_cuda_graph=True)
    try:
        assert type(eng.scheduler.runner.model).__name__ == "Gemma3ForConditionalGeneration"
        assert ids_of(generate(eng, prompts, ignore_eos=True)) == want
    finally:
        eng.shutdown()
