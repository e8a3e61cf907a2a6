"""Attention over the paged KV pool with Kiln's Triton kernels (kiln.layers.triton_attention): decode split-K over
each request's KV table, extend over each request's cached prefix and its own new tokens, all requests of a step in
one launch. `--attention-backend triton`; on CUDA the kernels compile for the GPU, elsewhere they run in Triton's
interpreter (TRITON_INTERPRET=1), which is how the CPU tests check them. Both take a layer's sliding window (decode
as its mask) and attention sinks (decode in the merge of its splits); softcapped scores attend through
kiln.runner.attention.windowed (AttentionBackend.forward)."""

from __future__ import annotations

from itertools import accumulate

import torch

from kiln.core.forward_batch import AttentionMetadata, ExtendSpans, ForwardBatch, ForwardMode
from kiln.layers import triton_attention
from kiln.memory.kv_pool import KVPool
from kiln.runner.attention import windowed
from kiln.runner.attention.base import AttentionBackend

# SGLang's --triton-attention-num-kv-splits default: the most chunks a decode row's KV is cut into
MAX_KV_SPLITS = 8
# a chunk of at least this many slots before a row is cut into more
SLOTS_PER_SPLIT = 256


class TritonBackend(AttentionBackend):
    """Decode reads each request's KV table row in place; extend reads each request's prefix slots in place and
    its new tokens as computed."""

    def __init__(self, kv_pool: KVPool, q_heads: int):
        if not triton_attention.available():
            raise ValueError("--attention-backend triton needs Triton: `pip install triton`")
        triton_attention.check_runnable("--attention-backend triton")
        super().__init__(kv_pool, q_heads)
        # (a step's mask, its (version, capturing) key, its row_ends): see _row_ends
        self._ends: tuple[torch.Tensor, tuple, torch.Tensor] | None = None

    def prepare_metadata(self, fb: ForwardBatch) -> AttentionMetadata:
        if fb.mode == ForwardMode.DECODE:
            width = fb.kv_table.shape[1]
            return AttentionMetadata(
                kv_splits=triton_attention.decode_splits(width, MAX_KV_SPLITS, SLOTS_PER_SPLIT)
            )
        device = fb.input_ids.device
        prefixes = [slots[:prefix] for slots, prefix in zip(fb.seq_slots, fb.prefix_lens)]

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        spans = ExtendSpans(
            prefix_slots=torch.cat(prefixes) if prefixes else ints([]),
            prefix_start=ints(list(accumulate(fb.prefix_lens, initial=0))[:-1]),
            prefix_lens=ints(fb.prefix_lens),
            ext_start=ints(list(accumulate(fb.extend_lens, initial=0))[:-1]),
            ext_lens=ints(fb.extend_lens),
            max_ext=max(fb.extend_lens, default=0),
        )
        return AttentionMetadata(spans=spans)

    def graph_metadata(self, shared_prefix: int | torch.Tensor = 0) -> AttentionMetadata:
        """A captured step's rows are cut into the most chunks: the table's width is not known at capture."""
        return AttentionMetadata(kv_splits=MAX_KV_SPLITS)

    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K and V in one kernel, read out of the step's q/k/v as they lie."""
        if not triton_attention.store_kv(self.kv_pool.k[layer], self.kv_pool.v[layer], slots, k, v):
            super().write_kv(layer, slots, k, v)

    def decode(
        self, layer: int, q: torch.Tensor, fb: ForwardBatch, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        b, width = fb.kv_table.shape
        mask = fb.kv_mask.reshape(b, width) if fb.kv_mask is not None else None
        k, v = self.kv_pool.k[layer], self.kv_pool.v[layer]
        return triton_attention.decode_attention(
            q, k, v, fb.kv_table, mask, scale, meta.kv_splits, ends=self._row_ends(fb.kv_mask, mask)
        )

    def extend_windowed(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        scale: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The extend kernel with the layer's window and sinks; softcapped scores it does not compute."""
        if softcap is not None or fb.attn is None or fb.attn.spans is None:
            return super().extend_windowed(layer, q, k, v, fb, scale, window, softcap, sinks)
        s = fb.attn.spans
        return triton_attention.extend_attention(
            q, k, v, self.kv_pool.k[layer], self.kv_pool.v[layer], s.prefix_slots, s.prefix_start,
            s.prefix_lens, s.ext_start, s.ext_lens, s.max_ext, scale, window=window, sinks=sinks,
        )  # fmt: skip

    def decode_windowed(
        self,
        layer: int,
        q: torch.Tensor,
        fb: ForwardBatch,
        scale: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The split-K kernel over each row's last `window` slots (the mask narrowed) and with the layer's sinks;
        softcapped scores it does not compute."""
        if softcap is not None or fb.attn is None:
            return super().decode_windowed(layer, q, fb, scale, window, softcap, sinks)
        mask = windowed.decode_mask(fb, window)
        k, v = self.kv_pool.k[layer], self.kv_pool.v[layer]
        return triton_attention.decode_attention(
            q,
            k,
            v,
            fb.kv_table,
            mask,
            scale,
            fb.attn.kv_splits,
            ends=triton_attention.row_ends(mask),
            sinks=sinks,
        )

    def _row_ends(self, step_mask: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The step's row ends, computed by its first layer and read by the rest: the step's mask is the same
        tensor for every layer. Computed anew for another mask, for this one written in place since (another
        version; an inference tensor keeps none), and for a graph capture, which must record the computation to
        replay it."""
        if mask is None:
            return None
        version = None if step_mask.is_inference() else step_mask._version
        capturing = step_mask.is_cuda and torch.cuda.is_current_stream_capturing()
        key = (version, capturing)
        if self._ends is None or self._ends[0] is not step_mask or self._ends[1] != key:
            self._ends = (step_mask, key, triton_attention.row_ends(mask))
        return self._ends[2]

    def extend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        s = meta.spans
        return triton_attention.extend_attention(
            q, k, v, self.kv_pool.k[layer], self.kv_pool.v[layer], s.prefix_slots, s.prefix_start,
            s.prefix_lens, s.ext_start, s.ext_lens, s.max_ext, scale,
        )  # fmt: skip
