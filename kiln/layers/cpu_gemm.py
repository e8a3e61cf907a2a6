"""Prepacked weights for CPU matmuls.

A float32 linear weight is packed once, at load, into a layout a CPU matmul reads faster than the plain one:
Kiln's own blocked layout ([N / 16, K, 16], csrc/blocked_gemm.cpp, built with torch's C++ extension loader on
first use) where the CPU has AVX2 and FMA, else oneDNN's blocked layout. Kiln's kernel streams each block of
weights once per call whatever the batch size, so decode, which is bound by reading the weights, runs at close to
the memory bandwidth; oneDNN's layout is the fallback because it still beats `F.linear`'s plain one at decode
batch sizes (figures in docs/benchmarks.md).

Which layout a load packs into is the `--cpu-gemm` mode, set once per model load with `set_cpu_gemm()`: a
module-wide setting rather than an argument because the layers' `prepack_weights()` reach it from deep inside the
model. A packed weight carries its layout, so models loaded under different modes in one process each keep their
matmuls; the other kernels (RMSNorm, decode attention) follow the mode in force, since `--cpu-gemm onednn` means
none of Kiln's kernels is built or run.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

from kiln.layers.quant_rows import BYTES_PER_BLOCK, QUANT_BLOCK, GGUFRows
from kiln.platform import check_cpu_gemm, cpu_runs_kiln_kernel, gguf_blocks_expected

logger = logging.getLogger("kiln")

# the batch size oneDNN picks its blocking for: decode batches are what prepacking speeds up
PACK_BATCH_HINT = 32
BLOCK = 16  # output columns per block of Kiln's layout
# GGUF type -> (pack, linear) of the kernel; a packed quantized weight is told apart by its chunk's bytes
_QUANT_OPS = {"Q4_1": ("pack_q4_1", "linear_q4_1"), "Q8_0": ("pack_q8_0", "linear_q8_0")}
_QUANT_BY_CHUNK = {BLOCK * BYTES_PER_BLOCK[q]: ops[1] for q, ops in _QUANT_OPS.items()}
_SOURCES = [os.path.join(os.path.dirname(__file__), "csrc", f) for f in ("blocked_gemm.cpp", "cpu_ops.cpp")]


_mode = "auto"  # --cpu-gemm of the model being loaded (or last loaded); set_cpu_gemm() changes it


def set_cpu_gemm(mode: str) -> None:
    """Set --cpu-gemm for the weights packed from now on (one model load). A ValueError names the flag and the
    valid values for an unknown mode, and refuses "kiln" where the CPU cannot run Kiln's kernel."""
    global _mode
    _mode = check_cpu_gemm(mode)


def cpu_gemm_mode() -> str:
    """The --cpu-gemm mode weights are packed under: one of kiln.platform.CPU_GEMM_MODES."""
    return _mode


@functools.cache
def blocked_kernel():
    """Kiln's CPU kernels (built on first use, then loaded from torch's extension cache), or None where the CPU
    lacks AVX2/FMA or the build fails (a warning says why). Cached whatever the mode: which loads use the kernel
    is kiln_kernel()'s question."""
    if not cpu_runs_kiln_kernel():
        return None
    t0 = time.perf_counter()
    try:
        ext = load_extension("kiln_blocked_gemm", _SOURCES)
    except Exception as e:  # no compiler, no ninja: oneDNN's layout still works
        logger.warning(f"Kiln's CPU matmul kernel could not be built, using oneDNN's: {e}")
        return None
    logger.info(
        f"Kiln's CPU matmul kernel loaded in {time.perf_counter() - t0:.1f} s (built on the first start)."
    )
    return ext


def kiln_kernel():
    """Kiln's CPU kernels under the current mode: None with --cpu-gemm onednn (never built then) or where they
    are unavailable. --cpu-gemm kiln asked for them by name, so a failed build is an error rather than a fallback."""
    if _mode == "onednn":
        return None
    kernel = blocked_kernel()
    if kernel is None and _mode == "kiln":
        raise RuntimeError(
            "--cpu-gemm kiln: Kiln's CPU kernel could not be built (the warning above says why). Use --cpu-gemm "
            "auto to fall back to oneDNN's layout, or --cpu-gemm onednn."
        )
    return kernel


def load_extension(name: str, sources: list[str], build_directory: str | None = None):
    """torch's C++ extension loader (build on first use, then load from the extension cache) with Kiln's flags, one
    Kiln process at a time per build directory. torch marks a build in progress with a `lock` file that a process
    killed mid-build leaves behind, and every later load then waits on it forever. Kiln holds an OS lock on a file
    of its own around the load (released by the kernel when its holder dies), so a `lock` found while holding it
    can only be such a leftover, and is removed."""
    from torch.utils import cpp_extension

    directory = build_directory or cpp_extension._get_build_directory(name, verbose=False)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "kiln.flock"), "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info(f"Waiting for another Kiln process to finish building {name} in {directory}.")
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = os.path.join(directory, "lock")
        if os.path.exists(stale):
            logger.warning(f"Removing {stale}, left by a build of {name} that was killed before it finished.")
            os.remove(stale)
        flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
        return cpp_extension.load(name, sources, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                  build_directory=directory)  # fmt: skip


def eager_cpu_kernel(x: torch.Tensor):
    """Kiln's CPU kernels for an eager float32 CPU call, or None (another device or dtype, inside a compiled step
    whose compiler fuses the ATen ops itself, or no kernel here)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.compiler.is_compiling():
        return None
    return kiln_kernel()


def packed_layout_name() -> str:
    return "Kiln's blocked" if kiln_kernel() is not None else "oneDNN's"


def prepack(weight: torch.Tensor, gguf_rows: GGUFRows | None = None) -> torch.Tensor | None:
    """The weight in a packed layout, or None where none applies (non-CPU, non-fp32): with the raw GGUF blocks
    the weight was dequantized from and a mode that keeps them, Kiln's quantized blocks (uint8 [N / 16, K / 32,
    16 x bytes per block]); else Kiln's float32 [N / 16, K, 16] blocks when the mode and CPU give the kernel and N
    divides into blocks; else oneDNN's."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    kernel = kiln_kernel()
    if kernel is not None and weight.shape[0] % BLOCK == 0:
        if gguf_rows is not None and weight.shape[1] % QUANT_BLOCK == 0 and gguf_blocks_expected(_mode):
            return getattr(kernel, _QUANT_OPS[gguf_rows.qtype][0])(gguf_rows.rows)
        return kernel.pack(weight.detach())
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)
    except RuntimeError as e:  # an oneDNN build without this path
        logger.warning(f"weight prepacking unavailable, using F.linear: {e}")
        return None


def _blocked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Kiln's kernel on a weight from prepack(): float32 blocks, or quantized ones (uint8)."""
    kernel = blocked_kernel()
    run = (
        kernel.linear if weight.dtype == torch.float32 else getattr(kernel, _QUANT_BY_CHUNK[weight.shape[2]])
    )
    y = run(x.reshape(-1, x.shape[-1]), weight)
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y + bias if bias is not None else y


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# The prepacked matmuls as opaque ops, so a compiled step calls them as they are instead of decomposing them into
# an `mm` that cannot read the packed layout. Registered with the dispatcher directly: `torch.library.custom_op`
# wraps it in autograd machinery whose per-call cost from compiled code is several times the dispatcher's, paid on
# every matmul of every step (docs/benchmarks.md).
_lib = torch.library.Library("kiln", "DEF")
_lib.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.impl("packed_linear", _onednn, "CompositeExplicitAutograd")
_lib.define("blocked_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.impl("blocked_linear", _blocked, "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::packed_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("kiln::blocked_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0] * BLOCK))


packed_linear = torch.ops.kiln.packed_linear


def _decode_attention(
    q, k_cache, v_cache, table, mask, scale: float, shared: int | torch.Tensor = 0
) -> torch.Tensor:
    return blocked_kernel().decode_attention(q, k_cache, v_cache, table, mask, scale, int(shared))


# decode attention over the KV pool as an opaque op, so a compiled decode step reads the pool in place too; the
# shared prefix's width is a one-element tensor there, an input of the step rather than a constant of its code
_lib.define(
    "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, Tensor mask, float scale, "
    "Tensor shared) -> Tensor"
)
_lib.impl("decode_attention", _decode_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::decode_attention")
def _(q, k_cache, v_cache, table, mask, scale: float, shared) -> torch.Tensor:
    return q.new_empty(q.shape)


def has_cpu_decode_attention(k_cache: torch.Tensor) -> bool:
    """Whether Kiln's decode attention serves this KV pool: float32 on the CPU, with the kernel built. Asked once,
    eagerly: a compiled step must not trace the kernel's loading."""
    return k_cache.device.type == "cpu" and k_cache.dtype == torch.float32 and kiln_kernel() is not None


def cpu_decode_attention():
    """Kiln's decode attention over the KV pool: the opaque op inside a compiled step, the kernel itself eagerly."""
    return torch.ops.kiln.decode_attention if torch.compiler.is_compiling() else _decode_attention


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> torch.Tensor:
    """`packed` comes from the layer (a traced weight does not report its layout); a 3-D weight is Kiln's."""
    if not packed:
        return F.linear(x, weight, bias)
    blocked = weight.dim() == 3
    if torch.compiler.is_compiling():
        return (torch.ops.kiln.blocked_linear if blocked else packed_linear)(x, weight, bias)
    return _blocked(x, weight, bias) if blocked else _onednn(x, weight, bias)


def prepack_module_weights(model: torch.nn.Module) -> int:
    """Calls `prepack_weights()` on every layer that has one; returns how many weights were packed."""
    return sum(int(m.prepack_weights()) for m in model.modules() if hasattr(m, "prepack_weights"))
