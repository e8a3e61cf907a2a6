"""Tensor-parallel group state and the collectives Kiln uses. tp_size == 1 is the path used on one device: every
collective returns at once there, so a single rank pays nothing for the tensor-parallel code.

One process per rank. The model's collectives (all-reduce, all-gather) run on the default group: gloo on the
CPU, NCCL on CUDA. The scheduler's Python objects (the messages rank 0 received, the sampled token ids) travel
over a gloo group on every device, as SGLang's CPU group does: they live on the host, and NCCL would copy them to
the device and back."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("kiln")


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    ep_size: int = 1  # --ep-size: the MoE layers' expert-parallel split of these ranks (kiln.core.sharding)


_TP = TPGroup()
_CPU_GROUP: Any = None  # the gloo group for Python objects; the default group itself on the CPU
_COMM_SECONDS = [0.0]  # host time spent inside collectives since the start (tp > 1, eager steps only)


def comm_seconds() -> float:
    """Seconds this rank has spent in collectives, waiting for the other ranks included: the decode log reports
    their share of a step. On CUDA NCCL returns before the device finishes, so there it counts launches only."""
    return _COMM_SECONDS[0]


def _timed(op: Callable[[], Any]) -> None:
    if torch.compiler.is_compiling():  # a compiled step traces the op; the clock is no part of it
        op()
        return
    t0 = time.perf_counter()
    op()
    _COMM_SECONDS[0] += time.perf_counter() - t0


def backend_for(device: str) -> str:
    """The backend of the model's collectives on this device."""
    return "nccl" if device.startswith("cuda") else "gloo"


def backend_version(backend: str) -> str:
    if backend == "nccl":
        version = torch.cuda.nccl.version()
        return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
    return f"torch {torch.__version__}"  # gloo ships inside torch and carries its version


def init_tp(
    rank: int,
    size: int,
    device: str = "cpu",
    init_method: str | None = None,
    timeout: float = 300,
    ep_size: int = 1,
) -> None:
    """Join the tensor-parallel group (one process per rank); init_method is tcp://HOST:PORT, timeout the seconds
    a collective may wait for the other ranks (--watchdog-timeout) before it raises."""
    global _TP, _CPU_GROUP
    if size > 1 and not dist.is_initialized():
        backend = backend_for(device)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=timeout)
        )
        _CPU_GROUP = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        if rank == 0:
            logger.info(
                f"Init torch distributed: backend {backend} ({backend_version(backend)}), world size {size}"
            )
    _TP = TPGroup(rank=rank, size=size, ep_size=ep_size)


def destroy_tp() -> None:
    global _TP, _CPU_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP, _CPU_GROUP = TPGroup(), None


def tp_rank() -> int:
    return _TP.rank


def tp_size() -> int:
    return _TP.size


def ep_size() -> int:
    return _TP.ep_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size > 1:
        _timed(lambda: dist.all_reduce(x))
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    _timed(lambda: dist.all_gather(parts, x.contiguous()))
    return torch.cat(parts, dim=-1)


def broadcast_objects(objects: list | None) -> list:
    """Rank 0's list of picklable objects, on every rank (the others pass None)."""
    if _TP.size == 1:
        return objects or []
    box = [objects if _TP.rank == 0 else None]
    _timed(lambda: dist.broadcast_object_list(box, src=0, group=_CPU_GROUP))
    return box[0] or []


def broadcast_token_ids(ids: list[int]) -> list[int]:
    """The token ids rank 0 sampled, on every rank: every rank appends the same token whatever its own sampler
    drew (a seed drawn on rank 0, logits that differ in the last bit)."""
    if _TP.size == 1:
        return ids
    tensor = torch.tensor(ids, dtype=torch.long)
    _timed(lambda: dist.broadcast(tensor, src=0, group=_CPU_GROUP))
    return tensor.tolist()


def all_gather_objects(obj: Any) -> list:
    """Every rank's obj, in rank order, on every rank."""
    if _TP.size == 1:
        return [obj]
    out: list[Any] = [None] * _TP.size
    dist.all_gather_object(out, obj, group=_CPU_GROUP)
    return out


def min_across_ranks(values: list[int]) -> list[int]:
    """Element-wise minimum of the ranks' integers: what every rank can hold, agreed before anything is allocated."""
    if _TP.size == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    return tensor.tolist()
