"""LoRA on the linear layers: a fixed pool of adapter slots per projection, and the delta each batch row adds
under its own adapter (a segmented gathered matmul over the batch's slot ids).

Every LoRA'd projection holds A [slots, n x max_rank, in] (its n sub-projections' A stacked: q, k, v of a merged
qkv; gate, up of gate_up; one otherwise) and one B [slots, max_rank, out_i] per sub-projection, zero where an
adapter's rank is below the max or an adapter leaves the projection out, so a row computes
y += scaling[slot] * (x A[slot]^T) B[slot] whatever its adapter's rank and targets. A row of slot -1 is the base
model's and adds nothing. The slot ids and per-slot scalings live in one LoraBatch every LoRA'd layer shares: the
model runner writes them in place before each forward, so the layers' inputs keep their addresses from step to
step (what a captured graph needs).

Two ways to compute the delta on torch (chosen per batch), Triton kernels on CUDA (kiln.layers.triton_lora):
- dense: one GEMM against every slot's A, a per-row mask that keeps the row's own slot (scaled), one GEMM against
  every slot's B. No data-dependent shapes: the form a compiled (captured) CPU decode step always runs, whatever
  the batch's adapters; it costs slots x rank columns per row.
- grouped: the rows of each slot present gathered and multiplied by that slot's A and B alone: the work of the
  adapters present only, but a loop over them decided on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.core.sharding import kv_heads_per_rank

# the target modules Kiln serves, in PEFT's names; a merged projection's parts are its sub-projections
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = ("o_proj", "down_proj")  # their input is split across ranks; the others' output is


@dataclass(frozen=True)
class PartShard:
    """One rank's share of a sub-projection's LoRA weights, as the base weight is split (kiln.layers.linear): a
    column-parallel part keeps B's rows [out_start, + out_size) and all of A; a row-parallel one A's columns
    [in_start, + in_size) and all of B (its partial delta is summed by the layer's all-reduce)."""

    in_start: int
    in_size: int
    out_start: int
    out_size: int


def part_shard(
    module: str, shape: tuple[int, int], num_kv_heads: int, head_dim: int, tp: int, rank: int
) -> PartShard:
    in_f, out_f = shape
    if module in ROW_PARALLEL:
        return PartShard(rank * (in_f // tp), in_f // tp, 0, out_f)
    if module in ("k_proj", "v_proj"):  # kv heads replicated when there are more ranks than heads
        size = kv_heads_per_rank(num_kv_heads, tp) * head_dim
        return PartShard(0, in_f, rank // max(1, tp // num_kv_heads) * size, size)
    return PartShard(0, in_f, rank * (out_f // tp), out_f // tp)


@dataclass
class LoraBatch:
    """What every LoRA'd layer reads about the batch: each row's slot (-1: the base model) and each slot's scaling.
    Buffers of fixed size written in place (set_rows), so their addresses stay put."""

    num_slots: int
    max_rank: int
    max_rows: int
    device: str | torch.device = "cpu"
    # torch (dense or grouped, whichever the batch makes cheaper) | dense | grouped | triton
    method: str = "torch"
    rows: int = 0  # the current batch's row count
    slot_ids: torch.Tensor = field(init=False)
    scaling: torch.Tensor = field(init=False)
    # the host's view of the current batch: each slot present and its rows (grouped); None when all rows are base
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slot_ids = torch.full((self.max_rows,), -1, dtype=torch.int64, device=self.device)
        self.scaling = torch.zeros(self.num_slots, dtype=torch.float32, device=self.device)

    def set_rows(self, slots: torch.Tensor | None) -> None:
        """The batch's per-row slot ids (None: every row is the base model's)."""
        self.slot_ids.fill_(-1)
        if slots is None or slots.numel() == 0:
            self.rows, self.groups = 0, []
            return
        n = int(slots.shape[0])
        if n > self.max_rows:  # a batch larger than planned: the buffer grows (eager steps only)
            self.max_rows = n
            self.slot_ids = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        self.slot_ids[:n].copy_(slots, non_blocking=True)
        self.rows = n
        host, self.groups = slots.cpu(), []
        # the Triton kernels read the slots on the device; the torch forms group the rows on the host
        if self.method != "triton":
            self.groups = [
                (int(s), (host == s).nonzero().flatten().to(self.device)) for s in host.unique() if s >= 0
            ]

    def any_adapter(self) -> bool:
        return bool(self.groups)

    def compiled_pays(self) -> bool:
        """Whether a compiled decode step should run this batch: it always runs the dense form over every slot
        (add_delta), which only beats the eager step where that would run the dense form too; a batch of the base
        alone or of few adapters runs eagerly, skipping the delta or taking the grouped form (docs/benchmarks.md:
        on the CPU the base on a LoRA server ran at 0.83x compiled against 1.13x eager, one adapter 0.70x against
        0.82x, sixteen 0.80x against 0.67x)."""
        return self.any_adapter() and self.torch_form() == "dense"

    def torch_form(self) -> str:
        """dense or grouped for this batch. Under "torch" the cheaper one (measured on the CPU, docs/benchmarks.md):
        grouped does only the adapters present, but pays a gather and two small GEMMs per adapter, which the
        dense form's one GEMM beats once a short batch holds more than half the slots' adapters."""
        if self.method != "torch":
            return self.method
        return "dense" if self.rows < 128 and 2 * len(self.groups) > self.num_slots else "grouped"


class LoraWeights:
    """One projection's slots: A [S, n x R, in] and B_i [S, R, out_i] for each of its n sub-projections, whose
    outputs are columns [offset_i, offset_i + out_i) of the projection's output."""

    def __init__(
        self,
        batch: LoraBatch,
        in_features: int,
        parts: list[tuple[str, int, int]],
        dtype: torch.dtype,
        device: str | torch.device,
    ):
        """parts: (PEFT module name, output offset, output size) of each sub-projection, on this rank."""
        s, r = batch.num_slots, batch.max_rank
        self.batch = batch
        self.parts = parts
        self.in_features = in_features
        self.a = torch.zeros(s, len(parts) * r, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(s, r, size, dtype=dtype, device=device) for _, _, size in parts]

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + sum(b.nbytes for b in self.b)

    def write(self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot`'s sub-projection `part`: a [r, in] and b [out, r] as PEFT saves them (None: the adapter
        leaves it out), zero-padded to the max rank."""
        r = self.batch.max_rank
        rows = self.a[slot, part * r : (part + 1) * r]
        rows.zero_()
        self.b[part][slot].zero_()
        if a is None or b is None:
            return
        rank = a.shape[0]
        rows[:rank].copy_(a)
        self.b[part][slot, :rank].copy_(b.t())

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each row's adapter delta (y is updated in place where it can be, and returned)."""
        batch = self.batch
        if torch.compiler.is_compiling():
            # a compiled (captured) step: the dense form from the fixed buffers whatever the batch's adapters, its
            # padded and base rows (slot -1) adding nothing. Nothing here reads the host's view of the batch
            # (groups, rows), so dynamo has no Python state to guard on: a new mix of adapters does not recompile
            x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
            return lora_delta_dense(x2, y2, self).view(y.shape)
        if batch.method == "triton":
            from kiln.layers.triton_lora import lora_delta_triton

            return lora_delta_triton(x, y, self)
        if not batch.any_adapter():
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        if batch.torch_form() == "grouped":
            y2 = lora_delta_grouped(x2, y2, self)
        else:
            y2 = lora_delta_dense(x2, y2, self)
        return y2.view(y.shape)


def lora_delta_dense(x: torch.Tensor, y: torch.Tensor, w: LoraWeights) -> torch.Tensor:
    """Every slot's A at once, each row masked to its own slot's columns (scaled), then every slot's B at once."""
    batch = w.batch
    t, s, r, n = x.shape[0], batch.num_slots, batch.max_rank, len(w.parts)
    slots = batch.slot_ids[:t]
    keep = (slots.unsqueeze(1) == torch.arange(s, device=x.device)).to(x.dtype)  # [T, S]
    keep = keep * batch.scaling.to(x.dtype)
    xa = (x @ w.a.view(s * n * r, -1).t()).view(t, s, n, r) * keep.view(t, s, 1, 1)
    for i, (_, offset, size) in enumerate(w.parts):
        y[:, offset : offset + size] += xa[:, :, i, :].reshape(t, s * r) @ w.b[i].view(s * r, size)
    return y


def lora_delta_grouped(x: torch.Tensor, y: torch.Tensor, w: LoraWeights) -> torch.Tensor:
    """The rows of each slot present, gathered, through that slot's A and B alone."""
    batch = w.batch
    r = batch.max_rank
    for slot, rows in batch.groups:
        xa = (x.index_select(0, rows) @ w.a[slot].t()) * batch.scaling[slot].to(x.dtype)
        for i, (_, offset, size) in enumerate(w.parts):
            delta = xa[:, i * r : (i + 1) * r] @ w.b[i][slot]
            y[rows, offset : offset + size] += delta
    return y


def lora_delta_reference(x: torch.Tensor, slot_ids: list[int], w: LoraWeights) -> torch.Tensor:
    """The delta row by row in float64, for tests: what every method must compute."""
    r, out = w.batch.max_rank, torch.zeros(x.shape[0], sum(p[2] for p in w.parts), dtype=torch.float64)
    for row, slot in enumerate(slot_ids):
        if slot < 0:
            continue
        xa = x[row].double() @ w.a[slot].double().t() * float(w.batch.scaling[slot])
        for i, (_, offset, size) in enumerate(w.parts):
            out[row, offset : offset + size] = xa[i * r : (i + 1) * r] @ w.b[i][slot].double()
    return out
