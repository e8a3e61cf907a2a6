"""Model configuration resolved once from an HF config dict (config.json or GGUF metadata: kiln.loader reads
either). The dtype the model is served in is not part of it: kiln.core.dtypes decides that, for the memory ledger
and the load alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model types transformers does not know that are an architecture it does know under another name: Kimi-K2's
# config.json names the DeepSeek-V3 architecture with its own model type
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention's widths (DeepSeek-V2/V3, Kimi-K2): queries through an optional low-rank
    projection, keys and values through one compressed latent per token that the KV pool holds."""

    q_lora_rank: int | None  # None: queries straight from the hidden state (q_proj)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """One token's KV pool row: the normalized latent, then the rotated shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: Any) -> MlaDims | None:
        if not getattr(hf, "kv_lora_rank", None):
            return None
        nope = int(hf.qk_nope_head_dim)
        return cls(
            q_lora_rank=int(hf.q_lora_rank) if getattr(hf, "q_lora_rank", None) else None,
            kv_lora_rank=int(hf.kv_lora_rank),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=int(hf.qk_rope_head_dim),
            v_head_dim=int(getattr(hf, "v_head_dim", None) or nope),
        )


@dataclass(frozen=True)
class ModelConfig:
    model_path: str
    hf_config: Any  # a transformers PretrainedConfig
    config_dict: dict
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    is_gguf: bool
    mla: MlaDims | None = None  # set for latent attention: the KV pool then holds one latent row per token

    @classmethod
    def from_hf_dict(cls, model_path: str, d: dict) -> ModelConfig:
        """The config of the model at `model_path` (a directory or a .gguf file) from its HF config dict."""
        from transformers import AutoConfig

        clean = {k: v for k, v in d.items() if not k.startswith("kiln_") and k != "model_type"}
        hf = AutoConfig.for_model(MODEL_TYPE_ALIASES.get(d["model_type"], d["model_type"]), **clean)
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_path=model_path,
            hf_config=hf,
            config_dict=d,
            architecture=(d.get("architectures") or ["LlamaForCausalLM"])[0],
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=hf.vocab_size,
            rms_norm_eps=getattr(hf, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
            eos_token_ids=eos_ids,
            is_gguf=model_path.endswith(".gguf"),
            mla=MlaDims.from_hf(hf),
        )
