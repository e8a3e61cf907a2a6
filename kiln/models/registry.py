"""Model classes keyed by the HF architecture name."""

from __future__ import annotations

from torch import nn

from kiln.models import deepseek_v3, gemma, llama, mixtral, phi3, qwen3_moe, qwen3_next
from kiln.models.config import ModelConfig

MODELS: dict[str, type[nn.Module]] = {
    "DeepseekV3ForCausalLM": deepseek_v3.DeepseekV3ForCausalLM,  # Kimi-K2's config names it too
    "Gemma2ForCausalLM": gemma.Gemma2ForCausalLM,
    "Gemma3ForCausalLM": gemma.Gemma3ForCausalLM,
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


def check_model_config(cfg: ModelConfig, context_length: int) -> None:
    """What serving the model would refuse (an architecture, a config field), without building it: `kiln plan`
    refuses what `kiln serve` would. `context_length`: the longest sequence it will serve."""
    cls = model_class(cfg.architecture)
    cls.check_config(cfg.hf_config)
    window = attention_window(cfg)
    if window is not None and context_length > window and not getattr(cls, "implements_window", False):
        raise ValueError(
            f"model config sliding_window {window} is not implemented by Kiln (every layer attends to the whole "
            f"sequence), and this model's context is {context_length} tokens: serve it with --context-length "
            f"{window} or less, where the window changes nothing"
        )


def attention_window(cfg: ModelConfig) -> int | None:
    """The sliding window transformers applies to some layer of this model, or None: the config's sliding_window
    where the architecture honours it (Mistral's, Mixtral's and Phi-3's every layer; Qwen2's, Qwen3's and
    Gemma's layers that layer_types marks sliding; Qwen3-MoE's with use_sliding_window, which its config resolves
    into sliding_window). A model class with `implements_window` masks its windowed layers so (Gemma's); the
    others attend over the whole sequence, and check_model_config keeps their context within the window."""
    window = getattr(cfg.hf_config, "sliding_window", None)
    types = getattr(cfg.hf_config, "layer_types", None)
    if not window or not getattr(model_class(cfg.architecture), "windowed", False):
        return None
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)
