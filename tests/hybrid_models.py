"""The tiny random hybrid model the tests build: a Qwen3-Next (gated DeltaNet linear-attention layers, gated full
attention every second layer, 4 experts top 2 with a gated shared expert, a dense MLP in layer 2) saved with
transformers beside the default model's tokenizer. Shared by the model tests and the hybrid cache tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from model_equality import random_model

TINY_HYBRID = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, full_attention_interval=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[2], max_position_embeddings=4096,
    tie_word_embeddings=False,
)  # fmt: skip


def hybrid_hf_model(seed: int = 0, **overrides):
    """The random transformers Qwen3-Next and its tokenizer. Beyond random_model's matrices, the vectors the
    layer math depends on (norm weights, decay parameters) are drawn too, so that none is at a neutral value
    that would hide a mistake in how it is applied."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    model, tok = random_model(Qwen3NextConfig, Qwen3NextForCausalLM, seed, **{**TINY_HYBRID, **overrides})
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith(("norm.weight", "dt_bias")):
                p.copy_(p + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=gen))
    return model.eval(), tok


def build_tiny_hybrid(out_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random Qwen3-Next saved with transformers, with the default model's tokenizer; `overrides` change the
    config (written into config.json after saving)."""
    model, tok = hybrid_hf_model(seed)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    if overrides:
        config = json.loads((out_dir / "config.json").read_text())
        (out_dir / "config.json").write_text(json.dumps({**config, **overrides}))
    return out_dir
