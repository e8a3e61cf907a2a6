"""Kiln's Triton kernels compiled for NVIDIA GPUs, on any machine (tests/gpu_compile.py records the launches a GPU
makes and compiles each down to a cubin): the CPU tests run the kernels in Triton's interpreter, which never
compiles them, so a kernel that only the GPU's compiler refuses would otherwise first fail on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")  # its compiler and ptxas ship in Triton's wheel

SCRIPT = Path(__file__).with_name("gpu_compile.py")


@pytest.mark.parametrize("arch", [90, 89, 80], ids=["sm90-hopper", "sm89-ada", "sm80-ampere"])
def test_every_kernel_compiles_for_the_gpu(arch):
    """Within the architecture's shared memory too (the script checks it: Triton would only at a GPU's first
    launch), with half precision's attention dots on tensor cores.

    The compiled kernels are kept in Triton's own cache, as ccache keeps objects: Triton keys each by the kernel's
    source (its jitted helpers' too), the launch's specialization, the target and the compiler's versions, so a
    changed kernel is compiled again, and an unchanged one is read back with the shared memory and PTX the checks
    read."""
    cache = Path("~/.cache/kiln/test-triton").expanduser()
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(cache))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", str(arch)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=SCRIPT.parent.parent,  # the repo root: the script imports kiln from it
    )
    assert done.returncode == 0, done.stderr[-4000:]
    launches = [json.loads(line) for line in done.stdout.splitlines()]
    ops = {(x["kernel"], x["dtype"]) for x in launches}
    assert {
        (k, d) for k in ("_decode_split_kernel", "_extend_kernel") for d in ("bfloat16", "float32")
    } <= ops
    dots = [x for x in launches if x["kernel"] in ("_extend_kernel", "_decode_split_kernel")]
    # half precision's attention runs its dots on tensor cores; float32's stay IEEE float32 (the exact mode)
    assert all(x["mma"] > 0 for x in dots if x["dtype"] != "float32")
    assert all(x["mma"] == 0 for x in dots if x["dtype"] == "float32")
    fp8_weights = [x for x in launches if x["kernel"] == "_fp8_block_matmul_kernel"]
    if (
        arch < 89
    ):  # no fp8 e4m3 below 8.9: Kiln refuses such a pool with this backend, and dequantizes FP8 weights
        assert not any(x.get("pool") == "float8_e4m3fn" for x in launches) and not fp8_weights
    else:
        assert any(x.get("pool") == "float8_e4m3fn" for x in launches)
        # FP8 weights multiplied in bfloat16 and float16 on tensor cores, decode's rows and a prefill's
        assert {(x["dtype"], x["rows"]) for x in fp8_weights if x["mma"] > 0} == {
            (d, r) for d in ("bfloat16", "float16") for r in ("4", "512")
        }


@pytest.mark.unit
def test_an_fp8_e4m3_pool_is_refused_below_compute_capability_8_9():
    from types import SimpleNamespace

    from kiln.scheduler.resolve import attention_refusal

    args, llama = SimpleNamespace(attention_backend="triton"), SimpleNamespace(mla=None)
    refusal = attention_refusal(args, llama, "fp8_e4m3", (8, 0))
    assert (
        "8.0" in refusal
        and "--kv-cache-dtype fp8_e5m2" in refusal
        and "--attention-backend torch_native" in refusal
    )
    assert attention_refusal(args, llama, "fp8_e4m3", (9, 0)) is None
    assert attention_refusal(args, llama, "fp8_e5m2", (8, 0)) is None
    assert attention_refusal(args, llama, "fp8_e4m3", None) is None  # the CPU: the interpreter converts it
    assert attention_refusal(SimpleNamespace(attention_backend=None), llama, "fp8_e4m3", (8, 0)) is None
    assert attention_refusal(args, SimpleNamespace(mla=object()), "fp8_e4m3", (8, 0)) is None
