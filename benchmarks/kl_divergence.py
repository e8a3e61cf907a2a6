"""Accuracy of Kiln's CPU matmul modes: KL divergence and top-1 agreement of each mode's logits against the float32
path on the same weights, next to llama.cpp's figures for the same GGUF files, tokens and windows.

For each weight format (the shipped Q4_1 file, and Q4_0 / Q8_0 / Q4_K / Q6_K files llama-quantize makes from it
with --allow-requantize), llama-perplexity runs twice per KV cache type (`--kv`: `f16`, its default, and `f32`,
Kiln's): on an F32 GGUF of the same dequantized weights (the base) and on the format's file, each with
`--kl-divergence-base FILE`, which writes the chunks' tokens and every scored position's log-probs (cached under
llama.cpp's build, about 0.4 GB a file per 16 windows). Kiln's model runner then runs those very tokens, window by
window (BOS first where the vocabulary asks for one, as llama-perplexity puts it), under `--cpu-gemm auto` (the
GGUF blocks multiplied in integers, activations rounded to int8) with a float32 KV cache, and with `--own-base`
also under `f32` (every matrix dequantized and multiplied in float32). Every figure is computed as
llama-perplexity's `--kl-divergence` computes its own: positions n_ctx/2 .. n_ctx-2 of each window, the base's
log-probs rounded to its 16-bit storage, KL(base || other) summed over the tokens whose base log-prob is above -16,
top-1 agreement of the argmaxes. Both sides score the same tokens against the same base, so the per-token
difference Kiln - llama.cpp is paired, and its standard error is smaller than either mean's.

Rows: `llama.cpp, KV f16` / `KV f32`: llama.cpp's quantized run against its own F32 base (same KV type);
`Kiln auto vs llama.cpp F32 base`: Kiln's integer path against llama.cpp's F32 / KV f32 base; with `--own-base`,
`Kiln auto`: against Kiln's float32 path, and `Kiln f32 vs llama.cpp F32 base`: how far the two float32
implementations are apart (the floor). `--llama-check` also runs llama-perplexity's own `--kl-divergence` and
prints its summary, which the llama.cpp rows must match.

The text: Isaac Newton's Opticks, which the apache-tvm-ffi wheel ships (tvm_ffi/3rdparty/libbacktrace), else the
Python language reference's topics in the standard library (pydoc_data.topics); the output says which.

python benchmarks/kl_divergence.py --windows 16            # every format, llama.cpp where built
python benchmarks/kl_divergence.py --formats Q4_1 --windows 4 --own-base --llama-check
python benchmarks/kl_divergence.py --formats Q4_1 --windows 4 --no-llama-cpp   # Kiln's own tokens and base only
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import re
import struct
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

WINDOW = 512
FIRST = WINDOW // 2  # llama-perplexity scores positions FIRST .. WINDOW - 2 of each window
FORMATS = ("Q4_1", "Q8_0", "Q4_0", "Q6_K", "Q4_K")
KV_TYPES = ("f16", "f32")  # llama.cpp's KV cache: its default, then Kiln's float32
CLAMP = 16.0  # llama-perplexity stores log-probs down to 16 below the top one and sums the KL over those only
Scores = tuple[torch.Tensor, torch.Tensor]  # per token: KL, and whether the argmaxes agree


@dataclass(frozen=True)
class Divergence:
    """KL(base || other) over the scored tokens and how often both pick the same top token."""

    tokens: int
    kl_mean: float
    kl_stderr: float  # of the mean, as llama-perplexity gives it
    kl_p99: float
    kl_max: float
    top1_agreement: float  # fraction of tokens


@dataclass(frozen=True)
class Difference:
    """The paired per-token difference of two KL divergences over the same tokens and base."""

    tokens: int
    mean: float
    stderr: float
    relative: float  # mean over the second divergence's mean


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
    """`count` consecutive windows of WINDOW tokens of the text (its first characters, a title page, skipped), as
    Kiln's tokenizer splits it: used only without llama.cpp, whose tokens are the ones compared otherwise."""
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


def token_divergence(base: torch.Tensor, other: torch.Tensor) -> Scores:
    """Per row: KL(softmax(base) || softmax(other)) in float64, and whether the argmaxes agree."""
    log_base, log_other = torch.log_softmax(base.double(), -1), torch.log_softmax(other.double(), -1)
    kl = (log_base.exp() * (log_base - log_other)).sum(-1).clamp_min(0.0)
    return kl, base.argmax(-1) == other.argmax(-1)


def encode_log_probs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs llama-perplexity's --kl-divergence-base stores of these logits [T, vocab] (perplexity.cpp's
    log_softmax, in its float32 arithmetic): each row's range from its top logit down to 16 below it (or to its
    lowest logit) in 65535 steps, the logits under the range at its bottom. Returns each row's step and lowest
    log-prob (float32 [T, 2]) and each token's steps above it (int32 [T, vocab], 0..65535)."""
    logits = logits.float()
    top = logits.max(-1, keepdim=True).values
    bottom = torch.maximum(logits.min(-1, keepdim=True).values, top - CLAMP)
    log_sum = torch.log(torch.exp(logits - top).double().sum(-1, keepdim=True)).float()
    step = (top - bottom) / 65535.0
    steps = torch.where(logits > bottom, torch.round((logits - bottom) * (1.0 / step)), 0.0)
    return torch.cat([step, bottom - top - log_sum], -1), steps.int()


def decode_log_probs(step_and_lowest: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Stored log-probs back to float32 [T, vocab], as perplexity.cpp reads its base."""
    return step_and_lowest[:, :1] * steps.float() + step_and_lowest[:, 1:2]


def stored_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """The logits' log-probs as llama-perplexity stores and reads them back: Kiln's base goes through the same
    rounding as llama.cpp's, so that the two sides' figures differ by the arithmetic alone."""
    return decode_log_probs(*encode_log_probs(logits))


def stored_divergence(base: torch.Tensor, other: torch.Tensor) -> Scores:
    """llama-perplexity's per-token KL(base || other) and top-1 agreement: `base` stored log-probs (decoded),
    `other` log-probs; the sum skips the tokens whose base log-prob is at or below -16 (and is not clamped at 0)."""
    base, other = base.double(), other.double()
    kl = torch.where(base > -CLAMP, base.exp() * (base - other), 0.0).sum(-1)
    return kl, base.argmax(-1) == other.argmax(-1)


def summarize(kl: torch.Tensor, same: torch.Tensor) -> Divergence:
    n = kl.numel()
    return Divergence(
        tokens=int(n),
        kl_mean=float(kl.mean()),
        kl_stderr=float(kl.double().std(correction=0) / max(n - 1, 1) ** 0.5),
        kl_p99=float(torch.quantile(kl.double(), 0.99)),
        kl_max=float(kl.max()),
        top1_agreement=float(same.double().mean()),
    )


def paired_difference(first: torch.Tensor, second: torch.Tensor) -> Difference:
    """Mean and standard error of first - second, token by token."""
    delta = first.double() - second.double()
    n = delta.numel()
    mean = float(delta.mean())
    return Difference(int(n), mean, float(delta.std() / n**0.5), mean / float(second.double().mean()))


# ---------------------------------------------------------------- llama-perplexity's log-prob files


@dataclass(frozen=True)
class LogProbFile:
    """What `llama-perplexity --kl-divergence-base FILE` writes (perplexity.cpp): "_logits_", n_ctx (uint32),
    n_vocab and n_chunk (int32), the chunks' tokens (int32, n_chunk x n_ctx, as tokenized: BOS is put first only
    when a chunk is run), then per chunk n_ctx - 1 - n_ctx/2 rows of 2 * ((n_vocab + 1) / 2) + 4 uint16: the row's
    step and lowest log-prob as two float32, then each token's log-prob in steps above that lowest one."""

    path: Path
    n_ctx: int
    n_vocab: int
    chunks: int

    HEADER = 20

    @classmethod
    def open(cls, path: Path) -> LogProbFile:
        with path.open("rb") as f:
            head = f.read(cls.HEADER)
        if head[:8] != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity log-prob file")
        n_ctx, n_vocab, chunks = struct.unpack("<Iii", head[8:])
        file = cls(path, n_ctx, n_vocab, chunks)
        expected = file._scores_offset + 2 * chunks * file.rows * file.row_width
        if path.stat().st_size != expected:
            raise ValueError(
                f"{path} holds {path.stat().st_size} bytes, not the {expected} its header implies"
            )
        return file

    @property
    def row_width(self) -> int:
        return 2 * ((self.n_vocab + 1) // 2) + 4

    @property
    def rows(self) -> int:
        return self.n_ctx - 1 - self.n_ctx // 2

    @property
    def _scores_offset(self) -> int:
        return self.HEADER + 4 * self.chunks * self.n_ctx

    def tokens(self) -> np.ndarray:
        count = self.chunks * self.n_ctx
        return np.fromfile(self.path, np.int32, count, offset=self.HEADER).reshape(self.chunks, self.n_ctx)

    def log_probs(self, chunk: int) -> torch.Tensor:
        """The chunk's stored log-probs, decoded as perplexity.cpp does: [rows, n_vocab] float32."""
        offset = self._scores_offset + 2 * chunk * self.rows * self.row_width
        raw = np.fromfile(self.path, np.uint16, self.rows * self.row_width, offset=offset)
        raw = raw.reshape(self.rows, self.row_width)
        step_and_lowest = torch.from_numpy(raw[:, :4].copy().view(np.float32))
        return decode_log_probs(
            step_and_lowest, torch.from_numpy(raw[:, 4 : 4 + self.n_vocab].astype(np.int32))
        )


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


def _perplexity_command(model: Path, text_file: Path, chunks: int, threads: int, kv: str) -> list[str]:
    command = [str(_llama_cpp().binary("llama-perplexity")), "-m", str(model), "-f", str(text_file)]
    command += ["-c", str(WINDOW), "--chunks", str(chunks), "-t", str(threads)]
    return command + ([] if kv == "f16" else ["-ctk", kv, "-ctv", kv])


def llama_cpp_log_probs(model: Path, text_file: Path, chunks: int, threads: int, kv: str) -> LogProbFile:
    """llama-perplexity's log-probs of `model` over the text's first `chunks` windows with a `kv` KV cache, cached
    beside the llama.cpp build (about 0.4 GB per 16 windows)."""
    out = _llama_cpp().CACHE / "kl" / f"{model.stem}.{chunks}x{WINDOW}.kv-{kv}.kld"
    if not out.exists():
        partial = out.with_suffix(".partial")
        command = _perplexity_command(model, text_file, chunks, threads, kv) + [
            "--kl-divergence-base",
            str(partial),
        ]
        subprocess.run(command, check=True, capture_output=True, timeout=3600)
        partial.rename(out)
    return LogProbFile.open(out)


_STATISTICS = {
    "kl_mean": r"Mean\s+KLD:\s+([-\d.e+]+)",
    "kl_stderr": r"Mean\s+KLD:\s+[-\d.e+]+\s+±\s+([-\d.e+]+)",
    "kl_p99": r"99\.0%\s+KLD:\s+([-\d.e+]+)",
    "kl_max": r"Maximum KLD:\s+([-\d.e+]+)",
    "top1_agreement": r"Same top p:\s+([-\d.e+]+)",
}


def llama_cpp_summary(
    model: Path, base: LogProbFile, text_file: Path, threads: int, kv: str
) -> dict[str, float]:
    """llama-perplexity's own `--kl-divergence` summary of `model` against `base` (a check of this file's
    arithmetic: its figures must equal the llama.cpp rows')."""
    command = _perplexity_command(model, text_file, base.chunks, threads, kv)
    command += ["--kl-divergence-base", str(base.path), "--kl-divergence"]
    run = subprocess.run(command, check=True, capture_output=True, text=True, timeout=3600)
    out = run.stdout + run.stderr
    found = {key: re.search(pattern, out) for key, pattern in _STATISTICS.items()}
    stats = {key: float(m.group(1)) for key, m in found.items() if m is not None}
    if "top1_agreement" in stats:
        stats["top1_agreement"] /= 100.0
    return stats


# ---------------------------------------------------------------- Kiln on the same windows


def first_token(model_path: str) -> int | None:
    """The BOS id llama-perplexity puts first in every window, None where the GGUF's vocabulary adds none."""
    import gguf

    fields = gguf.GGUFReader(model_path).fields

    def value(key: str):
        field = fields.get(key)
        return None if field is None else field.parts[field.data[0]][0]

    return int(value("tokenizer.ggml.bos_token_id")) if value("tokenizer.ggml.add_bos_token") else None


def _log_probs(runner, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, float64 log-probs) of the positions llama-perplexity scores."""
    logits = teacher_forced_logits(runner, ids)[FIRST : WINDOW - 1]
    return logits, torch.log_softmax(logits.double(), -1)


def score_format(
    model: Path,
    windows: list[list[int]],
    modes: tuple[str, ...],
    llama: dict[str, tuple[LogProbFile, ...]],
    own_base: bool,
) -> dict[str, Scores]:
    """Per-token scores of every row, over the windows; `llama` maps a KV type to its (base, quantized) files
    (empty: Kiln's rows against Kiln's base only). `own_base`: also run Kiln's float32 path, the base of the
    "Kiln <mode>" rows (without it Kiln is scored against llama.cpp's F32 base alone, one forward per window)."""
    own_base = own_base or not llama
    runners = {mode: load_runner(str(model), mode) for mode in (("f32",) if own_base else ()) + modes}
    scores: dict[str, list[Scores]] = defaultdict(list)
    for chunk, ids in enumerate(windows):
        kiln = {mode: _log_probs(runner, ids) for mode, runner in runners.items()}
        base = stored_log_probs(kiln["f32"][0]) if own_base else None
        for mode in modes if own_base else ():
            scores[f"Kiln {mode}"].append(stored_divergence(base, kiln[mode][1]))
        for kv, (llama_base, quantized) in llama.items():
            stored = llama_base.log_probs(chunk)
            scores[f"llama.cpp, KV {kv}"].append(stored_divergence(stored, quantized.log_probs(chunk)))
            if kv == "f32":
                for mode in runners:
                    scores[f"Kiln {mode} vs llama.cpp F32 base"].append(
                        stored_divergence(stored, kiln[mode][1])
                    )
    del runners
    gc.collect()
    return {
        row: (torch.cat([s[0] for s in got]), torch.cat([s[1] for s in got])) for row, got in scores.items()
    }


def llama_windows(files: dict[str, tuple[LogProbFile, ...]], bos: int | None) -> list[list[int]]:
    """The windows every llama.cpp file scored (the same tokens in all, checked), BOS first where it goes."""
    tokens = [file.tokens() for pair in files.values() for file in pair]
    if any(t.shape != tokens[0].shape or not np.array_equal(t, tokens[0]) for t in tokens):
        raise ValueError("llama-perplexity's runs tokenized the text differently")
    windows = [row.tolist() for row in tokens[0]]
    if bos is not None:
        windows = [[bos, *ids[1:]] for ids in windows]
    return windows


# ---------------------------------------------------------------- one matrix: the activations' scales

MATRIX_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # whose llama.cpp activations (Q8_0 / Q8_1 blocks) keep fp16 scales


def block_scaled_linear(x: torch.Tensor, rows: torch.Tensor, qtype: str, scales: torch.dtype) -> torch.Tensor:
    """x [M, K] against a 32-wide type's raw rows, the activations rounded to int8 in blocks as both Kiln and
    llama.cpp round them, the integer block sums exact and the rest in float64, but each block's activation scale
    (amax / 127) and Q4_1's sum term (scale * sum(q)) rounded to `scales`: float16 as llama.cpp's
    quantize_row_q8_0 / q8_1 store them, float32 as Kiln's kernels keep them, float64 for the exact value."""
    from kiln.layers import int_gemm

    weights, act = int_gemm.unpack_rows(rows, qtype), int_gemm.quantize_activations(x, 32)
    n, m = weights.q.shape[0], x.shape[0]
    q = weights.q.double().reshape(n, -1, 32) - (8 if qtype == "Q4_0" else 0)
    a = act.q.double().reshape(m, -1, 32)
    exact = x.double().reshape(m, -1, 32).abs().amax(-1) / 127
    if scales == torch.float64:
        scale, term = exact, exact * a.sum(-1)
    else:  # llama.cpp and Kiln both compute in float32 first
        scale = act.d.to(scales).double()
        term = (act.d.double() * a.sum(-1)).float().to(scales).double()
    y = (torch.einsum("nbw,mbw->mnb", q, a) * weights.d.double()[None] * scale[:, None, :]).sum(-1)
    if qtype == "Q4_1":
        y = y + (weights.m.double()[None] * term[:, None, :]).sum(-1)
    return y


def matrix_errors(model: Path, qtype: str, tensors: tuple[str, ...], count: int = 256) -> list[str]:
    """The relative error (Frobenius, against float64 on the same dequantized weights) of a few of the model's
    matrices on heavy-tailed activations (Student's t, 3 degrees of freedom: a few large values per row, as hidden
    states have), with Kiln's activation scales and with llama.cpp's."""
    import gguf

    from kiln.layers import int_gemm

    reader = gguf.GGUFReader(model)
    generator = torch.Generator().manual_seed(0)
    lines = []
    for name in tensors:
        tensor = next(t for t in reader.tensors if t.name == name)
        rows = torch.from_numpy(np.array(tensor.data)).reshape(int(tensor.shape[1]), -1)
        weight = int_gemm.dequantize(rows, qtype).double()
        normals = torch.randn(4, count, weight.shape[1], generator=generator)
        x = normals[0] / (normals[1:].square().sum(0) / 3).sqrt()  # Student's t, 3 degrees of freedom
        exact = x.double() @ weight.T
        errors = [
            float((block_scaled_linear(x, rows, qtype, scales) - exact).norm() / exact.norm())
            for scales in (torch.float32, torch.float16)
        ]
        lines.append(
            f"| {qtype} | {name} | {errors[0]:.6e} | {errors[1]:.6e} | {100 * (errors[1] / errors[0] - 1):+.3f} % |"
        )
    return lines


# ---------------------------------------------------------------- the report


def _row(fmt: str, who: str, d: dict) -> str:
    mean = f"{d['kl_mean']:.6f}" + (f" ± {d['kl_stderr']:.6f}" if "kl_stderr" in d else "")
    cells = [mean] + [f"{d[k]:.6f}" if k in d else "-" for k in ("kl_p99", "kl_max")]
    agree = f"{100 * d['top1_agreement']:.2f} %" if "top1_agreement" in d else "-"
    return f"| {fmt} | {who} | {' | '.join(cells)} | {agree} |"


def _difference_row(fmt: str, who: str, d: Difference) -> str:
    return f"| {fmt} | {who} | {d.mean:+.6f} ± {d.stderr:.6f} | {100 * d.relative:+.2f} % |"


def compare(scores: dict[str, Scores], modes: tuple[str, ...]) -> dict[str, Difference]:
    """Each Kiln mode's paired difference from llama.cpp's rows over the same tokens: against the same base
    (llama.cpp's F32 / KV f32 run), and, where Kiln's own float32 path ran, each against its own base."""
    pairs = {
        f"Kiln {mode} - llama.cpp, KV {kv}, each against its own base": (
            f"Kiln {mode}",
            f"llama.cpp, KV {kv}",
        )
        for mode in modes
        for kv in KV_TYPES
    }
    pairs |= {
        f"Kiln {mode} - llama.cpp, KV f32, both against llama.cpp's F32 base": (
            f"Kiln {mode} vs llama.cpp F32 base",
            "llama.cpp, KV f32",
        )
        for mode in modes
    }
    return {
        row: paired_difference(scores[kiln][0], scores[llama][0])
        for row, (kiln, llama) in pairs.items()
        if kiln in scores and llama in scores
    }


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated GGUF types")
    ap.add_argument("--windows", type=int, default=16, help=f"windows of {WINDOW} tokens")
    ap.add_argument("--modes", default="auto", help="Kiln --cpu-gemm modes compared with f32 (auto, exact)")
    ap.add_argument("--kv", default=",".join(KV_TYPES), help="llama.cpp's KV cache types (f16: its default)")
    ap.add_argument("--own-base", action="store_true", help="also score Kiln against Kiln's float32 path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-cpp", action="store_true", help="Kiln's figures only, on Kiln's tokens")
    ap.add_argument("--llama-check", action="store_true", help="also print llama-perplexity's own summary")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too (after each format)")
    ap.add_argument(
        "--matrix-error", action="store_true", help="only one matrix's error, Kiln's vs llama.cpp's scales"
    )
    return ap.parse_args()


def _llama_files(model: Path, text_file: Path, args) -> dict[str, tuple[LogProbFile, LogProbFile]]:
    f32 = _llama_cpp().quantize(model, "F32")
    return {
        kv: tuple(llama_cpp_log_probs(m, text_file, args.windows, args.threads, kv) for m in (f32, model))
        for kv in args.kv.split(",")
    }


def run_format(
    model: Path, args, text: tuple[str, Path], use_llama: bool
) -> tuple[dict, list[str], list[str]]:
    """One weight format's figures (as JSON), its rows of the divergences' table and of the differences'."""
    modes = tuple(args.modes.split(","))
    t0 = time.perf_counter()
    files = _llama_files(model, text[1], args) if use_llama else {}
    windows = llama_windows(files, first_token(str(model))) if files else None
    windows = windows or token_windows(str(model), text[0], args.windows)
    t1 = time.perf_counter()
    scores = score_format(model, windows, modes, files, args.own_base)
    summary: dict[str, dict] = {row: asdict(summarize(*s)) for row, s in scores.items()}
    if args.llama_check:
        for kv, (base, _) in files.items():
            own = llama_cpp_summary(model, base, text[1], args.threads, kv)
            summary[f"llama-perplexity's own summary, KV {kv}"] = own
    differences = compare(scores, modes)
    qtype = model.stem.rsplit(".", 1)[-1]
    rows = [_row(qtype, row, s) for row, s in summary.items()]
    difference_rows = [_difference_row(qtype, row, d) for row, d in differences.items()]
    print(f"{model.name}: llama.cpp {t1 - t0:.0f} s, Kiln {time.perf_counter() - t1:.0f} s", flush=True)
    print("\n".join(rows + difference_rows), flush=True)
    return summary | {row: asdict(d) for row, d in differences.items()}, rows, difference_rows


def main() -> None:
    args = _arguments()
    torch.set_num_threads(args.threads)
    from kiln.loader.default_model import default_model_path

    llama_cpp = _llama_cpp()
    shipped = Path(default_model_path())
    if args.matrix_error:
        print(
            "| format | matrix | Kiln's scales | llama.cpp's (fp16) | llama.cpp over Kiln |\n|---|---|---|---|---|"
        )
        for qtype in (q for q in args.formats.split(",") if q in MATRIX_TYPES):
            tensors = ("blk.10.attn_q.weight", "blk.10.ffn_down.weight")
            print("\n".join(matrix_errors(format_file(shipped, qtype), qtype, tensors)), flush=True)
        return
    text, source = english_text()
    text_file = llama_cpp.CACHE / "kl" / "text.txt"
    text_file.parent.mkdir(parents=True, exist_ok=True)
    text_file.write_text(text[2000:], encoding="utf-8")
    use_llama = not args.no_llama_cpp and llama_cpp.binary("llama-perplexity").exists()
    tokens_from = "llama.cpp's tokens (llama-perplexity's chunks)" if use_llama else "Kiln's tokenizer"
    print(
        f"text: {source}; {args.windows} windows of {WINDOW} tokens from {tokens_from}, positions {FIRST}.."
    )
    rows, difference_rows, figures = [], [], {}
    for qtype in args.formats.split(","):
        model = format_file(shipped, qtype)
        if model is None:
            print(f"{qtype}: skipped (llama-quantize not built)")
            continue
        figures[qtype], new_rows, new_differences = run_format(model, args, (text, text_file), use_llama)
        rows += new_rows
        difference_rows += new_differences
        if args.json:
            payload = {"text": source, "windows": args.windows, "tokens": tokens_from, "figures": figures}
            args.json.write_text(json.dumps(payload, indent=1))
    print(
        "\n| format | scored | KL mean ± stderr | KL p99 | KL max | top-1 agreement |\n|---|---|---|---|---|---|"
    )
    print("\n".join(rows))
    print("\n| format | paired per-token difference | KL difference ± stderr | relative |\n|---|---|---|---|")
    print("\n".join(difference_rows))


if __name__ == "__main__":
    main()
