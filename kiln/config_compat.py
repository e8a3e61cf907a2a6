"""SGLang's `launch_server` flags that Kiln has no field for: each is accepted, and what Kiln does instead is
said in one log line at startup, so that an SGLang launch line starts Kiln (never exit 2) without a flag being
ignored in silence. The flags Kiln implements stay ServerArgs fields (kiln/config.py); SGLANG_NATIVE_FLAGS lists
the SGLang spellings those fields take, so that the two lists together are SGLang's (sglang 0.5.23,
ServerArgs.add_cli_args).

Also here: human_readable_int, the token counts' parser (32k, 1M, 4Ki), and markdown_table, the generated
table of docs/sglang_flags.md (`python -m kiln.config --sglang-flags-markdown`)."""

from __future__ import annotations

import argparse
import enum
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

__all__ = [
    "DEST_PREFIX",
    "FOREIGN_FLAGS",
    "FOREIGN_VALUES",
    "SGLANG_NATIVE_FLAGS",
    "ForeignFlag",
    "ForeignValue",
    "Shape",
    "add_foreign_flags",
    "foreign_flag_messages",
    "foreign_flags_given",
    "human_readable_int",
    "markdown_table",
]

# argparse dests of the foreign flags carry this prefix, so that they never collide with a ServerArgs field
DEST_PREFIX = "sglang_flag__"


class Shape(enum.Enum):
    """How a flag takes its value on the command line (argparse's action and nargs)."""

    SWITCH = "switch"  # store_true
    TOGGLE = "toggle"  # --x / --no-x (argparse.BooleanOptionalAction)
    VALUE = "value"  # one value
    VALUES = "values"  # one or more (nargs="+")
    ANY_VALUES = "any values"  # zero or more (nargs="*")
    OPTIONAL_VALUE = "optional value"  # zero or one (nargs="?")


@dataclass(frozen=True)
class ForeignFlag:
    """An SGLang flag Kiln accepts without a field: `instead` is the sentence of what Kiln does. Given with one
    of `agreeing` (for a switch: "on"), Kiln already does what the flag asks, and the line is logged at info
    rather than as a warning."""

    flag: str
    shape: Shape
    instead: str
    aliases: tuple[str, ...] = ()
    agreeing: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return DEST_PREFIX + self.flag.removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class ForeignValue:
    """Values SGLang takes for a flag Kiln implements, that Kiln does not: accepted, the field keeps its
    default, and `instead` is said once at startup."""

    flag: str
    values: tuple[str, ...]
    instead: str


def _group(
    instead: str,
    *,
    switches: str = "",
    toggles: str = "",
    values: str = "",
    lists: str = "",
    any_lists: str = "",
    optional: str = "",
    agreeing: tuple[str, ...] = (),
) -> tuple[ForeignFlag, ...]:
    """ForeignFlags sharing one sentence, by shape: each a space-separated list of flags, in which "--a|--b"
    gives the flag --a with the alias --b."""
    shaped = [
        (Shape.SWITCH, switches),
        (Shape.TOGGLE, toggles),
        (Shape.VALUE, values),
        (Shape.VALUES, lists),
        (Shape.ANY_VALUES, any_lists),
        (Shape.OPTIONAL_VALUE, optional),
    ]
    flags = []
    for shape, specs in shaped:
        for spec in specs.split():
            flag, *aliases = spec.split("|")
            flags.append(ForeignFlag(flag, shape, instead, tuple(aliases), agreeing))
    return tuple(flags)


_ATTENTION = (
    "Kiln chooses its attention kernel itself: torch SDPA on CUDA (as SGLang's torch_native), its own CPU kernel "
    "on the CPU (as intel_amx), latent attention for MLA models"
)
_GRAPHS = (
    "Kiln captures decode CUDA graphs and breakable prefill graphs (on the CPU: compiled steps); "
    "--cuda-graph-max-bs, --cuda-graph-bs, --cuda-graph-max-bs-prefill, --disable-cuda-graph and "
    "--disable-prefill-graph shape them"
)

FOREIGN_FLAGS: tuple[ForeignFlag, ...] = (
    # ---- the flags of a common launch line, each with its own sentence
    *_group(
        "Kiln runs no code from the model repository: it serves the architectures it implements (Llama, "
        "Mistral, Mixtral, Phi-3, Gemma 2, Gemma 3, Qwen2, Qwen3, Qwen3-MoE, Qwen3-Next, DeepSeek-V3 / Kimi-K2)",
        switches="--trust-remote-code",
    ),
    *_group(
        "Kiln serves Prometheus /metrics by default (--disable-metrics turns it off)",
        switches="--enable-metrics",
        agreeing=("on",),
    ),
    *_group(
        "Kiln quantizes nothing at load but --quantization int8 (CPU): it serves the checkpoint's own weights "
        "(GGUF blocks kept on the CPU, FP8 blocks kept on CUDA from compute capability 8.9, else dequantized)",
        switches="--quantize-and-serve",
        values="--quantization-param-path --modelopt-quant --rl-quant-profile",
    ),
    *_group(
        _ATTENTION,
        values="--decode-attention-backend --prefill-attention-backend",
        agreeing=("torch_native", "intel_amx"),
    ),
    *_group(
        "Kiln samples with PyTorch ops (SGLang's pytorch backend)",
        values="--sampling-backend",
        agreeing=("pytorch",),
    ),
    *_group(
        "Kiln has no torch.compile debug mode: --enable-torch-compile compiles the CPU's decode steps, and "
        "TORCH_LOGS is torch's own switch for what the compiler says",
        switches="--enable-torch-compile-debug-mode",
    ),
    *_group(
        "Kiln's request log has SGLang's levels (--log-requests-level) and no other formats or targets",
        values="--log-requests-format",
        lists="--log-requests-target",
    ),
    *_group(
        "Kiln loads the tokenizer with transformers' AutoTokenizer (the fast one where there is one)",
        values="--tokenizer-mode --tokenizer-backend",
        agreeing=("auto", "huggingface"),
    ),
    *_group(
        "Kiln tokenizes and detokenizes in its front process, one worker each",
        switches=(
            "--enable-dynamic-batch-tokenizer --enable-tokenizer-batch-encode "
            "--disable-tokenizer-batch-decode"
        ),
        values=(
            "--tokenizer-worker-num --detokenizer-worker-num --dynamic-batch-tokenizer-batch-size "
            "--dynamic-batch-tokenizer-batch-timeout"
        ),
        agreeing=("1",),
    ),
    *_group(
        "Kiln always loads the tokenizer: requests may carry text or input_ids",
        switches="--skip-tokenizer-init",
    ),
    *_group(
        "Kiln reads no config file: give the flags on the command line",
        values="--config",
    ),
    *_group(
        "Kiln checks no checksum of its own: huggingface_hub verifies the sizes of what it downloads",
        optional="--model-checksum",
    ),
    *_group(
        "Kiln serves generation and --is-embedding models only (no reward or diffusion models), and keeps a "
        "prefill-only request's KV for the prefix cache",
        switches="--prefill-only-disable-kv-cache",
        toggles="--dllm-fdfo",
        values="--dllm-algorithm --dllm-algorithm-config",
    ),
    *_group(
        "Kiln always reports cached prompt tokens in usage.prompt_tokens_details",
        switches="--enable-cache-report",
        agreeing=("on",),
    ),
    *_group(
        "Kiln refuses a request longer than the context length (400) rather than truncating it",
        switches="--allow-auto-truncate",
    ),
    *_group(
        "Kiln includes usage in a stream when the request's stream_options.include_usage asks",
        switches="--stream-response-default-include-usage",
    ),
    *_group(
        "Kiln's sampling defaults are --sampling-defaults' (the model's generation_config.json, or OpenAI's); it "
        "takes no JSON of preferred ones",
        values="--preferred-sampling-params",
    ),
    *_group(
        "Kiln renders the tokenizer's chat template (or --chat-template) with the request's "
        "chat_template_kwargs",
        switches="--trust-request-chat-template --strip-thinking-cache --enable-strict-thinking",
        values="--hf-chat-template-name --completion-template --default-chat-template-kwargs",
    ),
    *_group(
        "Kiln has no batch-invariant kernels: a sampled request is reproducible by its seed, not across "
        "batches or prefix-cache hits (a prompt whose prefix is cached computes its attention in another "
        "order: under --cpu-gemm auto, whose int8 activations amplify that, logprobs move by up to ~0.2 on the "
        "default model; under --cpu-gemm exact by ~1e-5)",
        switches="--enable-deterministic-inference",
        values="--rl-on-policy-target",
    ),
    *_group(
        "Kiln returns tokens, text and logprobs only: no hidden states, routed experts or indexer top-k",
        switches=(
            "--enable-return-hidden-states --enable-return-routed-experts --enable-return-indexer-topk "
            "--enable-return-aux-hidden-states --return-input-ids --return-output-ids"
        ),
        values="--return-hidden-states-mode",
        lists="--return-aux-hidden-state-layer-ids",
    ),
    *_group(
        "Kiln takes no custom logit processors",
        switches="--enable-custom-logit-processor",
    ),
    *_group(
        "Kiln's grammar backend uses its own whitespace rules for JSON constraints",
        switches="--constrained-json-disable-any-whitespace --disable-outlines-disk-cache",
        values="--constrained-json-whitespace-pattern --constrained-json-max-whitespace-cnt",
    ),
    *_group(
        "Kiln streams every --stream-interval decode steps, each chunk the text since the last one",
        switches="--incremental-streaming-output",
        values="--batch-notify-size",
    ),
    *_group(
        "Kiln has no streaming sessions: each request stands alone (its prefix cache reuses shared prefixes)",
        switches="--enable-streaming-session --enable-session-radix-cache",
    ),
    *_group(
        "Kiln's warm-up is one generation (--skip-server-warmup skips it); named warm-ups do not exist",
        values="--warmups",
    ),
    *_group(
        "Kiln's watchdog is --watchdog-timeout alone; it leaves Python's garbage collector as it is",
        values="--soft-watchdog-timeout --gc-warning-threshold-secs",
        lists="--gc-threshold",
    ),
    *_group(
        "Kiln runs on the devices it probes (CUDA or the CPU); Apple MLX and NUMA pinning flags do not apply",
        switches="--mlx-enable-sampling --enable-mis",
        lists="--numa-node",
    ),
    # ---- model loading
    *_group(
        "Kiln loads weights one way: streamed from the checkpoint files of the model path onto the device",
        switches=(
            "--weight-loader-disable-mmap --weight-loader-prefetch-checkpoints "
            "--weight-loader-drop-cache-after-load "
            "--remote-instance-weight-loader-start-seed-via-transfer-engine --delete-ckpt-after-loading "
            "--checkpoint-engine-wait-weights-before-ready"
        ),
        values=(
            "--model-loader-extra-config --startup-weight-load-mode --weight-loader-prefetch-num-threads "
            "--remote-instance-weight-loader-seed-instance-ip "
            "--remote-instance-weight-loader-seed-instance-service-port "
            "--remote-instance-weight-loader-send-weights-group-ports "
            "--remote-instance-weight-loader-backend --modelexpress-config --decrypted-config-file "
            "--decrypted-draft-config-file --weight-cache-mode --weight-cache-socket --weight-cache-timeout "
            "--engine-info-bootstrap-port"
        ),
        any_lists="--custom-weight-loader",
    ),
    *_group(
        "Kiln uses its own implementation of each architecture it serves, configured by the model's "
        "config.json",
        values="--model-impl --model-config-parser --json-model-override-args",
        agreeing=("auto",),
    ),
    *_group(
        "Kiln reports no weight version and cannot update weights in place",
        values="--weight-version",
    ),
    *_group(
        "Kiln keeps every weight on the device: no CPU offload, memory saver or weight backup",
        switches="--enable-memory-saver --enable-weights-cpu-backup --enable-draft-weights-cpu-backup",
        toggles="--ple-offload-embedding",
        values=(
            "--cpu-offload-gb --offload-group-size --offload-num-in-group --offload-prefetch-step "
            "--offload-mode --ple-offload-backend --ple-offload-dir"
        ),
    ),
    *_group(
        "Kiln has no ModelOpt export: it serves checkpoints as they are",
        values="--modelopt-checkpoint-restore-path --modelopt-checkpoint-save-path --modelopt-export-path",
    ),
    *_group(
        "Kiln computes in --dtype throughout (float32 on the CPU by default)",
        switches="--enable-fp32-lm-head --enable-precise-embedding-interpolation",
        toggles="--enable-tf32-matmul",
        values="--prefill-kv-cache-dequant-dtype",
    ),
    # ---- scheduling and memory
    *_group(
        "Kiln's scheduler admits prefills by --schedule-policy and --max-prefill-tokens each step and decodes "
        "every running request each step",
        switches="--enable-dynamic-chunking --enable-mixed-chunk --enable-prefill-delayer --sleep-on-idle",
        values=(
            "--prefill-decode-interval --prefill-decode-interval-min-bs --prefill-max-requests "
            "--num-continuous-decode-steps --scheduler-recv-interval "
            "--prefill-delayer-max-delay-passes --prefill-delayer-token-usage-low-watermark "
            "--prefill-delayer-queue-min-ratio --prefill-delayer-max-delay-ms --min-free-slots-delay"
        ),
        lists="--prefill-delayer-forward-passes-buckets --prefill-delayer-wait-seconds-buckets",
    ),
    *_group(
        "Kiln retracts the running requests with the least output first (the longest prompt first among "
        "them) when the KV pool runs out: SGLang's length policy",
        values="--retraction-policy",
        agreeing=("length",),
    ),
    *_group(
        "Kiln has no request priorities: requests are scheduled by --schedule-policy alone",
        switches=(
            "--enable-priority-scheduling --disable-priority-preemption --abort-on-priority-when-disabled "
            "--schedule-low-priority-values-first"
        ),
        values="--default-priority-value --priority-scheduling-preemption-threshold",
    ),
    *_group(
        "Kiln's prefix cache evicts least recently used leaves first",
        values="--radix-eviction-policy --radix-eviction-policy-config --radix-cache-backend",
        agreeing=("lru",),
    ),
    *_group(
        "Kiln's KV pool is one token-granular pool per rank (--page-size tokens a page), laid out per layer",
        switches="--enable-page-major-kv-layout --enable-unified-memory --disable-chunked-prefix-cache",
        values="--c128-page-size",
    ),
    *_group(
        "Kiln's state pool holds gated DeltaNet states (conv in the model dtype, recurrent float32) or a hybrid "
        "sliding-window model's rings of the window, checkpointed every --mamba-track-interval tokens: no Mamba2 "
        "or other state layouts",
        switches=(
            "--disable-hybrid-swa-memory --enable-mamba-cache-stochastic-rounding "
            "--enable-int8-mamba-checkpoint --enable-linear-replayssm --enable-linear-replayssm-spec "
            "--enable-encoder-swa-bounded-replay"
        ),
        toggles="--enable-decoder-swa-bounded-replay",
        values=(
            "--mamba-backend --mamba-ssm-dtype "
            "--mamba-max-states-per-path --mamba-cache-philox-rounds "
            "--mamba-radix-cache-strategy --int8-mamba-ckpt-size "
            "--linear-attn-backend --linear-attn-decode-backend --linear-attn-prefill-backend "
            "--linear-attn-verify-backend --linear-replayssm-cache-len --swa-prefix-tails"
        ),
    ),
    *_group(
        "Kiln's KV tiers take --enable-hierarchical-cache, --hicache-size, --hicache-ratio, "
        "--hicache-write-policy and --hicache-storage-backend file only: no other host-memory layouts, "
        "storage backends or external KV stores",
        switches=(
            "--enable-unified-cache-external-linker --enable-hisparse --enable-lmcache --enable-flexkv "
            "--enable-linker-mla-dedup"
        ),
        values=(
            "--hicache-host-memory-mode --hicache-io-backend --hicache-mem-layout "
            "--hicache-storage-prefetch-policy "
            "--hicache-storage-backend-extra-config --hicache-storage-prefetch-retry-poll-interval "
            "--hicache-storage-prefetch-retry-max-attempts --unified-cache-external-linker-backend "
            "--hisparse-config|--hierarchical-sparse-attention-extra-config --lmcache-config-file "
            "--flexkv-config-file --hicache-host-memory-fraction --unified-cache-external-linker-config"
        ),
    ),
    *_group(
        _ATTENTION,
        switches=(
            "--enable-lean-attention --triton-attention-reduce-in-fp32 --flashinfer-mla-disable-ragged "
            "--enable-deepseek-v4-fp4-indexer --enable-dsa-cache-layer-split"
        ),
        toggles="--enable-dsa-fused-indexer",
        values=(
            "--dsa-prefill-backend --dsv4-prefill-backend --dsa-decode-backend "
            "--dsa-paged-mqa-logits-backend --dsa-topk-backend --triton-attention-num-kv-splits "
            "--triton-attention-split-tile-size --dsv4-attn-backend --qsa-indexer-dtype --dsa-triton-union "
            "--mm-attention-backend"
        ),
    ),
    # ---- kernels and graphs
    *_group(
        "Kiln picks its matmul and fused kernels itself (on the CPU: --cpu-gemm)",
        switches=(
            "--disable-flashinfer-autotune --enable-aiter-allreduce-fusion "
            "--disable-aiter-allreduce-fusion-in-prefill --disable-aiter-allreduce-fusion-in-decode "
            "--enable-amd-monokernel --enable-nvidia-megakernel"
        ),
        toggles="--enable-fused-qk-norm-rope",
        values=(
            "--fp8-gemm-backend --fp4-gemm-backend --bf16-gemm-backend --sampling-mask-max-tokens "
            "--monokernel-backend"
        ),
        lists="--flashinfer-autotune-skip-ops",
        agreeing=("auto",),
    ),
    *_group(
        _GRAPHS,
        switches=(
            "--disable-cuda-graph-padding --enable-profile-cuda-graph --enable-cudagraph-gc "
            "--debug-cuda-graph"
        ),
        values=(
            "--cuda-graph-config --cuda-graph-backend-decode --cuda-graph-backend-prefill "
            "--cuda-graph-prefill-max-context|--context-bucket --cuda-graph-max-seq-len-prefill"
        ),
    ),
    *_group(
        "Kiln has no decode-only switch: --cuda-graph-max-bs 0 captures no decode graph",
        switches="--disable-decode-cuda-graph",
    ),
    # ---- parallelism
    *_group(
        "Kiln parallelises by --tp-size (tensor), --ep-size (experts) and --dp-size (replicas) only: no "
        "pipeline, context or attention-data parallelism",
        switches=(
            "--enable-prefill-cp --enable-cp-decode-attn-tp --enable-kv-cache-sharding "
            "--enable-dp-attention-local-control-broadcast --enable-dp-lm-head "
            "--enable-attn-tp-input-scattered --enable-shared-experts-attn-tp --enable-dense-mlp-attn-tp "
            "--enable-layernorm-sp --disable-attn-tp-gather --enable-dp-attention "
            "--enable-megamoe-for-layernorm-sp"
        ),
        toggles="--dcp-replicate-q-proj --enable-tp-lm-head-all-to-all",
        values=(
            "--dcp-size|--decode-context-parallel-size --pp-size|--pipeline-parallel-size "
            "--pp-max-micro-batch-size --pp-async-batch-depth --attn-dp-size|--attention-data-parallel-size "
            "--attn-cp-size|--attention-context-parallel-size --moe-dp-size|--moe-data-parallel-size "
            "--dwdp-size --dcp-comm-backend --cp-strategy --shared-experts-tp-size --moe-dense-tp-size"
        ),
    ),
    *_group(
        "Kiln's ranks communicate through torch.distributed (NCCL on CUDA, gloo on the CPU) with its plain "
        "all-reduce; ranks meet at --dist-init-addr or a free local port",
        switches=(
            "--enable-p2p-check --enable-nccl-nvls --enable-symm-mem --disable-custom-all-reduce "
            "--enable-mscclpp --enable-torch-symm-mem --enable-scattered-sconv --pre-warm-nccl "
            "--enable-quant-communications --enforce-disable-flashinfer-allreduce-fusion "
            "--enable-flashinfer-allreduce-fusion --enable-fused-moe-sum-all-reduce"
        ),
        values=(
            "--nccl-port --dist-timeout --gated-launch-port --boundary-reduction "
            "--flashinfer-allreduce-fusion-backend"
        ),
    ),
    *_group(
        "Kiln places a node's ranks on its GPUs 0, 1, ... (CUDA_VISIBLE_DEVICES chooses which) and runs no Ray",
        switches="--use-ray",
        values="--base-gpu-id --gpu-id-step",
    ),
    *_group(
        "Kiln's --dp-size replicas sit behind SGLang's router (--router-policy etc. pass through to it)",
        values="--load-balance-method",
    ),
    *_group(
        "Kiln runs one batch per step: no two-batch or single-batch overlap",
        switches="--enable-two-batch-overlap --enable-single-batch-overlap",
        values="--tbo-token-distribution-threshold",
    ),
    *_group(
        "Kiln's MoE layer splits experts by --tp-size / --ep-size and runs them with its own kernel: no "
        "all-to-all backends, expert rebalancing, redundant or offloaded experts",
        switches=(
            "--enable-w4a4-mxfp4-megamoe --enable-eplb --enable-elastic-expert-backup --enable-waterfill "
            "--disable-flashinfer-cutlass-moe-fp4-allgather --disable-shared-experts-fusion "
            "--enforce-shared-experts-fusion --enable-paged-experts"
        ),
        values=(
            "--moe-a2a-backend --deepep-v2-mode --moe-runner-backend --flashinfer-mxfp4-moe-precision "
            "--deepep-mode --fuseep-mode --deepep-dispatcher-output-dtype --ep-num-redundant-experts "
            "--ep-dispatch-algorithm --init-expert-location --eplb-algorithm "
            "--eplb-rebalance-num-iterations --eplb-rebalance-layers-per-chunk "
            "--eplb-min-rebalancing-utilization-threshold --expert-distribution-recorder-mode "
            "--expert-distribution-recorder-buffer-size --expert-balancedness-report-mode --deepep-config "
            "--elastic-ep-backend --mooncake-ib-device --elastic-ep-join-mode --elastic-ep-join-rank-offset "
            "--elastic-ep-initial-size --max-ep-size --elastic-ep-scale-timeout --kt-weight-path "
            "--kt-method --kt-cpuinfer --kt-threadpool-count --kt-num-gpu-experts "
            "--kt-max-deferred-experts-per-token --flashinfer-a2a-dispatch-type "
            "--paged-experts-num-resident"
        ),
    ),
    # ---- what Kiln does not have
    *_group(
        "Kiln's speculative decoding takes --speculative-algorithm (NGRAM, STANDALONE, EAGLE, EAGLE3, NEXTN) with "
        "--speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens and the draft's "
        "path; SGLang's other speculative settings are not Kiln's",
        switches=(
            "--speculative-dspark-align-verify-tokens-to-graph-tier --speculative-use-rejection-sampling "
            "--enable-multi-layer-eagle --speculative-adaptive --speculative-use-block-verification"
        ),
        toggles="--speculative-enable-w4a4-mxfp4-megamoe",
        values=(
            "--uno-lora-path --speculative-draft-model-revision "
            "--speculative-draft-load-format --speculative-dflash-block-size --speculative-dspark-block-size "
            "--speculative-dspark-sps-table-path --speculative-dspark-confidence-sts-path "
            "--speculative-accept-threshold-single --speculative-accept-threshold-acc "
            "--speculative-token-map --speculative-attention-mode --speculative-draft-attention-backend "
            "--speculative-dsa-topk-backend --speculative-draft-kv-cache-dtype "
            "--speculative-draft-window-size --speculative-moe-runner-backend --speculative-moe-a2a-backend "
            "--speculative-draft-model-quantization --speculative-adaptive-config "
            "--decoupled-spec-bind-endpoint --decoupled-spec-connect-endpoints --decoupled-spec-rank "
            "--decoupled-spec-role --spec-trace-dir --speculative-ngram-min-bfs-breadth "
            "--speculative-ngram-max-bfs-breadth --speculative-ngram-match-type "
            "--speculative-ngram-max-trie-depth --speculative-ngram-capacity "
            "--speculative-ngram-external-corpus-path --speculative-ngram-external-sam-budget "
            "--speculative-ngram-external-corpus-max-tokens --speculative-domino-candidate-pool-size "
            "--speculative-draft-sink-size"
        ),
    ),
    *_group(
        "Kiln loads an adapter into a free slot, or the least recently used one no running request uses, when a "
        "request first needs it; adapters are checked whole when loaded",
        switches="--enable-lora-overlap-loading --lora-use-virtual-experts",
        toggles="--experts-shared-outer-loras --lora-strict-loading",
        values="--lora-eviction-policy --max-lora-chunk-size --lora-drain-wait-threshold",
    ),
    *_group(
        "Kiln runs prefill and decode in the one server: no prefill/decode or encoder disaggregation",
        switches=(
            "--disaggregation-decode-enable-radix-cache --disaggregation-decode-enable-offload-kvcache "
            "--encoder-only --enable-adaptive-dispatch-to-encoder --enable-pdmux "
            "--disaggregation-enable-kv-checksum --enable-pd-role-switch"
        ),
        values=(
            "--disaggregation-mode --disaggregation-transfer-backend --disaggregation-bootstrap-port "
            "--disaggregation-ib-device --disaggregation-decode-retraction-backup "
            "--num-reserved-decode-tokens --disaggregation-decode-extra-slots "
            "--disaggregation-decode-polling-interval --optimistic-prefill-attempts "
            "--encoder-transfer-backend --encoder-bootstrap-port --pdmux-config-path --sm-group-num "
            "--disaggregation-decode-host-receive-threshold --disaggregation-decode-allocation-policy"
        ),
        lists="--encoder-urls --encoder-register-urls",
    ),
    *_group(
        "Kiln serves text-only models: no image, audio or video inputs",
        switches=(
            "--enable-multimodal --enable-broadcast-mm-inputs-process --enable-prefix-mm-cache "
            "--trust-mm-content-hashes --enable-mm-global-cache --disable-fast-image-processor "
            "--language-only --language-model-only"
        ),
        toggles="--mm-enable-dp-encoder",
        values=(
            "--asr-max-buffer-seconds --asr-max-concurrent-sessions --mm-process-config "
            "--mm-processor-worker-num --mm-io-worker-num --media-url-max-file-size-mb "
            "--mm-preprocess-cache-size-mb --limit-mm-data-per-request --image-processor-backend "
            "--mm-global-cache-backend --mm-feature-transport"
        ),
        lists="--allowed-media-domains",
    ),
    # ---- HTTP and observability
    *_group(
        "Kiln serves plain HTTP/1.1 with uvicorn on --host/--port (put a TLS proxy in front); --api-key "
        "guards it",
        switches=(
            "--smg-grpc-mode --grpc-mode --enable-http2 --enable-ssl-refresh --enable-http-worker-reuseport"
        ),
        values=(
            "--fastapi-root-path --grpc-port --sidecar --sidecar-args --http2-max-concurrent-streams "
            "--http2-initial-connection-window-size --ssl-keyfile --ssl-certfile --ssl-ca-certs "
            "--ssl-keyfile-password --admin-api-key "
            "--smg-http-sidecar-port|--grpc-http-sidecar-port --grpc-response-timeout-secs"
        ),
    ),
    *_group(
        "Kiln has no file storage, tool servers, response store or watermarking",
        switches="--enable-response-store --enable-watermark",
        values="--file-storage-path --tool-server --watermark-config",
    ),
    *_group(
        "Kiln's /metrics has fixed series and buckets (docs/metrics.md), labelled by nothing a request sets",
        switches=(
            "--enable-mfu-metrics --enable-metrics-for-all-schedulers --enable-forward-pass-metrics "
            "--export-metrics-to-file --enable-request-time-stats-logging"
        ),
        values=(
            "--load-snapshot-publish-interval --tokenizer-metrics-custom-labels-header "
            "--extra-metric-labels --forward-pass-metrics-worker-id --forward-pass-metrics-ipc-name "
            "--export-metrics-to-file-dir"
        ),
        lists=(
            "--tokenizer-metrics-allowed-custom-labels --bucket-time-to-first-token "
            "--bucket-inter-token-latency --bucket-e2e-request-latency --prompt-tokens-buckets "
            "--generation-tokens-buckets"
        ),
    ),
    *_group(
        "Kiln exports no traces, KV events or load snapshots: its state is at /metrics, /get_load and "
        "/status",
        switches="--enable-trace",
        values=(
            "--trace-modules --otlp-traces-endpoint --otlp-service-name --kv-events-config "
            "--load-publish-endpoint"
        ),
    ),
    *_group(
        "Kiln has no crash dumps, tensor dumps, KV canaries, forward hooks or timing marks; its startup phases "
        "and their times are at /status and in --startup-events",
        switches="--show-time-cost --enable-layerwise-nvtx-marker",
        values=(
            "--crash-dump-folder --debug-tensor-dump-output-folder --debug-tensor-dump-input-file "
            "--kv-canary --kv-canary-sweep-interval --kv-canary-real-data --forward-hooks "
            "--msprobe-dump-config"
        ),
        lists="--debug-tensor-dump-layers",
        agreeing=("none",),
    ),
)

# SGLang's spellings of the flags ServerArgs implements (its fields' names and aliases), for the docs table and
# the test that every SGLang flag parses
SGLANG_NATIVE_FLAGS: tuple[str, ...] = tuple(
    "--model-path --model --tokenizer-path --context-length --revision --download-dir --dtype --kv-cache-dtype "
    "--mem-fraction-static --max-running-requests --max-queued-requests --max-total-tokens "
    "--chunked-prefill-size --max-prefill-tokens --schedule-policy --schedule-conservativeness --page-size "
    "--disable-radix-cache --dist-init-addr --nccl-init-addr --nnodes --node-rank --tp-size "
    "--tensor-parallel-size --dp-size --data-parallel-size --device --random-seed --watchdog-timeout --host "
    "--port --skip-server-warmup --api-key --served-model-name --chat-template --stream-interval "
    "--log-level --log-level-http --uvicorn-access-log-exclude-prefixes --log-requests --decode-log-interval "
    "--grammar-backend --cuda-graph-max-bs-decode "
    "--cuda-graph-max-bs-prefill --cuda-graph-bs-decode --cuda-graph-bs-prefill "
    "--disable-prefill-cuda-graph --ep-size --expert-parallel-size --ep --enable-hierarchical-cache "
    "--enable-hicache --hicache-ratio --hicache-size --hicache-write-policy --hicache-storage-backend "
    "--reasoning-parser --tool-call-parser --sampling-defaults --disable-cuda-graph --enable-torch-compile "
    "--torch-compile-max-bs --mamba-full-memory-ratio "
    "--max-mamba-cache-size --mamba-track-interval --quantization --speculative-algorithm "
    "--speculative-draft-model-path --speculative-draft-model --speculative-num-steps "
    "--speculative-eagle-topk --speculative-num-draft-tokens --attention-backend --load-format "
    "--disable-overlap-schedule --is-embedding".split()
)

FOREIGN_VALUES: tuple[ForeignValue, ...] = (
    ForeignValue(
        "--load-format",
        tuple(
            "pt npcache sharded_state bitsandbytes layered jax remote remote_instance fastsafetensors "
            "private mistral flash_rl".split()
        ),
        "Kiln loads what the model path holds: *.safetensors (FP8 block-quantized ones kept in FP8 on CUDA from "
        "compute capability 8.9, else dequantized), or a GGUF file",
    ),
    ForeignValue(
        "--attention-backend",
        tuple(
            "aiter ascend cutlass_mla dual_chunk_flash_attn fa3 fa4 flashinfer flashmla flex_attention "
            "hybrid_linear_attn intel_xpu nsa trtllm_mha trtllm_mla wave".split()
        ),
        "Kiln's attention kernels are its own (--attention-backend triton | torch_native | intel_amx): it chooses "
        "one itself",
    ),
    ForeignValue(
        "--hicache-storage-backend",
        tuple(
            "aibrix dynamic eic hf3fs mooncake mori nixl npu_memcache seaweedfs shm sim simm tensorcast".split()
        ),
        "Kiln has a file storage tier only (--hicache-storage-backend file): it keeps no third tier",
    ),
    ForeignValue(
        "--grammar-backend",
        ("xgrammar", "outlines"),
        "Kiln compiles constraints with llguidance only: it refuses a schema feature it cannot enforce (400), "
        "where these backends may ignore one",
    ),
    ForeignValue(
        "--quantization",
        tuple(
            "awq fp8 mxfp8 gptq gptq_marlin awq_marlin bitsandbytes gguf modelopt modelopt_fp8 modelopt_fp4 "
            "nvfp4_online modelopt_mixed petit_nvfp4 w8a8_int8 w8a8_fp8 moe_wna16 w4afp8 mxfp4 auto-round "
            "auto-round-int8 compressed-tensors modelslim mxfp_w4a8 quark quark_int4fp8_moe quark_mxfp4 mlx_q4 "
            "mlx_q8 unquant humming".split()
        ),
        "Kiln quantizes at load only with --quantization int8 (CPU): it serves the checkpoint's own weights "
        "(GGUF blocks kept on the CPU, FP8 blocks kept on CUDA from compute capability 8.9, else dequantized)",
    ),
    ForeignValue(
        "--schedule-policy",
        ("dfs-weight", "hrrn", "lof", "priority", "random", "routing-key", "shortest-prefill-first"),
        "Kiln schedules fcfs or lpm only: it schedules fcfs",
    ),
)


def foreign_value(flag: str, value: str) -> ForeignValue | None:
    """The ForeignValue that `value` of `flag` is, or None for a value Kiln takes."""
    return next((v for v in FOREIGN_VALUES if v.flag == flag and value in v.values), None)


def add_foreign_flags(parser: argparse.ArgumentParser) -> None:
    """Adds every foreign flag to `parser`: any value is taken (SGLang's choices are not Kiln's to check), and
    a flag not given leaves nothing in the namespace (argparse.SUPPRESS), so that only given ones are reported.
    They stay out of --help, which they would bury; docs/sglang_flags.md lists them."""
    group = parser.add_argument_group(
        "SGLang's other flags",
        "every other flag of SGLang's launch_server is accepted, and what Kiln does instead logged once at "
        "startup (docs/sglang_flags.md lists them)",
    )
    for flag in FOREIGN_FLAGS:
        kw: dict = {"dest": flag.dest, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
        names = (flag.flag, *flag.aliases)
        if any(name in parser._option_string_actions for name in names):
            continue  # Kiln implements it now (a ServerArgs field); the tests ask for the table to say so
        if flag.shape is Shape.SWITCH:
            group.add_argument(*names, action="store_true", **kw)
        elif flag.shape is Shape.TOGGLE:
            group.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        else:
            nargs = {Shape.VALUES: "+", Shape.ANY_VALUES: "*", Shape.OPTIONAL_VALUE: "?"}.get(flag.shape)
            group.add_argument(*names, nargs=nargs, metavar="VALUE", **kw)


def foreign_flags_given(namespace: argparse.Namespace) -> tuple[tuple[str, ...], ...]:
    """The foreign flags in a parsed namespace, each as argv tokens under its main spelling: ("--flag",
    *values), ("--no-flag",) for a toggle turned off. In the order given."""
    by_dest = {flag.dest: flag for flag in FOREIGN_FLAGS}
    given = []
    for dest, value in vars(namespace).items():
        flag = by_dest.get(dest)
        if flag is None:
            continue
        if flag.shape is Shape.TOGGLE and value is False:
            given.append(("--no-" + flag.flag.removeprefix("--"),))
        elif isinstance(value, bool) or value is None:
            given.append((flag.flag,))
        elif isinstance(value, list):
            given.append((flag.flag, *value))
        else:
            given.append((flag.flag, value))
    return tuple(given)


def _sentence(flag: str, values: Sequence[str]) -> tuple[int, str]:
    """(logging level, sentence) for one given foreign flag or value."""
    value = values[0] if values else "on"
    for entry in FOREIGN_VALUES:
        if entry.flag == flag and value in entry.values:
            return logging.WARNING, entry.instead
    name = flag.removeprefix("--no-") if flag.startswith("--no-") else flag.removeprefix("--")
    for entry in FOREIGN_FLAGS:
        if entry.flag == "--" + name:
            agrees = not flag.startswith("--no-") and value in entry.agreeing
            return (logging.INFO if agrees else logging.WARNING), entry.instead
    raise KeyError(f"{flag} is not an SGLang flag Kiln accepts without implementing")


def foreign_flag_messages(given: Iterable[tuple[str, ...]]) -> list[tuple[int, str]]:
    """One (logging level, line) per given foreign flag or value: the flag as given, then what Kiln does."""
    messages = []
    for flag, *values in given:
        level, instead = _sentence(flag, values)
        shown = " ".join([flag, *values])
        messages.append((level, f"SGLang flag {shown}: {instead}"))
    return messages


_SUFFIXES = {
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,  # SGLang's SI suffixes
    "m": 10**6, "g": 10**9, "t": 10**12,  # vLLM's lowercase ones, the same powers of 1000
    "K": 2**10, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,  # vLLM's K and SGLang's IEC ones
}  # fmt: skip
_READABLE = re.compile(r"(-?\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|[kKmMgGtT])")


def human_readable_int(text: str) -> int:
    """A token count as SGLang's human_readable_int reads it: 32k = 32000, 1M = 10**6, 25.6k = 25600,
    4Ki = 4096; vLLM's spellings are taken too where they do not conflict: lowercase m, g, t (powers of 1000)
    and uppercase K (1024). vLLM reads an uppercase M, G, T as powers of 1024; Kiln follows SGLang (powers of
    1000) there."""
    text = text.strip()
    match = _READABLE.fullmatch(text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: not a count (an integer, or one with a suffix: 32k = 32000, 1M = 1000000, "
                "4Ki = 4096)"
            ) from None
    number, suffix = match.groups()
    if "." in number and _SUFFIXES[suffix] % 1000:  # as SGLang: a fraction of a binary unit is a slip
        raise argparse.ArgumentTypeError(f"{text!r}: decimals go with k, M, G, T (powers of 1000) only")
    try:
        value = Decimal(number) * _SUFFIXES[suffix]
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"{text!r}: not a count") from None
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is {value}, not a whole number of tokens")
    return int(value)


def markdown_table(parser: argparse.ArgumentParser) -> str:
    """docs/sglang_flags.md: each SGLang flag and what `parser` (kiln serve's) does with it, read from the
    parser itself so that the table cannot drift from it."""
    actions = {option: action for action in parser._actions for option in action.option_strings}
    lines = [
        "# SGLang's launch_server flags in Kiln",
        "",
        "Generated by `python -m kiln.config --sglang-flags-markdown` from `kiln serve`'s parser (a test",
        "checks this file against it). Every flag of SGLang 0.5.23's `launch_server` parses: **native** is a",
        "Kiln flag of the same meaning, **alias** another spelling of one, **accepted** a flag Kiln takes and",
        "reports at startup in one line saying what it does instead (at info level where Kiln already does what",
        "it asks, else as a warning). Token counts (--context-length, --max-total-tokens, --max-prefill-tokens,",
        "--chunked-prefill-size) take SGLang's suffixes: 32k = 32000, 1M = 1000000, 4Ki = 4096; vLLM's",
        "lowercase m, g, t are powers of 1000 and its uppercase K is 1024 (an uppercase M, G, T is SGLang's",
        "power of 1000).",
        "",
        "| SGLang flag | Kiln | what Kiln does |",
        "|---|---|---|",
    ]
    sglang_flags = [
        *SGLANG_NATIVE_FLAGS,
        *(spelling for f in FOREIGN_FLAGS for spelling in (f.flag, *f.aliases)),
    ]
    for flag in sorted(sglang_flags):
        lines.append(_markdown_row(flag, actions[flag]))
    for entry in FOREIGN_VALUES:
        lines.append(f"| `{entry.flag} {' / '.join(entry.values)}` | accepted | {entry.instead} |")
    others = sorted(
        (option, action.option_strings[0])
        for action in parser._actions
        for option in action.option_strings[1:]
        if option not in sglang_flags and action.dest != "help" and not action.dest.startswith(DEST_PREFIX)
    )
    lines += ["", "Other spellings Kiln takes (vLLM's where the meaning is the same):", ""]
    lines += ["| flag | Kiln |", "|---|---|"]
    lines += [f"| `{option}` | alias of `{main}` |" for option, main in others]
    return "\n".join(lines) + "\n"


def _markdown_row(flag: str, action: argparse.Action) -> str:
    help_text = (action.help or "").replace("|", "\\|").replace("\n", " ")
    if action.dest.startswith(DEST_PREFIX):
        entry = next(f for f in FOREIGN_FLAGS if f.dest == action.dest)
        help_text = entry.instead
        if entry.agreeing:
            agreeing = "" if entry.agreeing == ("on",) else "with " + " / ".join(entry.agreeing) + ": "
            help_text += f" ({agreeing}logged as info, not as a warning)"
        return f"| `{flag}` | accepted | {help_text} |"
    main = action.option_strings[0]
    if flag == main:
        return f"| `{flag}` | native | {help_text} |"
    return f"| `{flag}` | alias of `{main}` | {help_text} |"
