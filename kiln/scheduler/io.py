"""Every message that crosses a process boundary, in one module: requests and outputs between the front (HTTP
or the in-process API) and the scheduler, the scheduler's stats snapshot, the engine's startup reports and its
server info. Each is a dataclass that pickles over ZMQ or a multiprocessing queue, so both sides read fields
by name instead of indexing tuples or dicts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kiln.sampling_params import InvalidParam, SamplingParams


@dataclass(frozen=True)
class PoolSpec:
    """What a prefill-only request (max_new_tokens 0) returns instead of tokens (kiln.scheduler.pooling): its
    prompt's final normed hidden states pooled (`mode` last | mean | cls, the first token), cut to their first
    `dimensions` values (Matryoshka) and then L2-normalised if `normalize`: an embedding; or, `mode` "labels", the
    log-probabilities of `label_ids` as the prompt's next token (/v1/score, /v1/rerank)."""

    mode: str
    normalize: bool = False
    dimensions: int | None = None
    label_ids: tuple[int, ...] = ()


def embedding_spec(pooling: PoolSpec, dimensions: int | None, hidden_size: int) -> PoolSpec:
    """An embedding request's PoolSpec: the server's pooling, with the `dimensions` (Matryoshka) it asks for."""
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise InvalidParam(
            "dimensions",
            f"dimensions={dimensions} must be in [1, {hidden_size}] (this model's embedding size)",
        )
    return PoolSpec(pooling.mode, pooling.normalize, dimensions)


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    stream: bool = False
    deadline: float | None = None  # time.time() after which the request is aborted
    log_metrics: bool = (
        True  # False: a probe (/health_generate), left out of the token counters as SGLang does
    )
    pool: PoolSpec | None = None  # a prefill-only request's pooled output (embeddings, label scores)
    lora_path: str | None = None  # the LoRA adapter's name (SGLang's lora_path); None: the base model


@dataclass
class AbortReq:
    rid: str | None = None  # None with abort_all
    abort_all: bool = False
    message: str = "aborted by the client"


@dataclass
class ControlReq:
    """flush_cache | server_info | check_integrity | load_lora_adapter | unload_lora_adapter; answered with a
    ControlOut of the same id."""

    kind: str
    cid: int = 0
    args: dict[str, Any] = field(default_factory=dict)  # a LoRA control's lora_name and lora_path


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: the first prompt token of prompt logprobs (nothing before it scores it)
    top: list[tuple[int, float]] | None = None


@dataclass
class ReqOutput:
    """What happened to one request in one step: new tokens and text, and the end when it ended."""

    rid: str
    new_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    # prompt logprobs (params.logprob_start_len), once: a TokenLogprob per prompt token from the start, in SGLang's
    # shape (the first one's logprob None)
    input_logprobs: list[TokenLogprob] | None = None
    num_retractions: int = 0
    queue_time: float | None = None  # seconds from arrival to first admission, on the first output only
    error: str | None = None  # set for requests that failed inside the engine (a 500 for that request alone)
    # speculative decoding (zero without): decode steps the request took part in, and its drafts accepted
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0
    # a request with a PoolSpec, once its prompt is computed: the embedding, or its label tokens' logprobs
    embedding: list[float] | None = None

    def spec_meta(self) -> dict[str, Any]:
        """meta_info's speculative fields as SGLang sends them (spec_accept_length = completion tokens per
        verify, the bonus token included); empty without speculative decoding."""
        if not self.spec_verify_ct:
            return {}
        return {
            "spec_accept_length": self.completion_tokens / self.spec_verify_ct,
            "spec_verify_ct": self.spec_verify_ct,
            "spec_num_correct_drafts": self.spec_accepted_drafts,
        }


@dataclass
class OutputAccumulator:
    """One request's outputs summed as they arrive: the deltas joined, and the latest output (which carries
    the token counts and, once finished, the finish reason)."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    last: ReqOutput | None = None

    def add(self, out: ReqOutput) -> None:
        self.text += out.text_delta
        self.ids.extend(out.new_ids)
        self.logprobs.extend(out.logprobs or [])
        self.input_logprobs.extend(out.input_logprobs or [])
        self.last = out

    @property
    def output(self) -> ReqOutput:
        """The latest output; only asked for once at least one arrived (every request ends with one)."""
        assert self.last is not None, "no output yet"
        return self.last


# ---------------------------------------------------------------------------------------------- stats
@dataclass
class RequestCounters:
    """What the scheduler has counted since it started. The scheduler alone increments these; everyone else
    sees them as part of a SchedulerStats snapshot."""

    decode_steps: int = 0
    retracted: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    failed: int = 0


COUNTER_NAMES = tuple(f.name for f in fields(RequestCounters))


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's gauges and counters at one step, sent with every output batch and heartbeat (for
    /metrics) and with the server info. Zero everywhere until the engine's first report."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    token_usage: float = 0.0  # used_tokens as a fraction of the pool
    used_tokens: int = 0  # pool tokens held by running requests and by the prefix cache
    cache_tokens: int = 0  # tokens held by the prefix cache
    evictable_tokens: int = 0  # of those, the ones no running request holds (free for the taking)
    pool_tokens: int = 0  # the KV pool's size
    integrity_violations: int = 0
    decode_steps: int = 0
    retracted: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    failed: int = 0
    # constrained decoding: compile cache hits and misses, and compile seconds as a histogram (counts per bucket
    # of kiln.structured.cache.COMPILE_BUCKETS, cumulative as Prometheus has them, and their sum)
    grammar_cache_hits: int = 0
    grammar_cache_misses: int = 0
    grammar_compile_buckets: tuple[int, ...] = ()
    grammar_compile_seconds_sum: float = 0.0
    # the hierarchical cache's tiers (zero when off): HiRadixCache.tier_stats
    host_tier_tokens: int = 0
    host_used_tokens: int = 0
    host_hit_tokens: int = 0
    host_load_back_seconds: float = 0.0
    host_bytes_written: int = 0
    storage_hit_tokens: int = 0
    storage_bytes_written: int = 0
    storage_load_seconds: float = 0.0
    storage_skipped_files: int = 0
    # speculative decoding (zero without): request-verifies and accepted drafts since startup, and SGLang's
    # gauges from them (accepted drafts + 1 per verify; accepted over num_draft_tokens - 1 per verify)
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0
    spec_accept_length: float = 0.0
    spec_accept_rate: float = 0.0

    @property
    def running_tokens(self) -> int:
        """SGLang's num_used_tokens: the pool less what is free or evictable, so an idle server reads 0 however
        full its prefix cache."""
        return self.used_tokens - self.evictable_tokens

    @property
    def running_token_usage(self) -> float:
        """SGLang's token_usage: running_tokens as a fraction of the pool."""
        return self.running_tokens / max(1, self.pool_tokens)

    def counters(self) -> dict[str, int]:
        """The counters alone, by name (the `stats` object of /get_server_info)."""
        return {name: getattr(self, name) for name in COUNTER_NAMES}


@dataclass
class BatchOut:
    outputs: list[ReqOutput]
    stats: SchedulerStats = field(default_factory=SchedulerStats)


# ---------------------------------------------------------------------------------------------- server info
@dataclass(frozen=True)
class ServerInfo:
    """What the engine resolved at startup, and the memory it measured against the ledger's prediction."""

    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    chunked_prefill_size: int | None
    vocab_size: int
    device: str
    ledger: dict[str, Any]  # Ledger.to_dict()
    measured: dict[str, int]  # bytes per allocation, as measured
    memory_check: list[dict[str, Any]]  # kiln.memory.measure.memory_check rows
    graphs: dict[str, Any] | None  # the captured graphs' summary; None without graphs
    pid: int
    tp_size: int = 1
    # the speculative draft's captured steps (its decode shapes, tree rows, catch-ups); None without them
    draft_graphs: dict[str, Any] | None = None
    # with several tensor-parallel ranks, each rank's memory_check rows in rank order (memory_check is rank 0's)
    memory_check_per_rank: list[list[dict[str, Any]]] | None = None
    # an embedding server's pooling (--is-embedding; None: a generation server) and the model's hidden size,
    # the longest embedding it gives
    pooling: PoolSpec | None = None
    hidden_size: int = 0


@dataclass(frozen=True)
class EngineState:
    """The answer to ControlReq("server_info"): the startup info as of now, the scheduler's stats and a fresh
    KV pool integrity report."""

    info: ServerInfo
    stats: SchedulerStats
    integrity: dict[str, Any]  # KVManager.integrity's report


@dataclass
class ControlOut:
    cid: int
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)
    state: EngineState | None = None  # set in the answer to server_info


# ---------------------------------------------------------------------------------------------- startup
@dataclass(frozen=True)
class PhaseEntered:
    """The engine began a startup phase (kiln.server.startup.PHASES, or "serving" once its loop starts, which
    only names the phase a rank died in); rank is the tensor-parallel rank that did."""

    name: str
    info: dict[str, Any] = field(default_factory=dict)
    rank: int = 0


@dataclass(frozen=True)
class Progress:
    """Progress inside the current phase (weights loaded, graphs captured so far)."""

    info: dict[str, Any]
    rank: int = 0


@dataclass(frozen=True)
class RankReady:
    """A rank (of several) built its engine; from here on it waits on the others, and its silence is theirs."""

    rank: int


@dataclass(frozen=True)
class RankFailed:
    """A rank ended after startup: in which phase, and why (a collective that timed out waiting for a silent rank,
    an error in a step)."""

    rank: int
    phase: str
    reason: str


@dataclass(frozen=True)
class EngineReady:
    info: ServerInfo


@dataclass(frozen=True)
class StartupFailed:
    reason: str
    traceback: str
    rank: int = 0


StartupMessage = PhaseEntered | Progress | RankReady | RankFailed | EngineReady | StartupFailed
