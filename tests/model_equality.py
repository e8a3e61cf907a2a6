"""End-to-end equality of a small random model served by the Engine with transformers' greedy output, shared by
the model families' test files: each prompt alone, all batched, on radix-cache hits, chunked, under retraction
and over HTTP, float32 logits within 1e-4, the pool idle after each.

A test file builds its model, supplies the module-scoped fixture `model_path` (the model directory), imports
one_torch_thread, engine_fixture and reference_fixture (pytest finds fixtures among a module's names; tests ask
for the last two as `engine`, an Engine on the model with BASE_ARGS, and `ref`, a Reference on it), then
subclasses EngineEquality in a class named Test*: pytest collects the inherited scenarios there, once per
model."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import ServerProcess, assert_pool_at_baseline, default_tokenizer_source
from test_correctness import hf_greedy, load_hf, make_prompt, token_stream

import kiln

NEW_TOKENS = 8
PROMPT_LENS = [1, 3, 9, 17, 40, 77, 150, 333, 700]
SHARED_PREFIX = 200
RETRACT_NEW, RETRACT_POOL, RETRACT_N = 48, 256, 8
BASE_ARGS = dict(max_total_tokens=8192, max_running_requests=32, num_threads=1, disable_cuda_graph=True)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Importing this into a test module applies it there: one torch thread, as the engines under test use."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", name="engine")
def engine_fixture(model_path: str) -> Iterator[kiln.Engine]:
    eng = kiln.Engine(model_path=model_path, **BASE_ARGS)
    yield eng
    eng.shutdown()
    gc.collect()


@pytest.fixture(scope="module", name="ref")
def reference_fixture(model_path: str) -> Reference:
    return Reference(model_path)


def random_model(config_cls, model_cls, seed: int, **config):
    """A transformers model of random weights on the default model's tokenizer (its GGUF vocab), and that
    tokenizer. The weights are larger than transformers' defaults so that logits have clear winners."""
    from kiln.text.tokenizer import load_tokenizer

    tok = load_tokenizer(default_tokenizer_source())
    cfg = config_cls(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **config
    )
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model, tok


def reference_greedy(
    model, prompt: list[int], new_tokens: int = NEW_TOKENS, stop_at_eos: bool = True
) -> list[int]:
    """transformers' greedy ids for one prompt, stopping at the config's EOS unless told otherwise."""
    eos = {model.config.eos_token_id} - {None} if stop_at_eos else set()
    return hf_greedy(model, prompt, new_tokens, eos)[0]


@torch.inference_mode()
def reference_logits(model, ids: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits at the last prompt position and after each generated token but the last."""
    out = model(torch.tensor([ids + generated[:-1]])).logits[0].float()
    return out[len(ids) - 1 :]


class Reference:
    """The prompts the scenarios run and transformers' answers to them, on the model at `path`."""

    def __init__(self, path: str):
        stream = token_stream()
        self.prompts = [make_prompt(stream, n, 37 * i) for i, n in enumerate(PROMPT_LENS)]
        prefix = make_prompt(stream, SHARED_PREFIX, 500)
        self.shared = [prefix + make_prompt(stream, 20, 7), prefix + make_prompt(stream, 33, 170)]
        self.retract = [make_prompt(stream, 20 + 3 * i, 13 * i + 5) for i in range(RETRACT_N)]
        self.model = load_hf(path)
        self.greedy = {tuple(p): reference_greedy(self.model, p) for p in self.prompts + self.shared}
        self.long = {
            tuple(p): reference_greedy(self.model, p, RETRACT_NEW, stop_at_eos=False) for p in self.retract
        }

    def expect(self, prompts: list[list[int]]) -> list[list[int]]:
        return [self.greedy[tuple(p)] for p in prompts]

    def logits(self, ids: list[int], generated: list[int]) -> torch.Tensor:
        return reference_logits(self.model, ids, generated)


def greedy_params(n: int = NEW_TOKENS, **kw) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, **kw}


def generate(eng: kiln.Engine, prompts: list[list[int]], **kw) -> list[dict]:
    return eng.generate(input_ids=prompts, sampling_params=[greedy_params(**kw) for _ in prompts])


def ids_of(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def assert_serves_as(model_path: str, reference, new_tokens: int = 10, seed: int = 5, **engine) -> None:
    """A quantized checkpoint at `model_path`, loaded by the Engine (with `engine`'s arguments), gives
    transformers' float32 greedy ids on `reference` (the same weights dequantized) for prompts of 3 to 40 random
    tokens, and holds float32 layers."""
    gen = torch.Generator().manual_seed(seed)
    vocab = reference.config.vocab_size
    prompts = [torch.randint(10, vocab - 10, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]
    with torch.inference_mode():
        want = [hf_greedy(reference, p, new_tokens, set())[0] for p in prompts]
    eng = kiln.Engine(model_path=model_path, **{**BASE_ARGS, "max_total_tokens": 4096, **engine})
    try:
        got = ids_of(generate(eng, prompts, ignore_eos=True, max_new_tokens=new_tokens))
        layer = eng.scheduler.runner.model.model.layers[0]
        assert all(p.dtype == torch.float32 for p in layer.parameters())
    finally:
        eng.shutdown()
    assert got == want


def assert_idle(eng: kiln.Engine) -> None:
    rep = eng.check_integrity()
    assert rep["ok"] and rep["in_use"] == 0, rep


def spy_logits(eng: kiln.Engine, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Every step's logits of one greedy generation from an empty cache, in order, and its output ids."""
    runner = eng.scheduler.runner
    seen: list[torch.Tensor] = []
    inner = type(runner).forward.__get__(runner)

    def forward(fb):
        logits = inner(fb)
        seen.append(logits.clone())
        return logits

    runner.forward = forward
    try:
        eng.scheduler.flush_cache()
        (out,) = generate(eng, [prompt])
    finally:
        del runner.forward
    return torch.cat(seen).cpu(), out["output_ids"]


class EngineEquality:
    """The scenarios; a subclass named Test* in a module holding the fixtures runs them."""

    def test_logits_match_transformers(self, engine: kiln.Engine, ref: Reference) -> None:
        prompt = ref.prompts[6]
        got, out = spy_logits(engine, prompt)
        want = ref.logits(prompt, out)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

    def test_each_prompt_alone(self, engine: kiln.Engine, ref: Reference) -> None:
        outs = []
        for prompt in ref.prompts:
            engine.scheduler.flush_cache()
            outs += generate(engine, [prompt])
        assert ids_of(outs) == ref.expect(ref.prompts)
        assert_idle(engine)

    def test_all_batched(self, engine: kiln.Engine, ref: Reference) -> None:
        engine.scheduler.flush_cache()
        assert ids_of(generate(engine, ref.prompts)) == ref.expect(ref.prompts)
        assert_idle(engine)

    def test_radix_cache_hits(self, engine: kiln.Engine, ref: Reference) -> None:
        engine.scheduler.flush_cache()
        prompt = ref.prompts[7]
        first, second = generate(engine, [prompt]), generate(engine, [prompt])
        assert second[0]["meta_info"]["cached_tokens"] >= len(prompt) - 1
        a, b = ref.shared
        out_a, out_b = generate(engine, [a]), generate(engine, [b])
        # A model whose windowed layers keep per-request rings (kiln.memory.window_pool) restarts a request only
        # where the prefix cache kept their state: at a prompt sent again and at a conversation's next turn, not
        # where two prompts part after a shared prefix (its cache still holds that for the full-attention layers).
        if not engine.scheduler.runner.model_config.spec.window_rings:
            assert out_b[0]["meta_info"]["cached_tokens"] >= SHARED_PREFIX
        assert ids_of(first + second + out_a + out_b) == ref.expect([prompt, prompt, a, b])
        # the next turn of a conversation: the whole of the last one, its answer and a new message
        turn = a + out_a[0]["output_ids"] + ref.prompts[2]
        (out_turn,) = generate(engine, [turn])
        assert out_turn["meta_info"]["cached_tokens"] >= len(a) + len(out_a[0]["output_ids"]) - 1
        assert out_turn["output_ids"] == reference_greedy(ref.model, turn)
        assert_idle(engine)

    def test_chunked_prefill(self, model_path: str, ref: Reference) -> None:
        eng = kiln.Engine(model_path=model_path, **{**BASE_ARGS, "chunked_prefill_size": 64})
        try:
            prompts = ref.prompts + ref.shared
            assert ids_of(generate(eng, prompts)) == ref.expect(prompts)
            assert_idle(eng)
        finally:
            eng.shutdown()

    def test_retraction_keeps_outputs(self, model_path: str, ref: Reference) -> None:
        eng = kiln.Engine(
            model_path=model_path,
            **{**BASE_ARGS, "max_total_tokens": RETRACT_POOL, "max_running_requests": RETRACT_N},
        )
        try:
            outs = generate(eng, ref.retract, n=RETRACT_NEW, ignore_eos=True)
            assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0, "no retraction: shrink the pool"
            assert ids_of(outs) == [ref.long[tuple(p)] for p in ref.retract]
            assert_idle(eng)
        finally:
            eng.shutdown()

    @pytest.mark.server
    def test_over_http(self, model_path: str, ref: Reference, tmp_path: Path) -> None:
        args = ["--model-path", model_path, "--max-total-tokens", "8192", "--num-threads", "1"]
        srv = ServerProcess([*args, "--chunked-prefill-size", "128"], tmp_path / "serve.log")
        try:
            srv.wait_ready()
            prompts = ref.prompts[:6] + ref.shared
            body = {"input_ids": prompts, "sampling_params": greedy_params()}
            r = httpx.post(f"{srv.url}/generate", json=body, timeout=300)
            assert r.status_code == 200, r.text
            assert [o["output_ids"] for o in r.json()] == ref.expect(prompts)
            assert_pool_at_baseline(srv.url)
        finally:
            srv.stop()
