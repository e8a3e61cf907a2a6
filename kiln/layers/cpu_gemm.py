"""Prepacked weights for CPU matmuls.

A float32 linear weight is packed once, at load, into a layout a CPU matmul reads faster than the plain one:
Kiln's own blocked layout ([N / 16, K, 16], csrc/blocked_gemm.cpp, built with torch's C++ extension loader on
first use) where the CPU has AVX2 and FMA, else oneDNN's blocked layout. Kiln's kernel streams each block of
weights once per call whatever the batch size, so decode, which is bound by reading the weights, runs at close to
the memory bandwidth; oneDNN's layout is the fallback because it still beats `F.linear`'s plain one at decode
batch sizes (figures in docs/benchmarks.md).

A GGUF matrix's quantized blocks (kiln/layers/quant_rows.py) are packed instead where the mode keeps them: under
`auto` (and `kiln`) every type the integer kernels take (kiln/layers/int_gemm.py: activations rounded to int8, as
llama.cpp computes); under `exact` Q4_1 and Q8_0, multiplied in float32 by Kiln's float kernel, which gives the
dequantized weights' products bit for bit. `--quantization int8` packs a float32 checkpoint's linear weights as
int8 rows (one float32 scale each) for the integer kernels.

Which layout a load packs into is the `--cpu-gemm` mode, set once per model load with `set_cpu_gemm()`: a
module-wide setting rather than an argument because the layers' `prepack_weights()` reach it from deep inside the
model. A packed weight carries its layout (float32 [N / 16, K, 16], quantized blocks uint8 [N / 16, K / 32, chunk],
the integer kernels' uint8 [N / 16, bytes per 16 rows], oneDNN's opaque tensor), so models loaded under different
modes in one process each keep their matmuls; the other kernels (RMSNorm, decode attention) follow the mode in
force, since `--cpu-gemm onednn` means none of Kiln's kernels is built or run.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

import kiln.layers.int_gemm as int_gemm
from kiln.layers.extension_loader import load_extension
from kiln.layers.quant_rows import BYTES_PER_BLOCK, QUANT_BLOCK, GGUFRows
from kiln.platform import check_cpu_gemm, cpu_runs_kiln_kernel, gguf_block_types, integer_compute

logger = logging.getLogger("kiln")

# the batch size oneDNN picks its blocking for: decode batches are what prepacking speeds up
PACK_BATCH_HINT = 32
BLOCK = 16  # output columns per block of Kiln's layout
# GGUF type -> (pack, linear) of the kernel; a packed quantized weight is told apart by its chunk's bytes
_QUANT_OPS = {"Q4_1": ("pack_q4_1", "linear_q4_1"), "Q8_0": ("pack_q8_0", "linear_q8_0")}
_QUANT_BY_CHUNK = {BLOCK * BYTES_PER_BLOCK[q]: ops[1] for q, ops in _QUANT_OPS.items()}
_SOURCES = [os.path.join(os.path.dirname(__file__), "csrc", f) for f in ("blocked_gemm.cpp", "cpu_ops.cpp")]


QUANTIZATIONS = ("int8",)  # --quantization values that quantize float32 weights at load

_kernel_loaded = False  # blocked_kernel() has loaded: what a compiled step asks, never the loader itself
_mode = "auto"  # --cpu-gemm of the model being loaded (or last loaded); set_cpu_gemm() changes it
_quantization: str | None = None  # --quantization of the model being loaded
_packed: Counter[str] = Counter()  # the formats prepack() gave since prepack_module_weights() began


def set_cpu_gemm(mode: str, quantization: str | None = None) -> None:
    """Set --cpu-gemm (and --quantization) for the weights packed from now on (one model load). A ValueError names
    the flag and the valid values for an unknown mode, and refuses "kiln" where the CPU cannot run Kiln's
    kernel."""
    global _mode, _quantization
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"--quantization {quantization!r}: Kiln quantizes at load to {', '.join(QUANTIZATIONS)}"
        )
    _mode = check_cpu_gemm(mode)
    _quantization = quantization


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
    global _kernel_loaded
    _kernel_loaded = True
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


def cpu_rms_norm(x: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    """Kiln's RMSNorm kernel for a float32 CPU x, or None (another device or dtype, --cpu-gemm onednn, no kernel).
    Inside a compiled step it is the opaque op over the same C++ function: inductor's own fused norm sums the
    squares in another order, and under integer compute a last-bit difference becomes another token, so a batch
    that runs eagerly (a shape not captured, or not kept) next to compiled ones would decode differently."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    if torch.compiler.is_compiling():
        return torch.ops.kiln.rms_norm if _kernel_loaded and _mode != "onednn" else None
    kernel = kiln_kernel()
    return None if kernel is None else kernel.rms_norm


def packed_layout_name() -> str:
    return "Kiln's blocked" if kiln_kernel() is not None else "oneDNN's"


def prepack(
    weight: torch.Tensor, gguf_rows: GGUFRows | None = None, quantize: bool = False, head: bool = False
) -> torch.Tensor | None:
    """The weight in a packed layout, or None where none applies (non-CPU, non-fp32): with the raw GGUF blocks
    the weight was dequantized from, the blocks where the mode keeps their type (the integer kernels' layout, or
    Kiln's quantized float blocks under `exact`); a linear layer's weight (`quantize`) as int8 rows under
    --quantization int8; else Kiln's float32 [N / 16, K, 16] blocks when the mode and CPU give the kernel and N
    divides into blocks; else oneDNN's. The LM head (`head`) keeps its blocks but is multiplied in float32 where
    Kiln's float kernel reads its type (Q4_1, Q8_0): rounding the head's input to int8 is a third of the KL
    divergence integer compute adds to the default model's logits (docs/benchmarks.md), for a few per cent of a
    step."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    kernel = kiln_kernel()
    if kernel is not None and weight.shape[0] % BLOCK == 0:
        packed, label = _pack_blocks(kernel, weight, gguf_rows, quantize, head)
        _packed[label] += 1
        return packed
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)
    except RuntimeError as e:  # an oneDNN build without this path
        logger.warning(f"weight prepacking unavailable, using F.linear: {e}")
        return None
    _packed["float32"] += 1
    return packed


def _pack_blocks(
    kernel, weight: torch.Tensor, gguf_rows: GGUFRows | None, quantize: bool, head: bool
) -> tuple[torch.Tensor, str]:
    """Kiln's layouts for a weight of N divisible into blocks, and the format's name for the load's log line."""
    qtype = gguf_rows.qtype if gguf_rows is not None and gguf_rows.qtype in gguf_block_types(_mode) else None
    k = weight.shape[1]
    integer = integer_compute(_mode) and int_gemm.kernel() is not None and not (head and qtype in _QUANT_OPS)
    if qtype is not None and integer and _readable(qtype, k):
        return int_gemm.pack(qtype, gguf_rows.rows), f"{qtype} (integer)"
    if qtype in _QUANT_OPS and k % QUANT_BLOCK == 0:  # exact, or no integer kernel here
        return getattr(kernel, _QUANT_OPS[qtype][0])(gguf_rows.rows), f"{qtype} (float32)"
    if quantize and _quantization == "int8" and int_gemm.kernel() is not None and _readable("I8", k):
        return int_gemm.pack("I8", int_gemm.quantize_int8_rows(weight)), "I8 (integer)"
    return kernel.pack(weight.detach()), "float32"


def _readable(qtype: str, k: int) -> bool:
    """Whether a weight packed for the integer kernels as `qtype` with inputs of width k is told apart from every
    other type by its shape (_integer_format), as linear() must."""
    if k % int_gemm.WEIGHTS_PER_BLOCK[qtype]:
        return False
    return _integer_format(k, int_gemm.packed_bytes_per_row_block(qtype, k)) == qtype


@functools.cache
def _integer_format(k: int, row_block_bytes: int) -> str | None:
    """The integer kernels' type of a packed weight [N / 16, row_block_bytes] multiplying inputs of width k: the
    one type whose layout has that many bytes per 16 rows (None for none or several: only I8's can share another's
    size, Q8_0's at k = 64, and such a weight is not packed for the integer kernels)."""
    found = [
        q
        for q in int_gemm.QTYPES
        if k % int_gemm.WEIGHTS_PER_BLOCK[q] == 0
        and int_gemm.packed_bytes_per_row_block(q, k) == row_block_bytes
    ]
    return found[0] if len(found) == 1 else None


def packed_formats() -> dict[str, int]:
    """How many weights prepack() packed into each format since prepack_module_weights() began."""
    return dict(_packed)


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

# RMSNorm as an opaque op (cpu_rms_norm says why); the extension registers its C++ function as the CPU kernel
_lib.define("rms_norm(Tensor x, Tensor w, float eps) -> Tensor")
_lib.impl("rms_norm", lambda x, w, eps: blocked_kernel().rms_norm(x, w, eps), "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::rms_norm")
def _(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


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


# the KV pool dtypes Kiln's decode attention reads, each converted to float32 in registers (csrc/cpu_ops.cpp)
DECODE_ATTENTION_KV_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


def has_cpu_decode_attention(k_cache: torch.Tensor) -> bool:
    """Whether Kiln's decode attention serves this KV pool: on the CPU, of a dtype it reads, with the kernel built.
    Asked once, eagerly: a compiled step must not trace the kernel's loading."""
    return (
        k_cache.device.type == "cpu"
        and k_cache.dtype in DECODE_ATTENTION_KV_DTYPES
        and kiln_kernel() is not None
    )


def cpu_decode_attention_sinks(
    q, k_cache, v_cache, table, mask, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """Kiln's decode attention with a sink logit per query head in every row's softmax (GPT-OSS), eagerly: a
    compiled step attends to sinks in torch ops (kiln.runner.attention.windowed)."""
    return blocked_kernel().decode_attention(q, k_cache, v_cache, table, mask, scale, 0, sinks)


def cpu_decode_attention():
    """Kiln's decode attention over the KV pool: the opaque op inside a compiled step, the kernel itself eagerly."""
    return torch.ops.kiln.decode_attention if torch.compiler.is_compiling() else _decode_attention


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> torch.Tensor:
    """`packed` comes from the layer (a traced weight does not report its layout); a 3-D weight is Kiln's blocks,
    a 2-D uint8 one the integer kernels' (its type read from its shape and the input's width)."""
    if not packed:
        return F.linear(x, weight, bias)
    if weight.dim() == 2 and weight.dtype == torch.uint8:
        k = x.shape[-1]
        # traced, the uncached function: the compiler would ignore the cache (and warn), the type is a constant
        find = _integer_format.__wrapped__ if torch.compiler.is_compiling() else _integer_format
        qtype = find(k, weight.shape[1])
        assert qtype is not None, f"no integer type packs {k} inputs into {weight.shape[1]} bytes per 16 rows"
        y = int_gemm.linear(x, weight, qtype, weight.shape[0] * BLOCK, k)
        return y + bias if bias is not None else y
    blocked = weight.dim() == 3
    if torch.compiler.is_compiling():
        return (torch.ops.kiln.blocked_linear if blocked else packed_linear)(x, weight, bias)
    return _blocked(x, weight, bias) if blocked else _onednn(x, weight, bias)


def prepack_module_weights(
    model: torch.nn.Module, reporting: Callable[[Iterable], Iterable] = iter
) -> tuple[int, dict[str, int]]:
    """Calls `prepack_weights()` on every layer that has one; returns how many weights were packed and how many
    into each format ("float32", "Q4_1 (integer)", "Q8_0 (float32)", "I8 (integer)", ...). `reporting` wraps
    the layers' iteration: packing a large model takes long enough that the startup watchdog must see progress."""
    _packed.clear()
    layers = [m for m in model.modules() if hasattr(m, "prepack_weights")]
    count = sum(int(m.prepack_weights()) for m in reporting(layers))
    return count, packed_formats()
