"""How long each startup phase will take, before it starts: each phase is a size times a rate (GiB of weights x
seconds per GiB, compiled shapes x seconds per shape, cold or cached...), the rates this host's own history
(kiln.server.startup_history) where it has measured them, built-in defaults measured on a 2-core CPU host
otherwise. What decides cold or warm is looked up, not guessed: whether each of Kiln's C++ extensions has a cached
build (kiln.layers.kernel_builds), and which shapes an earlier start compiled into this compile cache directory (a
marker file Kiln keeps there, so emptying the directory makes the next prediction cold again).

`kiln plan` prints the prediction beside the ledger; `kiln serve` makes it at launch for /status (`predicted_s`,
`eta_s`) and the watchdog's per-phase limits, and at ready folds what each phase took back into the history."""

from __future__ import annotations

import math
import os
import platform as py_platform
import time
from dataclasses import dataclass, field

from kiln.config import ServerArgs
from kiln.core.graph_shapes import CPU_GRAPH_MAX_BS, decode_graph_batch_sizes, prefill_graph_token_sizes
from kiln.core.json_file import read_json_dict, write_json_atomic
from kiln.core.units import human
from kiln.layers.kernel_builds import build_directory, is_first_build, kernels_for, last_build_seconds
from kiln.server.startup_history import StartupHistory

GIB = 1 << 30
MARKER = "kiln_startup_shapes.json"  # in the compile cache directory: the shapes compiled there
# The weights' read-rate probe: at most this much of the first file, or this long (a launch must not wait on it)
PROBE_BYTES, PROBE_S, PROBE_CHUNK = 64 << 20, 0.5, 4 << 20
# Defaults for a host with no history: the 2-core AMD EPYC CPU host's rates when idle (its busy starts divided by
# their contention; docs/benchmarks.md, "Startup prediction"); a first start elsewhere learns its own.
DEFAULTS: dict[str, float] = {
    "download_s_per_gib": 25.0,  # ~40 MiB/s
    "launching_s": 7.0,  # a spawned engine: import torch and the model classes, resolve
    "launching_fork_s": 0.5,  # a forked one (kiln.server.ranks.start_method): the front's imports are its own
    "kernel_cold_s": 50.0,  # one C++ extension compiled (per extension; its own recorded build time wins)
    "kernel_warm_s": 0.3,  # one cached extension loaded
    "load_fixed_s": 2.0,  # build the model, read its metadata: what a small model's load is mostly made of
    "load_s_per_gib": 20.0,  # read, dequantize and prepack: a GGUF's bytes on disk
    "allocating_kv_s": 3.5,
    "capture_cold_s": 40.0,  # one CPU decode shape compiled by inductor and timed against eager
    "capture_warm_s": 13.0,  # one shape loaded from the compile cache: Dynamo still traces the step
    "warming_up_s": 1.0,
    # the first request after a cold capture: its own rate, so that a start after a slow one does not inherit it
    # (docs/benchmarks.md, "Startup prediction": once much slower than after a warm capture, as fast since the
    # engine is forked)
    "warming_up_cold_s": 1.0,
}
CUDA_DEFAULTS: dict[str, float] = {"capture_cold_s": 0.5, "capture_warm_s": 0.5, "load_s_per_gib": 2.0}
# the decode batch sizes a CUDA start captures when none are given: SGLang's default up to 160 (its mid-size GPUs)
CUDA_GUESS_MAX_BS = 160


@dataclass(frozen=True)
class StartupFacts:
    """What a start will do, in sizes: the inputs of the prediction."""

    device: str  # "cpu" | "cuda"
    host: str  # the CPU model (and the GPU's name on CUDA): history is per host
    weight_bytes: int  # the model's files on disk
    download_bytes: int = 0  # weights still to download (0: a local path or cached)
    kernels: tuple[
        tuple[str, bool, float | None], ...
    ] = ()  # (extension, first build, its last build's seconds)
    shapes: tuple[str, ...] = ()  # "decode/1", "prefill/512": what capturing compiles
    cached_shapes: frozenset[str] = field(
        default_factory=frozenset
    )  # those compiled by an earlier start here
    draft_shapes: int = 0  # what capture_draft captures (speculative decoding)
    warmup: bool = True
    forked: bool = False  # the engine process is forked from the front, not spawned
    read_bytes_per_s: float | None = None  # the weights' read rate, probed (read_rate); None: not probed
    # how much slower than on an idle host the CPU runs this start (contention_at_launch): CPU rates scale by it
    slowdown: float = 1.0

    @property
    def key(self) -> str:
        return f"{self.host}|{self.device}"

    @property
    def size_class(self) -> str:
        """Compile time per shape grows with the model: its rates are kept per power-of-two size of the weights."""
        return f"w{max(0, round(math.log2(max(self.weight_bytes, 1) / (64 << 20))))}"

    @property
    def cold_shapes(self) -> int:
        return sum(s not in self.cached_shapes for s in self.shapes)


def rate(name: str, facts: StartupFacts, learned: dict[str, float]) -> float:
    """A rate: the history's for this model size class, else its own, else the built-in default."""
    for key in (f"{name}@{facts.size_class}", name):
        if key in learned:
            return learned[key]
    if facts.device == "cuda" and name in CUDA_DEFAULTS:
        return CUDA_DEFAULTS[name]
    return DEFAULTS[name]


def predict(facts: StartupFacts, learned: dict[str, float] | None = None) -> dict[str, float]:
    """{phase: seconds} for the phases this start goes through, in order, and "total"."""
    r = learned or {}
    out: dict[str, float] = {}
    if facts.download_bytes:
        out["downloading"] = facts.download_bytes / GIB * rate("download_s_per_gib", facts, r)
    out["launching"] = rate(launching_rate(facts), facts, r)
    if facts.kernels:
        out["building_kernels"] = sum(
            (last or r.get(f"kernel_cold_s/{name}") or rate("kernel_cold_s", facts, r))
            if cold
            else rate("kernel_warm_s", facts, r)
            for name, cold, last in facts.kernels
        )
    gib = facts.weight_bytes / GIB
    if (
        f"load_s_per_gib@{facts.size_class}" in r
    ):  # measured for this size of model: it holds the fixed part too
        out["loading_weights"] = gib * r[f"load_s_per_gib@{facts.size_class}"]
    else:
        out["loading_weights"] = rate("load_fixed_s", facts, r) + gib * rate("load_s_per_gib", facts, r)
    out["allocating_kv"] = rate("allocating_kv_s", facts, r)
    cold, warm = facts.cold_shapes, len(facts.shapes) - facts.cold_shapes
    if facts.shapes:  # a start with nothing to capture never enters the phase (kiln.scheduler.launch)
        out["capturing"] = cold * rate("capture_cold_s", facts, r) + warm * rate("capture_warm_s", facts, r)
    if facts.draft_shapes:  # a draft's shapes are smaller than the target's: cold, as a conservative bound
        out["capture_draft"] = facts.draft_shapes * rate("capture_cold_s", facts, r)
    warm_up = "warming_up_cold_s" if facts.cold_shapes else "warming_up_s"
    out["warming_up"] = rate(warm_up, facts, r) if facts.warmup else 0.1
    if facts.device == "cpu":  # every phase but the download runs on the CPU the other processes share
        out = {k: v if k == "downloading" else v * facts.slowdown for k, v in out.items()}
    if facts.read_bytes_per_s:  # a disk slower than the load's own work bounds it, however fast the CPU
        out["loading_weights"] = max(out["loading_weights"], facts.weight_bytes / facts.read_bytes_per_s)
    out = {k: round(v, 1) for k, v in out.items()}
    out["total"] = round(sum(out.values()), 1)
    return out


def launching_rate(facts: StartupFacts) -> str:
    return "launching_fork_s" if facts.forked else "launching_s"


def contention(load: float, cpus: int | None = None) -> float:
    """How much slower than alone a CPU-bound start runs with this many runnable threads on the host (the 1-minute
    load average, the start's own included): 1 until they outnumber the cores."""
    return max(1.0, load / (cpus or os.cpu_count() or 1))


def contention_at_launch(cpus: int | None = None, samples: int = 10, every_s: float = 0.03) -> float:
    """The slowdown a start about to launch can expect: the threads running on the host now (sampled, not the
    1-minute average, which still counts a process that just ended) plus its own (one per core: torch's
    default), measured the same way as observed_rates' load averages."""
    cpus = cpus or os.cpu_count() or 1
    running = []
    for _ in range(samples):
        try:
            with open(
                "/proc/loadavg"
            ) as f:  # "1.0 0.9 0.8 3/512 ...": 3 runnable now, this reader among them
                running.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            from kiln.server.startup import load_average

            return contention(load_average() + cpus, cpus)
        time.sleep(every_s)
    return contention(sum(running) / len(running) + cpus, cpus)


def observed_rates(
    facts: StartupFacts,
    timings: dict[str, float],
    kernels: list | None,
    loads: dict[str, float] | None = None,
) -> dict[str, float]:
    """One finished start's timings as rates the next prediction can use (only what this start measured), each
    CPU phase divided by the contention its load average says it ran under (`loads`: phase -> load at its end),
    so that a start on a busy host teaches idle-host rates."""
    cls, out = facts.size_class, {}
    slow = {p: contention(load) if facts.device == "cpu" else 1.0 for p, load in (loads or {}).items()}
    t = {p: s if p == "downloading" else s / slow.get(p, 1.0) for p, s in timings.items()}
    if (
        t.get("downloading") and facts.download_bytes > 64 << 20
    ):  # a few files' round trips say nothing of a rate
        out["download_s_per_gib"] = t["downloading"] / (facts.download_bytes / GIB)
    for phase, name in (("launching", launching_rate(facts)), ("allocating_kv", "allocating_kv_s")):
        if phase in t:
            out[name] = t[phase]
    if facts.warmup and "warming_up" in t:
        out["warming_up_cold_s" if facts.cold_shapes else "warming_up_s"] = t["warming_up"]
    for k in kernels or []:  # each extension's own load, as building_kernels reported it
        if not k.get("loaded"):
            continue
        seconds = k["seconds"] / slow.get("building_kernels", 1.0)
        if k.get("built"):
            out[f"kernel_cold_s/{k['name']}"] = seconds
        else:
            out["kernel_warm_s"] = seconds
    if "loading_weights" in t and facts.weight_bytes:
        out[f"load_s_per_gib@{cls}"] = t["loading_weights"] / (facts.weight_bytes / GIB)
    if "capturing" in t and facts.shapes:
        n, cold = len(facts.shapes), facts.cold_shapes
        if cold == n:
            out[f"capture_cold_s@{cls}"] = t["capturing"] / n
        elif cold == 0:
            out[f"capture_warm_s@{cls}"] = t["capturing"] / n
    return out


# ------------------------------------------------------------------------------------------- facts from the args
def capture_shapes(args: ServerArgs, device: str) -> tuple[str, ...]:
    """The shapes capturing compiles, from the flags as the ledger reads them (kiln.memory.graph_budget); on CUDA
    without --cuda-graph-max-bs, SGLang's mid-size default (the ledger's own pick needs the GPU's memory)."""
    if args.disable_cuda_graph or args.is_embedding:
        return ()
    args = args.with_torch_compile(device)
    if args.cuda_graph_bs:
        decode = sorted(set(args.cuda_graph_bs))
    else:
        default = CPU_GRAPH_MAX_BS if device == "cpu" else CUDA_GUESS_MAX_BS
        decode = decode_graph_batch_sizes(
            args.cuda_graph_max_bs if args.cuda_graph_max_bs is not None else default
        )
    running = args.max_running_requests
    decode = [b for b in decode if running is None or b <= running] or decode[:1]
    prefill: list[int] = []
    if not args.disable_prefill_graph:
        if args.cuda_graph_bs_prefill:
            prefill = sorted(set(args.cuda_graph_bs_prefill))
        elif args.cuda_graph_max_bs_prefill:
            prefill = prefill_graph_token_sizes(args.cuda_graph_max_bs_prefill)
    return (*(f"decode/{b}" for b in decode), *(f"prefill/{n}" for n in prefill))


def facts_for(args: ServerArgs, device: str, shapes: tuple[str, ...] | None = None) -> StartupFacts:
    """The facts of a start of `args` (resolved: a local model path, or a model id's snapshot directory) on
    `device`; `shapes` when the caller knows them exactly (kiln plan: the ledger's)."""
    shapes = capture_shapes(args, device) if shapes is None else shapes
    kernels = kernels_for(args.cpu_gemm, args.quantization) if device == "cpu" else ()
    built = tuple((k.name, is_first_build(k), last_build_seconds(k)) for k in kernels if _has_dir(k))
    draft = len([s for s in shapes if s.startswith("decode/")]) if args.speculative_algorithm else 0
    # kiln.server.ranks imports the engine process's modules: only once a prediction is made
    from kiln.server.ranks import start_method

    forked = start_method(args, forkable=not args.hub_model_id, device=device) == "fork"
    weight_bytes, download_bytes = hub_bytes(args) or (model_bytes(args.model_path), 0)
    return StartupFacts(
        device=device,
        host=host_name(device),
        weight_bytes=weight_bytes,
        download_bytes=download_bytes,
        kernels=built,
        shapes=shapes,
        cached_shapes=frozenset(s for s in shapes if s in compiled_shapes(args)),
        draft_shapes=draft,
        warmup=not args.skip_server_warmup,
        forked=forked,
        read_bytes_per_s=read_rate(args.model_path),
        slowdown=contention_at_launch() if device == "cpu" else 1.0,
    )


def _has_dir(kernel) -> bool:
    try:
        build_directory(kernel)
    except Exception:  # noqa: BLE001 - no extension directory to be had: the engine will fall back, so no build
        return False
    return True


def weight_files(model_path: str) -> list[str]:
    """The model's weight files: a GGUF or safetensors file, or a directory's safetensors (or .bin) files."""
    if os.path.isfile(model_path) and model_path.endswith((".gguf", ".safetensors")):
        return [model_path]
    if os.path.isfile(model_path):  # a config.json (kiln plan): the weights beside it
        model_path = os.path.dirname(model_path) or "."
    try:
        names = sorted(os.listdir(model_path))
    except OSError:
        return []
    weights = [n for n in names if n.endswith((".safetensors", ".gguf"))] or [
        n for n in names if n.endswith(".bin")
    ]
    return [os.path.join(model_path, n) for n in weights]


def model_bytes(model_path: str) -> int:
    return sum(os.path.getsize(f) for f in weight_files(model_path))


def read_rate(model_path: str, most_bytes: int = PROBE_BYTES, most_s: float = PROBE_S) -> float | None:
    """Bytes per second reading the first weight file from its start, up to `most_bytes` or `most_s`: the disk's
    rate, or the page cache's where the file is cached, as the load will find it. None without a file to read."""
    files = weight_files(model_path)
    if not files:
        return None
    buf, done, t0 = bytearray(PROBE_CHUNK), 0, time.perf_counter()
    try:
        with open(files[0], "rb", buffering=0) as f:
            while done < most_bytes and time.perf_counter() - t0 < most_s:
                n = f.readinto(buf)
                if not n:
                    break
                done += n
    except OSError:
        return None
    elapsed = time.perf_counter() - t0
    return done / elapsed if done and elapsed > 0 else None


def hub_bytes(args: ServerArgs) -> tuple[int, int] | None:
    """A Hugging Face model id's (weight bytes, bytes still to download): its snapshot holds only the config and
    tokenizer until serve's downloading phase, so the files on disk undercount it; the checkpoint is what
    download_weights will fetch, sized from the repo listing fetch_metadata cached. None for a local path, or
    where no listing is cached (an older huggingface_hub's cache): the files on disk are all there is to go by."""
    if not args.hub_model_id:
        return None
    from kiln.loader.hub import checkpoint

    files = checkpoint(args.hub_model_id, args.model_path, args.download_dir)
    return None if files.total is None else (files.total, files.to_fetch)


def host_name(device: str) -> str:
    cpu = py_platform.processor() or py_platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu} x{os.cpu_count()}" + ("" if device == "cpu" else " + cuda")


# ------------------------------------------------------------------------------ compiled shapes, kept with the cache
def _cache_key(args: ServerArgs) -> str:
    """What a compiled shape depends on beyond its size: the model and how its weights and KV are held."""
    return f"{os.path.abspath(args.model_path)}|{args.dtype}|{args.cpu_gemm}|{args.quantization}|{args.kv_cache_dtype}"


def _marker_path(args: ServerArgs) -> str:
    from kiln.runner.compiler import compile_cache_dir

    return os.path.join(compile_cache_dir(args.compile_cache_dir), MARKER)


def compiled_shapes(args: ServerArgs) -> set[str]:
    """The shapes an earlier start of this configuration compiled into its compile cache directory."""
    return _shapes_of(read_json_dict(_marker_path(args)), _cache_key(args))


def _shapes_of(marker: dict, key: str) -> set[str]:
    shapes = marker.get(key)
    return {s for s in shapes if isinstance(s, str)} if isinstance(shapes, list) else set()


def note_compiled(args: ServerArgs, shapes: tuple[str, ...]) -> None:
    """After a start that captured `shapes`: they are in the compile cache now."""
    if not shapes:
        return
    path, key = _marker_path(args), _cache_key(args)
    data = read_json_dict(path)
    data[key] = sorted(_shapes_of(data, key) | set(shapes))
    try:
        write_json_atomic(path, data)
    except OSError:  # a read-only cache: the next prediction says cold, and errs on the slow side
        pass


# ------------------------------------------------------------------------------------------------ the one call
def predict_for(
    args: ServerArgs, device: str, shapes: tuple[str, ...] | None = None
) -> tuple[StartupFacts, dict]:
    facts = facts_for(args, device, shapes)
    return facts, predict(facts, StartupHistory().rates(facts.key))


def record(
    args: ServerArgs,
    facts: StartupFacts,
    timings: dict[str, float],
    kernels: list | None,
    loads: dict[str, float],
) -> None:
    """At ready: what each phase took, into the history, and the captured shapes into the cache's marker."""
    StartupHistory().update(facts.key, observed_rates(facts, timings, kernels, loads))
    if facts.device == "cpu":  # CUDA graphs are captured again at every start: nothing is cached
        note_compiled(args, facts.shapes)


def basis(facts: StartupFacts, phase: str) -> str:
    """What a phase's prediction assumes, in words (kiln plan's third column)."""
    if phase == "building_kernels":
        cold = [name for name, first, _ in facts.kernels if first]
        return f"first build of {', '.join(cold)}" if cold else f"{len(facts.kernels)} cached builds"
    # human(): a GiB figure for a real model, and a small one's size still reads as more than "0.00 GiB"
    if phase == "loading_weights":  # a model id's first start: what the download will have put on disk
        where = "once fetched" if facts.download_bytes else "on disk"
        read = f", read at {human(int(facts.read_bytes_per_s))}/s" if facts.read_bytes_per_s else ""
        return f"{human(facts.weight_bytes)} {where}{read}"
    if phase == "capturing":
        if not facts.shapes:
            return "no shapes"
        cold = facts.cold_shapes
        return f"{len(facts.shapes)} shapes: {cold} cold, {len(facts.shapes) - cold} cached"
    if phase == "capture_draft":
        return f"{facts.draft_shapes} draft shapes"
    if phase == "downloading":
        return f"{human(facts.download_bytes)} to fetch"
    return ""


def format_prediction(facts: StartupFacts, predicted: dict[str, float], learned: bool) -> str:
    source = "this host's history" if learned else "built-in defaults (no history on this host yet)"
    lines = [f"Startup prediction ({source}):"]
    for phase, seconds in predicted.items():
        if phase != "total":
            lines.append(f"  {phase:<18} {seconds:>7.1f} s  {basis(facts, phase)}".rstrip())
    lines.append(f"  {'total':<18} {predicted['total']:>7.1f} s")
    return "\n".join(lines)
