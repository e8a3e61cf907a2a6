"""The contract every attention backend keeps with the model runner, the graph runner and the model's layers.

A backend states what it supports in class attributes instead of being steered by fields preset on the batch,
works out the batch's attention metadata once per step (prepare_metadata, before graphs or the model run), gives
captured and compiled steps a static version of it (graph_metadata), and attends in every layer reading only that
metadata (forward)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kiln.core.forward_batch import AttentionMetadata, ForwardBatch, ForwardMode
from kiln.memory.kv_pool import KVPool
from kiln.memory.window_pool import WindowPool
from kiln.runner.attention import windowed


class AttentionBackend(ABC):
    # a decode batch's shared prefix is read once per chunk of requests, in compiled steps too (where it is an
    # input of the step): the graph runner need not send mostly-shared batches to the eager path
    reads_shared_prefix_once: ClassVar[bool] = False
    # short extends on cached prefixes (a question after a shared system prompt) run as decode rows
    runs_short_extends: ClassVar[bool] = False

    def __init__(self, kv_pool: KVPool, q_heads: int):
        """q_heads: query heads per rank; the KV pool holds the KV heads per rank. Their ratio, the GQA group, is
        fixed for the model, so it is worked out here once rather than in every layer."""
        self.kv_pool = kv_pool
        # a hybrid sliding-window model's rings: its windowed layers attend over them, not the token pool
        self.rings: WindowPool | None = None
        kv_heads = kv_pool.k[0].shape[1] if kv_pool.k else 1
        self.group = max(1, q_heads // kv_heads)

    @abstractmethod
    def prepare_metadata(self, fb: ForwardBatch) -> AttentionMetadata:
        """The batch's attention metadata, worked out once per step from its KV table or sequences."""

    def graph_metadata(self, shared_prefix: int | torch.Tensor = 0) -> AttentionMetadata:
        """The metadata of a captured or compiled decode step: static, with no data-dependent slot sets; only the
        shared prefix, an input of the step, may change from replay to replay."""
        return AttentionMetadata(shared_prefix=shared_prefix)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] for the new tokens, written to the pool first. Returns [T, Hq * D].
        The layer's own attention: `window`, a sliding window (each query sees its last `window` keys, itself
        included); `softcap`, scores capped as cap x tanh(scores / cap) before the mask and the softmax; `sinks`
        [Hq], a logit per head in every row's softmax whose share goes to no key. A layer with any of them runs
        through kiln.runner.attention.windowed, the others through the backend's own paths."""
        meta = fb.attn
        if meta is None:
            raise ValueError(
                "the batch has no attention metadata: prepare_metadata builds it before the model runs"
            )
        if window is not None and self.rings is not None:  # `layer`: the layer's index among the windowed
            if fb.mode == ForwardMode.DECODE:
                out = windowed.ring_decode(self.rings, layer, q, k, v, fb, scale, softcap, sinks)
            else:
                out = windowed.ring_extend(self.rings, layer, q, k, v, fb, scale, window, softcap, sinks)
            return out.reshape(q.shape[0], -1)
        self.write_kv(layer, fb.out_cache_loc, k, v)
        if window is not None or softcap is not None or sinks is not None:
            if fb.mode == ForwardMode.DECODE:
                out = self.decode_windowed(layer, q, fb, scale, window, softcap, sinks)
            else:
                out = self.extend_windowed(layer, q, k, v, fb, scale, window, softcap, sinks)
        elif fb.mode == ForwardMode.DECODE:
            out = self.decode(layer, q, fb, meta, scale)
        else:
            out = self.extend(layer, q, k, v, fb, meta, scale)
        return out.reshape(q.shape[0], -1)

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
        """An extend over a sliding window, with softcapped scores or sinks: [T, Hq, D] -> [T, Hq, D], in torch ops
        (a backend whose kernel runs some of these overrides it)."""
        return windowed.extend(self.kv_pool, layer, q, k, v, fb, scale, window, softcap, sinks)

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
        """A decode over a sliding window, with softcapped scores or sinks: [B, Hq, D] -> [B, Hq, D], in torch ops
        (a backend whose kernel runs some of these overrides it)."""
        return windowed.decode(self.kv_pool, layer, q, fb, scale, window, softcap, sinks)

    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' K and V into the pool's rows `slots`."""
        self.kv_pool.write(layer, slots, k, v)

    @abstractmethod
    def decode(
        self, layer: int, q: torch.Tensor, fb: ForwardBatch, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """One new token per request: [B, Hq, D] -> [B, Hq, D] over each request's KV table row."""

    @abstractmethod
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
        """Each request's new tokens over its cached prefix and themselves (causal): [T, Hq, D] -> [T, Hq, D]."""
