"""The memory ledger's types: what it is asked (LedgerInputs) and what it answers (Ledger: lines, sizes, verdict).
Plain data, imported by every part of the ledger's arithmetic and by its readers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kiln.platform import gguf_blocks_expected

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
    cuda_graph_bs: tuple[int, ...] | None = None
    cuda_graph_max_bs_prefill: int | None = None
    cuda_graph_bs_prefill: tuple[int, ...] | None = None
    disable_cuda_graph: bool = False
    disable_prefill_graph: bool = False
    enable_hierarchical_cache: bool = False
    hicache_size_gb: float = 0.0
    hicache_ratio: float = 2.0
    host_memory_bytes: int | None = None  # node RAM available (defaults to probed)
    draft_hf_config: dict | None = None  # speculative decoding draft model
    weight_prepack: bool = True  # CPU float32: linear weights in a packed layout (a tied lm head gets a copy)
    # CPU float32 with prepacking: GGUF Q4_1 / Q8_0 matrices stay in their blocks (Kiln's kernel, AVX2)
    gguf_blocks: bool = field(default_factory=gguf_blocks_expected)


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
    graph_batch_sizes: tuple[int, ...]
    graph_prefill_tokens: tuple[int, ...]
    prefill_activation_bytes: int
    logits_bytes: int
    headroom_bytes: int
    fits: bool
    failure: Failure | None
    device: str = "cpu"
    tp_size: int = 1

    def line(self, name: str) -> LedgerLine:
        return next(x for x in self.lines if x.name == name)

    def has_line(self, name: str) -> bool:
        return any(x.name == name for x in self.lines)

    def to_dict(self) -> dict:
        return asdict(self)
