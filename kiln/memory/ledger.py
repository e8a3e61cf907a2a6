"""The memory ledger: every per-rank allocation predicted from the model config and the arguments alone.

Nothing here touches a device; `compute_ledger` is pure arithmetic and is what `kiln plan` prints and
what `kiln serve` checks before allocating. Sizes are bytes; "GiB" in messages is 2^30, the hierarchical
cache's "GB" is 1e9 (it is given per rank, in GB, like SGLang's `--hicache-size`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

GIB = 1 << 30
MIB = 1 << 20

_DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}  # fmt: skip
_NON_KV_LAYER_TYPES = {"linear_attention", "mamba", "mamba2", "conv", "recurrent"}

# CPU defaults, chosen for a shared 2-core / 24 GiB machine:
# - the KV pool takes at most 25% of the available RAM (or what CPU_MAX_RUNNING_REQUESTS x context needs,
#   if smaller), so Kiln does not grab a machine it shares with the tokenizer, the client and other work;
# - 128 running requests: two cores saturate well below that, and the logits/request tables stay small;
# - 2048-token prefill chunks: at ~800 tok/s a chunk takes ~2.5 s, longer chunks stall running decodes
#   for longer without making prefill faster, and the activations of a 2048-token chunk are small.
CPU_POOL_RAM_FRACTION = 0.25
CPU_MAX_RUNNING_REQUESTS = 128
CPU_CHUNKED_PREFILL_SIZE = 2048
# Interpreter, tokenizer, allocator slack; on CUDA SGLang's 512 MiB + tp/8 GiB of communication buffers.
RUNTIME_OVERHEAD_BYTES = 512 * MIB
MOMENTS = ("load_weights", "kv_allocation", "host_memory", "graph_capture", "first_full_prefill")


@dataclass(frozen=True, kw_only=True)
class LedgerInputs:
    hf_config: dict
    device: str = "cpu"
    device_memory_bytes: int
    available_memory_bytes: int  # free before loading, per rank
    tp_size: int = 1
    dtype: str = "float32"  # resolved weight/activation dtype name
    kv_cache_dtype: str | None = None
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 16384
    page_size: int = 1
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    enable_hierarchical_cache: bool = False
    hicache_size_gb: float = 0.0
    hicache_ratio: float = 2.0
    host_memory_bytes: int | None = None  # node RAM available (defaults to probed)
    draft_hf_config: dict | None = None  # speculative decoding draft model


@dataclass(frozen=True)
class LedgerLine:
    name: str
    bytes: int
    inputs: str  # the arithmetic behind the number


@dataclass(frozen=True)
class Failure:
    moment: str  # one of MOMENTS
    message: str
    fix: str
    fix_flags: dict = field(default_factory=dict)  # the primary fix as serve flags, e.g. {"--tp-size": "2"}


@dataclass(frozen=True)
class Ledger:
    lines: tuple[LedgerLine, ...]
    kv_bytes_per_token: int
    weight_bytes: int
    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    chunked_prefill_size: int
    max_prefill_tokens: int
    mem_fraction_static: float
    mem_fraction_reason: str
    graph_reserve_bytes: int
    prefill_activation_bytes: int
    logits_bytes: int
    headroom_bytes: int
    fits: bool
    failure: Failure | None
    device: str = "cpu"
    tp_size: int = 1

    def line(self, name: str) -> LedgerLine:
        return next(x for x in self.lines if x.name == name)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- model-config arithmetic


def dtype_bytes(name: str) -> int:
    try:
        return _DTYPE_BYTES[name.lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (use one of {', '.join(sorted(_DTYPE_BYTES))})") from None


def text_config(hf_config: dict) -> dict:
    """The language-model part of a config (multimodal configs nest it under text_config)."""
    if "num_hidden_layers" not in hf_config and isinstance(hf_config.get("text_config"), dict):
        return hf_config["text_config"]
    return hf_config


def resolve_dtype(hf_config: dict, device: str, dtype: str | None = "auto") -> str:
    """'auto' -> float32 on CPU (fastest in stock PyTorch there); on CUDA the checkpoint's half type."""
    if dtype and dtype != "auto":
        dtype_bytes(dtype)
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    cfg = text_config(hf_config)
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or hf_config.get("torch_dtype") or "bfloat16")
    name = name.removeprefix("torch.")
    return name if name in ("bfloat16", "float16") else "float16"


def _req(cfg: dict, key: str) -> int:
    if cfg.get(key) is None:
        raise ValueError(f"model config has no {key!r}; is this a decoder LLM config.json?")
    return int(cfg[key])


def _is_mla(cfg: dict) -> bool:
    return bool(cfg.get("kv_lora_rank"))


def head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or _req(cfg, "hidden_size") // _req(cfg, "num_attention_heads"))


def kv_heads_per_rank(cfg: dict, tp_size: int) -> int:
    """KV heads held by one rank; replicated (1 per rank) when tp > kv heads."""
    kv = int(cfg.get("num_key_value_heads") or _req(cfg, "num_attention_heads"))
    return max(1, math.ceil(kv / tp_size))


def kv_layers(cfg: dict) -> int:
    """Layers that keep KV (hybrid models: only the attention layers)."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return sum(1 for t in types if str(t) not in _NON_KV_LAYER_TYPES)
    return _req(cfg, "num_hidden_layers")


def kv_dims(cfg: dict, tp_size: int) -> tuple[int, int, str]:
    """(K width, V width) per token per layer on one rank, in elements, and the formula in words."""
    if _is_mla(cfg):
        lora, rope = int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim") or 0)
        return lora + rope, 0, f"MLA (kv_lora_rank {lora} + rope {rope})"
    heads, hd = kv_heads_per_rank(cfg, tp_size), head_dim(cfg)
    vd = int(cfg.get("v_head_dim") or hd)
    return heads * hd, heads * vd, f"{heads} kv heads/rank x ({hd}+{vd})"


def kv_bytes_per_token(hf_config: dict, tp_size: int, dtype_bytes: int) -> int:
    """MHA/GQA: kv_heads_per_rank x (head_dim + v_head_dim) x layers x bytes; MLA: (lora + rope) x layers x bytes."""
    cfg = text_config(hf_config)
    k, v, _ = kv_dims(cfg, tp_size)
    return (k + v) * kv_layers(cfg) * dtype_bytes


def _moe_layer(cfg: dict, i: int) -> bool:
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
    h, nh = _req(cfg, "hidden_size"), _req(cfg, "num_attention_heads")
    if _is_mla(cfg):
        lora, rope, nope = (
            int(cfg["kv_lora_rank"]),
            int(cfg.get("qk_rope_head_dim") or 0),
            int(cfg.get("qk_nope_head_dim") or 0),
        )
        vd, qr = int(cfg.get("v_head_dim") or nope), cfg.get("q_lora_rank")
        q = (h * qr + qr + qr * nh * (nope + rope) / tp) if qr else h * nh * (nope + rope) / tp
        return q + h * (lora + rope) + lora + lora * nh * (nope + vd) / tp + nh * vd * h / tp
    hd, kvr = head_dim(cfg), kv_heads_per_rank(cfg, tp)
    params = 2 * h * nh * hd / tp + 2 * h * kvr * hd
    if cfg.get("attention_bias") or cfg.get("model_type") in ("qwen2", "qwen2_moe"):
        params += nh * hd / tp + 2 * kvr * hd + (h if cfg.get("attention_bias") else 0)
    if str(cfg.get("model_type", "")).startswith("qwen3"):
        params += 2 * hd  # q_norm, k_norm
    return params


def _mlp_params(cfg: dict, i: int, tp: int) -> tuple[float, float]:
    """(linear params sharded by TP, replicated small params) of layer i's MLP."""
    h = _req(cfg, "hidden_size")
    if not _moe_layer(cfg, i):
        return 3 * h * _req(cfg, "intermediate_size") / tp, 0.0
    n, inter, shared, _ = _experts(cfg)
    router = h * n + (h if cfg.get("shared_expert_intermediate_size") else 0)  # + shared-expert gate
    return 3 * h * (n * inter + shared) / tp, float(router)


def param_counts(hf_config: dict, tp_size: int) -> tuple[int, int]:
    """Per-rank (linear-layer params, other params: embeddings, lm head, norms, routers)."""
    cfg = text_config(hf_config)
    h, layers, vocab = _req(cfg, "hidden_size"), _req(cfg, "num_hidden_layers"), _req(cfg, "vocab_size")
    tied = bool(cfg.get("tie_word_embeddings", hf_config.get("tie_word_embeddings", False)))
    other = vocab * h / tp_size * (1 if tied else 2) + h  # embedding (+ untied lm head) + final norm
    linear = 0.0
    for i in range(layers):
        mlp, small = _mlp_params(cfg, i, tp_size)
        linear += _attn_params(cfg, tp_size) + mlp
        other += 2 * h + small
    return round(linear), round(other)


def _linear_bytes_per_param(hf_config: dict, dtype_bytes: int) -> tuple[float, str]:
    q = hf_config.get("quantization_config") or {}
    method = str(q.get("quant_method") or "").lower()
    if not method:
        return float(dtype_bytes), ""
    if "fp8" in method or method in ("compressed-tensors", "modelopt"):
        return 1.0 + 4 / (128 * 128), f"{method} (1 B + block scales)"
    if method in ("mxfp4", "modelopt_fp4", "nvfp4"):
        return 0.5 + 1 / 32, f"{method} (0.5 B + scales)"
    if method == "bitsandbytes":
        return (0.5 + 4 / 64, "bnb 4-bit") if q.get("load_in_4bit") else (1.0, "bnb 8-bit")
    bits, group = int(q.get("bits") or 4), int(q.get("group_size") or 128)
    group = group if group > 0 else 1024
    return bits / 8 + (dtype_bytes + bits / 8) / group, f"{method} {bits}-bit, group {group}"


def weight_bytes(hf_config: dict, tp_size: int, dtype_bytes: int) -> int:
    """Per-rank weight bytes: parameter count from shapes (or GGUF's f32 total), quantized linears as stored."""
    gguf = hf_config.get("kiln_gguf") if isinstance(hf_config.get("kiln_gguf"), dict) else {}
    f32 = gguf.get("weight_bytes_f32") or hf_config.get("kiln_gguf.weight_bytes_f32")
    if f32:  # GGUF tensors are dequantized to the serving dtype
        return math.ceil(int(f32) / 4 * dtype_bytes / tp_size)
    linear, other = param_counts(hf_config, tp_size)
    per_param, _ = _linear_bytes_per_param(hf_config, dtype_bytes)
    return math.ceil(linear * per_param + other * dtype_bytes)


def weight_inputs(hf_config: dict, tp_size: int, dtype: str) -> str:
    gguf = hf_config.get("kiln_gguf") if isinstance(hf_config.get("kiln_gguf"), dict) else {}
    f32 = gguf.get("weight_bytes_f32") or hf_config.get("kiln_gguf.weight_bytes_f32")
    if f32:
        return f"GGUF {int(f32) // 4:,} params dequantized to {dtype} / tp {tp_size}"
    linear, other = param_counts(hf_config, tp_size)
    _, quant = _linear_bytes_per_param(hf_config, dtype_bytes(dtype))
    how = f"linears {quant}, rest {dtype}" if quant else dtype
    return f"{(linear + other) / 1e9:.3f}e9 params/rank (tp {tp_size}) x {how}"


def context_len_of(hf_config: dict) -> int:
    cfg = text_config(hf_config)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        if cfg.get(key):
            return int(cfg[key])
    return 2048


def prefill_activation(hf_config: dict, tokens: int, tp: int, act_bytes: int, device: str) -> tuple[int, str]:
    """Peak activations of one prefill forward over `tokens` tokens, per rank."""
    cfg = text_config(hf_config)
    h, nh, vocab = _req(cfg, "hidden_size"), _req(cfg, "num_attention_heads"), _req(cfg, "vocab_size")
    heads = max(1, math.ceil(nh / tp))
    if _is_mla(cfg):
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
    return sum(parts.values()), text


# ---------------------------------------------------------------- sizing


def _cuda_defaults(device_memory_bytes: int, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, decode graph max bs) by device memory, as SGLang picks them."""
    gib = device_memory_bytes / GIB
    for limit, chunk, small, large in (
        (20, 2048, 8, 8),
        (35, 2048, 24, 80),
        (60, 4096, 32, 160),
        (160, 8192, 256, 512),
    ):
        if gib < limit:
            return chunk, small if tp < 4 else large
    return 16384, 512


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64)]
    sizes += [*range(1280, 4097, 256), *range(4608, max_tokens + 1, 512)]
    return [s for s in sizes if s <= max_tokens]


def graph_reserve(inp: LedgerInputs, max_bs: int, chunk: int) -> tuple[int, str]:
    """SGLang's reserve_for_graph on CUDA: decode max_bs x 2 MiB + prefill sizes x 8 MiB (MLA: + 1536 MiB)."""
    if inp.disable_cuda_graph:
        return 0, "graphs disabled"
    if not inp.device.startswith("cuda"):
        if inp.cuda_graph_max_bs is None:
            return 0, "no graph capture on cpu"
        return max_bs * 2 * MIB, f"decode bs <= {max_bs} x 2 MiB"
    if _is_mla(text_config(inp.hf_config)):
        return (max_bs * 2 + 1536) * MIB, f"decode bs <= {max_bs} x 2 MiB + MLA 1536 MiB"
    n = len(prefill_graph_sizes(chunk))
    return (
        max_bs * 2 + n * 8
    ) * MIB, f"decode bs <= {max_bs} x 2 MiB + {n} prefill sizes (<= {chunk}) x 8 MiB"


def sglang_reserve(inp: LedgerInputs, chunk: int) -> int:
    """SGLang's default slack (MiB math of its mem_fraction_static heuristic), in bytes."""
    _, max_bs = _cuda_defaults(inp.device_memory_bytes, inp.tp_size)
    graph, _ = graph_reserve(inp, inp.cuda_graph_max_bs or max_bs, chunk)
    reserved = (512 + max(chunk, 2048) * 1.5 + inp.tp_size / 8 * 1024) * MIB + graph
    if inp.device_memory_bytes > 60 * GIB:
        reserved = max(reserved, 10240 * MIB)
    return int(reserved)


def resolve_running_requests(inp: LedgerInputs, tokens: int, ctx: int) -> int:
    if inp.max_running_requests:
        want = inp.max_running_requests
    elif inp.device.startswith("cuda"):
        want = min(max(int(tokens / max(ctx, 1) * 512), 2048), 4096)
    else:
        want = CPU_MAX_RUNNING_REQUESTS
    return max(1, min(want, tokens // 2))


def compute_ledger(inp: LedgerInputs) -> Ledger:
    """The ledger for these inputs; when it does not fit, the failure names the moment and a verified fix."""
    from kiln.memory.ledger_format import find_fix

    ledger = compute_core(inp)
    if ledger.failure is None:
        return ledger
    fix, flags = find_fix(inp, ledger, compute_core)
    return replace(ledger, failure=replace(ledger.failure, fix=fix, fix_flags=flags))


def _validate(inp: LedgerInputs) -> None:
    checks = [
        (inp.tp_size >= 1, "--tp-size must be >= 1"),
        (inp.available_memory_bytes > 0, "available device memory must be > 0"),
        (
            inp.mem_fraction_static is None or 0 < inp.mem_fraction_static <= 1,
            "--mem-fraction-static must be in (0, 1]",
        ),
        (inp.page_size >= 1, "--page-size must be >= 1"),
        (inp.max_total_tokens is None or inp.max_total_tokens >= 1, "--max-total-tokens must be >= 1"),
        (inp.context_length is None or inp.context_length >= 1, "--context-length must be >= 1"),
        (
            inp.max_running_requests is None or inp.max_running_requests >= 1,
            "--max-running-requests must be >= 1",
        ),
        (
            inp.chunked_prefill_size in (None, -1) or inp.chunked_prefill_size >= 1,
            "--chunked-prefill-size must be >= 1 or -1",
        ),
        (inp.max_prefill_tokens >= 1, "--max-prefill-tokens must be >= 1"),
        (inp.cuda_graph_max_bs is None or inp.cuda_graph_max_bs >= 1, "--cuda-graph-max-bs must be >= 1"),
        (
            inp.hicache_size_gb >= 0 and inp.hicache_ratio > 0,
            "--hicache-size must be >= 0 and --hicache-ratio > 0",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


@dataclass
class _Sizing:
    tokens: int
    mfs: float
    reason: str
    cause: str
    target: tuple[int, str] | None  # (tokens required by an absolute target, its description)


def _host_check(inp: LedgerInputs, pool: int, device_used: int) -> tuple[list[LedgerLine], str | None]:
    """Host tier lines (per rank, per node) and the host-memory failure message, if any."""
    if not inp.enable_hierarchical_cache:
        return [], None
    if inp.hicache_size_gb > 0:
        per_rank, how = (
            int(inp.hicache_size_gb * 1e9),
            f"--hicache-size {inp.hicache_size_gb:g} GB (1e9 B) per rank",
        )
    else:
        per_rank, how = (
            int(inp.hicache_ratio * pool),
            f"--hicache-ratio {inp.hicache_ratio:g} x KV pool {gib(pool)}",
        )
    if inp.host_memory_bytes is not None:
        host = inp.host_memory_bytes
    else:
        from kiln.platform import host_available_bytes

        host = host_available_bytes()
    reserve = min(10 * GIB, max(GIB, host // 10))
    shared = (
        inp.tp_size * device_used if not inp.device.startswith("cuda") else 0
    )  # on CPU the KV pools are RAM too
    budget = host - reserve - shared
    node = inp.tp_size * per_rank
    minus = f" - cpu ranks' own use {gb(shared)}" if shared else ""
    lines = [
        LedgerLine("host tier per rank", per_rank, how),
        LedgerLine(
            "host tier node", node, f"{inp.tp_size} ranks x {gb(per_rank)} = {gb(node)} of system RAM"
        ),
        LedgerLine("host budget", budget, f"available RAM {gb(host)} - reserve {gb(reserve)}{minus}"),
    ]
    if node <= budget:
        return lines, None
    message = (
        f"the hierarchical cache lives in system RAM, not accelerator memory: {how} = {gb(per_rank)} per rank "
        f"x {inp.tp_size} ranks = {gb(node)} on this node, but only {gb(budget)} is usable "
        f"(available RAM {gb(host)} - reserve {gb(reserve)}{minus})"
    )
    return lines, message


def _size_pool(
    inp: LedgerInputs, static: int, cell: int, ctx: int, need_at, static_chunk: int = 0
) -> _Sizing:
    """Decide the KV pool token count and the mem_fraction_static it corresponds to."""
    pre, page = inp.available_memory_bytes, inp.page_size
    target = None
    if inp.context_length and inp.max_running_requests:
        n = inp.context_length * inp.max_running_requests
        target = (
            n,
            f"--context-length {inp.context_length} x --max-running-requests {inp.max_running_requests}",
        )
    elif inp.context_length:
        target = (inp.context_length, f"--context-length {inp.context_length}")
    if inp.max_total_tokens and (target is None or inp.max_total_tokens > target[0]):
        target = (inp.max_total_tokens, f"--max-total-tokens {inp.max_total_tokens}")

    def tokens_for(mfs: float) -> int:
        return max(0, (int((pre * mfs - static) // cell) - page) // page * page)

    if inp.mem_fraction_static is not None:
        mfs = inp.mem_fraction_static
        tokens = tokens_for(mfs)
        if inp.max_total_tokens and inp.max_total_tokens <= tokens:
            tokens = inp.max_total_tokens // page * page
        return _Sizing(
            tokens, mfs, f"--mem-fraction-static {mfs:g} given", f"--mem-fraction-static {mfs:g}", target
        )
    if inp.max_total_tokens:
        tokens = inp.max_total_tokens // page * page
        mfs = round((static + (tokens + page) * cell) / pre, 3)
        reason = f"derived from --max-total-tokens {inp.max_total_tokens}: (weights + KV pool) / available = {mfs:.3f}"
        # a pool smaller than one full context is a valid setup: requests that cannot fit are refused one by one
        return _Sizing(tokens, mfs, reason, f"--max-total-tokens {inp.max_total_tokens}", None)
    upper = max(0, (pre - static) // cell)
    need = need_at(resolve_running_requests(inp, upper, ctx))
    if inp.device.startswith("cuda"):
        # The ledger's own reserve, but never less than SGLang's empirical one (1.5 MiB per prefill token, ...):
        # allocator fragmentation and library workspaces are not in the ledger's lines.
        floor_ = sglang_reserve(inp, static_chunk)
        reserve = max(need, floor_)
        mfs = math.floor((pre - reserve) / pre * 1000) / 1000
        which = (
            "the ledger's runtime + capture + peak prefill + logits + request table"
            if need >= floor_
            else (f"SGLang's reserve formula (above the ledger's {gib(need)})")
        )
        reason = (
            f"chosen so the headroom covers {which} = {gib(reserve)} of {gib(pre)} free: "
            f"floor((free - reserve) / free) = {mfs:.3f}"
        )
        return _Sizing(tokens_for(mfs), mfs, reason, f"the default --mem-fraction-static {mfs:.3f}", target)
    room = max(0, (pre - static - need) // cell - page)
    by_ram = int(CPU_POOL_RAM_FRACTION * pre) // cell
    by_use = (inp.max_running_requests or CPU_MAX_RUNNING_REQUESTS) * ctx
    both = bool(inp.context_length and inp.max_running_requests)  # an absolute pool target
    want = target[0] if both else max(min(by_ram, by_use), target[0] if target else 0)
    tokens = max(0, min(want, room) // page * page)
    mfs = round((static + (tokens + page) * cell) / pre, 3)
    why = (
        f"target {target[1]} = {want:,} tokens"
        if both
        else f"min({CPU_POOL_RAM_FRACTION:.0%} of available RAM = {by_ram:,} tokens, "
        f"{inp.max_running_requests or CPU_MAX_RUNNING_REQUESTS} requests x {ctx} context = {by_use:,} tokens)"
    )
    reason = (
        f"cpu default: KV pool = {why}, capped by what leaves headroom for peak prefill "
        f"({room:,} tokens), so Kiln does not take over a shared machine; "
        f"(weights + pool) / available = {mfs:.3f}"
    )
    return _Sizing(tokens, mfs, reason, "the default KV pool", target)


def compute_core(inp: LedgerInputs) -> Ledger:
    """compute_ledger without the fix search."""
    _validate(inp)
    hf, cfg, tp, pre, page = (
        inp.hf_config,
        text_config(inp.hf_config),
        inp.tp_size,
        inp.available_memory_bytes,
        inp.page_size,
    )
    cuda = inp.device.startswith("cuda")
    wb = dtype_bytes(inp.dtype)
    kv_dtype = inp.kv_cache_dtype if inp.kv_cache_dtype not in (None, "auto") else inp.dtype
    kvb = dtype_bytes(kv_dtype)
    cell = kv_bytes_per_token(hf, tp, kvb)
    draft = inp.draft_hf_config
    draft_cell = kv_bytes_per_token(draft, tp, kvb) if draft else 0
    weights = weight_bytes(hf, tp, wb)
    draft_w = weight_bytes(draft, tp, wb) if draft else 0
    static, full_cell = weights + draft_w, cell + draft_cell
    ctx = inp.context_length or context_len_of(hf)
    default_chunk, default_bs = (
        _cuda_defaults(inp.device_memory_bytes, tp) if cuda else (CPU_CHUNKED_PREFILL_SIZE, 0)
    )
    chunk = inp.chunked_prefill_size or default_chunk
    prefill_tokens = min(chunk, inp.max_prefill_tokens) if chunk > 0 else max(inp.max_prefill_tokens, ctx)
    prefill, prefill_text = prefill_activation(hf, prefill_tokens, tp, wb, inp.device)
    overhead = RUNTIME_OVERHEAD_BYTES + (tp * GIB // 8 if cuda else 0)
    vocab = _req(cfg, "vocab_size")

    def parts(mrr: int) -> tuple[int, str, int, int]:
        max_bs = min(inp.cuda_graph_max_bs or default_bs, mrr)
        graph, graph_text = graph_reserve(inp, max_bs, chunk if chunk > 0 else prefill_tokens)
        return graph, graph_text, mrr * vocab * 4, mrr * ctx * 8

    def need_at(mrr: int) -> int:
        graph, _, logits, table = parts(mrr)
        return overhead + graph + prefill + logits + table

    sizing = _size_pool(inp, static, full_cell, ctx, need_at, chunk if chunk > 0 else prefill_tokens)
    tokens = sizing.tokens
    mrr = resolve_running_requests(inp, tokens, ctx) if tokens > 0 else (inp.max_running_requests or 1)
    graph, graph_text, logits, table = parts(mrr)
    pool = (tokens + page) * full_cell if tokens > 0 else 0
    after_pool = pre - static - pool - table - overhead
    headroom = after_pool - graph - prefill - logits

    k_w, v_w, kv_text = kv_dims(cfg, tp)
    layers = kv_layers(cfg)
    k_bytes = (tokens + page) * k_w * layers * kvb if tokens > 0 else 0
    kv_split = f"K {gib(k_bytes)} + V {gib(pool - k_bytes)}" if v_w else f"KV {gib(pool)}"
    ram = f" (RAM / tp {tp})" if not cuda and tp > 1 else ""
    lines = [
        LedgerLine("available", pre, f"free {inp.device} memory per rank before loading{ram}"),
        LedgerLine("weights", weights, weight_inputs(hf, tp, inp.dtype)),
    ]
    if draft:
        lines.append(LedgerLine("draft weights", draft_w, weight_inputs(draft, tp, inp.dtype)))
    kv_line = f"{kv_text} x {layers} layers x {kvb} B ({kv_dtype})"
    if draft:
        kv_line += f" + draft {draft_cell} B"
    lines += [
        LedgerLine("kv bytes per token", full_cell, kv_line),
        LedgerLine("kv pool", pool, f"{tokens:,} tokens + {page} padding x {full_cell} B: {kv_split}"),
        LedgerLine("request table", table, f"{mrr} requests x {ctx} context x 8 B (int64)"),
        LedgerLine(
            "runtime overhead",
            overhead,
            "interpreter, tokenizer, allocator slack" + (f" + tp {tp}/8 GiB comm" if cuda else ""),
        ),
        LedgerLine("graph reserve", graph, graph_text),
        LedgerLine("prefill activations", prefill, prefill_text),
        LedgerLine("logits buffer", logits, f"{mrr} requests x vocab {vocab} x 4 B"),
        LedgerLine("headroom", headroom, "available - everything above (must stay >= 0)"),
    ]
    host_lines, host_fail = _host_check(inp, pool, pre - max(headroom, 0))
    lines += host_lines

    failure = _first_failure(inp, sizing, static, pre, overhead, tokens, full_cell, after_pool, graph, graph_text,
                             prefill, prefill_tokens, logits, host_fail)  # fmt: skip
    return Ledger(
        lines=tuple(lines), kv_bytes_per_token=full_cell, weight_bytes=static, max_total_num_tokens=tokens,
        max_running_requests=mrr, context_len=ctx, chunked_prefill_size=chunk, max_prefill_tokens=inp.max_prefill_tokens,
        mem_fraction_static=min(1.0, sizing.mfs), mem_fraction_reason=sizing.reason, graph_reserve_bytes=graph,
        prefill_activation_bytes=prefill, logits_bytes=logits, headroom_bytes=headroom,
        fits=failure is None, failure=failure, device=inp.device, tp_size=tp,
    )  # fmt: skip


def _first_failure(inp, sizing, static, pre, overhead, tokens, cell, after_pool, graph, graph_text,
                   prefill, prefill_tokens, logits, host_fail) -> Failure | None:  # fmt: skip
    """The earliest startup moment that would run out of memory, in the order startup reaches them."""
    if static + overhead > pre:
        return Failure("load_weights", f"weights need {gib(static)} per rank (tp {inp.tp_size}) + runtime "
                       f"{gib(overhead)}, but only {gib(pre)} is free per rank", "")  # fmt: skip
    if tokens <= 0:
        return Failure("kv_allocation", f"{sizing.cause}: weights {gib(static)} leave no memory for the KV cache "
                       f"after the reserve for runtime, capture and prefill ({gib(pre)} free per rank)", "")  # fmt: skip
    if sizing.target and tokens < sizing.target[0]:
        want, what = sizing.target
        return Failure("kv_allocation", f"{what} needs {want:,} tokens = {gib(want * cell)} of KV, but "
                       f"{sizing.cause} gives a pool of {tokens:,} tokens ({gib(tokens * cell)})", "")  # fmt: skip
    if after_pool < 0:
        return Failure("kv_allocation", f"{sizing.cause}: weights {gib(static)} + KV pool {gib(tokens * cell)} + "
                       f"request table and runtime exceed the {gib(pre)} free per rank", "")  # fmt: skip
    if host_fail:
        return Failure("host_memory", host_fail, "")
    if after_pool < graph:
        return Failure("graph_capture", f"{sizing.cause} leaves {gib(after_pool)} after the KV pool; graph capture "
                       f"needs {gib(graph)} ({graph_text})", "")  # fmt: skip
    if after_pool - graph < prefill + logits:
        return Failure("first_full_prefill", f"{sizing.cause} leaves {gib(after_pool - graph)} after capture; a full "
                       f"{prefill_tokens}-token prefill needs {gib(prefill + logits)} (activations {gib(prefill)} "
                       f"+ logits buffer {gib(logits)})", "")  # fmt: skip
    return None
