"""The LoRA slot pool's bookkeeping: which adapter each of the --max-loras-per-batch slots holds, how many running
requests pin it, and when it was last used. Pure: the weights are written by the caller (kiln.runner.lora).

A request pins its adapter's slot from admission to its end, so the slots bound the distinct adapters of a batch. An
adapter not in a slot takes a free one, else the least recently used slot no request pins; when every slot is
pinned the request waits for one."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class SlotTable:
    num_slots: int
    holder: list[int | None] = field(init=False)  # the adapter uid in each slot
    pins: list[int] = field(init=False)
    last_used: list[int] = field(init=False)
    _clock: itertools.count = field(init=False, default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.holder = [None] * self.num_slots
        self.pins = [0] * self.num_slots
        self.last_used = [0] * self.num_slots

    def slot_of(self, uid: int) -> int | None:
        return self.holder.index(uid) if uid in self.holder else None

    def take(self, uid: int) -> tuple[int, bool] | None:
        """Pin a slot for adapter `uid`: (slot, whether its weights must be written there), or None when every
        slot is pinned by other adapters."""
        slot, fresh = self.slot_of(uid), False
        if slot is None:
            idle = [s for s in range(self.num_slots) if self.pins[s] == 0]
            if not idle:
                return None
            empty = [s for s in idle if self.holder[s] is None]
            slot = empty[0] if empty else min(idle, key=lambda s: self.last_used[s])
            self.holder[slot], fresh = uid, True
        self.pins[slot] += 1
        self.last_used[slot] = next(self._clock)
        return slot, fresh

    def release(self, slot: int) -> None:
        assert self.pins[slot] > 0, f"release of LoRA slot {slot}, which no request pins"
        self.pins[slot] -= 1

    def drop(self, uid: int) -> int | None:
        """Adapter `uid` unloaded: its slot, if no request pins it, is emptied and returned (to be zeroed); a pinned
        slot keeps serving its requests and is reused once they end (the uid is never asked for again)."""
        slot = self.slot_of(uid)
        if slot is None or self.pins[slot]:
            return None
        self.holder[slot] = None
        return slot

    def in_use(self) -> dict[int, int]:
        """Pinned slots' adapter uids and pin counts."""
        return {uid: p for uid, p in zip(self.holder, self.pins) if uid is not None and p}
