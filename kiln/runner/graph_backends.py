"""What the graph runner captures and replays, one backend per kind of step.

Decode: on CUDA a torch.cuda.CUDAGraph per batch size over static input buffers; on the CPU the step compiled by
torch.compile (inductor), batch size static, KV length dynamic. A batch pads up to its captured size with dummy
rows that write and read the reserved padding slot 0. Prefill: the layers' attention-free halves compiled per
token count ("pieces"); attention, whose shapes follow the batch's sequences, runs eagerly between them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.runner.forward_batch import ForwardBatch, ForwardMode, Pieces

# the KV length of the dummy decode batch used for capture (>= 2: a length of 1 would be specialised)
CAPTURE_KV_LEN = 64
# CUDA decode graphs gather every request's KV over a static table width; longer sequences run eagerly. The
# gathered K and V take bs x width x kv heads x head dim x 2 x dtype bytes per layer inside the graph pool.
CUDA_GRAPH_KV_WIDTH = 2048
DecodeInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


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


def decode_batch(inputs: DecodeInputs) -> ForwardBatch:
    ids, pos, loc, table, mask = inputs
    return ForwardBatch(
        ForwardMode.DECODE, ids, pos, loc, logits_index=None, kv_table=table, kv_mask=mask, shared_kv=False
    )


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


def _decode_step(model, ids, pos, loc, table, mask) -> torch.Tensor:
    return model(decode_batch((ids, pos, loc, table, mask)))


class CompiledDecode:
    """CPU: one torch.compile'd step; each batch size compiles its own static-batch code, KV length dynamic."""

    name = "inductor"

    def __init__(self, model, device: str):
        self.model, self.device = model, device
        self.fn = torch.compile(_decode_step, dynamic=False)

    def capture(self, bs: int) -> None:
        inputs = dummy_decode_inputs(bs, CAPTURE_KV_LEN, self.device)
        torch._dynamo.mark_dynamic(inputs[3], 1)
        torch._dynamo.mark_dynamic(inputs[4], 3)
        self.fn(self.model, *inputs)

    def replay(self, bs: int, fb: ForwardBatch) -> torch.Tensor:
        return self.fn(self.model, *pad_decode_inputs(fb, bs))


class CudaGraphDecode:
    """CUDA: static input buffers of the largest size and one CUDAGraph per batch size in one shared pool. The
    KV table has a static width; a batch with a longer sequence runs eagerly."""

    name = "full"

    def __init__(self, model, device: str, max_bs: int, kv_width: int):
        self.model, self.kv_width = model, kv_width
        self.buffers = dummy_decode_inputs(max_bs, kv_width, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _view(self, bs: int) -> DecodeInputs:
        return tuple(t[:bs] for t in self.buffers)  # type: ignore[return-value]

    def capture(self, bs: int) -> None:
        inputs = self._view(bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph: lazy initialisation must not be captured
                _decode_step(self.model, *inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bs] = _decode_step(self.model, *inputs)
        self.pool = graph.pool()
        self.graphs[bs] = graph

    def replay(self, bs: int, fb: ForwardBatch) -> torch.Tensor:
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
        self.graphs[bs].replay()
        return self.outputs[bs].clone()


# ---------------------------------------------------------------------------------------------- prefill
def dummy_extend_batch(tokens: int, device) -> ForwardBatch:
    """One fresh prompt of `tokens` tokens whose KV all goes to the padding slot 0."""
    slots = torch.zeros(tokens, dtype=torch.int64, device=device)
    return ForwardBatch(
        ForwardMode.EXTEND, slots.clone(), torch.arange(tokens, device=device), slots,
        logits_index=torch.tensor([tokens - 1], device=device), extend_lens=[tokens], prefix_lens=[0],
        seq_slots=[slots],
    )  # fmt: skip


class CompiledPrefill:
    """Prefill on pieces: per token count, the layers' attention-free halves compiled once for every layer."""

    name = "inductor-piecewise"

    def __init__(self, model, device: str):
        self.model, self.device = model, device
        layer = type(model.model.layers[0])
        self.before = torch.compile(layer.before_attention, dynamic=False)
        self.after = torch.compile(layer.after_attention, dynamic=False)

    def capture(self, tokens: int) -> None:
        self.model(dummy_extend_batch(tokens, self.device), Pieces(self.before, self.after, tokens))

    def replay(self, tokens: int, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb, Pieces(self.before, self.after, tokens))
