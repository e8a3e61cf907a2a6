"""What the engine needs to know of a model, as typed data: Kiln's model contract. Built from the HF config dict
(config.json or GGUF metadata) without torch, so `kiln plan` describes a 671B model as cheaply as serve starts a
135M one. The memory ledger, the pools, the tensor-parallel checks, speculative decoding and plan read a model
through a ModelSpec and nothing else; the field arithmetic of each family lives beside it in kiln/models
(shapes.py, tp_split.py), so a new family changes kiln/models only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.core.dtypes import resolve_dtype_name
from kiln.core.layer_kinds import LINEAR_ATTENTION
from kiln.models import shapes, tp_split
from kiln.models.shapes import GgufBlocks, LinearState, WindowState

__all__ = ["FULL", "LATENT", "SLIDING", "GgufBlocks", "LayerSpec", "LinearState", "ModelSpec", "WindowState"]

FULL, SLIDING, LATENT = "full_attention", "sliding_attention", "latent_attention"
# why a model with linear-attention layers runs eagerly: they update the state pool in place, per request, which a
# captured decode or prefill step does not carry
EAGER_LINEAR = "the linear-attention layers' state updates are not captured"
# ... and a hybrid sliding-window model: its windowed layers' rings are indexed by the batch's request slots, which
# a captured step does not carry
EAGER_WINDOW = "the windowed layers' rings are not captured"


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: how it attends (FULL, SLIDING over `window` tokens, LATENT for MLA's compressed KV, or
    LINEAR_ATTENTION with a per-request state instead of KV), its attention scores' softcap (Gemma 2), and whether
    its MLP is a sparse MoE."""

    attention: str
    sparse_mlp: bool = False
    window: int | None = None
    softcap: float | None = None

    @property
    def keeps_kv(self) -> bool:
        return self.attention != LINEAR_ATTENTION


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int  # of a dense MLP; 0 when the config has none
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int | None  # an EAGLE-3 head's own (smaller) output vocabulary
    layers: tuple[LayerSpec, ...]
    context_len: int  # the longest context it serves (max positions stretched by its rope scaling)
    tie_word_embeddings: bool
    checkpoint_dtype: str | None  # what the weights were saved in, when the config says
    half_dtype: str  # the 16-bit type "auto" serves it in on CUDA
    routed_experts: int
    fp8_block: tuple[int, int] | None  # an FP8 block-quantized checkpoint's block
    nextn_layers: int  # multi-token-prediction layers shipped with it (DeepSeek-V3's NEXTN)
    # an EAGLE-3 head's taps: the target layers whose outputs it reads (None: SGLang's default three)
    aux_hidden_layers: tuple[int, ...] | None
    # the config itself, for kiln/models' own arithmetic: nothing outside kiln/models, kiln/loader and
    # kiln/layers reads it (tests/test_model_contract.py)
    _config: dict = field(repr=False, compare=False)

    @classmethod
    def from_config(cls, config: dict, defaults: dict | None = None) -> ModelSpec:
        """The spec of a model from its HF config dict, `defaults` (transformers' config of its type) filling the
        fields it leaves out but those that size the model: ValueError naming one of those that it lacks."""
        nested = isinstance(config.get("text_config"), dict)
        for key in shapes.SIZING_FIELDS:
            if not (nested and key == "vocab_size"):  # a multimodal config leaves it to its text model's type
                shapes.required(shapes.text_config(config), key)
        config = {**(defaults or {}), **config}
        if nested and isinstance(
            (defaults or {}).get("text_config"), dict
        ):  # the language model's own defaults
            config["text_config"] = {**defaults["text_config"], **config["text_config"]}
        text = shapes.text_config(config)
        kinds = shapes.layer_types(text)
        latent = shapes.is_mla(text)
        window, softcap = text.get("sliding_window"), text.get("attn_logit_softcapping")
        layers = tuple(
            LayerSpec(
                attention=LATENT if latent and kind != LINEAR_ATTENTION else kind,
                sparse_mlp=shapes.is_sparse_layer(text, i),
                window=int(window) if kind == SLIDING and window else None,
                softcap=float(softcap) if softcap and kind != LINEAR_ATTENTION else None,
            )
            for i, kind in enumerate(kinds)
        )
        draft_vocab = text.get("draft_vocab_size")
        return cls(
            architecture=str((config.get("architectures") or text.get("architectures") or [""])[0]),
            model_type=str(text.get("model_type") or config.get("model_type") or ""),
            hidden_size=shapes.required(text, "hidden_size"),
            intermediate_size=int(text.get("intermediate_size") or 0),
            num_heads=shapes.required(text, "num_attention_heads"),
            num_kv_heads=shapes.kv_heads(text),
            head_dim=shapes.head_dim(text),
            vocab_size=shapes.required(text, "vocab_size"),
            draft_vocab_size=int(draft_vocab) if draft_vocab else None,
            layers=layers,
            context_len=shapes.context_len_of(config),
            tie_word_embeddings=shapes.tied(config),
            checkpoint_dtype=shapes.checkpoint_dtype(config),
            half_dtype=shapes.half_dtype(config),
            routed_experts=tp_split.num_routed_experts(text),
            fp8_block=shapes.fp8_weight_block(config),
            nextn_layers=int(text.get("num_nextn_predict_layers") or 0),
            aux_hidden_layers=shapes.aux_hidden_layers(config),
            _config=dict(config),
        )

    # --- layers -----------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_layers(self) -> int:
        """Layers with KV rows in the pool (a hybrid's attention layers only; a hybrid sliding-window model's
        full-attention layers only)."""
        return shapes.kv_layers(self._text)

    @property
    def window_rings(self) -> bool:
        """Its windowed layers keep per-request rings of the window (shapes.window_rings), not pool rows."""
        return shapes.window_rings(self._text)

    @property
    def linear_layers(self) -> int:
        return sum(layer.attention == LINEAR_ATTENTION for layer in self.layers)

    @property
    def is_mla(self) -> bool:
        return any(layer.attention == LATENT for layer in self.layers)

    @property
    def has_linear_attention(self) -> bool:
        return self.linear_layers > 0

    @property
    def eager_only(self) -> str | None:
        """Why none of its steps can be captured as a graph (the ledger then reserves none, the graph runner
        captures none); None when they can."""
        if self.has_linear_attention:
            return EAGER_LINEAR
        return EAGER_WINDOW if self.window_rings else None

    # --- KV and state -----------------------------------------------------------------------------------------
    def kv_dims(self, tp: int) -> tuple[int, int, str]:
        """(K width, V width) per token per layer on one rank, in elements, and the formula in words."""
        return shapes.kv_dims(self._text, tp)

    def kv_bytes_per_token(self, tp: int, element_bytes: int) -> int:
        return shapes.kv_bytes_per_token(self._whole, tp, element_bytes)

    def linear_state(self, tp: int, element_bytes: int) -> shapes.LinearState | None:
        return shapes.linear_state(self._whole, tp, element_bytes)

    def window_state(self, tp: int, element_bytes: int, context: int) -> shapes.WindowState | None:
        return shapes.window_state(self._whole, tp, element_bytes, context)

    # --- weights ----------------------------------------------------------------------------------------------
    def param_counts(self, tp: int) -> tuple[int, int]:
        """Per-rank (linear-layer params, other params: embeddings, lm head, norms, routers)."""
        return shapes.param_counts(self._whole, tp)

    def weight_bytes(self, tp: int, element_bytes: int, fp8_kept: bool = False) -> int:
        return shapes.weight_bytes(self._whole, tp, element_bytes, fp8_kept)

    def weight_text(self, tp: int, dtype: str, fp8_kept: bool = False) -> str:
        """How weight_bytes was reckoned, in words, for the ledger's line."""
        return shapes.weight_inputs(self._whole, tp, dtype, fp8_kept)

    def packed_lm_head_bytes(self, tp: int) -> int:
        return shapes.packed_lm_head_bytes(self._whole, tp)

    def gguf_blocks(self, tp: int, types: tuple[str, ...]) -> shapes.GgufBlocks | None:
        return shapes.gguf_block_bytes(self._whole, tp, types)

    def int8_saved_bytes(self, tp: int, element_bytes: int, kept: tuple[str, ...] = ()) -> int:
        return shapes.int8_saved_bytes(self._whole, tp, element_bytes, kept)

    def prefill_activation(self, tokens: int, tp: int, act_bytes: int, device: str) -> tuple[int, str]:
        return shapes.prefill_activation(self._whole, tokens, tp, act_bytes, device)

    def serving_dtype(self, device: str, requested: str | None = "auto") -> str:
        """The dtype it is served in on `device` for --dtype `requested` (kiln.core.dtypes.resolve_dtype_name)."""
        return resolve_dtype_name(self.checkpoint_dtype, self.half_dtype, device, requested)

    # --- LoRA -------------------------------------------------------------------------------------------------
    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection a LoRA adapter may target, in PEFT's names, whole (one rank's share is the
        caller's): attention's q, k, v, o and the dense MLP's gate, up, down."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, inter = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        }  # fmt: skip

    @property
    def lora_problem(self) -> str | None:
        """Why Kiln serves no LoRA adapter on this model (its slots cover dense full-attention layers only); None
        when it does."""
        if self.is_mla or self.has_linear_attention or self.routed_experts or not self.intermediate_size:
            kind = (
                "latent attention"
                if self.is_mla
                else "linear attention"
                if self.has_linear_attention
                else "MoE"
            )
            return f"{self.architecture} has {kind} layers: Kiln serves LoRA adapters on dense attention models only"
        return None

    # --- limits and splits ------------------------------------------------------------------------------------
    def context_overrun(self, context_length: int | None) -> str | None:
        """Why a --context-length is past the model's longest context, or None."""
        if context_length is None or context_length <= self.context_len:
            return None
        return (
            f"--context-length {context_length} is longer than this model's maximum position {self.context_len} "
            "(its config's max_position_embeddings and rope scaling): positions past it may give wrong outputs"
        )

    def tp_problems(self, tp: int, ep: int = 1, fp8_block: tuple[int, int] | None = None) -> list[str]:
        """Why tp (and ep) ranks cannot split this model; empty when they can."""
        return tp_split.tp_size_problems(self._text, tp, ep, fp8_block)

    def valid_tp_sizes(self, limit: int = 64, fp8_block: tuple[int, int] | None = None) -> list[int]:
        return tp_split.valid_tp_sizes(self._text, limit, fp8_block)

    @property
    def _whole(self) -> dict[str, Any]:
        return self._config  # read, never written, by kiln/models' arithmetic

    @property
    def _text(self) -> dict[str, Any]:
        return shapes.text_config(self._whole)
