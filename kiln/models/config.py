"""Model configuration resolved once from an HF config dict (config.json or GGUF metadata: kiln.loader reads
either). The dtype the model is served in is not part of it: kiln.core.dtypes decides that, for the memory ledger
and the load alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.core.layer_kinds import LINEAR_ATTENTION
from kiln.models.spec import ModelSpec

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
class LinearAttentionSpec:
    """A hybrid model's gated DeltaNet layers (Qwen3-Next): which layers they are and the per-request state each
    keeps instead of KV rows, a conv state of the last (kernel - 1) inputs of the mixed q/k/v channels and a
    recurrent state of one [key dim, value dim] matrix per value head."""

    layer_types: tuple[str, ...]  # per layer: "linear_attention" or "full_attention"
    conv_kernel: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t != LINEAR_ATTENTION)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q and k (key_dim each) and v (value_dim)."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    @classmethod
    def from_hf(cls, hf: Any) -> LinearAttentionSpec | None:
        types = tuple(str(t) for t in (getattr(hf, "layer_types", None) or ()))
        if LINEAR_ATTENTION not in types:
            return None
        return cls(
            layer_types=types,
            conv_kernel=int(hf.linear_conv_kernel_dim),
            num_key_heads=int(hf.linear_num_key_heads),
            num_value_heads=int(hf.linear_num_value_heads),
            key_head_dim=int(hf.linear_key_head_dim),
            value_head_dim=int(hf.linear_value_head_dim),
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
    spec: ModelSpec  # what the engine reads of the model (its typed contract)
    mla: MlaDims | None = None  # set for latent attention: the KV pool then holds one latent row per token
    # set for hybrid models: their linear-attention layers keep a per-request state and no KV
    linear_attention: LinearAttentionSpec | None = None

    def __post_init__(self) -> None:
        if self.mla is None and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config num_key_value_heads {self.num_kv_heads} does not divide num_attention_heads "
                f"{self.num_heads}: each key/value head serves a whole group of query heads"
            )

    @property
    def num_kv_layers(self) -> int:
        """Layers with KV in the pool: every layer, or a hybrid's (linear or sliding-window) full-attention layers
        only (a draft head's config holds its own num_layers, not its target's)."""
        if self.linear_attention is None and not self.spec.window_rings:
            return self.num_layers
        return self.spec.kv_layers

    @classmethod
    def from_hf_dict(cls, model_path: str, d: dict) -> ModelConfig:
        """The config of the model at `model_path` (a directory or a .gguf file) from its HF config dict."""
        whole = _transformers_config(d)
        hf = whole.get_text_config()  # a multimodal config's language model (Gemma 3's): Kiln serves the text
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
            spec=ModelSpec.from_config(d, whole.to_dict()),  # as model_spec(d) builds it
            mla=MlaDims.from_hf(hf),
            linear_attention=LinearAttentionSpec.from_hf(hf),
        )


def _transformers_config(d: dict) -> Any:
    """transformers' config object for an HF config dict: its defaults filled in for what the dict leaves out."""
    from transformers import AutoConfig

    if "model_type" not in d:
        raise ValueError("model config has no 'model_type'; is this a decoder LLM config.json?")
    clean = {k: v for k, v in d.items() if not k.startswith("kiln_") and k != "model_type"}
    return AutoConfig.for_model(MODEL_TYPE_ALIASES.get(d["model_type"], d["model_type"]), **clean)


def model_spec(d: dict) -> ModelSpec:
    """The ModelSpec of an HF config dict, with transformers' defaults for the fields it leaves out: the same spec
    a served model's ModelConfig holds, so a plan and a serve of one config read one description."""
    return ModelSpec.from_config(d, _transformers_config(d).to_dict())
