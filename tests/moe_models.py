"""The tiny random MoE models the tests build: a Qwen3-MoE and a DeepSeek-V3 (with its MTP layer's tensors),
saved with transformers beside the default model's tokenizer. Shared by the model tests and the tensor-parallel
tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from model_equality import random_model

TINY_MOE = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    mlp_only_layers=[0], max_position_embeddings=4096, tie_word_embeddings=False,
)  # fmt: skip


def build_tiny_moe(out_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random Qwen3-MoE (a dense first layer, then 8 experts, top 2) saved with transformers, with the default
    model's tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model, tok = random_model(Qwen3MoeConfig, Qwen3MoeForCausalLM, seed, **TINY_MOE)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**config, **overrides}))
    return out_dir


TINY_DEEPSEEK = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
    num_nextn_predict_layers=1,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=1024, beta_fast=32, beta_slow=1,
                      mscale=1.0, mscale_all_dim=0.8),
)  # fmt: skip
# a layer numbered num_hidden_layers: the MTP layer's tensors, which the model keeps aside
MTP_TENSORS = {
    "model.layers.3.eh_proj.weight": (64, 128),
    "model.layers.3.enorm.weight": (64,),
    "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": (40, 64),
    "model.layers.3.mlp.experts.0.up_proj.weight": (32, 64),
}


def deepseek_hf_model(seed: int, **overrides):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model, tok = random_model(DeepseekV3Config, DeepseekV3ForCausalLM, seed, **{**TINY_DEEPSEEK, **overrides})
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    return model.eval(), tok


def write_mtp(out_dir: Path) -> None:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(3)
    save_file(
        {k: torch.randn(shape, generator=gen) for k, shape in MTP_TENSORS.items()},
        out_dir / "mtp.safetensors",
    )


def build_tiny_deepseek(out_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random DeepSeek-V3 saved with transformers (plus an MTP layer's tensors in their own shard), with the
    default model's tokenizer."""
    model, tok = deepseek_hf_model(seed, **overrides)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    write_mtp(out_dir)
    return out_dir
