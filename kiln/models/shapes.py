"""Model-shape arithmetic from an HF config dict alone (config.json or GGUF metadata, no torch): layer kinds, KV
dimensions (MHA/GQA/MLA), parameter and weight bytes per rank, peak prefill activations, and which tensor-parallel
sizes split the model. kiln.models.spec.ModelSpec is its one reader: everything outside kiln/models asks the spec."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.core.dtypes import dtype_bytes
from kiln.core.graph_shapes import PROMPT_LOGPROB_ROWS
from kiln.core.layer_kinds import LINEAR_ATTENTION
from kiln.core.sharding import kv_heads_per_rank

# families whose attention applies the config's sliding_window on every layer when it is set (the others mark
# their windowed layers in layer_types)
_WINDOW_ON_EVERY_LAYER = ("mistral", "mixtral", "phi3")


def text_config(hf_config: dict) -> dict:
    """The language-model part of a config (multimodal configs nest it under text_config)."""
    if "num_hidden_layers" not in hf_config and isinstance(hf_config.get("text_config"), dict):
        return hf_config["text_config"]
    return hf_config


# what a decoder LLM's config.json must say itself: no default stands in for its size
SIZING_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


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
    every_layer = cfg.get("model_type") in _WINDOW_ON_EVERY_LAYER or (
        cfg.get("model_type") == "qwen3_moe" and cfg.get("use_sliding_window")  # its config clears it without
    )
    if cfg.get("sliding_window") and every_layer:
        return ["sliding_attention"] * layers
    return ["full_attention"] * layers


def has_linear_attention(cfg: dict) -> bool:
    """A hybrid model (Qwen3-Next): some layers keep a per-request state instead of KV."""
    cfg = text_config(cfg)
    return cfg.get("num_hidden_layers") is not None and LINEAR_ATTENTION in layer_types(cfg)


_NON_KV_LAYER_TYPES = {LINEAR_ATTENTION, "mamba", "mamba2", "conv", "recurrent"}


def is_mla(cfg: dict) -> bool:
    """Multi-head latent attention (DeepSeek): one compressed KV latent per token instead of K and V heads."""
    return bool(cfg.get("kv_lora_rank"))


def head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or required(cfg, "hidden_size") // required(cfg, "num_attention_heads"))


def kv_heads(cfg: dict) -> int:
    """KV heads of the whole model (as many as the attention heads without GQA)."""
    return int(cfg.get("num_key_value_heads") or required(cfg, "num_attention_heads"))


def kv_layers(cfg: dict) -> int:
    """Layers that keep KV in the token pool (hybrid models: only the attention layers; hybrid sliding-window
    models: only the full-attention ones, their windowed layers keep a ring per request, window_state)."""
    windowed = "sliding_attention" if window_rings(cfg) else None
    return sum(1 for t in layer_types(cfg) if t not in _NON_KV_LAYER_TYPES and t != windowed)


def window_rings(cfg: dict) -> bool:
    """Whether the model's windowed layers keep their KV in per-request rings of the window's length rather than
    in the token pool: a model with both sliding-window and full-attention layers (Gemma 2/3, GPT-OSS), as
    SGLang's hybrid SWA memory takes them. A model whose every layer is windowed (Mistral) keeps the pool."""
    kinds = set(layer_types(cfg))
    return bool(cfg.get("sliding_window")) and "sliding_attention" in kinds and "full_attention" in kinds


@dataclass(frozen=True)
class WindowState:
    """One request's KV in a hybrid sliding-window model's windowed layers, on one rank: per layer a ring of its
    last `tokens` positions' K and V (the window, or the context when that is shorter)."""

    layers: int
    tokens: int
    kv_heads: int
    k_dim: int
    v_dim: int
    element_bytes: int

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot of the ring pool: every windowed layer's ring."""
        return self.layers * self.tokens * self.kv_heads * (self.k_dim + self.v_dim) * self.element_bytes

    def text(self) -> str:
        return (
            f"{self.layers} windowed layers x {self.tokens} tokens x {self.kv_heads} kv heads x "
            f"({self.k_dim}+{self.v_dim}) x {self.element_bytes} B"
        )


def window_state(hf_config: dict, tp_size: int, element_bytes: int, context: int) -> WindowState | None:
    """The per-request rings of a hybrid sliding-window model (window_rings), None for any other model."""
    cfg = text_config(hf_config)
    if not window_rings(cfg):
        return None
    _, v, _ = kv_dims(cfg, tp_size)
    heads, hd = kv_heads_per_rank(kv_heads(cfg), tp_size), head_dim(cfg)
    return WindowState(
        layers=sum(t == "sliding_attention" for t in layer_types(cfg)),
        tokens=min(int(cfg["sliding_window"]), context),
        kv_heads=heads,
        k_dim=hd,
        v_dim=v // heads,
        element_bytes=element_bytes,
    )


def linear_layers(cfg: dict) -> int:
    """Linear-attention (gated DeltaNet) layers: each keeps a fixed-size state per request instead of KV."""
    return sum(1 for t in layer_types(cfg) if t == LINEAR_ATTENTION)


# Qwen3-Next keeps the delta rule's recurrent state in float32 whatever the serving dtype (transformers' torch path
# computes it in float32; SGLang's --mamba-ssm-dtype defaults to float32 for it); the conv state is the model's.
STATE_SSM_DTYPE = "float32"


@dataclass(frozen=True)
class LinearState:
    """One request's state in a hybrid model's linear-attention layers, on one rank."""

    layers: int
    conv_shape: tuple[int, int]  # (conv_dim / tp, kernel - 1): the conv1d's last input columns
    ssm_shape: tuple[int, int, int]  # (value heads / tp, key dim, value dim): the delta rule's matrix
    conv_element_bytes: int
    ssm_element_bytes: int

    @property
    def conv_bytes(self) -> int:
        return self.layers * math.prod(self.conv_shape) * self.conv_element_bytes

    @property
    def ssm_bytes(self) -> int:
        return self.layers * math.prod(self.ssm_shape) * self.ssm_element_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot of the state pool: every linear layer's conv and recurrent state."""
        return self.conv_bytes + self.ssm_bytes

    def text(self) -> str:
        (conv, columns), (heads, key, value) = self.conv_shape, self.ssm_shape
        return (
            f"{self.layers} linear layers x (conv {conv}x{columns} x {self.conv_element_bytes} B "
            f"+ recurrent {heads}x{key}x{value} x {self.ssm_element_bytes} B)"
        )


def _linear_dims(cfg: dict) -> tuple[int, int, int, int, int]:
    """(key heads, value heads, key head dim, value head dim, conv kernel) of the linear layers, with
    transformers' Qwen3NextConfig defaults."""
    return (
        int(cfg.get("linear_num_key_heads") or 16),
        int(cfg.get("linear_num_value_heads") or 32),
        int(cfg.get("linear_key_head_dim") or 128),
        int(cfg.get("linear_value_head_dim") or 128),
        int(cfg.get("linear_conv_kernel_dim") or 4),
    )


def linear_state(hf_config: dict, tp_size: int, element_bytes: int) -> LinearState | None:
    """The per-request state of a gated DeltaNet hybrid (Qwen3-Next): conv_dim = 2 x key heads x key dim + value
    heads x value dim over kernel - 1 columns, and a [value heads, key dim, value dim] float32 matrix, per linear
    layer; None for a model without linear-attention layers."""
    cfg = text_config(hf_config)
    layers = linear_layers(cfg)
    if not layers:
        return None
    key_heads, value_heads, key_dim, value_dim, kernel = _linear_dims(cfg)
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    return LinearState(
        layers=layers,
        conv_shape=(conv_dim // tp_size, kernel - 1),
        ssm_shape=(value_heads // tp_size, key_dim, value_dim),
        conv_element_bytes=element_bytes,
        ssm_element_bytes=dtype_bytes(STATE_SSM_DTYPE),
    )


def kv_dims(cfg: dict, tp_size: int) -> tuple[int, int, str]:
    """(K width, V width) per token per layer on one rank, in elements, and the formula in words."""
    if is_mla(cfg):
        lora, rope = int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim") or 0)
        return lora + rope, 0, f"MLA (kv_lora_rank {lora} + rope {rope})"
    heads, hd = kv_heads_per_rank(kv_heads(cfg), tp_size), head_dim(cfg)
    vd = int(cfg.get("v_head_dim") or hd)
    return heads * hd, heads * vd, f"{heads} kv heads/rank x ({hd}+{vd})"


def kv_bytes_per_token(hf_config: dict, tp_size: int, element_bytes: int) -> int:
    """MHA/GQA: kv_heads_per_rank x (head_dim + v_head_dim) x layers x bytes; MLA: (lora + rope) x layers x bytes."""
    cfg = text_config(hf_config)
    k, v, _ = kv_dims(cfg, tp_size)
    return (k + v) * kv_layers(cfg) * element_bytes


def is_sparse_layer(cfg: dict, i: int) -> bool:
    """Whether layer i's MLP is a sparse MoE (DeepSeek's first dense layers and frequency, Qwen-MoE's sparse step
    and MLP-only layers, Mixtral's every layer)."""
    if cfg.get("n_routed_experts"):  # DeepSeek-V2/V3
        return (
            i >= int(cfg.get("first_k_dense_replace") or 0) and i % int(cfg.get("moe_layer_freq") or 1) == 0
        )
    if cfg.get("num_experts") or "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:  # Qwen2/3-MoE
        step = int(cfg.get("decoder_sparse_step") or 1)
        return i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % step == 0
    return bool(cfg.get("num_local_experts"))  # Mixtral


def _experts(cfg: dict) -> tuple[int, int, int, int]:
    """(routed experts, expert intermediate, shared-expert intermediate total, experts per token)."""
    n = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
    shared = int(cfg.get("n_shared_experts") or 0) * inter + int(
        cfg.get("shared_expert_intermediate_size") or 0
    )
    return n, inter, shared, int(cfg.get("num_experts_per_tok") or 2)


def _attn_params(cfg: dict, tp: int) -> float:
    h, nh = required(cfg, "hidden_size"), required(cfg, "num_attention_heads")
    if is_mla(cfg):
        lora, rope, nope = (
            int(cfg["kv_lora_rank"]),
            int(cfg.get("qk_rope_head_dim") or 0),
            int(cfg.get("qk_nope_head_dim") or 0),
        )
        vd, qr = int(cfg.get("v_head_dim") or nope), cfg.get("q_lora_rank")
        q = (h * qr + qr * nh * (nope + rope) / tp) if qr else h * nh * (nope + rope) / tp
        return q + h * (lora + rope) + lora * nh * (nope + vd) / tp + nh * vd * h / tp
    hd, kvr = head_dim(cfg), kv_heads_per_rank(kv_heads(cfg), tp)
    params = 2 * h * nh * hd / tp + 2 * h * kvr * hd
    # the biases transformers gives: attention_bias on all four projections, Qwen2's on q, k, v always, Mistral none
    qwen2 = cfg.get("model_type") in ("qwen2", "qwen2_moe")
    bias = bool(cfg.get("attention_bias")) and cfg.get("model_type") != "mistral"
    if bias or qwen2:
        params += nh * hd / tp + 2 * kvr * hd + (h if bias and not qwen2 else 0)
    if str(cfg.get("model_type", "")).startswith(("qwen3", "gemma3")):
        params += 2 * hd  # q_norm, k_norm
    if cfg.get("model_type") == "qwen3_next":
        params += h * nh * hd / tp  # q_proj also projects the output gate
    return params


def _linear_attn_params(cfg: dict, tp: int) -> tuple[float, float]:
    """(linear params sharded by TP, the rest) of a gated DeltaNet layer: in_proj_qkvz, in_proj_ba and out_proj;
    the conv1d weight, A_log, dt_bias and the gated norm's weight."""
    h = required(cfg, "hidden_size")
    key_heads, value_heads, key_dim, value_dim, kernel = _linear_dims(cfg)
    key, value = key_heads * key_dim, value_heads * value_dim
    linear = (h * (2 * key + 2 * value) + h * 2 * value_heads + value * h) / tp
    conv = (2 * key + value) * kernel / tp
    return linear, conv + 2 * value_heads / tp + value_dim


def _attn_norm_params(cfg: dict, tp: int) -> float:
    """Attention's params never quantized with the linears: MLA's q_a_layernorm and kv_a_layernorm (replicated),
    GPT-OSS's sinks (a logit per query head, split with the heads)."""
    if cfg.get("model_type") == "gpt_oss":
        return required(cfg, "num_attention_heads") / tp
    if not is_mla(cfg):
        return 0
    return int(cfg.get("q_lora_rank") or 0) + int(cfg["kv_lora_rank"])


def _layer_norms(cfg: dict) -> int:
    """Hidden-size norms per decoder layer: before attention and before the MLP, and Gemma 2 / 3's after each."""
    return 4 if str(cfg.get("model_type", "")).startswith(("gemma2", "gemma3")) else 2


def _mlp_params(cfg: dict, i: int, tp: int) -> tuple[float, float]:
    """(linear params sharded by TP, replicated small params) of layer i's MLP."""
    h = required(cfg, "hidden_size")
    if not is_sparse_layer(cfg, i):
        return 3 * h * required(cfg, "intermediate_size") / tp, 0.0
    n, inter, shared, _ = _experts(cfg)
    router = h * n + (h if cfg.get("shared_expert_intermediate_size") else 0)  # + shared-expert gate
    if cfg.get("model_type") == "gpt_oss":  # the router's bias; the experts' gate_up bias split, down whole
        router += n + n * 2 * inter / tp + n * h
    return 3 * h * (n * inter + shared) / tp, float(router)


# architectures whose router gate is float32 whatever the serving dtype (transformers keeps it so, and Kiln too)
_FLOAT32_ROUTER_TYPES = ("deepseek_v3", "kimi_k2")


def _router_extra_bytes(cfg: dict, element_bytes: int) -> int:
    """Router bytes beyond their params x element bytes: DeepSeek-V3's float32 gate, and the float32
    e_score_correction_bias of noaux_tc routing (a buffer in transformers, so not among param_counts, though
    every checkpoint and Kiln's model hold it). Not split by TP: every rank routes."""
    float32_gate = cfg.get("model_type") in _FLOAT32_ROUTER_TYPES
    method = cfg.get("topk_method") or ("noaux_tc" if float32_gate else "greedy")
    n, h = _experts(cfg)[0], required(cfg, "hidden_size")
    per_layer = (h * n * (4 - element_bytes) if float32_gate else 0) + (n * 4 if method == "noaux_tc" else 0)
    return per_layer * sum(is_sparse_layer(cfg, i) for i in range(required(cfg, "num_hidden_layers")))


def param_counts(hf_config: dict, tp_size: int) -> tuple[int, int]:
    """Per-rank (linear-layer params, other params: embeddings, lm head, norms, routers)."""
    cfg = text_config(hf_config)
    h, layers, vocab = (
        required(cfg, "hidden_size"),
        required(cfg, "num_hidden_layers"),
        required(cfg, "vocab_size"),
    )
    other = (
        vocab * h / tp_size * (1 if tied(hf_config) else 2) + h
    )  # embedding (+ untied lm head) + final norm
    linear = 0.0
    kinds = layer_types(cfg)
    for i in range(layers):
        mlp, small = _mlp_params(cfg, i, tp_size)
        if kinds[i] == "linear_attention":
            mixer, mixer_rest = _linear_attn_params(cfg, tp_size)
        else:
            mixer, mixer_rest = _attn_params(cfg, tp_size), _attn_norm_params(cfg, tp_size)
        linear += mixer + mlp
        other += _layer_norms(cfg) * h + small + mixer_rest
    return round(linear), round(other)


def tied(hf_config: dict) -> bool:
    """Whether the LM head is the embedding (the text config's say, else the whole config's)."""
    return bool(
        text_config(hf_config).get("tie_word_embeddings", hf_config.get("tie_word_embeddings", False))
    )


def checkpoint_dtype(hf_config: dict) -> str | None:
    """The dtype the checkpoint was saved in (the language model's first), or None when its config does not say."""
    text = hf_config.get("text_config")
    for config in (text if isinstance(text, dict) else {}, hf_config):
        name = config.get("torch_dtype") or config.get("dtype")
        if name:
            return str(name).lower().removeprefix("torch.")
    return None


def half_dtype(hf_config: dict) -> str:
    """The 16-bit type a float32 or unspecified checkpoint is served in on CUDA: bfloat16 for the Gemma family,
    whose activations overflow float16 (SGLang's `_get_and_verify_dtype`), and for GPT-OSS, whose checkpoints
    hold their unquantized tensors in bfloat16 and whose config names no dtype; else float16."""
    text = text_config(hf_config)
    model_type = str(text.get("model_type") or hf_config.get("model_type") or "")
    return "bfloat16" if model_type.startswith(("gemma", "gpt_oss")) else "float16"


def aux_hidden_layers(hf_config: dict) -> tuple[int, ...] | None:
    """An EAGLE-3 head's `eagle_config.eagle_aux_hidden_state_layer_ids`, or None when it names none."""
    ids = (hf_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else None


def packed_lm_head_bytes(hf_config: dict, tp_size: int) -> int:
    """The CPU prepacked copy of a tied lm head (the embedding keeps the plain rows): vocab/tp x hidden x 4 B."""
    cfg = text_config(hf_config)
    if not tied(hf_config):
        return 0
    return math.ceil(required(cfg, "vocab_size") / tp_size) * required(cfg, "hidden_size") * 4


def fp8_weight_block(hf_config: dict) -> tuple[int, int] | None:
    """An FP8 block-quantized checkpoint's weight block (kiln/loader/fp8.py reads these), else None."""
    q = hf_config.get("quantization_config") or {}
    if str(q.get("quant_method") or "").lower() != "fp8":
        return None
    block = q.get("weight_block_size")  # without it the loader refuses the config (kiln/loader/fp8.py)
    if not (isinstance(block, list | tuple) and len(block) == 2):
        return None
    return int(block[0]), int(block[1])


def _latent_up_params(cfg: dict, tp: int) -> float:
    """kv_b_proj's per-rank params: latent attention holds it in the serving dtype even from an FP8 checkpoint."""
    if not is_mla(cfg):
        return 0.0
    nope, heads = int(cfg.get("qk_nope_head_dim") or 0), required(cfg, "num_attention_heads")
    v = int(cfg.get("v_head_dim") or nope)
    return required(cfg, "num_hidden_layers") * int(cfg["kv_lora_rank"]) * heads * (nope + v) / tp


def _linear_bytes_per_param(hf_config: dict, element_bytes: int, fp8_kept: bool = False) -> tuple[float, str]:
    q = hf_config.get("quantization_config") or {}
    method = str(q.get("quant_method") or "").lower()
    if not method:
        return float(element_bytes), ""
    block = fp8_weight_block(hf_config)
    if block is not None and fp8_kept:  # kiln/layers/fp8_linear.py: 1 B a weight, a float32 factor a block
        return 1.0 + 4 / (block[0] * block[1]), f"fp8 blocks kept (1 B + 4 B per {block[0]}x{block[1]} block)"
    if "fp8" in method:  # kiln/loader/fp8.py dequantizes the blocks at load: the weights are held unquantized
        return float(element_bytes), f"{method} checkpoint dequantized at load"
    if method == "compressed-tensors":  # kiln/loader/compressed.py decompresses them at load
        return float(element_bytes), f"{method} checkpoint dequantized at load"
    if method == "modelopt":
        return 1.0 + 4 / (128 * 128), f"{method} (1 B + block scales)"
    if method == "mxfp4":  # kiln/loader/mxfp4.py: GPT-OSS's experts, dequantized at load (no MXFP4 kernel)
        return float(element_bytes), "mxfp4 experts dequantized at load"
    if method in ("modelopt_fp4", "nvfp4"):
        return 0.5 + 1 / 32, f"{method} (0.5 B + scales)"
    if method == "bitsandbytes":
        return (0.5 + 4 / 64, "bnb 4-bit") if q.get("load_in_4bit") else (1.0, "bnb 8-bit")
    bits, group = int(q.get("bits") or 4), int(q.get("group_size") or 128)
    if method in ("gptq", "awq"):  # kiln/loader/packed_int.py: dequantized at load (no packed low-bit kernel)
        return float(element_bytes), f"{method} {bits}-bit checkpoint dequantized at load"
    group = group if group > 0 else 1024
    return bits / 8 + (element_bytes + bits / 8) / group, f"{method} {bits}-bit, group {group}"


def weight_bytes(hf_config: dict, tp_size: int, element_bytes: int, fp8_kept: bool = False) -> int:
    """Per-rank weight bytes: parameter count from shapes (or GGUF's f32 total), quantized linears as stored;
    an FP8 checkpoint's linears dequantized, or kept in FP8 (fp8_kept: kiln.platform.fp8_weights_kept), all but
    latent attention's kv_b_proj."""
    gguf = hf_config.get("kiln_gguf") if isinstance(hf_config.get("kiln_gguf"), dict) else {}
    f32 = gguf.get("weight_bytes_f32") or hf_config.get("kiln_gguf.weight_bytes_f32")
    if f32:  # GGUF tensors are dequantized to the serving dtype
        return math.ceil(int(f32) / 4 * element_bytes / tp_size)
    linear, other = param_counts(hf_config, tp_size)
    per_param, _ = _linear_bytes_per_param(hf_config, element_bytes, fp8_kept)
    if fp8_kept and fp8_weight_block(hf_config) is not None:
        plain = _latent_up_params(text_config(hf_config), tp_size)
        linear, other = linear - plain, other + plain
    extra = _router_extra_bytes(text_config(hf_config), element_bytes)
    return math.ceil(linear * per_param + other * element_bytes) + extra


@dataclass(frozen=True)
class GgufBlocks:
    """GGUF matrices that Kiln's CPU kernels keep in their blocks, per rank."""

    linear_params: int  # parameters of the linear matrices kept in blocks
    linear_bytes: int  # their bytes in blocks
    head_bytes: int  # the tied LM head's prepacked copy in blocks; 0 when untied or not in blocks
    types: tuple[str, ...] = ()  # the GGML types kept, in the file's order


# packed bytes per raw byte of the GGUF types whose packed layout is larger than the file's blocks: the integer
# kernels' Q4_K holds each super-block's 12 bytes of 6-bit scales and mins as 16 bytes
_PACKED_PER_RAW = {"Q4_K": (148, 144)}


def gptq_q4_0_blocks(quant: dict | None) -> bool:
    """Whether a GPTQ checkpoint's linears load as Q4_0 blocks beside their float32 weights (kiln/loader/packed_int.py):
    4 bits, symmetric (every zero point 8), no act-order, groups of whole 32-column blocks."""
    q = quant or {}
    if str(q.get("quant_method", "")).lower() != "gptq" or int(q.get("bits", 4)) != 4:
        return False
    group = int(q.get("group_size", 128))
    return bool(q.get("sym", True)) and not q.get("desc_act", False) and (group == -1 or group % 32 == 0)


def _block_types(hf_config: dict) -> dict:
    """{GGML type: [linear params, their bytes in blocks, the tied head's bytes]} of the matrices a load keeps in
    blocks: a GGUF's from its header; a symmetric 4-bit GPTQ checkpoint's projections as Q4_0 (18 B a 32)."""
    gguf = hf_config.get("kiln_gguf") if isinstance(hf_config.get("kiln_gguf"), dict) else {}
    if gguf.get("block_types"):
        return gguf["block_types"]
    if gptq_q4_0_blocks(hf_config.get("quantization_config")):
        params = round(_projection_counts(text_config(hf_config), 1)[0])
        return {"Q4_0": [params, params // 32 * 18, 0]}
    return {}


def gguf_block_bytes(hf_config: dict, tp_size: int, types: tuple[str, ...]) -> GgufBlocks | None:
    """The GGUF matrices of `types` (those --cpu-gemm keeps, in its order) in their packed blocks on one rank;
    None where none is."""
    found = _block_types(hf_config)
    kept = {t: found[t] for t in types if t in found}
    if not any(counts[0] for counts in kept.values()):
        return None
    head_tied = tied(hf_config)
    packed = {t: _PACKED_PER_RAW.get(t, (1, 1)) for t in kept}
    params = sum(int(counts[0]) for counts in kept.values())
    nbytes, head = (
        sum(int(counts[i]) * packed[t][0] // packed[t][1] for t, counts in kept.items()) for i in (1, 2)
    )
    return GgufBlocks(
        *(math.ceil(v / tp_size) for v in (params, nbytes, head if head_tied else 0)),
        types=tuple(t for t, counts in kept.items() if counts[0] or (head_tied and counts[2])),
    )


def int8_saved_bytes(hf_config: dict, tp_size: int, element_bytes: int, kept: tuple[str, ...] = ()) -> int:
    """Bytes per rank that --quantization int8 saves on the CPU: each weight of the attention and dense MLP
    projections held in 1 byte instead of `element_bytes`, plus a float32 scale per output row; of a GGUF, the
    projections whose type is not among the `kept` blocks. Matrices it does not count (latent attention's, the
    experts') stay counted at `element_bytes`: the plan errs high."""
    gguf = hf_config.get("kiln_gguf") if isinstance(hf_config.get("kiln_gguf"), dict) else {}
    if gguf.get("linear_types"):
        params, rows = (
            sum(int(counts[i]) for t, counts in gguf["linear_types"].items() if t not in kept) for i in (0, 1)
        )
        return math.floor((params * (element_bytes - 1) - 4 * rows) / tp_size)
    if any(t in kept for t in _block_types(hf_config)):  # the projections are blocks already (GPTQ as Q4_0)
        return 0
    params, rows = _projection_counts(text_config(hf_config), tp_size)
    return math.floor(params * (element_bytes - 1) - 4 * rows)


def _projection_counts(cfg: dict, tp_size: int) -> tuple[float, float]:
    """Weights and output rows per rank of the attention (all but latent attention's) and dense MLP projections."""
    h, nh = required(cfg, "hidden_size"), required(cfg, "num_attention_heads")
    params = rows = 0.0
    for i in range(required(cfg, "num_hidden_layers")):
        if not is_mla(cfg):
            hd, kvr = head_dim(cfg), kv_heads_per_rank(kv_heads(cfg), tp_size)
            q_rows, kv_rows = nh * hd / tp_size, 2 * kvr * hd
            params += (q_rows + kv_rows) * h + h * q_rows
            rows += q_rows + kv_rows + h
        if not is_sparse_layer(cfg, i):
            inter = required(cfg, "intermediate_size") / tp_size
            params += 3 * h * inter
            rows += 2 * inter + h
    return params, rows


def weight_inputs(hf_config: dict, tp_size: int, dtype: str, fp8_kept: bool = False) -> str:
    gguf = hf_config.get("kiln_gguf") if isinstance(hf_config.get("kiln_gguf"), dict) else {}
    f32 = gguf.get("weight_bytes_f32") or hf_config.get("kiln_gguf.weight_bytes_f32")
    if f32:
        return f"GGUF {int(f32) // 4:,} params dequantized to {dtype} / tp {tp_size}"
    linear, other = param_counts(hf_config, tp_size)
    _, quant = _linear_bytes_per_param(hf_config, dtype_bytes(dtype), fp8_kept)
    how = f"linears {quant}, rest {dtype}" if quant else dtype
    return f"{(linear + other) / 1e9:.3f}e9 params/rank (tp {tp_size}) x {how}"


def context_len_of(hf_config: dict) -> int:
    """The longest context the model serves: its config's maximum position, stretched by a rope scaling factor
    as SGLang derives it (not llama3's, nor one naming its original maximum: there the maximum is the stretched
    one already)."""
    cfg = text_config(hf_config)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")  # the older and newer transformers' names
    rope = rope if isinstance(rope, dict) else {}
    stretched = (
        "original_max_position_embeddings" not in rope and rope.get("rope_type", rope.get("type")) != "llama3"
    )
    factor = float(rope.get("factor") or 1) if stretched else 1.0
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        if cfg.get(key):
            return int(factor * int(cfg[key]))
    return 2048


def prefill_activation(hf_config: dict, tokens: int, tp: int, act_bytes: int, device: str) -> tuple[int, str]:
    """Peak activations of one prefill forward over `tokens` tokens, per rank; or, where larger, of the prompt
    logprobs scored after it (a chunk of rows' float32 logits and their log-softmax)."""
    cfg = text_config(hf_config)
    h, nh, vocab = (
        required(cfg, "hidden_size"),
        required(cfg, "num_attention_heads"),
        required(cfg, "vocab_size"),
    )
    heads = max(1, math.ceil(nh / tp))
    if is_mla(cfg):
        nope, rope = int(cfg.get("qk_nope_head_dim") or 0), int(cfg.get("qk_rope_head_dim") or 0)
        vd = int(cfg.get("v_head_dim") or nope)
        qkv_w, out_w = heads * (2 * (nope + rope) + vd), heads * vd
    else:
        k_w, v_w, _ = kv_dims(cfg, tp)
        qkv_w, out_w = heads * head_dim(cfg) + k_w + v_w, heads * int(cfg.get("v_head_dim") or head_dim(cfg))
    inter = int(cfg.get("intermediate_size") or 0)
    n, e_inter, shared, topk = _experts(cfg)
    if n:
        inter = max(inter if not cfg.get("num_local_experts") else 0, topk * e_inter + shared)
    inter = math.ceil(inter / tp)
    t = tokens
    parts = {
        "hidden": 2 * t * h * act_bytes,
        "qkv": t * qkv_w * act_bytes,
        "attn out": t * out_w * act_bytes,
        "mlp": 2 * t * inter * act_bytes,
        # CPU: torch sdpa materializes fp32 scores per head; CUDA kernels keep scores on chip (the mask remains)
        "scores": heads * t * t * 4 if not device.startswith("cuda") else t * t * act_bytes,
        "last logits": vocab * 4,
    }
    text = (
        f"{t} tokens: hidden 2x{h}, qkv {qkv_w}, attn out {out_w}, mlp 2x{inter} @ {act_bytes} B; "
        + (f"scores {heads} heads x {t}^2 x 4 B; " if not device.startswith("cuda") else f"mask {t}^2; ")
        + f"last-token logits {vocab} x 4 B"
    )
    scoring = 2 * min(t, PROMPT_LOGPROB_ROWS) * vocab * 4
    if scoring > sum(parts.values()):
        return (
            scoring,
            f"prompt logprobs: {min(t, PROMPT_LOGPROB_ROWS)} rows x vocab {vocab} x 4 B x 2 (> {text})",
        )
    return sum(parts.values()), text
