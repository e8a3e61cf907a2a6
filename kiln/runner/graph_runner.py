"""The graph runner: decode steps at fixed batch sizes and prefills at fixed token counts, captured once at
startup and replayed.

Apart from the model runner, it only calls the model, through the backends of graph_backends.py (CUDA graphs or
compiled steps for decode; for prefill, CUDA graphs or compiled code for each layer's attention-free pieces).
Compiled code is cached on disk so that a second start reuses it. Shapes are captured largest first, prefill before
decode. A batch pads up to the next captured shape (decode: dummy rows at the reserved padding slot 0; prefill:
rows attention never sees, at most 2x); larger batches and, on the CPU, shapes whose compiled code measured slower
than eager run eagerly.

Under speculative decoding the target's verify step is a decode batch of num_draft_tokens rows per request, so
the verify shapes (each captured batch size x num_draft_tokens rows, as SGLang captures its target verify graph;
on CUDA only those within the largest decode graph's rows) are captured with the decode ones, on the same step; a
draft model's or head's decode steps are captured the same way with role="draft". Every captured decode step hands
out the hidden states the model keeps for a draft, which the graph runner returns with the logits.

A draft head's catch-up after a verify (1 + the accepted drafts of each request) runs as decode rows too, one row
per token: its "extend" shapes (SGLang's draft extend graph, num_steps + 1 tokens per request) are captured on a
decode backend of their own, since a catch-up's features are the target's hidden states, not the head's own. A
batch runs on the shapes captured for its features' width.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.core.graph_shapes import (
    CUDA_GRAPH_KV_WIDTH,
    bucket_for,
    catch_up_rows,
    prefill_bucket_for,
    verify_rows,
)
from kiln.core.units import gib
from kiln.layers.lora import LoraBatch
from kiln.memory.kv_pool import token_bytes
from kiln.platform import available_gb, available_memory_bytes, used_memory_bytes
from kiln.runner.attention import AttentionBackend
from kiln.runner.compiler import (
    capture_window,
    compile_cache_counts,
    configure_compiler,
)
from kiln.runner.graph_backends import (
    CAPTURE_KV_LEN,
    BreakablePrefill,
    CompiledDecode,
    CompiledPrefill,
    CudaGraphDecode,
    LogitsRows,
    StepOutput,
    decode_batch,
    dummy_decode_inputs,
    dummy_extend_batch,
    dummy_features,
    feature_width,
    keeps_hidden,
    takes_features,
)
from kiln.runner.graph_payoff import PayoffStore

logger = logging.getLogger("kiln")

# a compiled CPU shape measured slower than eager by more than this factor at capture is dropped (it runs
# eagerly); within it, timing drift on a shared host would decide
MAX_SLOWDOWN = 1.05


class GraphReplayError(RuntimeError):
    """A captured shape failed to run a batch it was chosen for."""


@dataclass
class ShapeRecord:
    """One captured shape (decode batch size or prefill token count): time, memory, and whether it pays."""

    size: int
    seconds: float
    mem_bytes: int
    graph_ms: float | None = None
    eager_ms: float | None = None
    kept: bool = True
    cache_hit: bool = False  # CPU: the compiled code came from the on-disk cache, nothing was compiled
    timed_earlier: bool = False  # CPU: graph_ms / eager_ms are an earlier start's, saved with the cached code


# ---------------------------------------------------------------------------------------------- the runner
@dataclass
class Phase:
    """Decode, verify, a draft head's catch-up ("extend") or prefill: its sizes, its backend and what was
    captured. Verify and catch-up sizes are decode batches of `tokens_per_req` rows per request, counted in rows;
    they run on a decode backend."""

    name: str
    sizes: list[int]  # every size asked for, ascending: a batch's bucket is chosen among these
    backend: CompiledDecode | CudaGraphDecode | CompiledPrefill | BreakablePrefill
    unit: str  # "bs" | "num_tokens"
    records: dict[int, ShapeRecord]
    seconds: float = 0.0
    mem_bytes: int = 0
    tokens_per_req: int = 1

    @property
    def captured(self) -> list[int]:
        return sorted(s for s, r in self.records.items() if r.kept)

    @property
    def is_decode(self) -> bool:
        """Its shapes are decode steps (decode, verify or catch-up rows), run on a decode backend."""
        return self.name != "prefill"

    @property
    def is_extend(self) -> bool:
        """Its shapes are a draft's catch-ups: a draft model's on prefill pieces, a head's as decode rows."""
        return self.name in ("prefill", "extend")

    def shape(self, size: int) -> str:
        """A shape as logs and progress name it: "bs=2", "num_tokens=64", a verify's "bs=2, num_tokens=8"."""
        if self.is_decode and self.tokens_per_req > 1:
            return f"bs={size // self.tokens_per_req}, num_tokens={size}"
        return f"{self.unit}={size}"

    def sizes_text(self) -> str:
        """The begin line's list, in SGLang's words."""
        if self.name == "prefill":
            return f"num_tokens={self.sizes}"
        batches = [s // self.tokens_per_req for s in self.sizes]
        return f"num_tokens_per_req={self.tokens_per_req}, bs={batches}"

    def summary(self) -> dict:
        return {
            "backend": self.backend.name,
            "sizes": self.sizes,
            "tokens_per_req": self.tokens_per_req,
            "captured": self.captured,
            "capture_seconds": round(self.seconds, 3),
            "capture_bytes": self.mem_bytes,
            "shapes": [vars(r) for r in sorted(self.records.values(), key=lambda r: r.size)],
        }


def shared_kv_runs_eagerly(fb: ForwardBatch, backend, kv_token_bytes: int) -> bool:
    """Whether a decode batch whose rows mostly read the same slots runs eagerly rather than on a captured step
    that gathers each row's KV: when the rows it gathers again cost more than the replay saves (the backend's
    shared_gather_limit, in bytes: none on the CPU, where compiled steps save little; on CUDA, what eager launches
    cost). kv_token_bytes: one token's KV over every layer."""
    if fb.kv_table.shape[0] == 1 or backend.reads_shared_prefix_once or not fb.attn.mostly_shared:
        return False
    return fb.attn.repeated_entries * kv_token_bytes > backend.shared_gather_limit


class GraphRunner:
    """Captures the prefill token counts and decode batch sizes at startup; runs a batch on the shape that fits."""

    def __init__(
        self,
        model,
        device: str,
        batch_sizes: list[int],
        prefill_tokens: list[int] | None = None,
        kv_width: int = 0,
        cache_dir: str | None = None,
        *,
        attn_backend: AttentionBackend,
        role: str = "target",
        verify_tokens_per_req: int = 0,
        decode_tokens_per_req: int = 1,
        catch_up_tokens_per_req: int = 0,
        lora: LoraBatch | None = None,
    ):
        """attn_backend: the attention backend the model runs with (the model runner's); role: "target", or
        "draft" for a speculative draft model or head (SGLang's draft capture log lines); verify_tokens_per_req:
        under speculative decoding, the rows a verify step gives each request (num_draft_tokens; 0: none);
        decode_tokens_per_req: the rows a decode step gives each request (a tree draft's topk branches);
        catch_up_tokens_per_req: a draft head's, the most tokens a catch-up gives a request (0: none captured);
        lora: the LoRA layers' shared batch when adapters are served (a shape's payoff is measured with it mixed)."""
        self.model, self.device, self.role, self.lora = model, device, role, lora
        self.attn = attn_backend
        self.kv_token_bytes = token_bytes([*attn_backend.kv_pool.k, *attn_backend.kv_pool.v])
        self.cuda = device.startswith("cuda")
        eager_only = getattr(model, "eager_only", None)
        if eager_only:  # nothing captured: every batch runs eagerly
            logger.info(f"Graph capture is off for {type(model).__name__}: {eager_only}; it runs eagerly.")
            batch_sizes, prefill_tokens = [], []
        decode_rows = sorted({bs * decode_tokens_per_req for bs in batch_sizes})
        # CUDA: within the rows of the largest decode graph, whose buffers (a static KV width per row) the
        # ledger's graph reserve counts; the CPU's compiled steps hold no buffers that grow with the rows
        most = max(decode_rows, default=0) if self.cuda else None
        verify = [r for r in verify_rows(batch_sizes, verify_tokens_per_req, most) if r not in decode_rows]
        catch_up = []
        if catch_up_tokens_per_req:
            # a head's catch-ups; on CUDA within the largest batch's rows, as the verify rows: the graphs' static
            # buffers and gathered K / V grow with the rows, and the ledger counts them at that size
            largest = max(batch_sizes, default=0) if self.cuda else None
            catch_up = catch_up_rows(batch_sizes, catch_up_tokens_per_req, largest)
        shapes = len(decode_rows) + len(verify) + len(catch_up) + len(prefill_tokens or [])
        configure_compiler(cache_dir, shapes)
        self.phases: dict[str, Phase] = {}
        if prefill_tokens:
            prefill = (
                BreakablePrefill(model, self.attn, device)
                if self.cuda
                else CompiledPrefill(model, self.attn, device)
            )
            self.phases["prefill"] = Phase("prefill", sorted(prefill_tokens), prefill, "num_tokens", {})
        if decode_rows:
            decode = self._decode_backend(max(decode_rows + verify), kv_width, feature_width(model))
            if verify:  # the larger shapes first, as SGLang captures them: graphs share their pool better
                self.phases["verify"] = Phase(
                    "verify", verify, decode, "bs", {}, tokens_per_req=verify_tokens_per_req
                )
            self.phases["decode"] = Phase(
                "decode", decode_rows, decode, "bs", {}, tokens_per_req=decode_tokens_per_req
            )
        if catch_up:  # after the draft's decode steps, as SGLang captures its draft extend graph
            # the target's hidden states in; logits at each request's last token only
            features, logits_rows = feature_width(model, catch_up=True), LogitsRows(catch_up_tokens_per_req)
            backend = self._decode_backend(max(catch_up), kv_width, features, logits_rows)
            self.phases["extend"] = Phase(
                "extend", catch_up, backend, "bs", {}, tokens_per_req=catch_up_tokens_per_req
            )
        self.beyond_width = 0  # decode batches a CUDA graph's static KV width could not hold: run eagerly
        self.payoff = PayoffStore(cache_dir, model) if not self.cuda and self.phases else None

    def _decode_backend(
        self, rows: int, kv_width: int, features: int | None, logits_rows: LogitsRows | None = None
    ) -> CompiledDecode | CudaGraphDecode:
        """A decode backend for batches of up to `rows` rows taking features `features` wide (None: none)."""
        if self.cuda:
            width = min(kv_width, CUDA_GRAPH_KV_WIDTH)
            return CudaGraphDecode(
                self.model, self.device, rows, width, features=features, logits_rows=logits_rows
            )
        return CompiledDecode(self.model, self.attn, self.device, features=features, logits_rows=logits_rows)

    @property
    def kind(self) -> str:
        return "CUDA" if self.cuda else "CPU"

    @property
    def capture_bytes(self) -> int:
        return sum(p.mem_bytes for p in self.phases.values())

    def captured(self, phase: str = "decode") -> list[int]:
        return self.phases[phase].captured if phase in self.phases else []

    def capture(self, on_progress: Callable[[dict], None] | None = None) -> None:
        """Prefill first, then decode; each largest first with gc frozen, reporting (i of n, shape, avail mem),
        inside the compiler's capture window (compiler.capture_window: afterwards a new compile raises)."""
        gc.collect()
        gc.freeze()
        try:
            with capture_window(), torch.inference_mode():
                for phase in self.phases.values():
                    self._capture_phase(phase, on_progress)
        finally:
            gc.unfreeze()

    def _capture_phase(self, phase: Phase, on_progress) -> None:
        from tqdm.auto import tqdm

        sizes = sorted(phase.sizes, reverse=True)
        t0, mem0 = time.perf_counter(), used_memory_bytes(self.device)
        avail_mem = gib(available_memory_bytes(self.device))
        extend = " extend" if phase.is_extend else ""
        if self.role == "draft":  # SGLang's wording, which operators watch for after the target's capture
            logger.info(
                f"Capture draft{extend} {self.kind.lower()} graph begin. This can take up to several minutes. "
                f"avail mem={avail_mem}, backend={phase.backend.name}, {phase.sizes_text()}"
            )
        else:
            logger.info(
                f"Capture target {phase.name} {self.kind} graph begin. backend={phase.backend.name}, "
                f"{phase.sizes_text()}, avail mem={avail_mem}"
            )
        label = phase.name if self.role == "target" else f"{self.role} {extend.strip() or phase.name}"
        desc = "Capturing " + ("draft " if self.role == "draft" else "")
        desc += "batches" if phase.is_decode else "num tokens"
        bar = tqdm(sizes, desc=desc, leave=False)
        for i, size in enumerate(bar):
            avail = available_gb(self.device)
            bar.set_description(f"{desc} ({phase.shape(size)} avail_mem={avail:.2f} GiB)")
            if on_progress:
                on_progress({"graph": label, "shape": phase.shape(size), "done": i, "total": len(sizes),
                             "avail_mem_gb": round(avail, 2)})  # fmt: skip
            phase.records[size] = self._capture_one(phase, size)
        phase.seconds, phase.mem_bytes = (
            time.perf_counter() - t0,
            max(0, used_memory_bytes(self.device) - mem0),
        )
        if self.role == "draft":
            logger.info(
                f"Capture draft{extend} {self.kind.lower()} graph end. Time elapsed: {phase.seconds:.2f} s. "
                f"mem usage={gib(phase.mem_bytes)}. avail mem={gib(available_memory_bytes(self.device))}."
            )
            return
        logger.info(
            f"Capture target {phase.name} {self.kind} graph end. elapsed={phase.seconds:.2f} s, "
            f"mem usage={gib(phase.mem_bytes)}, avail mem={gib(available_memory_bytes(self.device))}."
        )

    def _capture_one(self, phase: Phase, size: int) -> ShapeRecord:
        t0, mem0, cache0 = time.perf_counter(), used_memory_bytes(self.device), compile_cache_counts()
        phase.backend.capture(size)
        rec = ShapeRecord(size, time.perf_counter() - t0, max(0, used_memory_bytes(self.device) - mem0))
        hits, misses = (now - before for now, before in zip(compile_cache_counts(), cache0))
        rec.cache_hit = hits > 0 and misses == 0
        if phase.backend.compiled:
            self._measure_payoff(phase, rec)
        return rec

    def _measure_payoff(self, phase: Phase, rec: ShapeRecord) -> None:
        """Time the compiled shape against eager on a dummy batch; one measurably slower than eager (by more than
        MAX_SLOWDOWN) is dropped. Code loaded from the cache reuses the times measured when it was compiled."""
        if phase.is_decode:
            inputs = dummy_decode_inputs(rec.size, CAPTURE_KV_LEN, self.device)
            index = phase.backend.logits_rows.index(rec.size, self.device)
            fb = decode_batch(inputs, self.attn.graph_metadata(), index)
        else:
            fb = dummy_extend_batch(rec.size, self.device, self.attn)
        if takes_features(self.model):  # a draft head: both runs read the features handed to it
            rows = rec.size if phase.is_decode else 1
            width = phase.backend.feature_width if phase.is_decode else feature_width(self.model)
            self.model.set_features(dummy_features(self.model, rows, self.device, width))
        earlier = self.payoff.get(phase.name, rec.size) if rec.cache_hit else None
        if self.lora is not None and phase.is_decode:
            # a mixed batch, every slot present: the compiled step always runs the dense delta, while eager skips
            # it for a base batch; timed on the base, a shape could be kept that does not pay for LoRA batches
            self.lora.set_rows(torch.arange(rec.size) % self.lora.num_slots)
        try:
            if earlier is not None:
                phase.backend.replay(rec.size, fb)  # the loaded code runs once before serving
                (rec.graph_ms, rec.eager_ms), rec.timed_earlier = earlier, True
            else:
                rec.graph_ms, rec.eager_ms = _time_pair(
                    lambda: phase.backend.replay(rec.size, fb), lambda: self.model(fb)
                )
                self.payoff.put(phase.name, rec.size, rec.graph_ms, rec.eager_ms)
        finally:
            if self.lora is not None:
                self.lora.set_rows(None)
        rec.kept = rec.graph_ms <= rec.eager_ms * MAX_SLOWDOWN
        verdict = "kept" if rec.kept else f"does not pay: this {phase.name} shape runs eagerly"
        hit = " (cache hit)" if rec.cache_hit else ""
        when = ", as measured when it was compiled" if rec.timed_earlier else ""
        logger.info(
            f"Compiled {phase.name} {phase.shape(rec.size)} in {rec.seconds:.1f} s{hit}: {rec.graph_ms:.1f} ms "
            f"vs eager {rec.eager_ms:.1f} ms ({rec.eager_ms / rec.graph_ms:.2f}x{when}), {verdict}"
        )

    def _decode_shape(self, fb: ForwardBatch) -> tuple[Phase | None, int | None]:
        """The decode, verify or catch-up shape a decode batch pads up to, among those captured for the width of
        the features the model was handed (a head's own or the target's; none for other models)."""
        features = getattr(self.model, "features", None) if takes_features(self.model) else None
        width = None if features is None else features.shape[-1]
        best: tuple[Phase, int] | None = None
        for phase in self.phases.values():
            if not phase.is_decode or phase.backend.feature_width != width:
                continue
            rows = phase.backend.logits_rows.rows_for(fb)  # a catch-up's shapes are sized by its requests
            size = bucket_for(phase.sizes, rows) if rows else None
            if size is not None and (best is None or size < best[1]):
                best = phase, size
        if best is None:
            return None, None
        phase, size = best
        width = getattr(phase.backend, "kv_width", None)  # CUDA graphs read a KV table of a static width
        if width is not None and fb.kv_table.shape[1] > width:
            self.beyond_width += 1
            return None, None
        if shared_kv_runs_eagerly(fb, phase.backend, self.kv_token_bytes):
            return None, None  # the eager path reads KV shared by the batch once: it wins there
        return phase, size

    def try_run(self, fb: ForwardBatch) -> StepOutput | None:
        """Logits of the batch from its captured shape, and the hidden states the model keeps for a draft (None
        when it keeps none); None when the batch runs eagerly by design (no shape holds it, a shape that does not
        pay, KV past a CUDA graph's width, a shared prefix eager reads once, a LoRA batch whose eager delta is
        cheaper than the compiled step's dense one). A captured shape that fails to run
        a batch it was chosen for raises GraphReplayError naming the shape: running it eagerly instead would hide
        a broken graph behind a slower server."""
        if fb.mode == ForwardMode.DECODE:
            if self.lora is not None and not self.lora.compiled_pays():
                return None  # the eager step skips the delta, or takes the grouped form: cheaper (LoraBatch)
            phase, size = self._decode_shape(fb)
        else:
            phase = self.phases.get("prefill")
            size = prefill_bucket_for(phase.sizes, int(fb.input_ids.shape[0])) if phase else None
        rec = phase.records.get(size) if phase is not None and size is not None else None
        if rec is None or not rec.kept:
            return None
        try:
            out = phase.backend.replay(size, fb)
        except Exception as e:
            rows = fb.batch_size if phase.is_decode else int(fb.input_ids.shape[0])
            raise GraphReplayError(
                f"the {phase.name} graph {phase.shape(size)} failed to run a batch of {rows} "
                f"({phase.backend.name}): {e!r}; --disable-cuda-graph runs every step eagerly"
            ) from e
        if not phase.is_decode:  # prefill pieces: the model's own forward kept its hidden states
            return out, self.model.last_hidden if keeps_hidden(self.model) else None
        return out  # the decode backends hand out the rows the eager forward would

    def summary(self) -> dict:
        return {name: phase.summary() for name, phase in self.phases.items()}


def _time_pair(
    graph: Callable, eager: Callable, budget_s: float = 2.0, most: int = 10
) -> tuple[float, float]:
    """Median ms of two callables, alternating call by call so drift of a shared host hits both alike; after two
    warm-up rounds, as many rounds (3 to `most`) as fit in about budget_s."""
    times: tuple[list[float], list[float]] = ([], [])
    rounds, i = 2 + most, 0
    while i < rounds:
        for out, f in zip(times, (graph, eager)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
        if i == 1:  # warm-up done: size the measured rounds by what one round costs
            rounds = 2 + max(3, min(most, int(budget_s / (times[0][-1] + times[1][-1]))))
        i += 1
    return statistics.median(times[0][2:]) * 1e3, statistics.median(times[1][2:]) * 1e3
