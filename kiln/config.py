"""ServerArgs: every flag of `kiln serve` as one frozen dataclass, the one description of them (`kiln plan` and
`kiln generate` take the same flags). Field `help` metadata is the CLI help, `aliases` other spellings of the
flag; flag names and defaults follow SGLang's where it has them."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import kiln.config_compat as config_compat


def _f(default: Any, help: str, **kw) -> Any:
    return field(default=default, metadata={"help": help, **kw})


def check_counts(
    *,
    max_total_tokens: int | None,
    context_length: int | None,
    max_running_requests: int | None,
    chunked_prefill_size: int | None,
    max_prefill_tokens: int,
    cuda_graph_max_bs: int | None,
    hicache_size: float,
    hicache_ratio: float,
) -> None:
    """The one rule for the count flags, for ServerArgs (so serve refuses them before any process starts, as plan
    does) and for ledger inputs built directly."""
    checks = [
        (max_total_tokens is None or max_total_tokens >= 1, "--max-total-tokens must be >= 1"),
        (context_length is None or context_length >= 1, "--context-length must be >= 1"),
        (max_running_requests is None or max_running_requests >= 1, "--max-running-requests must be >= 1"),
        (
            chunked_prefill_size in (None, -1) or chunked_prefill_size >= 1,
            "--chunked-prefill-size must be >= 1 or -1",
        ),
        (max_prefill_tokens >= 1, "--max-prefill-tokens must be >= 1"),
        (cuda_graph_max_bs is None or cuda_graph_max_bs >= 1, "--cuda-graph-max-bs must be >= 1"),
        (hicache_size >= 0 and hicache_ratio > 0, "--hicache-size must be >= 0 and --hicache-ratio > 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def compute_capability_tuple(text: str) -> tuple[int, int]:
    """--compute-capability "X.Y" as (X, Y). Raises ValueError naming the flag."""
    major, dot, minor = text.strip().partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise ValueError(f"--compute-capability {text}: give it as X.Y, e.g. 9.0 (H100) or 8.0 (A100)")
    return int(major), int(minor)


# why a LoRA field or route is refused on a server without --enable-lora (the front and the engine say it alike)
LORA_OFF = (
    "LoRA adapters are off on this Kiln server: start it with --enable-lora and --lora-paths NAME=PATH (or load them "
    "with POST /load_lora_adapter once it runs with --enable-lora), or serve a model with the adapter merged into "
    "its weights"
)


def lora_path_pairs(values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """--lora-paths as (name, path) pairs: NAME=PATH, a PATH named by itself, or SGLang's JSON object with
    lora_name and lora_path. Raises ValueError naming the flag and the value."""
    pairs: list[tuple[str, str]] = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                obj = json.loads(value)
                name, path = str(obj["lora_name"]), str(obj["lora_path"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"--lora-paths {value}: a JSON entry needs lora_name and lora_path"
                ) from None
        else:
            name, eq, path = value.partition("=")
            name, path = (name, path) if eq else (value, value)
        if not name or not path:
            raise ValueError(f"--lora-paths {value}: give NAME=PATH")
        if any(name == n for n, _ in pairs):
            raise ValueError(f"--lora-paths names the adapter {name!r} twice")
        pairs.append((name, path))
    return tuple(pairs)


def lora_modules(values: tuple[str, ...]) -> tuple[str, ...]:
    """--lora-target-modules as PEFT module names ("all": every one Kiln serves). Raises ValueError naming a module
    Kiln does not serve."""
    from kiln.layers.lora import TARGET_MODULES

    if "all" in values:
        return TARGET_MODULES
    for module in values:
        if module not in TARGET_MODULES:
            raise ValueError(
                f"--lora-target-modules {module}: Kiln serves LoRA on {', '.join(TARGET_MODULES)} (or all)"
            )
    return tuple(m for m in TARGET_MODULES if m in values)


def check_mem_fraction_static(value: float | None) -> None:
    """The one rule for --mem-fraction-static: a fraction in (0, 1); 1 would leave nothing for activations."""
    if value is not None and not 0.0 < value < 1.0:
        raise ValueError(f"--mem-fraction-static {value:g} must be in (0, 1)")


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = _f(
        None,
        "HF model directory, its config.json (kiln plan only), a .gguf file or a directory holding one, or a "
        "Hugging Face model id (org/name), downloaded through huggingface_hub (HF_TOKEN, HF_ENDPOINT and "
        "HF_HUB_OFFLINE honoured; serve downloads the weights in its `downloading` phase, plan only the config "
        "and tokenizer) (default: the bundled SmolLM2-135M-Instruct GGUF)",
        aliases=("--model",),
    )
    revision: str | None = _f(
        None,
        "branch, tag or commit of a Hugging Face model id given as --model-path (default: main)",
    )
    download_dir: str | None = _f(
        None,
        "where a Hugging Face model id's files are downloaded, in huggingface_hub's cache layout (default: "
        "HF_HUB_CACHE, else HF_HOME/hub)",
    )
    tokenizer_path: str | None = _f(None, "tokenizer directory (default: the model path)")
    served_model_name: str | None = _f(None, "model name reported by /v1/models (default: the model path)")
    chat_template: str | None = _f(None, "a Jinja chat template file overriding the model's")
    is_embedding: bool = _f(
        False,
        "serve the model as an embedding model: /v1/embeddings and /encode, no generation (on by itself for a "
        "model directory with a sentence-transformers pooling config: modules.json and 1_Pooling/config.json)",
    )
    host: str = _f("127.0.0.1", "HTTP host")
    port: int = _f(30000, "HTTP port")
    device: str = _f("auto", "cpu | cuda | auto", choices=["auto", "cpu", "cuda"])
    dtype: str = _f(
        "auto",
        "weight/activation dtype: auto (float32 on CPU; on CUDA the checkpoint's half type, float16 for a float32 "
        "checkpoint, as SGLang) | float32 | bfloat16 | float16 (SGLang's and vLLM's half = float16, float = float32)",
        choices=["auto", "float32", "bfloat16", "float16"],
        value_aliases={"half": "float16", "float": "float32"},
    )
    kv_cache_dtype: str = _f(
        "auto",
        "KV cache dtype: auto (= dtype) | float32 | bfloat16 | float16 | fp8_e4m3 | fp8_e5m2 (SGLang's bf16 = "
        "bfloat16). fp8 stores each K and V value as it is, with a scale of 1.0 (SGLang's default without "
        "calibrated scales): half a bfloat16 cache's bytes, a quarter of float32's; e5m2 keeps range, e4m3 "
        "precision. Attention reads it converted to the compute dtype. SGLang's mxfp8 and FP4 types are refused",
        choices=["auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"],
        value_aliases={"bf16": "bfloat16"},
    )
    context_length: int | None = _f(
        None, "max tokens per request (default: the model's)", aliases=("--max-model-len",), readable=True
    )
    mem_fraction_static: float | None = _f(
        None, "fraction of device memory for weights + KV pool (default: chosen by the ledger)"
    )
    max_total_tokens: int | None = _f(
        None, "KV pool size in tokens (overrides the memory fraction)", readable=True
    )
    max_running_requests: int | None = _f(None, "max requests decoding at once", aliases=("--max-num-seqs",))
    max_prefill_tokens: int = _f(16384, "token budget of one prefill batch", readable=True)
    chunked_prefill_size: int | None = _f(
        None, "max tokens of one prefill chunk; -1 disables chunking", readable=True
    )
    page_size: int = _f(1, "tokens per KV page")
    schedule_policy: str = _f("fcfs", "fcfs | lpm (longest cached prefix first)", choices=["fcfs", "lpm"])
    schedule_conservativeness: float = _f(1.0, "scales the decode-token reservation used for admission")
    disable_radix_cache: bool = _f(False, "disable prefix reuse")
    mamba_full_memory_ratio: float | None = _f(
        None,
        "hybrid linear-attention models: state pool memory : full-attention KV pool memory, SGLang's split of "
        "the pool memory (its default 0.9 applies when --max-running-requests is not given; given it, the ledger "
        "sizes both pools for the running requests instead)",
    )
    max_mamba_cache_size: int | None = _f(
        None,
        "hybrid linear-attention models: state pool slots at most (each running request holds one, the prefix "
        "cache's checkpoints the rest)",
    )
    swa_full_tokens_ratio: float = _f(
        0.8,
        "hybrid sliding-window models (Gemma 2/3, GPT-OSS): windowed-layer tokens : full-attention pool tokens, "
        "SGLang's ratio; Kiln keeps the windowed layers' KV in per-request rings of the window, so it sizes their "
        "slots (running requests and prefix-cache checkpoints), when --max-running-requests is not given",
    )
    mamba_track_interval: int = _f(
        256,
        "hybrid linear-attention models: tokens between the prefix cache's state checkpoints (a multiple of "
        "--page-size)",
    )
    tp_size: int = _f(
        1,
        "tensor-parallel ranks, one engine process each (gloo on the CPU, NCCL on CUDA)",
        aliases=("--tensor-parallel-size",),
    )
    ep_size: int = _f(
        1,
        "expert-parallel ranks: each of the --tp-size ranks holds whole experts (num_experts / ep-size of them), "
        "each expert split over tp-size / ep-size ranks; 1 = a slice of every expert on every rank (SGLang's "
        "default)",
        aliases=("--expert-parallel-size", "--ep"),
    )
    nnodes: int = _f(1, "nodes the tensor-parallel ranks span (tp-size / nnodes ranks on each)")
    node_rank: int = _f(0, "this node's index; node 0 serves HTTP, the others run their ranks only")
    dist_init_addr: str | None = _f(
        None,
        "HOST:PORT where the ranks meet (required with --nnodes > 1; default: a free local port)",
        aliases=("--nccl-init-addr",),
    )
    dp_size: int = _f(
        1,
        "data-parallel replicas: N whole servers (each with its --tp-size ranks) behind SGLang's router on "
        "--host/--port (pip install 'kiln[router]'); router flags pass through as --router-<flag>, e.g. "
        "--router-policy round_robin (default cache_aware; see python -m sglang_router.launch_router --help)",
        aliases=("--data-parallel-size",),
    )
    router_dp_worker_base_port: int = _f(
        31000, "with --dp-size > 1: the first port tried for the replicas (each then on a free port above it)"
    )
    random_seed: int | None = _f(None, "seed for requests without their own seed")
    stream_interval: int = _f(1, "decode steps between streamed chunks")
    decode_log_interval: int = _f(40, "decode steps between 'Decode batch' log lines")
    skip_server_warmup: bool = _f(False, "mark ready without a warm-up request")
    api_key: str | None = _f(
        None, "require 'Authorization: Bearer KEY' (probes, /metrics and the console's page stay open)"
    )
    max_queued_requests: int | None = _f(None, "waiting requests beyond which new ones get 429")
    request_timeout: float | None = _f(None, "seconds after which a request is aborted")
    max_request_bytes: int | None = _f(
        None,
        "largest request body in bytes, refused with 413 while it is read (default: 128 bytes per token of "
        "the context length, room for a full-context prompt as JSON-escaped text, and at least 4 MiB)",
    )
    request_read_timeout: float = _f(
        30.0, "seconds a client may take to send a request's headers, and again its body (then 408 / cut)"
    )
    timeout_keep_alive: int = _f(5, "seconds an idle keep-alive connection stays open (uvicorn's)")
    max_connections: int = _f(
        1024, "open HTTP connections at most; beyond it the longest-idle one is closed for the new one"
    )
    shutdown_timeout: float = _f(
        30.0, "on SIGTERM, seconds in-flight requests may take to finish before abort"
    )
    disable_metrics: bool = _f(False, "do not serve Prometheus /metrics")
    disable_console: bool = _f(
        False, "do not serve the built-in console (the web page at / and /ui: startup, memory, load, chat)"
    )
    watchdog_timeout: float = _f(300.0, "seconds a forward step or startup phase may make no progress")
    log_level: str = _f("info", "logging level")
    log_requests: bool = _f(
        False, "log every request: its prompt and changed sampling parameters, then its finish and text"
    )
    log_requests_level: int = _f(
        2,
        "what --log-requests logs (SGLang's levels): 0 metadata, 1 and the sampling parameters, 2 and the input "
        "and output cut at 2048 characters, 3 and the input and output whole",
        choices=[0, 1, 2, 3],
    )
    log_level_http: str | None = _f(
        None,
        "the HTTP server's (uvicorn's) logging level, its access lines at info; default: --log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    uvicorn_access_log_exclude_prefixes: tuple[str, ...] = _f(
        (),
        "paths whose access lines are not logged, e.g. /health /metrics /status (probes and kiln wait's polls)",
    )
    load_format: str = _f(
        "auto",
        "auto | safetensors | gguf: what the model path holds (FP8 block-quantized safetensors kept in FP8 on CUDA from "
        "compute capability 8.9, dequantized elsewhere) | "
        "dummy: random weights (SGLang's dummy loader: uniform in ±1e-3, seeded), only the directory's "
        "config.json and tokenizer read, to measure a model without its checkpoint",
        choices=["auto", "safetensors", "gguf", "dummy"],
    )
    attention_backend: str | None = _f(
        None,
        "attention kernels (default: Kiln chooses: its CPU kernel on the CPU under float32 compute, torch SDPA "
        "elsewhere, latent attention for MLA models) | triton (Kiln's Triton kernels reading the paged KV pool in "
        "place, as SGLang's: compiled on CUDA, run in Triton's interpreter on the CPU, which is for checking, not "
        "speed; `pip install triton`) | torch_native (torch SDPA) | intel_amx (SGLang's CPU backend: Kiln's CPU "
        "kernel, the CPU's default). MLA models keep latent attention. SGLang's other backends are accepted and "
        "Kiln chooses",
        choices=["triton", "torch_native", "intel_amx"],
    )
    num_threads: int | None = _f(
        None, "torch CPU threads (default: OMP_NUM_THREADS where set, else all cores)"
    )
    disable_weight_prepack: bool = _f(
        False,
        "CPU: keep linear weights in their plain layout (F.linear) instead of a prepacked one (Kiln's or oneDNN's)",
    )
    cpu_gemm: str = _f(
        "auto",
        "CPU matmul kernels: auto (Kiln's kernels where the CPU has AVX2 and FMA, else oneDNN's; GGUF Q4_0, "
        "Q4_1, Q8_0, Q4_K and Q6_K matrices kept in their blocks and multiplied in integers, activations rounded "
        "to int8 as llama.cpp does) | exact (GGUF Q4_1 / Q8_0 blocks multiplied in float32: the same products as "
        "the dequantized weights, greedy output equal to transformers' float32) | kiln (as auto, refused where "
        "the CPU cannot run Kiln's kernels) | f32 (Kiln's float32 kernel: every GGUF matrix dequantized) | onednn",
        choices=["auto", "exact", "kiln", "f32", "onednn"],
        aliases=("--cpu-matmul",),
    )
    quantization: str | None = _f(
        None,
        "int8: on the CPU, float32 checkpoints' linear weights quantized at load to int8 per output row (weight "
        "only; activations rounded to int8 per 32 as they are multiplied), through the integer kernels of "
        "--cpu-gemm auto; SGLang's other methods are accepted and the checkpoint's own weights served",
        choices=["int8"],
    )
    grammar_backend: str = _f(
        "llguidance",
        "library that compiles response_format / regex / ebnf / json_schema constraints into token masks "
        "(llguidance: it refuses schema features it cannot enforce; docs/structured_output.md) | none",
        choices=["llguidance", "none"],
    )
    tool_call_parser: str | None = _f(
        None,
        "how tool calls are read from the model's output (SGLang's names; kiln.text.tool_parsers)",
        choices=["llama3", "qwen25", "qwen", "hermes", "mistral", "deepseekv3", "kimi_k2", "gpt-oss"],
    )
    reasoning_parser: str | None = _f(
        None,
        "splits reasoning_content from content (SGLang's names; kiln.text.reasoning_parsers)",
        choices=["deepseek-r1", "qwen3", "kimi", "gpt-oss"],
    )
    sampling_defaults: str = _f(
        "model",
        "where a request's unset temperature, top_p, top_k, min_p and repetition_penalty come from: model (the "
        "model directory's generation_config.json, where it sets them; a GGUF has none) | openai (temperature 1, "
        "top_p 1, no top-k, min-p or repetition penalty); /model_info reports those in use",
        choices=["model", "openai"],
    )
    # speculative decoding (kiln.speculative.settings resolves SGLang's auto defaults and checks them)
    speculative_algorithm: str | None = _f(
        None,
        "speculative decoding: NGRAM (drafts copied from the request's own prompt and output), STANDALONE (a "
        "smaller model with the same tokenizer), EAGLE / EAGLE3 (draft heads on the target's hidden states), "
        "NEXTN (the model's own MTP layer); greedy outputs stay identical, sampling keeps the distribution",
        choices=["NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN"],
        value_aliases={name.lower(): name for name in ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN")},
    )
    speculative_draft_model_path: str | None = _f(
        None,
        "the draft model (STANDALONE) or draft head (EAGLE, EAGLE3)",
        aliases=("--speculative-draft-model",),
    )
    speculative_num_steps: int | None = _f(
        None,
        "draft steps per verify (default: SGLang's auto choice by model; with NGRAM num-draft-tokens - 1 for a "
        "chain, num-draft-tokens // topk for a tree)",
    )
    speculative_eagle_topk: int | None = _f(
        None,
        "draft tokens branched per step (NGRAM: its BFS breadth); above 1 the drafts form a tree verified with a "
        "tree attention mask (default: SGLang's auto choice by model; 10 with NGRAM, SGLang's BFS breadth)",
    )
    speculative_num_draft_tokens: int | None = _f(
        None,
        "tokens verified per request per step, the last token included (default: SGLang's auto choice by model, "
        "steps + 1 for a chain; 12 with NGRAM)",
    )
    # multi-LoRA serving (kiln.runner.lora; SGLang's flags)
    enable_lora: bool = _f(
        False,
        "serve LoRA adapters on the base model: a request names its adapter by lora_path (/generate) or model "
        '"BASE:ADAPTER" (OpenAI routes); requests for different adapters and the base run in one batch (on by '
        "itself with --lora-paths)",
    )
    lora_paths: tuple[str, ...] = _f(
        (),
        "adapters loaded at startup, each NAME=PATH, a PATH (named by itself) or SGLang's JSON "
        '{"lora_name": ..., "lora_path": ...}; PEFT\'s layout (adapter_config.json + adapter_model.safetensors)',
    )
    max_loras_per_batch: int = _f(
        8, "adapter slots on the device: the most distinct adapters in one batch (the base model needs none)"
    )
    max_lora_rank: int | None = _f(
        None,
        "rank of the adapter slots, the largest rank an adapter may have (default: the largest of --lora-paths)",
    )
    lora_target_modules: tuple[str, ...] = _f(
        (),
        "projections the slots cover, of q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all "
        "(default: those --lora-paths' adapters target)",
    )
    max_loaded_loras: int | None = _f(
        None, "adapters kept in host memory at once, loaded ones included (default: no limit)"
    )
    lora_backend: str = _f(
        "auto",
        "how the batch's per-adapter delta is computed: auto (triton on CUDA, torch_native on the CPU) | triton "
        "(segmented gathered kernels) | torch_native (torch ops; SGLang's csgmv = triton)",
        choices=["auto", "triton", "torch_native"],
        value_aliases={"csgmv": "triton"},
    )
    # memory ledger inputs
    device_memory: str | None = _f(None, "device memory to plan for, e.g. 80GiB (default: probed)")
    device_name: str | None = _f(
        None,
        "the GPU to plan for, from Kiln's table (H100, H200, B200, A100, L40S, RTX 4090, ...: its memory, compute "
        "capability and bandwidth), so that `kiln plan` describes a GPU it does not run on; `kiln serve` checks it "
        "names the GPU it finds",
    )
    compute_capability: str | None = _f(
        None,
        "the CUDA compute capability X.Y to plan for (default: the GPU's, or --device-name's; a plan for --device "
        "cuda without either assumes 9.0 and says so)",
    )
    host_memory: str | None = _f(None, "host RAM to plan for, e.g. 512GiB (default: probed)")
    enable_hierarchical_cache: bool = _f(
        False, "keep evicted prefixes in a host-memory tier", aliases=("--enable-hicache",)
    )
    hicache_size: float = _f(0.0, "host tier size in GB per rank (overrides --hicache-ratio)")
    hicache_ratio: float = _f(2.0, "host tier size as a multiple of the device KV pool")
    hicache_write_policy: str = _f(
        "write_through",
        "when a prefix is copied to the host tier: write_through (as it is cached), write_back (as it is evicted "
        "from the device), write_through_selective (once it has been hit twice)",
        choices=["write_through", "write_back", "write_through_selective"],
    )
    hicache_storage_backend: str | None = _f(
        None,
        "a third tier below the host: file (KV pages in --hicache-storage-dir, kept across restarts and shared "
        "by the replicas on one disk)",
        choices=["file"],
    )
    hicache_storage_dir: str | None = _f(
        None, "directory of the file storage tier (default: ~/.cache/kiln/hicache)"
    )
    cuda_graph_max_bs: int | None = _f(
        None,
        "largest decode batch captured as a graph (default: by device memory on CUDA, 0 = none on the CPU)",
        aliases=("--cuda-graph-max-bs-decode",),
    )
    cuda_graph_bs: tuple[int, ...] | None = _f(
        None,
        "decode batch sizes to capture (default: SGLang's list up to --cuda-graph-max-bs)",
        aliases=("--cuda-graph-bs-decode",),
    )
    cuda_graph_max_bs_prefill: int | None = _f(
        None,
        "largest prefill token count captured, on SGLang's buckets (default: the chunk size on CUDA, 0 on CPU)",
        readable=True,
    )
    cuda_graph_bs_prefill: tuple[int, ...] | None = _f(None, "prefill token counts to capture")
    disable_cuda_graph: bool = _f(False, "run every step eagerly: no graphs (CUDA) or compiled steps (CPU)")
    enable_torch_compile: bool = _f(
        False,
        "compile the decode steps with torch.compile: on the CPU those up to --torch-compile-max-bs, unless "
        "--cuda-graph-max-bs or --cuda-graph-bs says which; on CUDA Kiln captures CUDA graphs either way",
    )
    torch_compile_max_bs: int = _f(32, "largest decode batch --enable-torch-compile compiles")
    disable_overlap_schedule: bool = _f(
        False, "schedule each decode step after the last one's tokens are in, not while the device runs it"
    )
    enable_overlap_schedule: bool = _f(
        False,
        "overlap scheduling with decode steps on the CPU too (on by default on CUDA only: on the CPU the forward "
        "thread and the scheduler share the cores; docs/benchmarks.md)",
    )
    disable_prefill_graph: bool = _f(
        False, "capture decode only; every prefill runs eagerly", aliases=("--disable-prefill-cuda-graph",)
    )
    compile_cache_dir: str | None = _f(
        None,
        "where compiled shapes are cached between starts (default: $TORCHINDUCTOR_CACHE_DIR or ~/.cache/kiln/compile)",
    )
    startup_events: str | None = _f(None, "append startup phase transitions as JSON lines to this file")
    # Not a flag: the SGLang flags (and values) given that Kiln accepts without implementing, as argv tokens
    # ("--flag", *values), so that startup can say once what Kiln does instead of each (config_compat.py).
    foreign_flags: tuple[tuple[str, ...], ...] = _f((), "", cli=False)
    # Not a flag: the Hugging Face model id --model-path named, once with_defaults has put its snapshot directory
    # (config and tokenizer only) in model_path; the server downloads the weights there (kiln.loader.hub).
    hub_model_id: str | None = _f(None, "", cli=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            # SGLang's and vLLM's other spellings of a value (--dtype half), for arguments built in code too
            aliases = f.metadata.get("value_aliases")
            if aliases and getattr(self, f.name) in aliases:
                object.__setattr__(self, f.name, aliases[getattr(self, f.name)])
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.tp_size < 1:
            raise ValueError("--tp-size must be >= 1")
        if self.dp_size < 1:
            raise ValueError(f"--dp-size {self.dp_size} must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads {self.num_threads} must be >= 1 (or left out: all cores)")
        if self.hicache_storage_backend and not self.enable_hierarchical_cache:
            raise ValueError(
                f"--hicache-storage-backend {self.hicache_storage_backend} sits below the host tier: add "
                "--enable-hierarchical-cache"
            )
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"--ep-size {self.ep_size} must divide --tp-size {self.tp_size}")
        self._check_nodes()
        if self.compute_capability is not None:
            compute_capability_tuple(self.compute_capability)
        if self.device == "cpu" and (self.device_name or self.compute_capability):
            given = "--device-name" if self.device_name else "--compute-capability"
            raise ValueError(f"{given} describes a GPU, and --device cpu asks for the CPU: drop one of them")
        for flag, sizes in (
            ("--cuda-graph-bs", self.cuda_graph_bs),
            ("--cuda-graph-bs-prefill", self.cuda_graph_bs_prefill),
        ):
            if sizes is not None and (not sizes or min(sizes) < 1):
                raise ValueError(f"{flag} {list(sizes)}: sizes must be >= 1")
        if self.torch_compile_max_bs < 1:
            raise ValueError(f"--torch-compile-max-bs {self.torch_compile_max_bs} must be >= 1")
        check_mem_fraction_static(self.mem_fraction_static)
        check_counts(
            max_total_tokens=self.max_total_tokens,
            context_length=self.context_length,
            max_running_requests=self.max_running_requests,
            chunked_prefill_size=self.chunked_prefill_size,
            max_prefill_tokens=self.max_prefill_tokens,
            cuda_graph_max_bs=self.cuda_graph_max_bs,
            hicache_size=self.hicache_size,
            hicache_ratio=self.hicache_ratio,
        )
        self._check_state_pool()
        self._check_lora()

    def _check_lora(self) -> None:
        if self.lora_paths and not self.enable_lora:  # SGLang's rule: adapters to load turn LoRA on
            object.__setattr__(self, "enable_lora", True)
        lora_path_pairs(self.lora_paths)
        if self.max_loras_per_batch < 1:
            raise ValueError(f"--max-loras-per-batch {self.max_loras_per_batch} must be >= 1")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank {self.max_lora_rank} must be >= 1")
        lora_modules(self.lora_target_modules)
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"--max-loaded-loras {self.max_loaded_loras} must be >= --max-loras-per-batch "
                f"{self.max_loras_per_batch}"
            )

    def _check_state_pool(self) -> None:
        if self.mamba_full_memory_ratio is not None and self.mamba_full_memory_ratio <= 0:
            raise ValueError(f"--mamba-full-memory-ratio {self.mamba_full_memory_ratio:g} must be > 0")
        if self.max_mamba_cache_size is not None and self.max_mamba_cache_size < 1:
            raise ValueError(f"--max-mamba-cache-size {self.max_mamba_cache_size} must be >= 1")
        if self.mamba_track_interval < 1:
            raise ValueError(f"--mamba-track-interval {self.mamba_track_interval} must be >= 1")
        if self.swa_full_tokens_ratio <= 0:
            raise ValueError(f"--swa-full-tokens-ratio {self.swa_full_tokens_ratio:g} must be > 0")

    def _check_nodes(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (node 0's address)")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}")

    @property
    def capability(self) -> tuple[int, int] | None:
        """--compute-capability as (major, minor), or None when not given."""
        return compute_capability_tuple(self.compute_capability) if self.compute_capability else None

    def request_byte_limit(self, context_len: int) -> int:
        """--max-request-bytes, or its default for this context length (see the flag's help)."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return max(4 << 20, 128 * context_len)

    def with_torch_compile(self, device: str) -> ServerArgs:
        """SGLang's --enable-torch-compile on the CPU: decode steps compiled up to --torch-compile-max-bs, as
        --cuda-graph-max-bs asks, where no capture flag of Kiln's decides already."""
        explicit = self.cuda_graph_max_bs is not None or self.cuda_graph_bs or self.disable_cuda_graph
        if not self.enable_torch_compile or device != "cpu" or explicit:
            return self
        return dataclasses.replace(self, cuda_graph_max_bs=self.torch_compile_max_bs)

    def with_defaults(self) -> ServerArgs:
        """Fill the model path with the default model when none was given, and turn a Hugging Face model id
        (--model-path org/name; --tokenizer-path too) into its snapshot directory in the hub cache at --revision,
        its config and tokenizer files fetched (no weights: kiln.loader.hub), so that everything after reads a
        local path; the id stays the served model name, as in SGLang, and hub_model_id. Raises ValueError naming
        an id that cannot be fetched."""
        from kiln.loader.model_config import hub_snapshot, is_hub_id

        if not self.model_path:
            from kiln.loader.default_model import default_model_path

            return dataclasses.replace(self, model_path=default_model_path())
        changes: dict[str, str] = {}
        if is_hub_id(self.model_path):
            changes["model_path"] = hub_snapshot(
                self.model_path, self.revision, download_dir=self.download_dir
            )
            changes["served_model_name"] = self.served_model_name or self.model_path
            changes["hub_model_id"] = self.model_path
        if self.tokenizer_path and is_hub_id(self.tokenizer_path):
            changes["tokenizer_path"] = hub_snapshot(
                self.tokenizer_path, self.revision, "--tokenizer-path", self.download_dir
            )
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Kiln's flags (the fields), then SGLang's flags that Kiln accepts without implementing (config_compat)."""
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli", True):
                _add_field_flag(parser, f)
        config_compat.add_foreign_flags(parser)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> ServerArgs:
        """The parsed flags; SGLang values Kiln does not take (config_compat.FOREIGN_VALUES) leave the field at its
        default and join the foreign flags given, to be reported at startup."""
        values: dict[str, Any] = {}
        foreign_values: list[tuple[str, ...]] = []
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True) or not hasattr(ns, f.name):
                continue
            value = getattr(ns, f.name)
            flag = _flag(f.name)
            if value not in f.metadata.get("choices", ()) and config_compat.foreign_value(flag, value):
                foreign_values.append((flag, value))
                value = f.default
            values[f.name] = tuple(value) if isinstance(value, list) else value
        foreign = config_compat.foreign_flags_given(ns) + tuple(foreign_values)
        return cls(**values, foreign_flags=foreign)


_VALUE_TYPES = {"int | None": int, "int": int, "float": float, "float | None": float}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_field_flag(parser: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    """One field's flag: its metadata gives the help, aliases, choices (SGLang's values Kiln does not take
    accepted too, see from_cli), other spellings of values, and readable counts (32k)."""
    flags = [_flag(f.name), *f.metadata.get("aliases", ())]
    kw: dict[str, Any] = {"help": f.metadata.get("help", ""), "dest": f.name, "default": f.default}
    if f.type in ("bool", bool):
        parser.add_argument(*flags, action="store_true", **kw)
        return
    if str(f.type) == "tuple[int, ...] | None":
        parser.add_argument(*flags, type=int, nargs="+", **kw)
        return
    if str(f.type) == "tuple[str, ...]":
        parser.add_argument(*flags, nargs="*", **kw)
        return
    if "choices" in f.metadata:
        choices = f.metadata["choices"]
        foreign = [
            v for entry in config_compat.FOREIGN_VALUES if entry.flag == flags[0] for v in entry.values
        ]
        kw["choices"] = [*choices, *foreign]
        kw["metavar"] = "{" + ",".join(map(str, choices)) + "}"
    aliases = f.metadata.get("value_aliases")
    if aliases:
        kw["type"] = lambda value: aliases.get(value, value)
    elif f.metadata.get("readable"):
        kw["type"] = config_compat.human_readable_int
        kw["help"] += " (a count: 32k = 32000, 1M = 1000000, 4Ki = 4096)"
    else:
        kw["type"] = _VALUE_TYPES.get(str(f.type), str)
    parser.add_argument(*flags, **kw)


def sglang_flags_markdown() -> str:
    """docs/sglang_flags.md, generated from `kiln serve`'s parser (config_compat.markdown_table)."""
    parser = argparse.ArgumentParser(prog="kiln serve")
    ServerArgs.add_cli_args(parser)
    return config_compat.markdown_table(parser)


if __name__ == "__main__":  # python -m kiln.config --sglang-flags-markdown > docs/sglang_flags.md
    import sys

    if sys.argv[1:] != ["--sglang-flags-markdown"]:
        sys.exit("usage: python -m kiln.config --sglang-flags-markdown")
    print(sglang_flags_markdown(), end="")
