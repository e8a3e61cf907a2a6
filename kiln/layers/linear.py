"""Tensor-parallel linear layers. Each parameter carries a `weight_loader(param, loaded, shard_id=None)`
that copies its own shard out of a full checkpoint tensor. A weight may be held in FP8 blocks
(kiln.layers.fp8_linear): the loaders copy its block factors with the same shard, and `_matmul` multiplies it as
stored."""

from __future__ import annotations

import torch
from torch import nn

from kiln.core.sharding import divide, kv_heads_per_rank
from kiln.distributed import all_reduce, tp_rank, tp_size
from kiln.layers import fused
from kiln.layers.cpu_gemm import linear, prepack
from kiln.layers.fp8_linear import copy_blocks
from kiln.layers.lora import LoraWeights
from kiln.layers.quant_rows import keep_rows, pop_rows


def _param(shape: tuple[int, ...], loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


class _PrepackableLinear(nn.Module):
    weight: nn.Parameter
    packed = False
    fp8_weight_names: tuple[str, ...] = ("weight",)  # what an FP8 checkpoint's weights are kept in FP8 for
    fp8_block: tuple[int, int] | None = None  # set when the weight is held in FP8 blocks
    # the projection's LoRA adapter slots (kiln.layers.lora), set when the server serves adapters
    lora: LoraWeights | None = None

    def prepack_weights(self) -> bool:
        """After loading: swap the weight for its prepacked CPU layout where that exists (quantized, when the
        weight came from GGUF blocks the --cpu-gemm mode keeps, or under --quantization int8)."""
        if self.fp8_block is not None:  # multiplied as stored
            return False
        packed = prepack(self.weight, pop_rows(self.weight), quantize=True)
        if packed is None:
            return False
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = True
        return True

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8_block is not None:
            from kiln.layers.triton_fp8 import fp8_block_linear  # Triton, imported only where FP8 is kept

            return fp8_block_linear(x, self.weight, self.weight_scale_inv, self.fp8_block, bias)
        return linear(x, self.weight, bias, self.packed)

    def _with_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each row's LoRA delta, when adapters are served (before a row-parallel all-reduce: the partial
        deltas of the ranks' input columns sum there like the partial products)."""
        return y if self.lora is None else self.lora.add_delta(x, y)


class ColumnParallelLinear(_PrepackableLinear):
    """y = x W^T with W's output rows split across ranks; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_per_rank = divide(out_features, tp_size())
        self.weight = _param((self.out_per_rank, in_features), self.weight_loader)
        self.bias = _param((self.out_per_rank,), self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self._copy_rows(param, loaded, 0, tp_rank() * self.out_per_rank, self.out_per_rank)

    def _copy_rows(self, param: nn.Parameter, loaded: torch.Tensor, dst: int, src: int, rows: int) -> None:
        """param[dst : dst + rows] = loaded[src : src + rows], with the rows' GGUF blocks, if any."""
        param.data.narrow(0, dst, rows).copy_(loaded.narrow(0, src, rows))
        if param is self.weight:
            keep_rows(param, loaded, dst, src, rows)
            copy_blocks(self, "weight", loaded, 0, dst, src, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._with_lora(x, self._matmul(x, self.bias))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input stored as one matrix (gate_up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert shard_id is not None, "merged projections load one part at a time"
        size = self.out_sizes[shard_id] // tp_size()
        offset = sum(self.out_sizes[:shard_id]) // tp_size()
        self._copy_rows(param, loaded, offset, tp_rank() * size, size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one matrix; kv heads are replicated when tp_size > num_kv_heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = tp_size()
        self.head_dim = head_dim
        self.q_heads = divide(num_heads, tp)
        self.kv_heads = kv_heads_per_rank(num_kv_heads, tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        total = (self.q_heads + 2 * self.kv_heads) * head_dim * tp
        super().__init__(hidden, total, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        q_size, kv_size = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, tp_rank()
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, tp_rank() // self.kv_replicas
        self._copy_rows(param, loaded, offset, rank * size, size)


class ReplicatedLinear(_PrepackableLinear):
    """y = x W^T with the whole W on every rank: a projection whose output every rank reads whole (the latent
    attention's down-projections, q_a_proj and kv_a_proj_with_mqa)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = _param((out_features, in_features), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.shape != loaded.shape:
            raise ValueError(
                f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}"
            )
        param.data.copy_(loaded)
        keep_rows(param, loaded, 0, 0, param.shape[0])
        copy_blocks(self, "weight", loaded, 0, 0, 0, param.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, None)


class RowParallelLinear(_PrepackableLinear):
    """y = x W^T with W's input columns split across ranks; partial outputs are summed."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_per_rank = divide(in_features, tp_size())
        self.weight = _param((out_features, self.in_per_rank), self.weight_loader)
        self.bias = _param((out_features,), self._bias_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        start = tp_rank() * self.in_per_rank
        param.data.copy_(loaded.narrow(1, start, self.in_per_rank))
        keep_rows(param, loaded, 0, 0, param.shape[0], k_start=start, k_len=self.in_per_rank)
        copy_blocks(self, "weight", loaded, 1, 0, start, self.in_per_rank)

    @staticmethod
    def _bias_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self._with_lora(x, self._matmul(x, None)))
        return y + self.bias if self.bias is not None else y

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + forward(x), `residual` consumed. Where the step's elementwise work is fused
        (kiln.layers.fused: half precision on CUDA), one rank's plain weight adds into the residual in place in
        the GEMM's epilogue (cuBLAS's beta = 1; out of place, cuBLAS first copies it): a kernel less a layer,
        rounded once. With several ranks the residual must wait for the all-reduce."""
        w = self.weight
        if (
            fused.kernels(x) is not None and x.is_cuda and x.dim() == 2 and tp_size() == 1 and self.bias is None
            and self.fp8_block is None and not self.packed and w.dtype == x.dtype == residual.dtype
            and self.lora is None
        ):  # fmt: skip
            return residual.addmm_(x, w.t())
        return residual + self.forward(x)
