"""Memory ledger formulas against hand-computed cases and public model configs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kiln.core.units import GIB, MIB
from kiln.memory.graph_budget import CPU_COMPILED_STEP_BYTES, CPU_COMPILER_BYTES
from kiln.memory.ledger import compute_ledger
from kiln.memory.ledger_format import format_refusal
from kiln.memory.ledger_types import LedgerInputs
from kiln.models.spec import ModelSpec
from kiln.platform import host_available_bytes, host_total_bytes, parse_size

model_spec = ModelSpec.from_config  # a model config dict's spec


pytestmark = pytest.mark.unit

# Public config.json values (only the fields the ledger reads).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}  # fmt: skip
TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}  # fmt: skip

LLAMA_PARAMS = 8_030_261_248  # the published 8.03B
LLAMA_NORMS = 32 * 2 * 4096 + 4096  # replicated on every rank


def ledger(cfg: dict, device: str = "cuda", mem_gib: float = 80, **kw):
    mem = int(mem_gib * GIB)
    kw.setdefault("dtype", "bfloat16")
    return compute_ledger(
        LedgerInputs(
            model=model_spec(cfg), device=device, device_memory_bytes=mem, available_memory_bytes=mem, **kw
        )
    )


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kv_bytes_per_token_public_models(tp):
    assert (
        model_spec(LLAMA_31_8B).kv_bytes_per_token(tp, 2) == 131_072 // tp
    )  # 8 kv heads x 256 x 32 layers x 2 B
    assert model_spec(QWEN3_8B).kv_bytes_per_token(tp, 2) == 147_456 // tp  # 8 x 256 x 36 x 2
    assert (
        model_spec(DEEPSEEK_V3).kv_bytes_per_token(tp, 2) == 70_272
    )  # (512 + 64) x 61 x 2, latent not split by TP


def test_kv_heads_replicated_when_tp_exceeds_kv_heads():
    # 8 kv heads on 16 ranks: every rank still holds one head
    assert model_spec(LLAMA_31_8B).kv_bytes_per_token(16, 2) == 1 * 256 * 32 * 2
    # 2 kv heads on 4 ranks: 1 head per rank, not half a head
    assert model_spec(TINY).kv_bytes_per_token(4, 4) == 1 * (16 + 16) * 2 * 4
    assert model_spec(TINY).kv_bytes_per_token(1, 4) == 2 * (16 + 16) * 2 * 4
    assert model_spec(LLAMA_31_8B).kv_bytes_per_token(1, 1) == 65_536  # fp8 KV halves the bf16 cell


def test_weight_bytes_public_models():
    assert model_spec(LLAMA_31_8B).weight_bytes(1, 2) == LLAMA_PARAMS * 2  # 16.06e9
    assert abs(model_spec(LLAMA_31_8B).weight_bytes(1, 2) - 16.06e9) < 0.01e9
    for tp in (2, 4, 8):  # everything but the norms is split (8 kv heads cover 8 ranks)
        assert (
            model_spec(LLAMA_31_8B).weight_bytes(tp, 2)
            == ((LLAMA_PARAMS - LLAMA_NORMS) // tp + LLAMA_NORMS) * 2
        )
    assert abs(sum(model_spec(QWEN3_8B).param_counts(1)) - 8.19e9) < 0.01e9
    assert abs(sum(model_spec(DEEPSEEK_V3).param_counts(1)) - 671e9) / 671e9 < 0.01  # without the MTP layer
    # fp8 checkpoint dequantized to bf16 at load: 2 B a parameter (and the float32 routers: a little more)
    assert 2 * 671e9 < model_spec(DEEPSEEK_V3).weight_bytes(1, 2) < 2 * 1.01 * 671e9 + 2e9


def test_weight_bytes_match_transformers_parameter_counts():
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320)  # fmt: skip
    configs = [
        tf.LlamaConfig(**small, tie_word_embeddings=False),
        tf.LlamaConfig(**small, tie_word_embeddings=True, attention_bias=True),
        tf.Qwen2Config(**small),
        tf.Qwen3Config(**small, head_dim=32),
        tf.Qwen3Config(**small, head_dim=32, attention_bias=True),
        tf.MistralConfig(**small, attention_bias=True),  # transformers' Mistral has no biases whatever it says
        tf.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2),
        tf.Gemma2Config(**small, head_dim=32),  # four norms a layer
        tf.Gemma3TextConfig(**small, head_dim=32, tie_word_embeddings=False),  # and q/k norms
        tf.Qwen3MoeConfig(**small, num_experts=4, moe_intermediate_size=32, mlp_only_layers=[0]),
        tf.DeepseekV3Config(**small, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                            v_head_dim=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                            first_k_dense_replace=1, num_experts_per_tok=2, n_group=2, topk_group=1),
    ]  # fmt: skip
    for cfg in configs:
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(cfg)
        n = sum(p.numel() for p in model.parameters())
        # DeepSeek-V3's e_score_correction_bias: a buffer in transformers, held by checkpoints and Kiln alike
        n += sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
        assert model_spec(cfg.to_dict()).weight_bytes(1, 4) == n * 4, cfg.model_type


def test_gguf_weight_total_is_used():
    cfg = dict(TINY, kiln_gguf={"weight_bytes_f32": 4_000_000})
    assert model_spec(cfg).weight_bytes(1, 4) == 4_000_000
    assert model_spec(cfg).weight_bytes(1, 2) == 2_000_000


@pytest.mark.parametrize("mem_gib", [24, 80, 141])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_pool_tokens_follow_the_formula(tp, mem_gib):
    # rest = available * mfs - weights; tokens = rest // cell, minus the padding page
    pre = mem_gib * GIB
    w = (LLAMA_PARAMS - LLAMA_NORMS) // tp * 2 + LLAMA_NORMS * 2
    cell = 131_072 // tp
    expected = int((pre * 0.85 - w) // cell) - 1
    got = ledger(LLAMA_31_8B, mem_gib=mem_gib, tp_size=tp, mem_fraction_static=0.85)
    assert got.kv_bytes_per_token == cell
    assert got.weight_bytes == w
    if expected > 0:
        assert got.max_total_num_tokens == expected
        assert got.line("kv pool").bytes == (expected + 1) * cell
    else:
        assert not got.fits and got.failure.moment == "kv_allocation"


@pytest.mark.parametrize("mem_gib", [24, 80, 141])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("cfg", [LLAMA_31_8B, QWEN3_8B], ids=["llama", "qwen3"])
def test_default_fraction_leaves_headroom(cfg, tp, mem_gib):
    got = ledger(cfg, mem_gib=mem_gib, tp_size=tp)
    assert got.fits, got.failure
    assert got.headroom_bytes >= 0
    lines = {x.name: x.bytes for x in got.lines}
    used = sum(v for k, v in lines.items() if k not in ("available", "headroom", "kv bytes per token"))
    assert used + got.headroom_bytes == lines["available"]
    assert got.graph_reserve_bytes > 0 and got.prefill_activation_bytes > 0
    assert 0.5 < got.mem_fraction_static < 1


def test_default_fraction_matches_sglang_on_known_gpus():
    assert ledger(LLAMA_31_8B, mem_gib=80).mem_fraction_static == 0.83  # H100
    assert ledger(LLAMA_31_8B, mem_gib=141).mem_fraction_static == 0.903  # H200
    assert "reserve" in ledger(LLAMA_31_8B, mem_gib=80).mem_fraction_reason


def test_sglang_worked_example_qwen3_8b():
    # B200 log: 177.57 GiB free before load, mfs 0.854 -> 992,896 tokens of 147,456 B
    got = ledger(QWEN3_8B, mem_gib=177.57, mem_fraction_static=0.854)
    assert abs(got.max_total_num_tokens - 992_896) / 992_896 < 0.002


@pytest.mark.parametrize("kept", [False, True], ids=["dequantized", "fp8-kept"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_deepseek_v3_mla(tp, kept):
    got = ledger(DEEPSEEK_V3, mem_gib=141, tp_size=tp, fp8_weights_kept=kept)
    assert got.kv_bytes_per_token == 70_272
    assert "MLA" in got.line("kv bytes per token").inputs
    # dequantized (an A100, or KILN_FP8_WEIGHTS=dequantize) the ledger counts bf16 weights: ~158 GiB per rank at
    # tp 8 (more than an H200 holds), ~80 GiB at tp 16; kept in FP8 (CUDA from compute capability 8.9), about half
    inputs = got.line("weights").inputs
    assert ("fp8 blocks kept" in inputs) == kept and ("dequantized at load" in inputs) == (not kept)
    least = 8 if kept else 16
    assert got.fits == (tp >= least)
    if tp < least:
        assert got.failure.moment == "load_weights"
        assert got.failure.fix_flags.get("--tp-size") == str(least)
    if tp == 8:
        weights = got.line("weights").bytes
        assert 75 * GIB < weights < 90 * GIB if kept else 150 * GIB < weights < 165 * GIB


def test_cpu_default_pool_is_capped_at_a_quarter_of_ram():
    got = ledger(LLAMA_31_8B, device="cpu", mem_gib=64, dtype="float32")
    assert got.fits
    assert got.line("kv pool").bytes <= 0.25 * 64 * GIB + got.kv_bytes_per_token
    assert got.max_running_requests == 128 and got.chunked_prefill_size == 2048
    assert "25%" in got.mem_fraction_reason and "shared machine" in got.mem_fraction_reason
    # no compiled steps by default on the CPU; asked for, SGLang's list up to the given size
    assert got.graph_batch_sizes == () and got.graph_reserve_bytes == 0
    on = ledger(LLAMA_31_8B, device="cpu", mem_gib=64, dtype="float32", cuda_graph_max_bs=8)
    assert on.graph_batch_sizes == (1, 2, 4, 8)
    assert on.graph_reserve_bytes == CPU_COMPILER_BYTES + 4 * CPU_COMPILED_STEP_BYTES


def test_cpu_small_model_pool_sized_by_use():
    got = ledger(TINY, device="cpu", mem_gib=24, dtype="float32")
    assert got.max_total_num_tokens == 128 * 512  # 128 requests x the model's 512 context


def test_absolute_targets_are_honored_and_checked():
    got = ledger(LLAMA_31_8B, mem_gib=80, max_total_tokens=100_000)
    assert got.fits and got.max_total_num_tokens == 100_000
    too_many = ledger(LLAMA_31_8B, mem_gib=80, max_total_tokens=2_000_000)
    assert not too_many.fits and too_many.failure.moment == "kv_allocation"
    pair = ledger(LLAMA_31_8B, device="cpu", mem_gib=24, context_length=4096, max_running_requests=8)
    assert pair.fits and pair.max_total_num_tokens == 4096 * 8 and pair.max_running_requests == 8
    big = ledger(
        LLAMA_31_8B, mem_gib=80, mem_fraction_static=0.85, context_length=8192, max_running_requests=512
    )
    assert not big.fits and big.failure.moment == "kv_allocation"
    assert "4,194,304 tokens" in big.failure.message  # 8192 x 512


def test_failure_moments_in_startup_order():
    assert ledger(LLAMA_31_8B, mem_gib=12).failure.moment == "load_weights"
    assert ledger(LLAMA_31_8B, mem_gib=80, mem_fraction_static=0.18).failure.moment == "kv_allocation"
    capture = ledger(LLAMA_31_8B, mem_gib=80, mem_fraction_static=0.95, context_length=8192)
    assert (
        capture.failure.moment == "graph_capture"
        and "graph capture needs 4.66 GiB" in capture.failure.message
    )
    assert capture.failure.fix == "use --mem-fraction-static <= 0.895, or --disable-cuda-graph"
    high = ledger(LLAMA_31_8B, mem_gib=80, mem_fraction_static=0.93, context_length=8192)
    assert high.failure.moment == "first_full_prefill"
    assert "8192-token prefill" in high.failure.message and "leaves" in high.failure.message
    assert high.failure.fix.startswith("use --mem-fraction-static <= 0.895")
    graphs = ledger(LLAMA_31_8B, mem_gib=80, mem_fraction_static=0.95, context_length=8192, max_running_requests=16,
                    cuda_graph_max_bs=16, chunked_prefill_size=16384, max_prefill_tokens=16384)  # fmt: skip
    assert graphs.fits or graphs.failure.moment in ("graph_capture", "first_full_prefill")


def test_hicache_overcommit_refused_with_per_rank_arithmetic():
    got = ledger(LLAMA_31_8B, mem_gib=80, tp_size=8, enable_hierarchical_cache=True, hicache_size_gb=100,
                 host_memory_bytes=512 * GIB)  # fmt: skip
    assert not got.fits and got.failure.moment == "host_memory"
    msg = got.failure.message
    assert "system RAM, not accelerator memory" in msg
    assert "100 GB" in msg and "x 8 ranks = 800.0 GB" in msg
    assert "--hicache-size" in got.failure.fix and "--hicache-ratio" in got.failure.fix
    assert got.line("host tier per rank").bytes == 100 * 10**9
    assert got.line("host tier node").bytes == 800 * 10**9
    refusal = format_refusal(got)
    assert "host_memory" in refusal and "--hicache-size" in refusal
    ok = ledger(LLAMA_31_8B, mem_gib=80, tp_size=8, enable_hierarchical_cache=True, hicache_size_gb=50,
                host_memory_bytes=512 * GIB)  # fmt: skip
    assert ok.fits


def test_hicache_ratio_scales_the_device_pool():
    got = ledger(LLAMA_31_8B, mem_gib=80, enable_hierarchical_cache=True, hicache_ratio=1.5,
                 host_memory_bytes=4096 * GIB)  # fmt: skip
    assert got.fits
    assert got.line("host tier per rank").bytes == int(1.5 * got.line("kv pool").bytes)


def test_the_host_tier_s_device_staging_is_a_runtime_line_on_cuda_only():
    tiers = dict(enable_hierarchical_cache=True, host_memory_bytes=4096 * GIB)
    for device, staging in (("cuda", 64 * MIB), ("cpu", 0)):
        plain, tiered = ledger(LLAMA_31_8B, device=device), ledger(LLAMA_31_8B, device=device, **tiers)
        runtime = tiered.line("runtime overhead")
        assert runtime.bytes - plain.line("runtime overhead").bytes == staging
        assert ("host tier staging 64.0 MiB" in runtime.inputs) == bool(staging), runtime.inputs


def test_draft_model_adds_weights_and_kv():
    base = ledger(LLAMA_31_8B, mem_gib=80, mem_fraction_static=0.8)
    spec = ledger(
        LLAMA_31_8B,
        mem_gib=80,
        mem_fraction_static=0.8,
        draft=model_spec(dict(LLAMA_31_8B, num_hidden_layers=1)),
    )
    assert spec.kv_bytes_per_token == base.kv_bytes_per_token + 131_072 // 32
    assert spec.line("draft weights").bytes > 0
    assert spec.weight_bytes == base.weight_bytes + spec.line("draft weights").bytes
    assert spec.max_total_num_tokens < base.max_total_num_tokens


def test_to_dict_is_json_and_lines_show_inputs():
    got = ledger(QWEN3_8B, mem_gib=24)
    data = json.loads(json.dumps(got.to_dict()))
    names = [x["name"] for x in data["lines"]]
    for name in (
        "weights",
        "kv pool",
        "request table",
        "graph reserve",
        "prefill activations",
        "logits buffer",
        "headroom",
    ):
        assert name in names
    assert all(x["inputs"] for x in data["lines"])
    assert "K " in got.line("kv pool").inputs and "V " in got.line("kv pool").inputs


@pytest.mark.parametrize(
    "bad", [dict(mem_fraction_static=1.5), dict(tp_size=0), dict(page_size=0), dict(dtype="int3")]
)
def test_unusable_inputs_raise(bad):
    with pytest.raises(ValueError):
        ledger(TINY, **bad)


def test_parse_size():
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("1.5e9") == 1_500_000_000
    assert parse_size("512MiB") == 512 * 2**20
    for bad in ("lots", "12 parsecs", "-1GB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_host_memory_is_cgroup_aware(tmp_path):
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("805306368\n")
    assert host_total_bytes(tmp_path) <= GIB
    assert host_available_bytes(tmp_path) <= GIB // 4
    (tmp_path / "memory.max").write_text("max\n")
    assert host_available_bytes(tmp_path) > 0 and host_total_bytes(tmp_path) > GIB // 4
    assert math.isclose(host_total_bytes(tmp_path), host_total_bytes(tmp_path / "missing"))


# ---------------------------------------------------------------------------------------------- MoE models: plan
# Public config.json values (only the fields the ledger reads) of the deployments' MoE families.
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 163840,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}  # fmt: skip
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
# a CUDA plan keeps an FP8 checkpoint's weights in FP8 (kiln/layers/fp8_linear.py): 1 B a weight and a float32
# factor per 128 x 128 block
FP8_LINEAR_BYTES = 1 + 4 / (128 * 128)


def _deepseek_family_weight_bytes(tp: int, heads: int, experts: int, dense: int, vocab: int) -> int:
    """DeepSeek-V3's shapes (hidden 7168, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128, 61 layers, dense
    intermediate 18432, experts of 2048 and one shared): linears kept in FP8 but kv_b_proj (latent attention
    absorbs it per head, in bf16), the rest bf16, the router gate float32
    (4 B, not 2) and its float32 e_score_correction_bias. Per rank: heads, experts' columns, vocab split by tp."""
    h, layers = 7168, 61
    sparse = layers - dense
    attention = (
        h * 1536 + 1536 * heads * (128 + 64) // tp  # q_a_proj (replicated), q_b_proj
        + h * (512 + 64) + 512 * heads * (128 + 128) // tp  # kv_a_proj_with_mqa (replicated), kv_b_proj
        + heads * 128 * h // tp  # o_proj
    )  # fmt: skip
    linear = layers * attention + dense * 3 * h * 18432 // tp + sparse * 3 * h * (experts + 1) * 2048 // tp
    latent_up = layers * 512 * heads * (128 + 128) // tp
    norms = layers * (1536 + 512 + 2 * h) + h  # q_a / kv_a / input / post-attention norms, the final norm
    other = norms + 2 * vocab * h // tp  # + embedding and lm head
    router = sparse * (experts * h * 4 + experts * 4)
    return math.ceil((linear - latent_up) * FP8_LINEAR_BYTES + (other + latent_up) * 2) + router


def _qwen3_30b_a3b_weight_bytes(tp: int) -> int:
    h, layers, kv_heads = 2048, 48, max(1, 4 // tp)
    attention = 2 * h * 32 * 128 // tp + 2 * h * kv_heads * 128 + 2 * 128  # q, o; k, v; q_norm, k_norm
    experts = 3 * h * 128 * 768 // tp + h * 128  # 128 experts' columns per rank; the router, replicated
    return 2 * (layers * (attention + experts + 2 * h) + 2 * 151936 * h // tp + h)


PLAN_CASES = {
    # name: (config, weight bytes per rank at tp, kv bytes per token at tp)
    "deepseek-v3": (DEEPSEEK_V3, lambda tp: _deepseek_family_weight_bytes(tp, 128, 256, 3, 129280),
                    lambda tp: (512 + 64) * 61 * 2),  # one latent row, the same on every rank
    "kimi-k2": (KIMI_K2, lambda tp: _deepseek_family_weight_bytes(tp, 64, 384, 1, 163840),
                lambda tp: (512 + 64) * 61 * 2),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, _qwen3_30b_a3b_weight_bytes,
                      lambda tp: max(1, 4 // tp) * (128 + 128) * 48 * 2),  # 4 kv heads: 1 per rank at tp 8
}  # fmt: skip


# --ep-size tp: each rank holds E / ep whole experts instead of a 1 / tp slice of every expert, the same bytes
@pytest.mark.parametrize("tp, ep", [(1, 1), (8, 1), (16, 1), (8, 8), (16, 16)])
@pytest.mark.parametrize("name", sorted(PLAN_CASES))
def test_plan_moe_models_per_rank(capsys, model_dir, monkeypatch, name: str, tp: int, ep: int):
    import kiln.plan as plan

    monkeypatch.delenv("KILN_FP8_WEIGHTS", raising=False)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("a CUDA plan on this GPU dequantizes FP8 weights")

    cfg, weights, cell = PLAN_CASES[name]
    argv = ["--model-path", model_dir(cfg, name), "--device", "cuda", "--device-memory", "141GiB"]
    rc = plan.main([*argv, "--tp-size", str(tp), "--ep-size", str(ep), "--json"])
    data = json.loads(capsys.readouterr().out)
    lines = {line["name"]: line["bytes"] for line in data["lines"]}
    assert lines["weights"] == data["weight_bytes"] == weights(tp)
    assert lines["kv bytes per token"] == data["kv_bytes_per_token"] == cell(tp)
    # kept in FP8, the big two fit on eight 141 GiB GPUs (dequantized, only on sixteen: test_deepseek_v3_mla);
    # Qwen3-30B-A3B's 61 GB on one
    assert rc == (1 if tp < 8 and name != "qwen3-30b-a3b" else 0)
    if rc == 0:
        assert lines["kv pool"] == (data["max_total_num_tokens"] + 1) * cell(tp)
    else:
        assert data["failure"]["moment"] == "load_weights"


def test_cuda_graph_reserve_follows_the_attention_backend_and_the_fused_kernels():
    """Llama-3-8B's shape, decode bs <= 64, prefill <= 8192 tokens: the Triton backend reads the pool in place (no
    gathered K and V of one layer, 64 x 2048 wide, in the decode graphs); fused step kernels keep no float32
    copies in a norm (2 x 4096 x 4 B a token) and hold fewer kernels a graph."""
    from kiln.memory.graph_budget import CUDA_BYTES_PER_FUSED_GRAPH, CUDA_BYTES_PER_GRAPH

    kw = dict(mem_gib=141, cuda_graph_max_bs=64, max_running_requests=64, context_length=8192)
    gathering = ledger(LLAMA_31_8B, **kw)
    in_place = ledger(LLAMA_31_8B, attention_gathers=False, **kw)
    fused = ledger(LLAMA_31_8B, attention_gathers=False, fused_step_kernels=True, **kw)
    assert gathering.graph_reserve_bytes - in_place.graph_reserve_bytes == 64 * 2048 * (1024 + 1024) * 2
    graphs = len(in_place.graph_batch_sizes) + 58 * 32 * 2  # 58 prefill token counts, two pieces a layer
    per_graph = CUDA_BYTES_PER_GRAPH - CUDA_BYTES_PER_FUSED_GRAPH
    assert (
        in_place.graph_reserve_bytes - fused.graph_reserve_bytes == 8192 * 2 * 4096 * 4 + graphs * per_graph
    )
    assert f"{graphs} graphs x 0.16 MiB" in fused.line("graph reserve").inputs
