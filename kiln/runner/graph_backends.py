"""What the graph runner captures and replays, one backend per kind of step.

Decode: on CUDA a torch.cuda.CUDAGraph per batch size over static input buffers; on the CPU the step compiled by
torch.compile (inductor), batch size static, KV length dynamic. A batch pads up to its captured size with dummy
rows that write and read the reserved padding slot 0. A step hands out the hidden states a speculative draft
reads along with the logits (a target whose drafter asked for them, or a draft head's own output); a draft head's
step also takes its input features as a static input, as SGLang's EAGLE draft graphs do. A head's catch-up step
(decode rows, several a request) takes which rows get logits as an input too (LogitsRows): the lm head runs on each
request's last token, not on every token.

Prefill runs on "pieces": each layer's attention-free halves at a fixed token count, with attention, whose shapes
follow the batch's sequences, run eagerly between them. On CUDA the halves are CUDA graphs over static buffers
(SGLang's "breakable" prefill graph); on the CPU they are compiled per token count.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from kiln.core.forward_batch import AttentionMetadata, ForwardBatch, ForwardMode, Pieces
from kiln.runner.attention import AttentionBackend

# capture(fn, pool) -> (replay, pool): records fn as a graph in the memory pool and returns what replays it
GraphCapture = Callable[[Callable[[], None], Any], tuple[Callable[[], None], Any]]

# the KV length of the dummy decode batch used for capture (>= 2: a length of 1 would be specialised)
CAPTURE_KV_LEN = 64
# The repeated KV a CUDA graph may gather for a decode batch whose rows mostly share their slots (a request's
# catch-up or verify rows, n > 1 on a long prompt) before the eager distinct-slot call wins: eager steps of a
# small model are launch-bound (a draft head's catch-up rows took 2.2-2.4 ms whatever the batch on an H200),
# while 1 GiB gathered again is about 0.5 ms at that GPU's 4.18 TB/s of copy bandwidth.
CUDA_SHARED_GATHER_LIMIT = 1 << 30
DecodeInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# a step's logits and the hidden states it hands a draft (None: the model keeps none)
StepOutput = tuple[torch.Tensor, torch.Tensor | None]


def takes_features(model) -> bool:
    """A draft head (EAGLE, EAGLE-3, NEXTN): each forward reads the features handed to set_features."""
    return hasattr(model, "set_features")


def keeps_hidden(model) -> bool:
    """Whether the model's forward leaves hidden states a drafter reads: a target set to keep them
    (capture_hidden), or a draft head, whose output is the next draft step's features."""
    return takes_features(model) or getattr(model, "capture_hidden", None) is not None


def feature_width(model, catch_up: bool = False) -> int | None:
    """The width of the features a draft head's captured step takes: a draft decode step's (the head's own
    output, fed back) or a catch-up's (the target's hidden states); None for a model that takes none."""
    if not takes_features(model):
        return None
    return model.catch_up_feature_width if catch_up else model.step_feature_width


def dummy_features(model, bs: int, device, width: int | None) -> torch.Tensor | None:
    """[bs, width] zero features for capture in the model's dtype; None for a width of None (no features)."""
    if width is None:
        return None
    dtype = next(model.parameters()).dtype
    return torch.zeros(bs, width, dtype=dtype, device=device)


def pad_features(model, bs: int) -> torch.Tensor | None:
    """The features a draft head was handed for this step, padded with zero rows to bs."""
    if not takes_features(model):
        return None
    features = model.features
    return _dense(F.pad(features, (0, 0, 0, bs - features.shape[0])))


# ---------------------------------------------------------------------------------------------- decode
def pad_decode_inputs(fb: ForwardBatch, bs: int, min_len: int = 2) -> DecodeInputs:
    """The batch's (ids, positions, out slots, [bs, L] KV table, [bs, 1, 1, L] mask), padded to bs rows (and to
    at least min_len KV columns): dummy rows write slot 0 and attend to it alone."""
    n, length = fb.kv_table.shape
    pad_rows, pad_cols = bs - n, max(0, min_len - length)
    mask = (
        fb.kv_mask.view(n, length)
        if fb.kv_mask is not None
        else torch.ones(n, length, dtype=torch.bool, device=fb.kv_table.device)
    )
    mask = F.pad(mask, (0, pad_cols, 0, pad_rows))
    mask[n:, 0] = True
    table = F.pad(fb.kv_table, (0, pad_cols, 0, pad_rows))
    rows = (F.pad(t, (0, pad_rows)) for t in (fb.input_ids, fb.positions, fb.out_cache_loc))
    return tuple(_dense(t) for t in (*rows, table, mask.view(bs, 1, 1, -1)))  # type: ignore[return-value]


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A copy with plain row-major strides, size-1 dims included (the compiled code is guarded on strides)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def decode_batch(
    inputs: DecodeInputs, attn: AttentionMetadata, logits_index: torch.Tensor | None = None
) -> ForwardBatch:
    """A captured decode step's batch, with the attention backend's graph metadata (see CompiledDecode)."""
    ids, pos, loc, table, mask = inputs
    return ForwardBatch(
        ForwardMode.DECODE, ids, pos, loc, logits_index=logits_index, kv_table=table, kv_mask=mask, attn=attn
    )


class LogitsRows:
    """Which rows of a captured decode step get logits: every row (a decode or verify step), or one row per
    `tokens_per_logit` rows (a head's catch-up, which wants each request's last token only: its logits rows, an
    input of the step, padded with row 0, so the lm head runs on a request's row, not on each of its tokens)."""

    def __init__(self, tokens_per_logit: int = 0):
        self.tokens_per_logit = tokens_per_logit

    def rows_for(self, fb: ForwardBatch) -> int:
        """The captured rows a batch needs (0: this step cannot run it). A step computing every row's logits takes
        a batch that wants every row's (decode and verify steps name all their rows, in order); a catch-up's,
        one that names a row per request, its requests' share of the rows."""
        n = int(fb.kv_table.shape[0])
        wanted = n if fb.logits_index is None else len(fb.logits_index)
        if not self.tokens_per_logit:
            return n if wanted == n else 0
        return 0 if fb.logits_index is None else max(n, wanted * self.tokens_per_logit)

    def count(self, bs: int) -> int:
        """The rows of logits (and hidden states) a step of bs rows computes."""
        return bs // self.tokens_per_logit if self.tokens_per_logit else bs

    def index(self, bs: int, device, fb: ForwardBatch | None = None) -> torch.Tensor | None:
        """The step's logits-rows input at bs rows: the batch's, padded (zeros for capture); None: every row."""
        if not self.tokens_per_logit:
            return None
        index = torch.zeros(self.count(bs), dtype=torch.int64, device=device)
        if fb is not None:
            index[: len(fb.logits_index)] = fb.logits_index
        return index

    def select(self, out: StepOutput, fb: ForwardBatch) -> StepOutput:
        """The rows of a step's output that the eager forward of the batch returns: the batch's rows of a padded
        step (every row, as rows_for takes them), or its requests' logits rows."""
        wanted = len(fb.logits_index) if self.tokens_per_logit else int(fb.kv_table.shape[0])
        logits, hidden = out
        return logits[:wanted], None if hidden is None else hidden[:wanted]


def dummy_decode_inputs(bs: int, length: int, device) -> DecodeInputs:
    zeros = torch.zeros(bs, dtype=torch.int64, device=device)
    mask = torch.zeros(bs, 1, 1, length, dtype=torch.bool, device=device)
    mask[..., 0] = True
    return (
        zeros,
        zeros.clone(),
        zeros.clone(),
        torch.zeros(bs, length, dtype=torch.int64, device=device),
        mask,
    )


def _decode_step(
    model,
    ids,
    pos,
    loc,
    table,
    mask,
    shared_prefix: int | torch.Tensor = 0,
    features: torch.Tensor | None = None,
    logits_index: torch.Tensor | None = None,
) -> StepOutput:
    """The step graphs capture. Its attention metadata is the model's own backend's graph metadata: static, with
    `shared_prefix` (the KV table's leading columns every request shares) as its one input that changes. A draft
    head's features go in as an input, and a catch-up's logits rows (LogitsRows); the hidden states the model keeps
    come out as an output, since a replayed CUDA graph leaves no attribute of the model up to date."""
    if features is not None:
        model.set_features(features)
    attn = model.attn.graph_metadata(shared_prefix)
    logits = model(decode_batch((ids, pos, loc, table, mask), attn, logits_index))
    return logits, model.last_hidden if keeps_hidden(model) else None


@functools.cache
def _warmup_stream() -> torch.cuda.Stream:
    """One side stream for every warm-up: the GEMM library keeps a workspace per stream it has run on."""
    return torch.cuda.Stream()


def cuda_graph_capture(fn: Callable[[], None], pool: Any) -> tuple[Callable[[], None], Any]:
    """fn captured as a torch.cuda.CUDAGraph in `pool` (None: a new pool), then replayed once so that the
    buffers it writes hold real values. A warm-up run on a side stream first: lazy initialisation (library
    handles, workspaces) must not be captured."""
    stream = _warmup_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    graph.replay()
    return graph.replay, graph.pool()


def _model_structure_guard(name: str) -> bool:
    """A guard on the model's own structure: its weights' shapes and strides, its modules' types and the flags and
    sizes fixed at load. Thousands of them (a 30-layer model: ~5,000) were checked before every replay, ~0.6 ms of
    a ~6 ms batch-1 step, and none can change once the model is loaded; `capture_hidden`, set when a drafter
    attaches, is the one attribute a step reads that is set after load, and its guards stay."""
    return (name == "model" or name.startswith(("model.", "model["))) and "capture_hidden" not in name


def _skip_model_structure_guards(entries) -> list[bool]:
    return [not _model_structure_guard(entry.name) for entry in entries]


def _own_code(fn: Callable) -> Callable:
    """fn with a code object of its own. Dynamo keeps compiled code per code object, so every CompiledDecode
    (a target, a draft model, a draft head) would otherwise share one cache, and without the model's structure
    guards a draft model could replay the target's code."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


# A batch-1 step on the CPU is a few milliseconds, so what runs around its kernels counts: the model's structure
# guards (above) and inductor's checks of every opaque op's output sizes and strides (~400 a step, ~0.4 ms; Kiln's
# ops return contiguous tensors of the shapes their fake implementations give, which tests check).
DECODE_COMPILE_OPTIONS = {"guard_filter_fn": _skip_model_structure_guards, "size_asserts": False}


class CompiledDecode:
    """CPU: one torch.compile'd step; each batch size compiles its own static-batch code, KV length dynamic. With
    Kiln's CPU attention kernel the step also takes how many leading KV columns the batch's requests share, as a
    tensor input, so a prefix the batch shares is read once per chunk of requests in compiled steps too."""

    name = "inductor"
    compiled = True  # its payoff against eager is measured at capture
    kv_width: int | None = None  # the KV length is dynamic: any width replays
    # a mostly shared batch runs eagerly (unless the step reads its shared prefix once)
    shared_gather_limit = 0

    def __init__(
        self,
        model,
        attn: AttentionBackend,
        device: str,
        features: int | None = None,
        logits_rows: LogitsRows | None = None,
    ):
        """features: the width of a draft head's input features (None: the model takes none); logits_rows: which
        rows get logits (default: every row)."""
        self.model, self.device, self.feature_width = model, device, features
        self.logits_rows = logits_rows or LogitsRows()
        self.fn = torch.compile(_own_code(_decode_step), dynamic=False, options=DECODE_COMPILE_OPTIONS)
        self.reads_shared_prefix_once = attn.reads_shared_prefix_once

    def capture(self, bs: int) -> None:
        inputs = dummy_decode_inputs(bs, CAPTURE_KV_LEN, self.device)
        torch._dynamo.mark_dynamic(inputs[3], 1)
        torch._dynamo.mark_dynamic(inputs[4], 3)
        features = dummy_features(self.model, bs, self.device, self.feature_width)
        self.fn(self.model, *inputs, self._shared(0), features, self.logits_rows.index(bs, self.device))

    def replay(self, bs: int, fb: ForwardBatch) -> StepOutput:
        """The shared prefix the attention backend found in the batch goes in as the step's input, as do a draft
        head's features and a catch-up's logits rows."""
        inputs = pad_decode_inputs(fb, bs)
        shared, features = self._shared(fb.attn.shared_prefix), pad_features(self.model, bs)
        out = self.fn(self.model, *inputs, shared, features, self.logits_rows.index(bs, self.device, fb))
        return self.logits_rows.select(out, fb)

    def _shared(self, columns: int | torch.Tensor) -> torch.Tensor | int:
        return torch.tensor([int(columns)], dtype=torch.int64) if self.reads_shared_prefix_once else 0


class CudaGraphDecode:
    """CUDA: static input buffers of the largest size and one CUDAGraph per batch size in one shared pool. The
    KV table has a static width; a batch with a longer sequence runs eagerly."""

    name = "full"
    compiled = False
    # the graphs run on the graph metadata: no distinct slots, no shared prefix, each request's rows gathered or
    # walked; mostly shared batches run eagerly once the rows they gather again pass shared_gather_limit
    reads_shared_prefix_once = False
    shared_gather_limit = CUDA_SHARED_GATHER_LIMIT

    def __init__(
        self,
        model,
        device: str,
        max_bs: int,
        kv_width: int,
        capture_graph: GraphCapture = cuda_graph_capture,
        features: int | None = None,
        logits_rows: LogitsRows | None = None,
    ):
        """features: the width of a draft head's input features (None: the model takes none); logits_rows: which
        rows get logits (default: every row)."""
        self.model, self.kv_width, self.capture_graph = model, kv_width, capture_graph
        self.feature_width = features
        self.logits_rows = logits_rows or LogitsRows()
        self.buffers = dummy_decode_inputs(max_bs, kv_width, device)
        self.features = dummy_features(model, max_bs, device, features)  # a draft head's input features
        self.logits_index = self.logits_rows.index(max_bs, device)  # a catch-up's logits rows
        self.graphs: dict[int, Callable[[], None]] = {}
        self.logits: torch.Tensor | None = None  # every graph's output, [max_bs (logits rows), vocab]
        self.hidden: torch.Tensor | None = None  # every graph's hidden states out, [max_bs, width], if kept
        self.pool: Any = None

    def _view(self, bs: int) -> DecodeInputs:
        return tuple(t[:bs] for t in self.buffers)  # type: ignore[return-value]

    def _step(self, bs: int) -> StepOutput:
        features = None if self.features is None else self.features[:bs]
        index = None if self.logits_index is None else self.logits_index[: self.logits_rows.count(bs)]
        return _decode_step(self.model, *self._view(bs), features=features, logits_index=index)

    def capture(self, bs: int) -> None:
        if self.logits is None:  # sized by the first, largest, batch; one buffer instead of one per graph
            logits, hidden = self._step(len(self.buffers[0]))
            self.logits = torch.empty_like(logits)
            self.hidden = None if hidden is None else torch.empty_like(hidden)
        count = self.logits_rows.count(bs)
        out, hidden_out = self.logits[:count], None if self.hidden is None else self.hidden[:count]

        def fn() -> None:
            logits, hidden = self._step(bs)
            out.copy_(logits)
            if hidden_out is not None:
                hidden_out.copy_(hidden)

        self.graphs[bs], self.pool = self.capture_graph(fn, self.pool)

    def replay(self, bs: int, fb: ForwardBatch) -> StepOutput:
        if fb.kv_table.shape[1] > self.kv_width:
            raise ValueError(
                f"a sequence of {fb.kv_table.shape[1]} tokens is above the graphs' {self.kv_width}"
            )
        inputs = pad_decode_inputs(fb, bs)
        ids, pos, loc, table, mask = self._view(bs)
        length = inputs[3].shape[1]
        for dst, src in zip((ids, pos, loc), inputs[:3]):
            dst.copy_(src)
        table.zero_()
        table[:, :length].copy_(inputs[3])
        mask.zero_()
        mask[..., :length].copy_(inputs[4])
        if self.features is not None:
            self.features[:bs].copy_(pad_features(self.model, bs))
        if self.logits_index is not None:
            index = self.logits_rows.index(bs, self.logits_index.device, fb)
            self.logits_index[: len(index)].copy_(index)
        self.graphs[bs]()
        # the rows the batch wants, copied out of the buffers the next replay overwrites
        logits, hidden = self.logits_rows.select((self.logits, self.hidden), fb)
        return logits.clone(), None if hidden is None else hidden.clone()


# ---------------------------------------------------------------------------------------------- prefill
def dummy_extend_batch(tokens: int, device, attn: AttentionBackend) -> ForwardBatch:
    """One fresh prompt of `tokens` tokens whose KV all goes to the padding slot 0, with its attention metadata.
    Every position is 0: a capture's token count may pass the context length, where the rotary table ends (a
    prefill of many prompts is longer than any one of them)."""
    slots = torch.zeros(tokens, dtype=torch.int64, device=device)
    fb = ForwardBatch(
        ForwardMode.EXTEND, slots.clone(), slots.clone(), slots,
        logits_index=torch.tensor([tokens - 1], device=device), extend_lens=[tokens], prefix_lens=[0],
        seq_slots=[slots],
    )  # fmt: skip
    return replace(fb, attn=attn.prepare_metadata(fb))


class CompiledPrefill:
    """Prefill on pieces: per token count, the layers' attention-free halves compiled once for every layer."""

    name = "inductor-piecewise"
    compiled = True

    def __init__(self, model, attn: AttentionBackend, device: str):
        self.model, self.attn, self.device = model, attn, device
        layer = type(model.model.layers[0])
        self.before = torch.compile(layer.before_attention, dynamic=False)
        self.after = torch.compile(layer.after_attention, dynamic=False)

    def capture(self, tokens: int) -> None:
        self.model(
            dummy_extend_batch(tokens, self.device, self.attn), Pieces(self.before, self.after, tokens)
        )

    def replay(self, tokens: int, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb, Pieces(self.before, self.after, tokens))


class BreakablePrefill:
    """CUDA: SGLang's breakable prefill graph. Per token count, each layer's two attention-free halves are CUDA
    graphs (largest count first, all in one pool); attention runs eagerly between them. The graphs read and write
    static buffers shared by every layer and count: the hidden state `h0` / `h1` (a layer reads one, writes the
    other), `cos_sin`, the attention output `attn`, and q / k / v."""

    name = "breakable"
    compiled = False

    def __init__(
        self, model, attn: AttentionBackend, device: str, capture_graph: GraphCapture = cuda_graph_capture
    ):
        self.model, self.attn, self.device, self.capture_graph = model, attn, device, capture_graph
        self.graphs: dict[tuple[int, int, str], Callable[[], None]] = {}
        self.bufs: dict[str, torch.Tensor] = {}
        self.pool: Any = None
        self.tokens = 0  # the token count of the forward in progress
        self.capturing = False

    def capture(self, tokens: int) -> None:
        fb = dummy_extend_batch(tokens, self.device, self.attn)
        self.model(fb)  # eager warm-up: lazy initialisation must not be captured
        self.capturing = True
        try:
            self.replay(tokens, fb)
        finally:
            self.capturing = False

    def replay(self, tokens: int, fb: ForwardBatch) -> torch.Tensor:
        self.tokens = tokens
        return self.model(fb, Pieces(self._before, self._after, tokens))

    def _buf(self, name: str, like: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The first `tokens` rows (along dim) of a static buffer; sized by the first, largest, capture."""
        if name not in self.bufs:
            self.bufs[name] = torch.empty_like(like)
        buf = self.bufs[name]
        if buf.shape[dim] < self.tokens:
            raise ValueError(f"{self.tokens} tokens are above the captured {buf.shape[dim]}")
        return buf.narrow(dim, 0, self.tokens)

    def _load(self, name: str, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        view = self._buf(name, x, dim)
        if view.data_ptr() != x.data_ptr():
            view.copy_(x)
        return view

    def _run(self, key: tuple[int, int, str], fn: Callable[[], None]) -> None:
        if self.capturing:
            self.graphs[key], self.pool = self.capture_graph(fn, self.pool)
        else:
            self.graphs[key]()

    def _before(self, layer, cos_sin: torch.Tensor, h: torch.Tensor, rotary) -> tuple[torch.Tensor, ...]:
        i = layer.self_attn.layer_id
        cs, hv = self._load("cos_sin", cos_sin, dim=1), self._load(f"h{i % 2}", h)
        if self.capturing and "q" not in self.bufs:  # the output buffers take the shapes of an eager run
            for name, t in zip("qkv", layer.before_attention(cs, hv, rotary)):
                self._buf(name, t)
        outs = [self.bufs[name][: self.tokens] for name in "qkv"]

        def fn() -> None:
            for out, t in zip(outs, layer.before_attention(cs, hv, rotary)):
                out.copy_(t)

        self._run((self.tokens, i, "before"), fn)
        return tuple(outs)

    def _after(self, layer, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Reads the hidden state from one of two buffers and writes the other (the next layer's input), so that
        replaying a graph twice gives the same result."""
        i = layer.self_attn.layer_id
        hv, av = self._load(f"h{i % 2}", h), self._load("attn", attn_out)
        out = self._buf(f"h{(i + 1) % 2}", hv)

        def fn() -> None:
            out.copy_(layer.after_attention(hv, av))

        self._run((self.tokens, i, "after"), fn)
        return out
