"""--kv-cache-dtype: the KV pool stores K and V in bfloat16, float16 or fp8 (e4m3fn / e5m2), converting on store;
Kiln's CPU decode kernel reads such a pool converting in registers and gives bit for bit what it gives on the same
values held in float32, and the torch backends read it converted; the ledger counts the stored bytes, which the pool
holds, and `kiln plan` names the dtype; a tiny random Llama's logits with each KV dtype stay within a bound of the
float32-KV run's, teacher-forced through decode steps that read the pool."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import kiln.plan as plan
from kiln.config import ServerArgs
from kiln.core.dtypes import dtype_bytes, kv_cache_dtype_name, kv_torch_dtype
from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.layers.cpu_gemm import cpu_decode_attention, has_cpu_decode_attention
from kiln.loader.model_config import load_model_config, read_model_spec
from kiln.memory.fix_search import serve_accepts
from kiln.memory.kv_pool import KVPool, LatentKVPool, copyable
from kiln.memory.ledger import compute_ledger
from kiln.memory.ledger_types import LedgerInputs
from kiln.runner.attention import CpuKernelBackend, TorchSdpaBackend, make_attention_backend
from kiln.runner.model_runner import ModelRunner, PoolSizes

pytestmark = pytest.mark.engine

NARROW = ("bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
HQ, HK, D = 9, 3, 64
KERNEL = has_cpu_decode_attention(torch.zeros(1, dtype=torch.bfloat16))
needs_kernel = pytest.mark.skipif(not KERNEL, reason="Kiln's CPU kernels are not built on this host")


def _pool(dtype: str, tokens: int = 1024, hk: int = HK, d: int = D, seed: int = 0) -> tuple[KVPool, KVPool]:
    """A pool of `dtype` filled with random rows (written through write(), which converts), and a float32 pool
    holding the same values."""
    g = torch.Generator().manual_seed(seed)
    narrow = KVPool(tokens, 1, 1, hk, d, kv_torch_dtype(dtype))
    slots = torch.arange(tokens + 1)
    narrow.write(
        0, slots, torch.randn(tokens + 1, hk, d, generator=g), torch.randn(tokens + 1, hk, d, generator=g)
    )
    wide = KVPool(tokens, 1, 1, hk, d, torch.float32)
    wide.write(0, slots, narrow.k[0], narrow.v[0])
    return narrow, wide


def _table(batch: int, prefix: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] scattered slots sharing `prefix` leading ones, ragged lengths (mask)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(1023, generator=g) + 1
    tails = [1 + (7 * b) % 23 for b in range(batch)]
    table = torch.cat(
        [perm[:prefix].expand(batch, prefix), perm[prefix : prefix + batch * 24].view(batch, 24)], 1
    )
    mask = torch.arange(prefix + 24).unsqueeze(0) < torch.tensor([prefix + t for t in tails]).unsqueeze(1)
    return table, mask


def _sdpa(q, k, v, mask, scale):
    """SDPA over gathered rows k, v [B, L, Hk, D] (float32)."""
    return F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.view(len(q), 1, 1, -1), scale=scale,
        enable_gqa=True,
    ).squeeze(2)  # fmt: skip


# ---------------------------------------------------------------------------------------------- names and flags
@pytest.mark.unit
def test_names_flags_and_sizes():
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    for given, canonical in [("bf16", "bfloat16"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")]:
        args = ServerArgs.from_cli(parser.parse_args(["--kv-cache-dtype", given]))
        assert args.kv_cache_dtype == canonical
    for refused in ("fp4_e2m1", "nvfp4"):
        with pytest.raises(argparse.ArgumentError):
            parser.parse_args(["--kv-cache-dtype", refused])
    assert serve_accepts({"--kv-cache-dtype": "fp8_e4m3"}) and serve_accepts({"--kv-cache-dtype": "fp8_e5m2"})
    assert (
        kv_torch_dtype("fp8_e4m3") == torch.float8_e4m3fn and kv_torch_dtype("fp8_e5m2") == torch.float8_e5m2
    )
    assert kv_torch_dtype("bf16") == torch.bfloat16 and kv_cache_dtype_name("auto", "float32") == "float32"
    assert [dtype_bytes(n) for n in NARROW] == [2, 2, 1, 1]
    with pytest.raises(ValueError, match="fp4_e2m1"):
        kv_cache_dtype_name("fp4_e2m1", "float32")


# ---------------------------------------------------------------------------------------------- the pool
@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.unit
def test_writes_convert_on_store_and_gather_as_reads_converted(dtype):
    pool = KVPool(16, 1, 2, 2, 8, kv_torch_dtype(dtype))
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([4, 9, 2])
    pool.write(1, slots, k, v)
    assert pool.dtype == kv_torch_dtype(dtype) and pool.k[1].dtype == pool.dtype
    got_k, got_v = pool.gather_as(1, slots, torch.float32)
    assert got_k.dtype == torch.float32
    assert torch.equal(got_k, k.to(pool.dtype).float()) and torch.equal(got_v, v.to(pool.dtype).float())
    latent = LatentKVPool(16, 1, 1, 12, kv_torch_dtype(dtype))
    rows = torch.randn(3, 12)
    latent.write(0, slots, rows)
    assert torch.equal(latent.gather_as(0, slots, torch.float32), rows.to(latent.dtype).float())
    assert latent.k_bytes == 17 * 12 * dtype_bytes(dtype)


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.unit
def test_tiers_copy_rows_of_every_dtype_bit_for_bit(dtype):
    """The host and storage tiers copy pool rows with index_select / index_copy_, which torch lacks for fp8 on the
    CPU: they copy through copyable(), bytes for fp8."""
    pool, _ = _pool(dtype, tokens=32)
    host = torch.zeros_like(pool.k[0])
    slots = torch.tensor([3, 7, 30])
    copyable(host).index_copy_(0, slots, copyable(pool.k[0]).index_select(0, slots))
    assert torch.equal(host[slots].view(torch.uint8), pool.k[0][slots].view(torch.uint8))
    assert copyable(pool.k[0]).data_ptr() == pool.k[0].data_ptr()


# ---------------------------------------------------------------------------------------------- the kernel
@needs_kernel
@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("batch, prefix", [(1, 0), (5, 0), (9, 104)])
@pytest.mark.unit
def test_kernel_reads_a_narrow_pool_as_its_float32_values(dtype, batch, prefix):
    """The kernel on a narrow pool equals, bit for bit, the kernel on a float32 pool of the same values (each
    element converted exactly, in registers), the shared-prefix walk included; and torch's SDPA on the rows
    gathered and converted."""
    narrow, wide = _pool(dtype, seed=batch)
    table, mask = _table(batch, prefix, seed=batch)
    q = torch.randn(batch, HQ, D)
    kernel = cpu_decode_attention()
    got = kernel(q, narrow.k[0], narrow.v[0], table, mask, 0.125, prefix)
    assert torch.equal(got, kernel(q, wide.k[0], wide.v[0], table, mask, 0.125, prefix))
    assert torch.equal(got, kernel(q, narrow.k[0], narrow.v[0], table, mask, 0.125, 0))
    k, v = narrow.gather_as(0, table, torch.float32)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, 0.125), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.unit
def test_every_fp8_byte_reads_as_torch_converts_it(dtype):
    """Each of the 256 bytes as a V row of one slot (weight 1): the kernel's vector conversion gives torch's value,
    infinities and NaNs included."""
    torch_type = kv_torch_dtype(dtype)
    pool = KVPool(256, 1, 1, 1, 8, torch_type)
    pool.v[0].view(torch.uint8)[1:, 0, :] = torch.arange(256, dtype=torch.uint8).unsqueeze(1)
    table = torch.arange(1, 257).view(256, 1)
    out = cpu_decode_attention()(torch.zeros(256, 1, 8), pool.k[0], pool.v[0], table, torch.empty(0), 1.0)
    want = torch.arange(256, dtype=torch.uint8).view(torch_type).float()
    got = out[:, 0, :]
    assert torch.equal(got.isnan(), want.isnan().unsqueeze(1).expand(256, 8))
    assert torch.equal(got.nan_to_num(nan=0.5), want.nan_to_num(nan=0.5).unsqueeze(1).expand(256, 8))


@needs_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.unit
def test_backends_on_a_narrow_pool_match_the_float32_pool_of_its_values(dtype):
    """Decode through the kernel backend and torch SDPA's (gathers converted), and an extend on a cached prefix:
    each the same as on a float32 pool holding the narrow pool's values (the new rows written are rounded alike)."""
    narrow, wide = _pool(dtype, seed=3)
    assert isinstance(make_attention_backend(narrow, HQ, torch.float32), CpuKernelBackend)
    table, mask = _table(4, 16, seed=3)
    loc = table[:, 16]
    q, k, v = torch.randn(4, HQ, D), torch.randn(4, HK, D), torch.randn(4, HK, D)
    k, v = k.to(narrow.dtype).float(), v.to(narrow.dtype).float()  # the rows as both pools store them
    decode = ForwardBatch(
        ForwardMode.DECODE, loc, loc, loc, None, kv_table=table, kv_mask=mask.view(4, 1, 1, -1)
    )
    for backend_type in (CpuKernelBackend, TorchSdpaBackend):
        outs = []
        for pool in (narrow, wide):
            backend = backend_type(pool, HQ)
            fb = replace(decode, attn=backend.prepare_metadata(decode))
            outs.append(backend.forward(0, q, k, v, fb, 0.125))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    slots = table[0, :20]
    extend = ForwardBatch(
        ForwardMode.EXTEND, slots[12:], slots[12:], slots[12:], None, extend_lens=[8], prefix_lens=[12],
        seq_slots=[slots],
    )  # fmt: skip
    q8 = torch.randn(8, HQ, D)
    k8, v8 = (torch.randn(8, HK, D).to(narrow.dtype).float() for _ in range(2))
    outs = []
    for pool in (narrow, wide):
        backend = TorchSdpaBackend(pool, HQ)
        outs.append(
            backend.forward(0, q8, k8, v8, replace(extend, attn=backend.prepare_metadata(extend)), 0.125)
        )
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- a model
@pytest.fixture(scope="module")
def runner(tiny_llama) -> Iterator[ModelRunner]:
    """The tiny Llama on one torch thread (its steps are too small to split, and threads that wait on each other
    on a busy host take longer than one), its pool remade per KV dtype by _use_pool."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    model = ModelRunner(load_model_config(tiny_llama), torch.float32, torch.float32, "cpu")
    model.load(256)
    yield model
    torch.set_num_threads(before)


def _use_pool(runner: ModelRunner, dtype: str, tokens: int = 160) -> None:
    runner.kv_dtype = kv_torch_dtype(dtype)
    runner.init_memory_pool(PoolSizes(tokens, 2, 160, 1))


def _decode_logits(runner: ModelRunner, ids: list[int], prefill: int) -> torch.Tensor:
    """Logits after each token from ids[prefill - 1] on: a prefill of the first `prefill` tokens, then one
    teacher-forced decode step per token, each reading the sequence's K and V back from the pool."""
    slots = torch.arange(1, len(ids) + 1)
    first = ForwardBatch(
        ForwardMode.EXTEND, torch.tensor(ids[:prefill]), torch.arange(prefill), slots[:prefill],
        torch.tensor([prefill - 1]), extend_lens=[prefill], prefix_lens=[0], seq_slots=[slots[:prefill]],
    )  # fmt: skip
    rows = [runner.forward(first)]
    for t in range(prefill, len(ids) - 1):
        step = ForwardBatch(
            ForwardMode.DECODE, torch.tensor([ids[t]]), torch.tensor([t]), slots[t : t + 1], None,
            kv_table=slots[: t + 1].unsqueeze(0),
        )  # fmt: skip
        rows.append(runner.forward(step))
    return torch.cat(rows).float()


# per KV dtype: the largest logit difference from the float32-KV run over the decoded tokens (logits of magnitude
# ~3) and the least share of decoded tokens whose argmax agrees with it, each with a margin of two to three times
# over what was measured on this model with several prompts; fp8_e5m2 keeps two mantissa bits and is the coarsest
BOUNDS = {"bfloat16": (0.03, 0.98), "float16": (0.004, 0.98), "fp8_e4m3": (0.4, 0.8), "fp8_e5m2": (0.8, 0.7)}


def test_logits_with_each_kv_dtype_stay_near_float32_kv(runner):
    ids = torch.randint(3, 4000, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    _use_pool(runner, "float32")
    base = _decode_logits(runner, ids, 32)
    diffs = {}
    for dtype in NARROW:
        _use_pool(runner, dtype)
        got = _decode_logits(runner, ids, 32)
        assert torch.equal(got[0], base[0]), (
            "a fresh prompt attends to its own K and V, not the pool's rounding"
        )
        diffs[dtype] = (got - base).abs().max().item()
        agree = (got.argmax(-1) == base.argmax(-1)).double().mean().item()
        bound, least = BOUNDS[dtype]
        assert 0 < diffs[dtype] <= bound and agree >= least, (dtype, diffs[dtype], agree)
    # the fewer mantissa bits, the further: float16 (10) < bfloat16 (7) < fp8_e4m3 (3) < fp8_e5m2 (2)
    assert sorted(diffs, key=diffs.get) == ["float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"], diffs


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_pool_bytes_are_the_ledgers_and_plan_names_the_dtype(runner, tiny_llama, capsys, dtype):
    argv = [
        "--model-path",
        tiny_llama,
        "--device",
        "cpu",
        "--kv-cache-dtype",
        dtype,
        "--max-total-tokens",
        "1000",
    ]
    args = ServerArgs(model_path=tiny_llama, device="cpu", kv_cache_dtype=dtype, max_total_tokens=1000)
    ledger = compute_ledger(LedgerInputs.from_args(args, read_model_spec(tiny_llama)))
    _use_pool(runner, dtype, ledger.max_total_num_tokens)
    assert runner.measured["kv_pool"] == ledger.line("kv pool").bytes
    assert plan.main(argv) == 0
    assert f"x {dtype_bytes(dtype)} B ({dtype})" in capsys.readouterr().out
