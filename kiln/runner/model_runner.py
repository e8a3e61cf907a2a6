"""Owns the model and its memory: weights, the KV pool, the request table, the allocator and the
attention backend; runs one forward pass for a ForwardBatch."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from kiln.core.forward_batch import ForwardBatch
from kiln.core.sharding import divide, kv_heads_per_rank
from kiln.core.units import gib
from kiln.distributed import tp_size
from kiln.layers.cpu_gemm import packed_layout_name
from kiln.layers.fp8_linear import block_factor_bytes
from kiln.loader.weights import LoadedModel, load_model
from kiln.memory.allocator import TokenAllocator
from kiln.memory.kv_pool import KVPool, LatentKVPool
from kiln.memory.req_to_token import ReqToTokenPool
from kiln.memory.state_pool import StatePool
from kiln.memory.window_pool import WindowPool
from kiln.models.config import ModelConfig
from kiln.platform import available_memory_bytes, current_rss_bytes
from kiln.runner.attention import AttentionBackend, make_attention_backend
from kiln.runner.lora import LoraManager, LoraSettings
from kiln.runner.prompt_logprobs import RowScores, score_rows

logger = logging.getLogger("kiln")


@dataclass(frozen=True)
class PoolSizes:
    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    page_size: int
    state_slots: int = 0  # hybrid models: working slots (one per table row) + the prefix cache's checkpoints


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: str,
        attention_backend: str | None = None,
    ):
        """attention_backend: --attention-backend (None: Kiln chooses for the pool)."""
        self.model_config = model_config
        self.dtype, self.kv_dtype, self.device = dtype, kv_dtype, device
        self.measured: dict[str, int] = {}
        self.graphs = None  # a GraphRunner once decode graphs were captured
        self.attn_backend: AttentionBackend | None = None  # chosen with the KV pool it reads
        self.attention_backend = attention_backend
        self.state_pool: StatePool | WindowPool | None = None  # hybrid models' linear states or window rings
        self.last_forward_graph = False
        self.last_hidden: torch.Tensor | None = None  # the last forward's [rows, width], if kept
        self.prompt_hidden: torch.Tensor | None = None  # the last forward's hidden_index rows (prompt lps)
        # the adapters and their slots, when LoRA is served (kiln.runner.lora)
        self.lora: LoraManager | None = None

    def _avail(self) -> str:
        return gib(available_memory_bytes(self.device))

    def load(
        self,
        max_positions: int,
        on_progress=None,
        prepack: bool = True,
        dummy: bool = False,
        head: bool = True,
    ) -> None:
        """head False (an embedding model): a checkpoint without an lm_head loads, its head left unfilled."""
        logger.info(f"Load weight begin. avail mem={self._avail()}")
        loaded = load_model(
            self.model_config, self.dtype, self.device, max_positions, on_progress, prepack, dummy, head
        )
        self.model = loaded.model
        params = dict(self.model.named_parameters())  # shared (tied) parameters once
        head_copy = params.pop("lm_head.packed_weight", None)
        scales = block_factor_bytes(self.model)  # FP8 weights' block factors: buffers, not parameters
        weight_bytes = sum(p.nbytes for p in params.values()) + scales
        self.measured["weights"] = weight_bytes
        if head_copy is not None:
            self.measured["packed_lm_head"] = head_copy.nbytes
            weight_bytes += head_copy.nbytes
        if loaded.prepacked_weights:
            self._log_prepacked(loaded, params, head_copy)
        if loaded.fp8_weights:
            logger.info(f"Kept {loaded.fp8_weights} weights in FP8 blocks ({gib(scales)} of block scales).")
        logger.info(
            f"Load weight end. elapsed={loaded.seconds:.2f} s, type={self.model_config.architecture}, "
            f"dtype={self.dtype}, avail mem={self._avail()}, mem usage={gib(weight_bytes)}."
        )

    @staticmethod
    def _log_prepacked(loaded: LoadedModel, params: dict, head_copy: torch.Tensor | None) -> None:
        # e.g. "210 Q4_1 (integer), 1 Q8_0 (float32)": the GGUF types kept and how they multiply
        formats = ", ".join(f"{n} {name}" for name, n in sorted(loaded.packed_formats.items()))
        kept = f": {formats}" if formats else ""
        logger.info(
            f"Prepacked {loaded.prepacked_weights} linear weights into {packed_layout_name()} CPU layout{kept}."
        )

    def _make_kv_pool(self, sizes: PoolSizes) -> KVPool | LatentKVPool:
        """The pool of the model's KV layout: one latent row per token for latent attention (MLA, the same on
        every rank), K and V heads (this rank's) otherwise."""
        cfg = self.model_config
        tokens, page = sizes.max_total_num_tokens, sizes.page_size
        if cfg.mla is not None:
            width = cfg.mla.latent_width
            return LatentKVPool(tokens, page, cfg.num_kv_layers, width, self.kv_dtype, self.device)
        heads = kv_heads_per_rank(cfg.num_kv_heads, tp_size())
        return KVPool(tokens, page, cfg.num_kv_layers, heads, cfg.head_dim, self.kv_dtype, self.device)

    def _make_state_pool(self, sizes: PoolSizes) -> None:
        """A hybrid model's linear-layer states, one slot per request-table row (a request's working slot is its
        row); the model reads them through its state_pool attribute."""
        spec = self.model_config.linear_attention
        if spec is None:
            self._make_window_pool(sizes)
            return
        self.state_pool = StatePool(
            max(sizes.state_slots, sizes.max_running_requests),
            len(spec.linear_layers),
            spec.conv_shape,
            spec.ssm_shape,
            self.dtype,
            self.device,
            ssm_dtype=torch.float32,  # the delta rule's state is float32 whatever the model dtype (the ledger's)
        )
        self.model.state_pool = self.state_pool
        self.measured["state_pool"] = self.state_pool.nbytes
        logger.info(
            f"State pool is allocated. #slots: {self.state_pool.num_slots}, conv {spec.conv_shape} "
            f"{self.dtype}, recurrent {spec.ssm_shape} {self.state_pool.ssm.dtype} x "
            f"{len(spec.linear_layers)} linear layers, size: {gib(self.state_pool.nbytes)}"
        )

    def _make_window_pool(self, sizes: PoolSizes) -> None:
        """A hybrid sliding-window model's rings, one slot per request-table row as the linear layers' states
        (kiln.memory.window_pool); its windowed layers attend over them through the attention backend."""
        element_bytes = torch.empty(0, dtype=self.kv_dtype).element_size()
        ring = self.model_config.spec.window_state(tp_size(), element_bytes, sizes.context_len)
        if ring is None:
            return
        slots = max(sizes.state_slots, sizes.max_running_requests)
        self.state_pool = WindowPool(
            slots, ring.layers, ring.tokens, ring.kv_heads, ring.k_dim, ring.v_dim, self.kv_dtype, self.device
        )
        self.attn_backend.rings = self.state_pool
        self.measured["state_pool"] = self.state_pool.nbytes
        logger.info(
            f"Window rings are allocated. #slots: {slots}, {ring.text()} each, size: {gib(self.state_pool.nbytes)}"
        )

    def init_memory_pool(self, sizes: PoolSizes) -> None:
        cfg, tp = self.model_config, tp_size()
        self.kv_pool = self._make_kv_pool(sizes)
        self.table = ReqToTokenPool(sizes.max_running_requests, sizes.context_len, self.device)
        self.allocator = TokenAllocator(sizes.max_total_num_tokens, sizes.page_size, self.device)
        lora = cfg.mla.kv_lora_rank if cfg.mla is not None else 0
        self.attn_backend = make_attention_backend(
            self.kv_pool, divide(cfg.num_heads, tp), self.dtype, lora, self.attention_backend
        )
        self.model.attn = self.attn_backend
        self._make_state_pool(sizes)
        self.measured["kv_pool"] = self.kv_pool.k_bytes + self.kv_pool.v_bytes
        self.measured["req_table"] = self.table.req_to_token.nbytes
        self.measured["rss_after_pool"] = current_rss_bytes()
        logger.info(
            f"KV Cache is allocated. dtype: {self.kv_dtype}, #tokens: {sizes.max_total_num_tokens}, "
            f"K size: {gib(self.kv_pool.k_bytes)}, V size: {gib(self.kv_pool.v_bytes)}"
        )
        logger.info(f"Memory pool end. avail mem={self._avail()}")

    def init_lora(self, settings: LoraSettings, max_rows: int) -> None:
        """The LoRA slot pool on the model's projections, and the adapters --lora-paths names loaded into host
        memory (a bad one refuses startup, naming it)."""
        self.lora = LoraManager(
            self.model, self.model_config.spec, settings, max_rows, self.dtype, self.device
        )
        self.measured["lora_slots"] = self.lora.nbytes
        for name, path in settings.paths:
            self.lora.load(name, path)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        t0 = time.perf_counter()
        if self.device != "cpu":
            fb = fb.to(self.device)
        # inference mode is entered here, not inside the model: a compiled step that entered it itself would
        # bypass AOTAutograd's cache, and a warm start would lower it again
        with torch.inference_mode():
            # once per step, before graphs or the model: every layer and the graph runner read the same metadata
            fb = replace(fb, attn=self.attn_backend.prepare_metadata(fb))
            if self.lora is not None:  # each row's adapter slot, written where every LoRA'd layer reads it
                self.lora.set_batch(fb.lora_slots)
            out = self.graphs.try_run(fb) if self.graphs is not None else None
            self.last_forward_graph = out is not None
            # the hidden states a draft reads (the model keeps them once a drafter asked): a captured step hands
            # them out with its logits, since a replayed graph leaves the model's attribute as it was at capture
            if out is not None:
                logits, self.last_hidden = out
            else:
                logits = self.model(fb)
                self.last_hidden = getattr(self.model, "last_hidden", None)
            # a prefill scoring its prompt: the rows the model kept (its head runs eagerly, under prefill pieces too)
            keeps = fb.hidden_index is not None
            self.prompt_hidden = getattr(self.model, "prompt_hidden", None) if keeps else None
        self.last_forward_seconds = time.perf_counter() - t0
        return logits

    def score_prompt(self, targets: torch.Tensor, top_n: int) -> RowScores:
        """Prompt logprobs of the last forward's kept rows (ForwardBatch.hidden_index), one target token each, their
        logits computed a chunk at a time by the model's own head (kiln.runner.prompt_logprobs)."""
        if self.prompt_hidden is None:
            raise RuntimeError(f"{type(self.model).__name__} kept no hidden states for prompt logprobs")
        with torch.inference_mode():
            return score_rows(self.model.compute_logits, self.prompt_hidden, targets, top_n)
