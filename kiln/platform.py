"""Device detection and memory probing (cgroup-aware on the host), and the Platform a deployment targets: this
machine's device, or a GPU described to `kiln plan` that it does not run on."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

import psutil

from kiln.core import envs
from kiln.core.units import GIB

_CGROUP_ROOT = Path("/sys/fs/cgroup")
# Values at or above this are "no limit" (cgroup v1 reports ~2^63 rounded to the page size).
_UNLIMITED = 1 << 60


def detect_device() -> str:
    """'cuda' when a CUDA device is usable, else 'cpu'."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # pragma: no cover - torch missing or broken
        return "cpu"


@dataclass(frozen=True)
class Platform:
    """What a deployment runs on, as every derived setting and refusal reads it: the device kind, its name, CUDA
    compute capability (None on the CPU), its memory where it is described rather than probed, whether Triton's
    kernels can run there, and whether it is this machine's own device (`here`) or one described for a plan.
    `assumed` lists what a plan had to assume, each with the flag that removes the assumption."""

    device: str  # "cpu" | "cuda"
    name: str
    capability: tuple[int, int] | None = None
    memory_bytes: int | None = None  # a described GPU's; None: probed here
    triton: bool = False
    here: bool = True
    assumed: tuple[str, ...] = ()


def machine_platform(device: str = "auto") -> Platform:
    """This machine's platform for --device `device` (auto: CUDA when usable). --device cuda on a machine
    without a usable GPU is not here: serve refuses it, plan plans it."""
    import torch

    triton = importlib.util.find_spec("triton") is not None
    kind = detect_device() if device == "auto" else device
    if not kind.startswith("cuda"):
        return Platform("cpu", "cpu", triton=triton)
    if not torch.cuda.is_available():
        return Platform("cuda", "cuda", triton=triton, here=False)
    return Platform(
        "cuda", torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability()), triton=triton
    )


ASSUMED_CAPABILITY = (9, 0)  # a plan for an unnamed GPU: the deployments' H100 and H200


def planned_platform(device: str, device_name: str | None, capability: tuple[int, int] | None) -> Platform:
    """The platform a plan targets: this machine's device, unless --device-name (a GPU from Kiln's table) or
    --compute-capability describe another, or --device cuda asks for a GPU this machine lacks (then compute
    capability 9.0 is assumed, and `assumed` says so)."""
    from kiln.core.devices import device_spec, same_device

    described = device_name is not None or capability is not None
    here = machine_platform("cuda" if described else device)
    if here.here and here.device == "cpu":  # neither a GPU named nor --device cuda
        return here
    if here.here and (device_name is None or same_device(device_name, here.name)):
        if capability in (None, here.capability):  # this machine's own GPU
            return here
    if device_name is not None:
        spec = device_spec(device_name)
        return Platform("cuda", spec.name, capability or spec.capability, spec.memory_bytes, True, here=False)
    assumed = ()
    if capability is None:
        capability = ASSUMED_CAPABILITY
        assumed = (
            f"compute capability {capability[0]}.{capability[1]} (an H100 or H200: FP8 weights kept, fp8_e4m3 KV "
            "read by Triton); give --device-name or --compute-capability for another GPU",
        )
    # CUDA builds of torch ship Triton: a plan made where it is missing describes the server, not this machine
    return Platform("cuda", "cuda", capability, None, True, here=False, assumed=assumed)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < _UNLIMITED else None


def cgroup_limit_bytes(root: Path = _CGROUP_ROOT) -> int | None:
    """Memory limit of this process's cgroup (v2 memory.max or v1 limit_in_bytes), None if unlimited."""
    for name in ("memory.max", "memory/memory.limit_in_bytes", "memory.limit_in_bytes"):
        value = _read_int(root / name)
        if value is not None:
            return value
    return None


def cgroup_usage_bytes(root: Path = _CGROUP_ROOT) -> int | None:
    """Current memory usage of this process's cgroup, None if unknown."""
    for name in ("memory.current", "memory/memory.usage_in_bytes", "memory.usage_in_bytes"):
        value = _read_int(root / name)
        if value is not None:
            return value
    return None


def host_total_bytes(root: Path = _CGROUP_ROOT) -> int:
    """System RAM, capped by the cgroup limit."""
    total = int(psutil.virtual_memory().total)
    limit = cgroup_limit_bytes(root)
    return min(total, limit) if limit is not None else total


def host_available_bytes(root: Path = _CGROUP_ROOT) -> int:
    """System RAM available now, capped by what the cgroup still allows."""
    avail = int(psutil.virtual_memory().available)
    limit = cgroup_limit_bytes(root)
    if limit is None:
        return avail
    usage = cgroup_usage_bytes(root) or 0
    return max(0, min(avail, limit - usage))


def total_memory_bytes(device: str) -> int:
    """Total memory of the device ('cpu' means host RAM)."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info()[1])
    return host_total_bytes()


def available_memory_bytes(device: str) -> int:
    """Free memory of the device now ('cpu' means host RAM)."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info()[0])
    return host_available_bytes()


def used_memory_bytes(device: str) -> int:
    """Memory in use now: the CUDA device's used bytes, or this process's RSS on the CPU."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(total - free)
    return current_rss_bytes()


def current_rss_bytes() -> int:
    """This process's resident memory."""
    return int(psutil.Process().memory_info().rss)


def cpu_threads(requested: int | None) -> int:
    """torch's CPU threads for an engine: --num-threads, else OMP_NUM_THREADS where set (as torch and OpenMP read
    it: an operator who limits it for a host shared with other work expects it kept), else every core this
    process may run on. Threads beyond the cores left free spin against the other processes (docs/testing.md)."""
    if requested:
        return requested
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return len(os.sched_getaffinity(0))


def available_gb(device: str) -> float:
    """available_memory_bytes in GB, as the startup log lines print it."""
    return available_memory_bytes(device) / GIB


# --cpu-gemm's values. "auto" and "kiln" keep a GGUF's quantized matrices in their blocks and multiply them with
# integer arithmetic (activations rounded to int8, as llama.cpp does); "exact" keeps Q4_1 / Q8_0 blocks but
# multiplies in float32, equal to the dequantized weights' float32 product; "f32" dequantizes every matrix for the
# float32 kernel; "onednn" keeps Kiln's CPU kernels out (nothing is built).
CPU_GEMM_MODES = ("auto", "exact", "kiln", "f32", "onednn")
INTEGER_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")  # the integer kernels' GGUF types
EXACT_GGUF_TYPES = ("Q4_1", "Q8_0")  # the float32 kernel's: it dequantizes them exactly as gguf does
_GGUF_BLOCK_TYPES = {"auto": INTEGER_GGUF_TYPES, "kiln": INTEGER_GGUF_TYPES, "exact": EXACT_GGUF_TYPES}
_KILN_KERNEL_CAPABILITIES = ("AVX2", "AVX512")


def cpu_capability() -> str:
    """The vector instruction set torch dispatches to on this CPU ("AVX2", "AVX512", "DEFAULT", ...)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def cpu_runs_kiln_kernel() -> bool:
    """Whether this CPU can run Kiln's kernels (AVX2 with FMA, which torch's AVX2 level implies)."""
    return cpu_capability() in _KILN_KERNEL_CAPABILITIES


def check_cpu_gemm(mode: str) -> str:
    """The --cpu-gemm mode, validated: a ValueError names the flag and the valid values, or, for "kiln" on a CPU
    that cannot run Kiln's kernel, the CPU's capability (auto would fall back to oneDNN's layout silently)."""
    if mode not in CPU_GEMM_MODES:
        raise ValueError(f"--cpu-gemm {mode!r}: expected one of {', '.join(CPU_GEMM_MODES)}")
    if mode == "kiln" and not cpu_runs_kiln_kernel():
        raise ValueError(
            f"--cpu-gemm kiln: Kiln's CPU kernel needs AVX2 and FMA, and this CPU's capability is "
            f"{cpu_capability()}. Use --cpu-gemm auto (oneDNN's layout here) or --cpu-gemm onednn."
        )
    return mode


def gguf_block_types(mode: str) -> tuple[str, ...]:
    """The GGUF types whose matrices Kiln's CPU kernels keep in their blocks here under --cpu-gemm `mode`
    (none without AVX2); asked before loading, so it builds no kernel."""
    types = _GGUF_BLOCK_TYPES.get(check_cpu_gemm(mode), ())
    return types if cpu_runs_kiln_kernel() else ()


def gguf_blocks_expected(mode: str) -> bool:
    """Whether Kiln's CPU kernels will keep any GGUF matrix in its blocks here under --cpu-gemm `mode`."""
    return bool(gguf_block_types(mode))


def int8_kernels(mode: str) -> bool:
    """Whether --quantization int8 rounds weights at load here under --cpu-gemm `mode` (Kiln's kernels, AVX2)."""
    return check_cpu_gemm(mode) != "onednn" and cpu_runs_kiln_kernel()


def fp8_weights_kept(target: Platform, load_format: str = "auto") -> bool:
    """Whether an FP8 block-quantized checkpoint keeps its weights in FP8 on `target` (kiln.layers.fp8_linear)
    rather than dequantized at load: never for --load-format dummy (random weights in the serving dtype);
    KILN_FP8_WEIGHTS=keep everywhere (the CPU runs the kernels in Triton's interpreter, for tests), dequantize
    nowhere; auto on CUDA with Triton (the kernels are Triton's) from compute capability 8.9, where Triton
    converts e4m3 (an A100 dequantizes)."""
    if load_format == "dummy":
        return False
    mode = envs.fp8_weights()
    if mode != "auto":
        return mode == "keep"
    if target.device != "cuda" or not target.triton:
        return False
    return target.capability is not None and target.capability >= (8, 9)


def attention_interpreted(device: str, attention_backend: str | None) -> bool:
    """Whether attention runs in Triton's interpreter (--attention-backend triton without a GPU): steps then run
    eagerly, as torch.compile cannot trace the interpreter."""
    return device == "cpu" and attention_backend == "triton"


def fused_step_kernels(device: str, dtype: str) -> bool:
    """Whether a step's norms, SiLU-and-multiply and rotary run as Kiln's fused Triton kernels
    (kiln.layers.fused): half-precision activations on CUDA, KILN_TRITON_FUSED not off. Triton is taken as there:
    torch's CUDA builds ship it, and a plan made on a machine without it (a laptop planning for a GPU server)
    must say what the server's own ledger says."""
    return device.startswith("cuda") and dtype in ("bfloat16", "float16") and envs.triton_fused() != "off"


def integer_compute(mode: str) -> bool:
    """Whether --cpu-gemm `mode` multiplies quantized weights with integer arithmetic (auto, kiln)."""
    return check_cpu_gemm(mode) in ("auto", "kiln")


_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "T": 1000**4,
    "TB": 1000**4,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """'80GiB', '24GB', '1.5e9', '512MiB' -> bytes (GiB = 2^30, GB = 1e9). Raises ValueError."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 80GiB, 24GB, 512MiB, 1.5e9)")
    number, unit = float(match.group(1)), match.group(2).upper()
    if unit not in _UNITS:
        raise ValueError(
            f"unknown size unit {match.group(2)!r} in {text!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    value = int(round(number * _UNITS[unit]))
    if value < 0:
        raise ValueError(f"size must be >= 0: {text!r}")
    return value
