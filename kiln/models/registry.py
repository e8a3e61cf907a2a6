"""Model classes keyed by the HF architecture name."""

from __future__ import annotations

from torch import nn

from kiln.models import deepseek_v3, gemma, gpt_oss, llama, mixtral, phi3, qwen3_moe, qwen3_next
from kiln.models.config import ModelConfig

MODELS: dict[str, type[nn.Module]] = {
    "DeepseekV3ForCausalLM": deepseek_v3.DeepseekV3ForCausalLM,  # Kimi-K2's config names it too
    "Gemma2ForCausalLM": gemma.Gemma2ForCausalLM,
    "Gemma3ForCausalLM": gemma.Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": gemma.Gemma3ForConditionalGeneration,  # its language model alone
    "GptOssForCausalLM": gpt_oss.GptOssForCausalLM,
    "LlamaForCausalLM": llama.LlamaForCausalLM,
    "MistralForCausalLM": llama.MistralForCausalLM,
    "MixtralForCausalLM": mixtral.MixtralForCausalLM,
    "Phi3ForCausalLM": phi3.Phi3ForCausalLM,
    "Qwen2ForCausalLM": llama.Qwen2ForCausalLM,
    "Qwen3ForCausalLM": llama.Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": qwen3_moe.Qwen3MoeForCausalLM,
    "Qwen3NextForCausalLM": qwen3_next.Qwen3NextForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; Kiln serves {sorted(MODELS)}")
    return MODELS[architecture]


def check_model_config(cfg: ModelConfig) -> None:
    """What serving the model would refuse (an architecture, a config field), without building it: `kiln plan`
    refuses what `kiln serve` would. A sliding window is not refused: every family masks its windowed layers as
    transformers does (kiln.models.llama.layer_windows)."""
    model_class(cfg.architecture).check_config(cfg.hf_config)
