"""Which rank the front blames for a stall: ranks meet at every turn's start, so the one that stopped on its own has
begun fewer turns than the ones waiting for it, even when it stamped its clock later (it was slower to start)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from kiln.config import ServerArgs
from kiln.scheduler.engine_proc import Beat
from kiln.server.ranks import RankProcesses

pytestmark = pytest.mark.unit


def ranks_with(beats: dict[int, tuple[int, float]]) -> RankProcesses:
    ranks = RankProcesses(ServerArgs(model_path="m", tp_size=len(beats)))
    for rank, (turns, ago) in beats.items():
        ranks.beats[rank] = Beat(mp.RawValue("d", time.time() - ago), mp.RawValue("q", turns))
        ranks.ready.add(rank)
    return ranks


def test_a_rank_stalled_before_its_first_turn_is_blamed_though_its_peer_stamped_earlier():
    # rank 0 began its first turn 30 s ago and waits for rank 1 there; rank 1 stamped 25 s ago and never turned
    assert ranks_with({0: (1, 30.0), 1: (0, 25.0)}).stalled_rank(20)[0] == 1


def test_among_ranks_on_the_same_turn_the_oldest_stamp_is_blamed():
    rank, silent = ranks_with({0: (7, 21.0), 1: (7, 40.0)}).stalled_rank(20)
    assert rank == 1 and silent >= 40


def test_a_rank_behind_but_recent_is_no_stall():
    assert ranks_with({0: (8, 0.1), 1: (7, 5.0)}).stalled_rank(20) is None


def test_the_stamp_counts_turns_only_when_asked():
    beat = Beat(mp.RawValue("d", 0.0), mp.RawValue("q", 0))
    beat.stamp()
    beat.stamp(turn=True)
    beat.stamp(turn=True)
    turns, stamped = beat.lag()
    assert turns == 2 and time.time() - stamped < 5
