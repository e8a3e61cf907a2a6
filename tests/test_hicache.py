"""The two-tier radix cache (HiRadixCache over a HostKVPool): evicted prefixes move to the host tier and come back
with the same KV; under random programs of inserts, matches, locks and evictions, for each write policy and page
size, every match returns slots whose KV is what was computed for that prefix, and the tiers' accounting holds
(device: free + cached + in use == total; host: held + free == total; device nodes a subtree holding every lock)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tier_copies import Held, hold_copies

from kiln.memory.allocator import TokenAllocator
from kiln.memory.hiradix_cache import WRITE_POLICIES, HiRadixCache
from kiln.memory.host_pool import HostKVPool
from kiln.memory.kv_pool import KVPool
from kiln.memory.storage_tier import FileStorageTier, model_fingerprint

pytestmark = pytest.mark.engine

BLOCK = 4  # storage block tokens in these tests


def row_of(prefix: tuple[int, ...]) -> float:
    """The KV a model would compute for the last token of this prefix: depends on the whole prefix."""
    return float(hash(prefix) % 100_003)


class Harness:
    def __init__(
        self,
        policy: str,
        page: int = 1,
        device_tokens: int = 24,
        host_tokens: int = 48,
        storage_dir: Path | None = None,
    ):
        self.pool = KVPool(device_tokens, page, num_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32)
        self.allocator = TokenAllocator(device_tokens, page)
        self.host = HostKVPool(self.pool, host_tokens)
        storage = None
        if storage_dir is not None:
            tensors = [*self.pool.k, *self.pool.v]
            storage = FileStorageTier(str(storage_dir), model_fingerprint({"test": page}), tensors, BLOCK)
        self.cache = HiRadixCache(self.allocator, self.host, policy, storage)
        self.page = page

    def compute(self, key: list[int]) -> torch.Tensor | None:
        """A request's prefill: match, allocate the rest, write its KV, insert; returns the slots or None."""
        match = self.cache.acquire_prefix(key)
        self.check_rows(key, match.indices)
        self.cache.lock(match.node)
        cached = match.indices.numel()
        n = len(key) - cached
        pages = -(-n // self.page) * self.page
        if self.allocator.available_size() < pages:
            self.cache.evict(pages - self.allocator.available_size())
        last = int(match.indices[-1]) if cached else -1
        fresh = self.allocator.alloc_extend([cached], [last], [n]) if n else torch.empty(0, dtype=torch.int64)
        self.cache.unlock(match.node)
        if fresh is None:
            return None
        slots = torch.cat([match.indices, fresh])
        for pos in range(match.indices.numel(), len(key)):
            for layer in range(2):
                self.pool.k[layer][slots[pos]] = row_of(tuple(key[: pos + 1]))
                self.pool.v[layer][slots[pos]] = -row_of(tuple(key[: pos + 1]))
        already = self.cache.insert(key, slots)
        if self.cache.storage is not None:
            self.cache.storage.drain()  # the files on disk before the next step: a deterministic program
        end = len(key) // self.page * self.page
        if already > match.indices.numel():
            self.allocator.free(slots[match.indices.numel() : already])
        if len(key) > end:
            self.allocator.free(slots[end:])
        return slots

    def check_rows(self, key: list[int], slots: torch.Tensor) -> None:
        for pos, slot in enumerate(slots.tolist()):
            want = row_of(tuple(key[: pos + 1]))
            for layer in range(2):
                assert self.pool.k[layer][slot, 0, 0].item() == want, f"k of token {pos} of {key}"
                assert self.pool.v[layer][slot, 0, 0].item() == -want

    def check_accounting(self) -> None:
        self.cache.debug_check()
        held = self.cache.total_size()
        assert self.allocator.available_size() + held == self.allocator.size


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.unit
def test_an_evicted_prefix_comes_back_from_the_host_with_its_kv(policy: str) -> None:
    h = Harness(policy)
    key = list(range(100, 116))
    h.compute(key)
    if policy == "write_through_selective":  # backed up on its second hit only
        h.cache.acquire_prefix(key)
        h.cache.acquire_prefix(key)
    assert h.cache.evict(16) == 16
    assert h.cache.total_size() == 0 and h.cache.host_cached_tokens() == 16
    h.check_accounting()
    match = h.cache.acquire_prefix(key)
    assert match.indices.numel() == 16 and h.cache.host_hit_tokens == 16
    h.check_rows(key, match.indices)
    h.check_accounting()


@pytest.mark.unit
def test_a_prefix_whose_copy_to_the_host_is_still_in_flight_comes_back_with_its_kv() -> None:
    h = Harness("write_back", device_tokens=16)
    copies = hold_copies(h.host.copies)
    key = list(range(100, 112))
    h.compute(key)
    h.compute(list(range(40, 52)))  # evicts `key` to the host: its copy is in flight
    assert h.cache.host_integrity()["in_flight"] == 12 and not copies[0].released
    match = h.cache.acquire_prefix(key)  # loads it back: the copy lands first
    assert match.indices.numel() == 12 and copies[0].released
    h.check_rows(key, match.indices)
    h.check_accounting()


@pytest.mark.unit
def test_eviction_fences_the_copies_before_its_slots_are_reused() -> None:
    """On CUDA a store's gathers run on the copy stream: the slots an eviction frees must not be written by the
    next step before they are read (a no-op on the CPU, where the gather is done when issued)."""
    h = Harness("write_back", device_tokens=16)
    fences: list[int] = []
    h.host.copies.fence = lambda: fences.append(h.host.copies.in_flight_tokens)
    h.compute(list(range(100, 112)))
    assert fences == []
    h.compute(list(range(40, 52)))  # evicts the first prompt: its store issued, then the fence
    assert fences == [12]


@pytest.mark.unit
def test_without_a_host_copy_selective_eviction_drops_the_prefix() -> None:
    h = Harness("write_through_selective")
    key = list(range(16))
    h.compute(key)
    h.cache.evict(16)
    assert h.cache.acquire_prefix(key).indices.numel() == 0 and h.cache.host_hit_tokens == 0
    h.check_accounting()


@pytest.mark.unit
def test_a_full_host_tier_keeps_the_most_recent_prefixes() -> None:
    h = Harness("write_back", device_tokens=16, host_tokens=16)
    old, new = list(range(0, 12)), list(range(50, 62))
    h.compute(old)
    h.compute(new)  # evicts `old` to the host
    h.cache.evict(16)  # `new` to the host: the host drops `old`, the least recently used
    h.check_accounting()
    assert h.cache.acquire_prefix(old).indices.numel() == 0
    match = h.cache.acquire_prefix(new)
    assert match.indices.numel() == 12
    h.check_rows(new, match.indices)


@pytest.mark.unit
def test_a_locked_prefix_never_leaves_the_device() -> None:
    h = Harness("write_back", device_tokens=16)
    key = list(range(12))
    h.compute(key)
    match = h.cache.acquire_prefix(key)
    h.cache.lock(match.node)
    assert h.cache.evict(16) == 0
    assert h.compute(list(range(40, 52))) is None  # no room: the locked prefix stays
    h.cache.unlock(match.node)
    h.check_accounting()


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(WRITE_POLICIES),
    page=st.sampled_from([1, 2]),
    storage=st.booleans(),
    slow_copies=st.booleans(),
    program=st.lists(
        st.tuples(
            st.sampled_from(["compute", "evict", "flush_host", "copies_done"]),
            st.integers(0, 5),
            st.integers(1, 12),
        ),
        min_size=1,
        max_size=25,
    ),
)
@pytest.mark.unit
def test_random_programs_keep_kv_and_accounting(
    policy: str, page: int, storage: bool, slow_copies: bool, program
) -> None:
    """Prompts share prefixes (a few stems, various lengths), so splits, partial hits on any tier, host
    eviction and dropping host subtrees on insert all happen. slow_copies: the host tier's stores stay in flight
    until the program lets them finish, with little staging, so loads of rows still in flight, stores
    landing over freed and reused host slots, and staging waits happen too."""
    with tempfile.TemporaryDirectory() as tmp:
        h = Harness(policy, page=page, storage_dir=Path(tmp) if storage else None)
        copies: list[Held] = []
        if slow_copies:
            h.host.copies.host_staging_bytes = 24 * h.host.row_bytes()
            copies = hold_copies(h.host.copies)
        _run_program(h, program, copies)


def _run_program(h: Harness, program, copies: list[Held]) -> None:
    stems = [[7, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [7, 7, 8, 9, 30, 31, 32, 33, 34, 35, 36, 37]]
    for op, which, length in program:
        if op == "compute":
            stem = stems[which % 2]
            h.compute(stem[:length] + [200 + which] * (which % 3))
        elif op == "evict":
            h.cache.evict(length)
        elif op == "flush_host":
            h.cache._evict_host(length)
        else:  # the copies issued so far, but the last `which`, are done
            for copy in copies[: max(len(copies) - which, 0)]:
                copy.released = True
        h.check_accounting()


# ---------------------------------------------------------------------------------------------- the storage tier


@pytest.mark.unit
def test_a_match_counts_the_host_tier_and_moves_nothing(tmp_path: Path) -> None:
    """The lookup that orders the queue changes nothing: a prefix on the host stays there (its load is admission's
    acquire_prefix), the stored blocks are not read, no node is split and no LRU time moves."""
    h = Harness("write_through", storage_dir=tmp_path)
    key = list(range(100, 116))
    h.compute(key)
    h.cache.storage.drain()
    assert h.cache.evict(16) == 16
    nodes = list(h.cache._iter_nodes())
    state = [(n.value is None, n.host_value is not None, len(n.key), n.last_access_time) for n in nodes]
    assert h.cache.match_prefix(key) == 16 and h.cache.match_prefix(key[:10] + [0] * 6) == 10
    assert h.cache.host_hit_tokens == 0 and h.cache.storage.hit_tokens == 0 and h.cache.total_size() == 0
    assert [
        (n.value is None, n.host_value is not None, len(n.key), n.last_access_time) for n in nodes
    ] == state
    assert list(h.cache._iter_nodes()) == nodes
    assert h.cache.acquire_prefix(key).indices.numel() == 16 and h.cache.host_hit_tokens == 16


def _stored_then_restarted(tmp_path: Path, key: list[int]) -> Harness:
    first = Harness("write_through", storage_dir=tmp_path)
    first.compute(key)
    first.cache.storage.drain()
    return Harness("write_through", storage_dir=tmp_path)  # a restart: empty tiers, the same files


@pytest.mark.unit
def test_a_restarted_cache_hits_the_stored_blocks(tmp_path: Path) -> None:
    key = list(range(300, 314))  # three whole blocks of 4, and 2 tokens no block holds
    h = _stored_then_restarted(tmp_path, key)
    match = h.cache.acquire_prefix(key)
    assert match.indices.numel() == 12 and h.cache.storage.hit_tokens == 12
    h.check_rows(key, match.indices)
    h.check_accounting()
    again = h.cache.acquire_prefix(key)  # now from the tree itself
    assert torch.equal(again.indices, match.indices) and h.cache.storage.hit_tokens == 12


@pytest.mark.unit
def test_a_partial_tree_hit_continues_from_storage(tmp_path: Path) -> None:
    key = list(range(300, 314))
    h = _stored_then_restarted(tmp_path, key)
    h.compute(key[:6])  # block 0 comes from disk, 2 tokens are computed: the tree holds 6
    assert h.cache.storage.hit_tokens == 4
    match = h.cache.acquire_prefix(key)  # the rest of block 1 and block 2 come from disk
    assert match.indices.numel() == 12 and h.cache.storage.hit_tokens == 4 + 6
    h.check_rows(key, match.indices)
    h.check_accounting()


def _corrupt_second_block(tmp_path: Path, how: str) -> None:
    files = sorted(tmp_path.rglob("*.kv"), key=lambda p: p.stat().st_mtime_ns)
    data = files[1].read_bytes()
    if how == "flip":
        files[1].write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    elif how == "truncate":
        files[1].write_bytes(data[: len(data) // 2])
    else:  # a foreign file under this name: the first block's file
        files[1].write_bytes(files[0].read_bytes())


@pytest.mark.parametrize("how", ["flip", "truncate", "foreign"])
@pytest.mark.unit
def test_a_bad_file_is_skipped_with_a_warning(tmp_path: Path, caplog, how: str) -> None:
    key = list(range(300, 312))
    first = Harness("write_through", storage_dir=tmp_path)
    first.compute(key)
    first.cache.storage.drain()
    _corrupt_second_block(tmp_path, how)
    h = Harness("write_through", storage_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        match = h.cache.acquire_prefix(key)
    assert match.indices.numel() == 4  # block 0 only: the bad block ends the run, block 2 is not reached
    h.check_rows(key, match.indices)
    assert h.cache.storage.skipped_files == 1 and "KV storage: skipped" in caplog.text
    assert len(list(tmp_path.rglob("*.kv"))) == 2  # the bad file is gone, to be written again


WRITER = """
import os, sys, time, torch
from kiln.memory.storage_tier import FileStorageTier
tier = FileStorageTier(sys.argv[1], "f" * 64, [torch.zeros(64, 2)], 4)
real_replace = os.replace
def stalled_replace(src, dst):
    print("written", flush=True)
    time.sleep(600)
os.replace = stalled_replace
tier.write(list(range(4)), torch.arange(1, 5))
time.sleep(600)
"""


@pytest.mark.unit
def test_a_kill_mid_write_leaves_nothing_a_start_reads(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.kv"))
    tier = FileStorageTier(str(tmp_path), "f" * 64, [torch.zeros(64, 2)], 4)
    assert not list(tmp_path.rglob("*.tmp"))  # the dead writer's temporary file is removed
    assert tier.load(tier.block_names(list(range(4)))) == []


# ---------------------------------------------------------------------------------------------- in the engine

GREEDY = {"max_new_tokens": 6, "temperature": 0}


def _prompt(seed: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(40))  # ~190 tokens: two overflow the pool


def _run(model: str, **tier) -> tuple[list[list[int]], list[int], object]:
    """Prompt 0, then 1 and 2 (which evict 0 from the 256-token device pool), then 0 again."""
    import kiln

    eng = kiln.Engine(model_path=model, device="cpu", max_total_tokens=256, chunked_prefill_size=64, **tier)
    try:
        outs = [eng.generate(_prompt(s), GREEDY) for s in (0, 1, 2, 0)]
        cache = eng.scheduler.kv.cache
        cache.debug_check()
        report = eng.scheduler.check_integrity()
        assert report["ok"] and ("host" in report) == bool(tier), report
        if tier:  # the figures /metrics shows
            stats = eng.scheduler.make_stats()
            assert stats.host_hit_tokens == cache.host_hit_tokens and stats.host_bytes_written > 0
            assert 0 < stats.host_used_tokens <= stats.host_tier_tokens
        return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs], cache
    finally:
        eng.shutdown()


@pytest.mark.engine
def test_the_engine_serves_an_evicted_prefix_from_the_host_tier(tiny_llama: str) -> None:
    plain_ids, plain_cached, _ = _run(tiny_llama)
    tier_ids, tier_cached, cache = _run(tiny_llama, enable_hierarchical_cache=True, hicache_ratio=4.0)
    assert tier_ids == plain_ids  # greedy outputs identical with the tier on and off
    assert plain_cached[3] <= 1  # one tier: prompt 0 was evicted (all but the BOS token the prompts share)
    assert tier_cached[3] >= 100  # two tiers: it came back from the host
    assert (
        cache.host_hit_tokens >= tier_cached[3] - 1 and cache.host.bytes_written > 0
    )  # BOS stayed on the device


def _once(model: str, prompt: str, **tier) -> tuple[list[int], int]:
    import kiln

    eng = kiln.Engine(model_path=model, device="cpu", max_total_tokens=512, **tier)
    try:
        out = eng.generate(prompt, GREEDY)
        eng.scheduler.kv.cache.storage.drain()
        return out["output_ids"], out["meta_info"]["cached_tokens"]
    finally:
        eng.shutdown()


def test_a_restarted_engine_serves_a_prefix_from_storage(tiny_llama: str, tmp_path: Path) -> None:
    tier = dict(
        enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path)
    )
    cold_ids, cold_cached = _once(tiny_llama, _prompt(7), **tier)
    assert cold_cached == 0 and list(tmp_path.rglob("*.kv"))
    warm_ids, warm_cached = _once(tiny_llama, _prompt(7), **tier)  # a new engine: empty device and host tiers
    assert warm_ids == cold_ids
    assert warm_cached >= 128  # the prompt's whole 64-token blocks came from disk
    for path in tmp_path.rglob("*.kv"):  # damaged on disk: a start skips them and computes the prompt
        data = path.read_bytes()
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0x55]))
    damaged_ids, damaged_cached = _once(tiny_llama, _prompt(7), **tier)
    assert damaged_ids == cold_ids and damaged_cached == 0


@pytest.mark.unit
def test_plan_shows_the_tiers(tiny_llama: str, tmp_path: Path, capsys) -> None:
    import json

    import kiln.plan as plan

    flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-dir"]
    rc = plan.main(["--model-path", tiny_llama, "--device", "cpu", *flags, str(tmp_path / "kv"), "--json"])
    lines = {line["name"]: line for line in json.loads(capsys.readouterr().out)["lines"]}
    assert rc == 0
    assert lines["host tier per rank"]["bytes"] == 2 * lines["kv pool"]["bytes"]  # --hicache-ratio 2
    assert (
        lines["storage tier disk free"]["bytes"] > 0
        and str(tmp_path) in lines["storage tier disk free"]["inputs"]
    )
