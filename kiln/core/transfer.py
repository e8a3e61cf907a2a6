"""Host tensors onto a GPU without waiting for it.

A plain host-to-device copy from pageable memory waits for the stream's work (torch synchronizes the stream after
it), and the overlap schedule builds step N+1 while the stream runs step N: its host tensors go through pinned
memory in non-blocking copies instead (torch keeps the pinned block until the copy is done). Device to host, a
pinned buffer and an event let the host wait for one step's results rather than for the whole stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`: through pinned memory, without waiting, from the host to a GPU; as `.to` otherwise."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu" or t.numel() == 0:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def read_back(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A host copy of `t` under way, and the wait for it: on a GPU a pinned buffer filled without blocking, with an
    event recorded after the copy (waiting for it waits for `t`'s work, not for what the stream runs next); a host
    tensor is its own copy, with nothing to wait for."""
    if t.device.type == "cpu":
        return t, lambda: None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done.synchronize
