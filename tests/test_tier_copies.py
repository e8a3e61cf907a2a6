"""The host tier's copies (kiln.memory.tier_copies) on the CPU, with copies held back to play a GPU's slow ones:
a store is in flight until its copy is done, lands in the order issued, is landed first by a load of its rows or
by staging past its bound, and keeps the rows of the moment it was issued."""

from __future__ import annotations

import pytest
import torch

from kiln.memory.tier_copies import TierCopies

pytestmark = pytest.mark.unit


class Held:
    """A copy that is done only when released, or when the host waits for it (which `log` records, if given)."""

    def __init__(self, log: list[str] | None = None, name: str = "") -> None:
        self.log, self.name, self.released = log, name, False

    def query(self) -> bool:
        return self.released

    def synchronize(self) -> None:
        if not self.released and self.log is not None:
            self.log.append(f"waited {self.name}")
        self.released = True


def hold_copies(c: TierCopies, log: list[str] | None = None) -> list[Held]:
    """Make every store `c` issues from now on a Held copy, named by its order; the list of them."""
    held: list[Held] = []

    def issue() -> Held:
        held.append(Held(log, f"store {len(held)}"))
        return held[-1]

    c._done_on_cpu = issue
    return held


def copies(tokens: int = 8, host_staging_bytes: int = 1 << 30) -> tuple[TierCopies, list[Held], list[str]]:
    device = [torch.arange(tokens * 4, dtype=torch.float32).view(tokens, 2, 2) + 1000 * i for i in range(2)]
    host = [torch.zeros(tokens, 2, 2) for _ in range(2)]
    c = TierCopies(device, host, host_staging_bytes=host_staging_bytes)
    log: list[str] = []
    return c, hold_copies(c, log), log


def slots(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_a_store_lands_at_a_poll_once_its_copy_is_done() -> None:
    c, held, log = copies()
    c.store(slots(1, 2), slots(5, 6))
    c.poll()
    assert c.in_flight_tokens == 2 and torch.equal(c.host[0][5], torch.zeros(2, 2))  # not yet
    held[0].released = True
    c.poll()
    assert c.in_flight_tokens == 0 and log == []
    assert torch.equal(c.host[0][5:7], c.device[0][1:3]) and torch.equal(c.host[1][5:7], c.device[1][1:3])


def test_stores_land_in_the_order_issued() -> None:
    """A host slot freed and stored again holds the later rows, whichever copy finished first."""
    c, held, _ = copies()
    c.store(slots(1), slots(4))
    c.store(slots(2), slots(4))
    held[1].released = True
    c.poll()
    assert c.in_flight_tokens == 2  # the second waits behind the first
    held[0].released = True
    c.poll()
    assert torch.equal(c.host[0][4], c.device[0][2])


def test_a_store_keeps_the_rows_of_its_moment() -> None:
    """The device slots are free for reuse once a store is issued: what lands is what they held then."""
    c, held, _ = copies()
    want = c.device[0][3].clone()
    c.store(slots(3), slots(0))
    c.device[0][3] = -1.0  # the slot reused by a later step
    c.drain()
    assert torch.equal(c.host[0][0], want)


def test_a_load_lands_the_stores_writing_its_rows_first() -> None:
    c, held, log = copies()
    c.store(slots(1), slots(6))  # store 0: the rows the load reads
    c.store(slots(2), slots(7))  # store 1: other rows, issued after
    c.store(slots(3), slots(6))  # store 2: the same rows again, last
    c.device[0][0] = 0.0
    c.load(slots(6), slots(0))
    assert log == ["waited store 0", "waited store 1", "waited store 2"]  # in order, up to the last writer
    assert torch.equal(c.device[0][0], c.device[0][3])


def test_a_load_of_other_rows_does_not_wait() -> None:
    c, held, log = copies()
    c.store(slots(1), slots(6))
    c.store(slots(4), slots(3))
    c.host[0][2] = 7.0
    c.load(slots(2), slots(0))
    assert log == [] and c.in_flight_tokens == 2
    assert torch.equal(c.device[0][0], torch.full((2, 2), 7.0))


def test_staging_past_its_bound_lands_the_oldest_store() -> None:
    row = 2 * 2 * 2 * 4  # two tensors of 2 x 2 float32 a token
    c, held, log = copies(host_staging_bytes=2 * row)
    c.store(slots(0), slots(0))
    c.store(slots(1), slots(1))
    assert log == []
    c.store(slots(2), slots(2))
    assert log == ["waited store 0"] and c.in_flight_tokens == 2
    assert torch.equal(c.host[0][0], c.device[0][0])
