"""GPT-OSS on a tiny random config whose sliding window (16 tokens) is far shorter than most prompts, with random
attention sinks and biases everywhere: served by the Engine token-identical to transformers' float32 greedy
output (logits within 1e-4) in the shared scenarios of tests/model_equality.py; the comparison sees the sinks, the
window and the clamp of the experts' SwiGLU; an MXFP4 checkpoint (the experts' blocks and scales, in its published
layout) loads as its dequantized bf16 twin; `kiln plan` counts the weights the engine holds."""

from __future__ import annotations

import json
from pathlib import Path

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
    reference_greedy,
    reference_logits,
    spy_logits,
)
from safetensors.torch import load_file, save_file

import kiln
import kiln.plan as plan
from kiln.loader import mxfp4

pytestmark = pytest.mark.engine

WINDOW = 16
SLIDING, FULL = "sliding_attention", "full_attention"
TINY_GPT_OSS = dict(
    hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
    layer_types=[SLIDING, FULL, SLIDING, FULL], max_position_embeddings=4096, tie_word_embeddings=False,
    swiglu_limit=0.5,  # small enough to clamp the tiny model's activations
    rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 1024, "rope_theta": 150000.0,
    },
)  # fmt: skip
SEED = 0


def build(out_dir: Path, seed: int = SEED) -> Path:
    """A random GPT-OSS saved with transformers, its 1-D parameters (sinks, biases, norms) random too: transformers
    starts biases at 0, which would hide a bias left out."""
    from transformers import GptOssConfig, GptOssForCausalLM

    model, tok = random_model(GptOssConfig, GptOssForCausalLM, seed, **TINY_GPT_OSS)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("_bias"):
                p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("gpt-oss")))


class TestGptOssMatchesTransformers(EngineEquality):
    """The shared end-to-end scenarios, HTTP's too (a served windowed model with rings, chunked prefill across
    its window)."""


def test_the_comparison_sees_the_sinks_window_and_clamp(engine: kiln.Engine, ref, model_path: str) -> None:
    """transformers without the window or the clamp, or with the sinks at -inf (no sink), answers a long prompt
    otherwise than Kiln, which matches it with them (test_logits_match_transformers)."""
    from transformers import AutoModelForCausalLM

    prompt = ref.prompts[6]
    assert len(prompt) > 4 * WINDOW
    got, out = spy_logits(engine, prompt)
    torch.testing.assert_close(got, ref.logits(prompt, out), rtol=0, atol=1e-4)
    for change in ({"sliding_window": 4096}, {"swiglu_limit": 1e9}, {"sinks": None}):
        sinkless = change.pop("sinks", 0) is None
        other = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **change).eval()
        if sinkless:
            with torch.no_grad():
                for layer in other.model.layers:
                    layer.self_attn.sinks.fill_(float("-inf"))
        assert (reference_logits(other, prompt, out) - got).abs().max() > 1e-2, change or "sinks"


def test_the_layers_are_the_configs(engine: kiln.Engine) -> None:
    model = engine.scheduler.runner.model
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.window for a in attns] == [WINDOW, None, WINDOW, None]
    assert all(a.sinks.shape == (4,) and a.o_proj.bias is not None for a in attns)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 64, 64) and experts.gate_up_bias.shape == (8, 64)
    assert model.model.layers[0].mlp.gate.bias.shape == (8,)


def test_the_ledger_counts_what_the_model_holds(engine: kiln.Engine, model_path: str, capsys) -> None:
    """Weights, the token pool's full-attention KV a token, and the windowed layers' rings (running requests'
    and the prefix cache's checkpoints) as serve allocates them at the same flags."""
    args = ["--max-total-tokens", "8192", "--max-running-requests", "32"]
    assert plan.main(["--model-path", model_path, "--device", "cpu", "--json", *args]) == 0
    planned = json.loads(capsys.readouterr().out)
    runner = engine.scheduler.runner
    assert planned["weight_bytes"] == runner.measured["weights"]
    per_token = runner.measured["kv_pool"] // (runner.kv_pool.num_tokens + runner.kv_pool.page_size)
    assert planned["kv_bytes_per_token"] == per_token == 2 * 2 * 2 * 16 * 4  # full layers x K,V x heads x dim
    lines = {line["name"]: line["bytes"] for line in planned["lines"]}
    rings = lines["state pool"] + lines["state checkpoints"]
    assert abs(rings - runner.measured["state_pool"]) <= 0.01 * runner.measured["state_pool"]


def test_a_long_conversation_keeps_only_the_window_for_its_windowed_layers(engine: kiln.Engine, ref) -> None:
    """A 4k-token conversation: the token pool holds the two full-attention layers alone, each windowed layer
    keeps the window's 16 positions a request (its ring), and the answer is transformers'."""
    from test_correctness import make_prompt, token_stream

    runner = engine.scheduler.runner
    assert len(runner.kv_pool.k) == 2  # of the 4 layers, the full-attention ones
    rings = runner.state_pool
    assert rings.k.shape[0] == 2 and rings.k.shape[2] == WINDOW
    prompt = make_prompt(token_stream(), 4000, 3)
    engine.scheduler.flush_cache()
    (out,) = generate(engine, [prompt], ignore_eos=True)
    assert out["output_ids"] == reference_greedy(ref.model, prompt, stop_at_eos=False)
    assert runner.measured["state_pool"] == rings.num_slots * 2 * 2 * WINDOW * 2 * 16 * 4


# ---------------------------------------------------------------------------------------------- MXFP4

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] -> blocks [E, rows, cols/32, 16] uint8 and scales [E, rows, cols/32] uint8, by the OCP MX
    layout GPT-OSS's checkpoints use: per 32 values a power-of-two scale (e8m0, biased by 127) that brings the
    largest to at most 6, each value rounded to the nearest e2m1 magnitude with its sign in bit 3, two values a
    byte with the even one in the low nibble."""
    e, rows, cols = w.shape
    x = w.float().reshape(e, rows, cols // 32, 32)
    exp = torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = x / torch.exp2(exp).unsqueeze(-1)
    code = (scaled.abs().unsqueeze(-1) - FP4).abs().argmin(-1) | ((scaled < 0).to(torch.long) << 3)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def mxfp4_twins(src: Path, out: Path) -> tuple[Path, Path]:
    """From a bf16-free checkpoint at `src`: an MXFP4 one (experts as blocks and scales, the rest as they were)
    and its dequantized twin, the same weights as transformers would run them."""
    state = load_file(src / "model.safetensors")
    quant, twin = {}, {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2))  # stored output-major, as OpenAI's files
            quant[name + "_blocks"], quant[name + "_scales"] = blocks, scales
            twin[name] = mxfp4.dequantize(blocks, scales).float()
        else:
            quant[name] = twin[name] = t
    config = json.loads((src / "config.json").read_text())
    paths = []
    for kind, tensors in (("mxfp4", quant), ("dequantized", twin)):
        path = out / kind
        path.mkdir()
        for f in src.iterdir():
            if f.suffix == ".json" or f.name.startswith("tokenizer"):
                (path / f.name).write_bytes(f.read_bytes())
        if kind == "mxfp4":
            quantization = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
            (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        paths.append(path)
    return paths[0], paths[1]


def test_an_mxfp4_checkpoint_serves_as_its_dequantized_weights(model_path: str, ref, tmp_path: Path) -> None:
    from test_correctness import hf_greedy
    from transformers import AutoModelForCausalLM

    quantized, twin = mxfp4_twins(Path(model_path), tmp_path)
    original = load_file(Path(model_path) / "model.safetensors")["model.layers.0.mlp.experts.down_proj"]
    dequantized = load_file(twin / "model.safetensors")["model.layers.0.mlp.experts.down_proj"]
    assert 0 < (dequantized - original).abs().max() < 0.25 * original.abs().max()  # quantized, not garbled
    reference = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    prompts = ref.prompts[:7]
    want = [hf_greedy(reference, p, 8, set())[0] for p in prompts]
    eng = kiln.Engine(
        model_path=str(quantized), max_total_tokens=4096, num_threads=1, disable_cuda_graph=True
    )
    try:
        got = ids_of(generate(eng, prompts, ignore_eos=True))
        assert eng.scheduler.runner.model.model.layers[0].mlp.experts.down_proj.dtype == torch.float32
    finally:
        eng.shutdown()
    assert got == want


@pytest.mark.unit
def test_an_mxfp4_half_without_its_pair_is_named() -> None:
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    stream = mxfp4.dequantized_stream(
        iter([("a.experts.down_proj_blocks", blocks), ("b.norm", torch.ones(2))])
    )
    with pytest.raises(ValueError, match="a.experts.down_proj_scales is missing"):
        list(stream)
