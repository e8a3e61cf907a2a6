"""Which kind of layer each of a model's layers is, from its HF config dict alone: the memory ledger sizes KV and
state pools by it, and the tensor-parallel checks refuse what Kiln does not shard by it."""

from __future__ import annotations

LINEAR_ATTENTION = "linear_attention"


def text_config(hf_config: dict) -> dict:
    """The language-model part of a config (multimodal configs nest it under text_config)."""
    if "num_hidden_layers" not in hf_config and isinstance(hf_config.get("text_config"), dict):
        return hf_config["text_config"]
    return hf_config


def required(cfg: dict, key: str) -> int:
    """An integer the arithmetic cannot do without; a ValueError that names it when the config lacks it."""
    if cfg.get(key) is None:
        raise ValueError(f"model config has no {key!r}; is this a decoder LLM config.json?")
    return int(cfg[key])


def layer_types(cfg: dict) -> list[str]:
    """Each layer's kind: the config's `layer_types`, or Qwen3-Next's pattern of a full-attention layer every
    `full_attention_interval`-th (transformers' default 4, which its config.json leaves out), else all attention."""
    types = cfg.get("layer_types")
    layers = required(cfg, "num_hidden_layers")
    if isinstance(types, list) and types:
        return [str(t) for t in types]
    if cfg.get("model_type") == "qwen3_next" or cfg.get("full_attention_interval"):
        interval = int(cfg.get("full_attention_interval") or 4)
        return ["full_attention" if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
    return ["full_attention"] * layers


def has_linear_attention(cfg: dict) -> bool:
    """A hybrid model (Qwen3-Next): some layers keep a per-request state instead of KV."""
    cfg = text_config(cfg)
    return cfg.get("num_hidden_layers") is not None and LINEAR_ATTENTION in layer_types(cfg)
