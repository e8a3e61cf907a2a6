"""The request-slot -> recurrent-state pool of hybrid linear-attention models.

A linear-attention layer carries, per request, a fixed-size state instead of a KV row per token: the causal
conv1d's last (kernel - 1) input columns and the delta rule's recurrent matrix. The pool holds both for every
linear layer, indexed by slot; a request's working slot is its request-table row, so no separate allocator is
needed for the running set. The conv state is kept in the model's dtype and the recurrent state in float32
(`ssm_dtype`), as transformers' Qwen3-Next cache and SGLang's mamba_ssm_dtype default keep them: the delta rule
accumulates into the state every token, and a half-precision state drifts from the reference.

Ownership (round 4): written by helper D1, handed over to helper D2 (checkpoint slots, sizing) as of now; D1
only reads it from the runner and the model.
"""

from __future__ import annotations

import torch

from kiln.memory.kv_pool import pool_tensor


class SlotPool:
    """Per-request states held as tensors [layers, slots, ...]: a slot moves and resets across all of them."""

    num_slots: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot's state over every layer."""
        return self.nbytes // max(self.num_slots, 1)

    def zero(self, slots: torch.Tensor | list[int]) -> None:
        """Reset `slots` to the empty state (a request that starts from no tokens)."""
        for t in self.tensors():
            t[:, torch.as_tensor(slots, dtype=torch.int64, device=t.device)] = 0

    def copy(self, src_slots: torch.Tensor | list[int], dst_slots: torch.Tensor | list[int]) -> None:
        """Copy the states of `src_slots` into `dst_slots` (pairwise, every layer)."""
        for t in self.tensors():
            src = torch.as_tensor(src_slots, dtype=torch.int64, device=t.device)
            t[:, torch.as_tensor(dst_slots, dtype=torch.int64, device=t.device)] = t[:, src]


class StatePool(SlotPool):
    """Per linear layer, the conv state `conv[layer, slot]` and the recurrent state `ssm[layer, slot]`.

    Both are one tensor each ([layers, slots, *shape]) rather than a list per layer, so a slot's whole state
    moves with one indexed copy (`copy`) and the byte count is two products.
    """

    def __init__(
        self,
        num_slots: int,
        num_linear_layers: int,
        conv_shape: tuple[int, ...],
        ssm_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        ssm_dtype: torch.dtype = torch.float32,
    ):
        self.num_slots = num_slots
        self.num_linear_layers = num_linear_layers
        self.conv_shape = tuple(conv_shape)
        self.ssm_shape = tuple(ssm_shape)
        self.conv = pool_tensor((num_linear_layers, num_slots, *self.conv_shape), dtype, device, slots_dim=1)
        self.ssm = pool_tensor(
            (num_linear_layers, num_slots, *self.ssm_shape), ssm_dtype, device, slots_dim=1
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.conv, self.ssm
