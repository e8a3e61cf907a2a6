"""Mixture-of-experts layers: the top-k router, the routed experts computed grouped by expert, and the sparse
block that adds shared experts.

Routing follows transformers' routers step for step (Qwen3MoeTopKRouter, DeepseekV2TopkRouter,
DeepseekV3TopkRouter), so that greedy outputs match the reference. The experts use SGLang's layout: every expert's
weights stacked into one parameter, each tensor-parallel rank holding a slice of every expert (a column slice of
gate and up, the matching row slice of down), the partial outputs summed once after the experts combine.

A config naming a routing feature Kiln does not implement is refused here, naming the field: running it with a
near miss would give plausible but wrong text."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.sharding import divide, expert_split
from kiln.distributed import all_reduce, ep_size, tp_rank, tp_size
from kiln.layers.activation import check_hidden_act, silu_and_mul
from kiln.layers.fp8_linear import FIX, as_dtype, copy_blocks
from kiln.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from kiln.layers.rotary import check_choice as _check_choice

SCORING_FUNCS = ("softmax", "sigmoid")
# greedy: plain top-k; group_limited_greedy (DeepSeek-V2): groups ranked by their best expert;
# noaux_tc (DeepSeek-V3): groups ranked by their two best experts, scores shifted by e_score_correction_bias
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
EXPERT_PARTS = ("gate", "up", "down")


def num_routed_experts(hf_config: Any) -> int:
    for name in ("n_routed_experts", "num_experts", "num_local_experts"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 0


def is_sparse_layer(hf_config: Any, layer_id: int) -> bool:
    """DeepSeek: dense below first_k_dense_replace, then every moe_layer_freq-th layer sparse. Qwen-MoE: every
    decoder_sparse_step-th layer sparse, except those in mlp_only_layers."""
    if num_routed_experts(hf_config) == 0:
        return False
    if getattr(hf_config, "first_k_dense_replace", None) is not None:
        freq = int(getattr(hf_config, "moe_layer_freq", None) or 1)
        return layer_id >= int(hf_config.first_k_dense_replace) and layer_id % freq == 0
    step = int(getattr(hf_config, "decoder_sparse_step", None) or 1)
    return layer_id not in (getattr(hf_config, "mlp_only_layers", None) or []) and (layer_id + 1) % step == 0


@dataclass(frozen=True)
class RouterSpec:
    """How a token picks its experts and weighs them."""

    num_experts: int
    top_k: int
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # DeepSeek computes the router logits in float32 and keeps the routing weights there; Qwen-MoE computes them
    # in the model's dtype and casts the weights back to it
    float32_routing: bool = False
    # GPT-OSS's router is a linear layer with a bias
    logit_bias: bool = False

    def __post_init__(self) -> None:
        _check_choice("scoring_func", self.scoring_func, SCORING_FUNCS)
        _check_choice("topk_method", self.topk_method, TOPK_METHODS)
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"model config num_experts_per_tok {self.top_k} must be between 1 and the {self.num_experts} "
                f"routed experts"
            )
        if self.topk_method != "greedy":
            self._check_groups()

    def _check_groups(self) -> None:
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(
                f"model config n_group {self.n_group} does not divide {self.num_experts} experts"
            )
        per_group = self.num_experts // self.n_group
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"model config topk_group {self.topk_group} must be between 1 and n_group")
        if self.top_k > self.topk_group * per_group:
            raise ValueError(
                f"model config num_experts_per_tok {self.top_k} exceeds the {self.topk_group * per_group} "
                f"experts of topk_group {self.topk_group} groups"
            )
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError(
                f"model config n_group {self.n_group}: topk_method noaux_tc ranks a group by its two best "
                f"experts, and {self.num_experts} experts leave {per_group} per group"
            )

    @property
    def grouped(self) -> bool:
        return self.topk_method != "greedy"

    @classmethod
    def from_hf(
        cls,
        hf_config: Any,
        scoring_func: str,
        topk_method: str,
        float32_routing: bool,
        config_routing: bool = True,
    ) -> RouterSpec:
        """The router of an HF config; `scoring_func` and `topk_method` are the architecture's own, used where the
        config does not name one. Without `config_routing` (Qwen's MoE) the architecture's routing is the only
        one: SGLang and transformers read none of DeepSeek's routing fields there, whatever the config holds."""
        routing: dict[str, Any] = {"scoring_func": scoring_func, "topk_method": topk_method}
        if config_routing:
            scale = getattr(hf_config, "routed_scaling_factor", None)
            routing = {
                "scoring_func": getattr(hf_config, "scoring_func", None) or scoring_func,
                "topk_method": getattr(hf_config, "topk_method", None) or topk_method,
                "n_group": int(getattr(hf_config, "n_group", None) or 1),
                "topk_group": int(getattr(hf_config, "topk_group", None) or 1),
                "routed_scaling_factor": 1.0 if scale is None else float(scale),
            }
        return cls(
            num_experts=num_routed_experts(hf_config),
            top_k=int(hf_config.num_experts_per_tok),
            norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
            float32_routing=float32_routing,
            **routing,
        )


@dataclass(frozen=True)
class MoESpec:
    hidden_size: int
    expert_intermediate_size: int  # of one routed expert
    shared_intermediate_size: int  # of all shared experts together; 0: none
    router: RouterSpec
    # Qwen2-MoE / Qwen3-Next: the shared expert's output is scaled per token by sigmoid(shared_expert_gate(x))
    shared_expert_gate: bool = False

    @classmethod
    def from_hf(
        cls,
        hf_config: Any,
        scoring_func: str,
        topk_method: str,
        float32_routing: bool = False,
        config_routing: bool = True,
    ) -> MoESpec:
        """The MoE layer of an HF config (RouterSpec.from_hf for the routing arguments); building it checks
        every field, so a model's check_config builds one to refuse what the model would."""
        check_hidden_act(hf_config)
        inter = int(hf_config.moe_intermediate_size)
        # DeepSeek: n_shared_experts of the routed experts' width; Qwen3-Next: one gated shared expert of its own
        gated_shared = int(getattr(hf_config, "shared_expert_intermediate_size", None) or 0)
        shared = int(getattr(hf_config, "n_shared_experts", None) or 0) * inter + gated_shared
        return cls(
            hidden_size=int(hf_config.hidden_size),
            expert_intermediate_size=inter,
            shared_intermediate_size=shared,
            router=RouterSpec.from_hf(hf_config, scoring_func, topk_method, float32_routing, config_routing),
            shared_expert_gate=gated_shared > 0,
        )


class TopKRouter(nn.Module):
    """gate weight [n_experts, hidden] (HF's mlp.gate.weight) -> per token the top-k expert ids and their
    weights. e_score_correction_bias (noaux_tc) shifts the scores that select experts, never the weights."""

    def __init__(self, spec: RouterSpec, hidden: int):
        super().__init__()
        self.spec = spec
        # DeepSeek's checkpoints and transformers keep its gate in float32 whatever the model's dtype
        dtype = torch.float32 if spec.float32_routing else None
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if spec.topk_method == "noaux_tc":  # float32 as in the checkpoint: it only ranks, and ranks finely
            bias = torch.empty(spec.num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        self.bias: nn.Parameter | None = None
        if spec.logit_bias:
            self.bias = nn.Parameter(torch.empty(spec.num_experts, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] -> (weights [T, k], expert ids [T, k])."""
        spec = self.spec
        if spec.float32_routing:
            bias = None if self.bias is None else self.bias.float()
            logits = F.linear(x.float(), self.weight.float(), bias)
        else:
            logits = F.linear(x, self.weight, self.bias)
        if spec.scoring_func == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        else:
            scores = logits.float().sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if spec.grouped:
            choice = self._within_best_groups(choice)
        ids = torch.topk(choice, spec.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * spec.routed_scaling_factor
        return (weights if spec.float32_routing else weights.to(logits.dtype)), ids

    def _within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """The selection scores with every expert outside the topk_group best groups masked out."""
        spec, tokens = self.spec, choice.shape[0]
        grouped = choice.view(tokens, spec.n_group, -1)
        if spec.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        best = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, -1)
        # noaux_tc's shifted scores may be negative, so its masked experts go to -inf; softmax scores are positive
        fill = float("-inf") if spec.topk_method == "noaux_tc" else 0.0
        return choice.masked_fill(~keep, fill)


def _stacked_param(shape: tuple[int, ...], loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class FusedMoE(nn.Module):
    """The routed experts this rank holds, stacked: gate_up_proj [E_local, 2 I/moe_tp, H] (this rank's gate rows,
    then its up rows) and down_proj [E_local, H, I/moe_tp]. With --ep-size 1 every rank holds a slice of every
    expert (E_local = E, moe_tp = tp); with --ep-size ep it holds E/ep whole experts' slices over tp/ep ranks
    (kiln.core.sharding.expert_split). Every rank sees every token, computes the pairs routed to its experts and
    the all-reduce sums the ranks' parts: each (expert, slice) lives on exactly one rank.

    Token-expert pairs are sorted by expert and each expert that has tokens runs one matmul over all of them, so
    the cost is one pair of GEMMs per active expert, not a loop over tokens."""

    fp8_weight_names = ("gate_up_proj", "down_proj")  # kept in FP8 blocks for an FP8 checkpoint
    fp8_block: tuple[int, int] | None = None  # set when they are (kiln.layers.fp8_linear)

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        bias: bool = False,
        activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    ):
        """bias: each expert's projections have biases (GPT-OSS's); activation: [.., 2 I] (gate, then up) ->
        [.., I], the gated activation between the projections."""
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.activation = activation
        ep_rank, ep, self.tp_rank, self.tp_size = expert_split(tp_rank(), tp_size(), ep_size())
        self.local_experts = divide(num_experts, ep)
        self.first_expert = ep_rank * self.local_experts
        self.per_rank = divide(intermediate, self.tp_size)
        self.gate_up_proj = _stacked_param(
            (self.local_experts, 2 * self.per_rank, hidden), self.weight_loader
        )
        self.down_proj = _stacked_param((self.local_experts, hidden, self.per_rank), self.weight_loader)
        self.loaded_shards: set[tuple[int, str]] = set()
        self.gate_up_bias: nn.Parameter | None = None
        self.down_bias: nn.Parameter | None = None
        if (
            bias
        ):  # every rank holds the down bias; the first of an expert's slices adds it (the all-reduce sums)
            self.gate_up_bias = _stacked_param((self.local_experts, 2 * self.per_rank), self.bias_loader)
            self.down_bias = _stacked_param((self.local_experts, hidden), self.bias_loader)

    def _local(self, expert: int) -> int | None:
        """The expert's index among this rank's, None when another rank holds it."""
        local = expert - self.first_expert
        return local if 0 <= local < self.local_experts else None

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str] | None = None
    ) -> None:
        """shard_id (expert, "gate" | "up" | "down"): one expert's HF projection, [I, H] or [H, I]. None: HF's
        fused tensor of every expert, [E, 2I, H] (gate rows, then up rows) or [E, H, I]."""
        if shard_id is None:
            self._load_fused(param, loaded)
            return
        expert, part = shard_id
        _check_choice("expert weight part", part, EXPERT_PARTS)
        local = self._local(expert)
        start = self.tp_rank * self.per_rank
        name = "down_proj" if part == "down" else "gate_up_proj"
        if part == "down":
            _check_shape(loaded, (self.hidden, self.intermediate), f"expert {expert} down_proj")
            if local is not None:
                param.data[local].copy_(loaded.narrow(1, start, self.per_rank))
                copy_blocks(self, name, loaded, 1, 0, start, self.per_rank, local)
        else:
            _check_shape(loaded, (self.intermediate, self.hidden), f"expert {expert} {part}_proj")
            if local is not None:
                dst = 0 if part == "gate" else self.per_rank
                param.data[local].narrow(0, dst, self.per_rank).copy_(loaded.narrow(0, start, self.per_rank))
                copy_blocks(self, name, loaded, 0, dst, start, self.per_rank, local)
        self.loaded_shards.add((expert, part))

    def _load_fused(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.fp8_block is not None:
            raise ValueError(
                "routed experts stacked in one tensor (experts.gate_up_proj) in FP8 blocks are not implemented by "
                f"Kiln: use per-expert tensors, {FIX}"
            )
        e, h, i, n = self.num_experts, self.hidden, self.intermediate, self.per_rank
        start = self.tp_rank * n
        mine = slice(self.first_expert, self.first_expert + self.local_experts)
        if param is self.gate_up_proj:
            _check_shape(loaded, (e, 2 * i, h), "experts.gate_up_proj")
            param.data[:, :n].copy_(loaded[mine, start : start + n])
            param.data[:, n:].copy_(loaded[mine, i + start : i + start + n])
            parts = ("gate", "up")
        else:
            _check_shape(loaded, (e, h, i), "experts.down_proj")
            param.data.copy_(loaded[mine, :, start : start + n])
            parts = ("down",)
        self.loaded_shards.update((expert, part) for expert in range(e) for part in parts)

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        """Every expert's biases in one tensor: gate_up [E, 2I] (gate, then up) or down [E, H]."""
        e, i, n = self.num_experts, self.intermediate, self.per_rank
        start, mine = self.tp_rank * n, slice(self.first_expert, self.first_expert + self.local_experts)
        if param is self.gate_up_bias:
            _check_shape(loaded, (e, 2 * i), "experts' gate_up bias")
            param.data[:, :n].copy_(loaded[mine, start : start + n])
            param.data[:, n:].copy_(loaded[mine, i + start : i + start + n])
        else:
            _check_shape(loaded, (e, self.hidden), "experts' down bias")
            param.data.copy_(loaded[mine])

    def _down_bias(self, expert: int | torch.Tensor) -> torch.Tensor | None:
        """The down projection's bias of `expert` (ids: one row each), on the rank holding its first slice."""
        if self.down_bias is None or self.tp_rank != 0:
            return None
        return self.down_bias[expert]

    def missing_shards(self) -> list[tuple[int, str]]:
        return [
            (e, p) for e in range(self.num_experts) for p in EXPERT_PARTS if (e, p) not in self.loaded_shards
        ]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights / topk_ids [T, k] -> [T, H]: sum over k of weight * expert(x), this rank's
        experts' part of it before the all-reduce."""
        flat = topk_ids.reshape(-1) - self.first_expert
        # pairs of other ranks' experts sort last (index local_experts) and are left out of the matmuls
        flat = flat.masked_fill((flat < 0) | (flat >= self.local_experts), self.local_experts)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order within each
        token = order // topk_ids.shape[1]
        rows = x.index_select(0, token)
        if self.fp8_block is not None:
            out = self._fp8_experts(rows, flat.index_select(0, order))
        elif x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = self._grouped_mm(rows, flat)
        else:
            out = self._per_expert(rows, flat)
        weights = topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
        combined = torch.zeros_like(x).index_add_(0, token, (out * weights).to(x.dtype))
        return all_reduce(combined)

    def _per_expert(self, rows: torch.Tensor, flat_ids: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(flat_ids, minlength=self.local_experts + 1).tolist()
        out = torch.zeros_like(rows)  # the rows of other ranks' experts stay zero
        start = 0
        for expert, count in enumerate(counts[: self.local_experts]):
            if count:
                end = start + count
                bias = None if self.gate_up_bias is None else self.gate_up_bias[expert]
                gate_up = F.linear(rows[start:end], self.gate_up_proj[expert], bias)
                out[start:end] = F.linear(
                    self.activation(gate_up), self.down_proj[expert], self._down_bias(expert)
                )
                start = end
        return out

    def _fp8_experts(self, rows: torch.Tensor, sorted_ids: torch.Tensor) -> torch.Tensor:
        """The product with the experts' weights in FP8 blocks: one grouped kernel launch a projection, its
        blocks of rows laid out on the device, so it neither syncs nor breaks a CUDA graph."""
        from kiln.layers.triton_fp8 import fp8_grouped_linear, group_rows  # Triton, only where FP8 is kept

        if self.gate_up_bias is not None:
            raise ValueError("experts with biases in FP8 blocks are not implemented by Kiln")
        block, groups = self.fp8_block, group_rows(sorted_ids, self.local_experts, rows)
        gate_up = fp8_grouped_linear(rows, self.gate_up_proj, self.gate_up_proj_scale_inv, block, groups)
        return fp8_grouped_linear(
            self.activation(gate_up), self.down_proj, self.down_proj_scale_inv, block, groups
        )

    def _grouped_mm(self, rows: torch.Tensor, flat_ids: torch.Tensor) -> torch.Tensor:
        """The same product without reading the per-expert counts on the host, which a CUDA graph cannot do:
        the group offsets stay on the device. Rows past the last group (other ranks' experts) come out zero."""
        ones = torch.ones_like(flat_ids, dtype=torch.int32)
        counts = torch.zeros(self.local_experts + 1, dtype=torch.int32, device=rows.device).scatter_add_(
            0, flat_ids, ones
        )
        offsets = counts[: self.local_experts].cumsum(0, dtype=torch.int32)
        gate_up = torch._grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offsets)
        sorted_ids = flat_ids.sort().values
        owned = sorted_ids.clamp(max=self.local_experts - 1)  # other ranks' rows are zeroed below
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias[owned]
        out = torch._grouped_mm(self.activation(gate_up), self.down_proj.transpose(1, 2), offs=offsets)
        down_bias = self._down_bias(owned)
        out = out if down_bias is None else out + down_bias
        return out.masked_fill((sorted_ids >= self.local_experts).unsqueeze(1), 0)


def _check_shape(loaded: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != shape:
        raise ValueError(f"checkpoint {what}: shape {tuple(loaded.shape)}, expected {shape}")


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), tensor-parallel: the shared experts of a sparse block."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
        self.down_proj = RowParallelLinear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """HF's mlp.gate (router), mlp.experts and, where the config has them, mlp.shared_experts (Qwen3-Next's
    mlp.shared_expert loads there too) and mlp.shared_expert_gate."""

    def __init__(self, spec: MoESpec, experts: FusedMoE | None = None):
        """experts: a family's own (GPT-OSS's have biases and another activation); by default the spec's."""
        super().__init__()
        self.gate = TopKRouter(spec.router, spec.hidden_size)
        self.experts = experts or FusedMoE(
            spec.router.num_experts, spec.hidden_size, spec.expert_intermediate_size
        )
        self.shared_experts = (
            GatedMLP(spec.hidden_size, spec.shared_intermediate_size)
            if spec.shared_intermediate_size
            else None
        )
        # one output row: every rank computes the whole gate from its whole input
        self.shared_expert_gate = ReplicatedLinear(spec.hidden_size, 1) if spec.shared_expert_gate else None
        if self.shared_expert_gate is not None:  # one row, which FP8 checkpoints leave unquantized
            self.shared_expert_gate.fp8_weight_names = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is None:
            return out
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared


# model.layers.N.mlp.experts.E.gate_proj.weight (per expert) or model.layers.N.mlp.experts.gate_up_proj (fused)
_PER_EXPERT = re.compile(r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\.weight")
_FUSED = re.compile(r"(?P<prefix>.+\.experts)\.(?P<param>gate_up_proj|down_proj)")


def expert_target(name: str) -> tuple[str, tuple[int, str] | None] | None:
    """The stacked parameter and shard id of a checkpoint tensor of routed experts; None for any other tensor."""
    match = _PER_EXPERT.fullmatch(name)
    if match is not None:
        param = "gate_up_proj" if match["part"] in ("gate", "up") else "down_proj"
        return f"{match['prefix']}.{param}", (int(match["expert"]), match["part"])
    match = _FUSED.fullmatch(name)
    if match is not None:
        return name, None
    return None


def load_expert_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Loads the routed experts' tensors of a checkpoint stream into `model` (their names into `loaded`) and
    passes every other tensor on, for the model's own loader."""
    params = dict(model.named_parameters())
    for name, tensor in weights:
        target = expert_target(name)
        if target is None:
            yield name, tensor
            continue
        param_name, shard_id = target
        if param_name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
        param = params[param_name]
        param.weight_loader(param, as_dtype(tensor, param.dtype), shard_id)  # type: ignore[attr-defined]
        loaded.add(param_name)


def check_experts_loaded(model: nn.Module) -> None:
    """Raises naming the first expert tensors a checkpoint lacked (the stacked parameters were only partly
    filled, which the loader's per-parameter check cannot see)."""
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            missing = module.missing_shards()
            if missing:
                shown = ", ".join(f"{name}.{e}.{part}_proj.weight" for e, part in missing[:3])
                raise ValueError(f"checkpoint lacks {len(missing)} expert tensors, e.g. {shown}")
