"""Compiles every Triton kernel launch Kiln makes on a GPU for an NVIDIA architecture, on a machine without one.

Triton's interpreter, which the CPU tests run the kernels in, never compiles them: a kernel can pass there and fail
to compile for the GPU (a dtype a dot does not take, a loop-carried value that changes type, a block too large for
shared memory). This script records the launches of Kiln's kernel wrappers (attention, fused norm / activation /
rotary, FP8 block weights) at the dtypes and shapes a GPU serves, with the launch choices the GPU makes, and
compiles each for the architecture through Triton's own binder and compiler, down to a cubin (Triton ships
ptxas), and checks each kernel's shared memory against the architecture's limit (which Triton checks only when it
loads a kernel on a device). Prints one JSON line per launch: kernel, dtypes, shared memory, and the tensor-core instructions in its
PTX; exits 1 where a kernel was never launched or takes too much shared memory.

    TRITON_INTERPRET=0 python tests/gpu_compile.py --arch 90
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels, not the interpreter's: before Triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from kiln.layers import triton_attention, triton_fp8, triton_fused  # noqa: E402

HALF = (torch.bfloat16, torch.float16)


@dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict
    what: dict = field(default_factory=dict)


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, kernel: JITFunction, launches: list[Launch]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, args, kwargs))


def kernels() -> list[tuple[object, str, JITFunction]]:
    """Kiln's Triton kernels: (module, name, kernel); their jitted helpers are compiled into them."""
    return [
        (module, name, obj)
        for module in (triton_attention, triton_fp8, triton_fused)
        for name, obj in vars(module).items()
        if isinstance(obj, JITFunction) and name.endswith("_kernel")
    ]


def record_launches(arch: int) -> list[Launch]:
    """Kiln's kernel wrappers called as a GPU of compute capability `arch` serving them calls them, with each kernel
    replaced by a Recorder."""
    launches: list[Launch] = []
    for module, name, kernel in kernels():
        setattr(module, name, Recorder(kernel, launches))

    def call(fn, *args, **what) -> None:
        before = len(launches)
        fn(*args)
        for launch in launches[before:]:
            launch.what = {k: str(v).removeprefix("torch.") for k, v in what.items()}

    for dtype, pool_dtype, dim, fn, args in attention_calls(arch):
        call(fn, *args, op=fn.__name__, dtype=dtype, pool=pool_dtype, head_dim=dim)
    for dtype in HALF:
        for fn, args in fused_calls(dtype):
            call(fn, *args, op=fn.__name__, dtype=dtype)
    for fn, dtype, rows in fp8_calls(arch):
        call(fn, *rows, op=fn.__name__, dtype=dtype, rows=rows[0].shape[0])
    return launches


def attention_calls(arch: int):
    """Decode and extend as a Llama-3-8B-shaped model's layers launch them (32 query heads over 8 KV heads, head
    dim 128), with the plan a GPU of compute capability `arch` takes: for each model dtype over each pool dtype it
    can run with, and in bfloat16 at head dims 64 and 256 too. fp8 e4m3 pools from compute capability 8.9 on
    (Kiln refuses them with this backend below that)."""
    fp8 = torch.float8_e4m3fn if arch >= 89 else torch.float8_e5m2
    cases = [(torch.bfloat16, torch.bfloat16, dim) for dim in (64, 128, 256)] + [
        (torch.bfloat16, fp8, 128), (torch.float16, torch.float16, 128), (torch.float32, torch.float32, 128),
        (torch.float32, torch.bfloat16, 128),
    ]  # fmt: skip
    for dtype, pool_dtype, dim in cases:
        q = torch.empty(4, 32, dim, dtype=dtype)
        k_cache = torch.empty(64, 8, dim, dtype=pool_dtype)
        table = torch.zeros(4, 40, dtype=torch.int64)
        mask = torch.ones(4, 40, dtype=torch.bool)
        ends = torch.zeros(4, dtype=torch.int32)
        # the backend's two launches: a mask comes with its rows' ends
        for m, splits, e in ((mask, 8, ends), (None, 1, None)):
            yield dtype, pool_dtype, dim, triton_attention.decode_attention, (
                q, k_cache, k_cache, table, m, 0.1, splits, triton_attention.dot_dtype(dtype, gpu=True), e
            )  # fmt: skip
        if dtype == pool_dtype:
            rows = torch.empty(3, 8, dim, dtype=dtype)
            yield dtype, pool_dtype, dim, triton_attention.store_kv, (
                k_cache, k_cache, torch.zeros(3, dtype=torch.int64), rows, rows
            )  # fmt: skip
        qe = torch.empty(30, 32, dim, dtype=dtype)
        ke = torch.empty(30, 8, dim, dtype=dtype)
        ints = torch.zeros(2, dtype=torch.int64)
        plan = triton_attention.extend_plan(dtype, dim, divmod(arch, 10))
        yield dtype, pool_dtype, dim, triton_attention.extend_attention, (
            qe, ke, ke, k_cache, k_cache, torch.zeros(10, dtype=torch.int64), ints, ints, ints, ints, 15, 0.1, plan,
        )  # fmt: skip


def fused_calls(dtype: torch.dtype):
    """RMSNorm (with and without the residual add), SiLU-and-multiply and rotary at 8B's widths (rotary on q as a
    strided view of the merged qkv projection)."""
    x = torch.empty(5, 4096, dtype=dtype)
    w = torch.empty(4096, dtype=dtype)
    qkv = torch.empty(5, 48, 128, dtype=dtype)
    yield triton_fused.rms_norm, (x, w, 1e-5)
    yield triton_fused.add_rms_norm, (x, x, w, 1e-5)
    yield triton_fused.silu_and_mul, (torch.empty(5, 2 * 14336, dtype=dtype),)
    yield triton_fused.rotary, (qkv[:, :32], torch.empty(2, 5, 1, 128, dtype=dtype))


def fp8_calls(arch: int):
    """DeepSeek-V3's FP8 block weights (128 x 128 blocks) as its layers multiply them, kept in FP8 from compute
    capability 8.9 on (kiln.layers.fp8_linear): a decode step's few rows and a prefill's many, in each model dtype
    (float32 is the exact mode)."""
    if arch < 89:
        return
    weight = torch.empty(7168, 2048, dtype=torch.float8_e4m3fn)
    scale = torch.empty(56, 16, dtype=torch.float32)
    experts = torch.empty(256, 512, 7168, dtype=torch.float8_e4m3fn)  # the routed experts' gate_up at tp 8
    expert_scale = torch.empty(256, 4, 56, dtype=torch.float32)
    for dtype in (*HALF, torch.float32):
        dot = triton_fp8.dot_dtype(dtype, gpu=True)
        for rows in (4, 512):
            x = torch.empty(rows, 2048, dtype=dtype)
            yield triton_fp8.fp8_block_linear, dtype, (x, weight, scale, (128, 128), None, dot)
            ids = torch.zeros(rows, dtype=torch.int64)
            x = torch.empty(rows, 7168, dtype=dtype)
            groups = triton_fp8.group_rows(ids, experts.shape[0], x, dot)
            yield triton_fp8.fp8_grouped_linear, dtype, (x, experts, expert_scale, (128, 128), groups)


def compile_launch(kernel: JITFunction, args: tuple, kwargs: dict, target: GPUTarget):
    """The kernel compiled as JITFunction.run compiles it for these arguments, for `target`."""
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--arch",
        type=int,
        default=90,
        choices=sorted(SHARED_LIMIT),
        help="compute capability: 90 H100/H200, 80 A100",
    )
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    names = {name for _, name, _ in kernels()}
    if args.arch < 89:  # FP8 weights are dequantized at load below 8.9: Triton has no e4m3 there
        names.discard("_fp8_block_matmul_kernel")
    launches = record_launches(args.arch)
    over = False
    for launch in launches:
        compiled = compile_launch(launch.kernel, launch.args, launch.kwargs, target)
        ptx = compiled.asm["ptx"]
        shared = compiled.metadata.shared
        print(json.dumps({
            "kernel": launch.kernel.__name__, **launch.what,
            "shared": shared, "mma": len(re.findall(r"\b(?:wgmma|mma)\.", ptx)),
        }))  # fmt: skip
        if shared > SHARED_LIMIT[args.arch]:
            print(f"{launch.kernel.__name__} {launch.what}: {shared} bytes of shared memory, over sm_{args.arch}'s "
                  f"{SHARED_LIMIT[args.arch]}", file=sys.stderr)  # fmt: skip
            over = True
    missed = names - {launch.kernel.__name__ for launch in launches}
    if missed:
        print(f"never launched here, so not compiled: {sorted(missed)}", file=sys.stderr)
    return 1 if missed or over else 0


# the most shared memory a block can take (opt-in), by compute capability: Triton checks it only when a kernel is
# loaded on a device, so a compile without one compares it here
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


if __name__ == "__main__":
    sys.exit(main())
