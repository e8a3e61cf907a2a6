"""Kiln against llama.cpp's `llama-server`, side by side, as a user deploys both.

Both servers start once and stay up for every workload: Kiln at its defaults (`kiln serve`, nothing tuned),
llama-server on the default GGUF requantized to Q4_0 (its fastest format on these CPUs) with one `--parallel`
and one context for all workloads. Each repetition runs every workload on both servers back to back, the
order alternating (A/B, then B/A), with fresh prompts per repetition so that neither server finds an earlier
repetition's prefix cached. The same client (`kiln bench serve`'s engine, streaming) drives both. Ratios are
paired per repetition; the table gives their minimum and median, the host's CPU model and its load average
before each run, and each server's CPU seconds per output token (Kiln's front and engine apart).

    .venv/bin/python benchmarks/compare.py              # 3 repetitions (~40 min on 2 cores)
    .venv/bin/python benchmarks/compare.py --quick      # a smoke run with a few short requests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("~/.cache/kiln/compare/results.json").expanduser()
LLAMA = "llama.cpp Q4_0"
LLAMA_PARALLEL, LLAMA_CTX = 32, 49152  # 32 slots of 1,536 tokens: the longest request (1,384) fits any slot


@dataclass
class Workload:
    """One `kiln bench serve` workload; `target`: (least paired tok/s ratio, most mean-TTFT ratio)."""

    name: str
    label: str
    flags: list[str]
    concurrency: int
    target: tuple[float | None, float | None] = (None, None)


def chat_prompts(path: Path, n: int, seed: int) -> Path:
    """`n` chat requests about real prose (passages of Python's own documentation, in the standard library),
    one JSON object per line for `--dataset-name jsonl`; `seed` picks the passages, so each repetition asks
    about different ones."""
    from pydoc_data.topics import topics

    paras = [" ".join(p.split()) for t in topics.values() for p in t.split("\n\n")]
    paras = [p for p in paras if 60 <= len(p.split()) <= 160]
    picked = random.Random(seed).sample(paras, n)
    asks = ("Explain this passage to a new programmer:", "Summarise this in three sentences:",
            "What are the key points here?", "Rewrite this more simply:")  # fmt: skip
    lines = [{"prompt": f"{asks[i % len(asks)]}\n\n{p}", "output_len": 128} for i, p in enumerate(picked)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def workloads(quick: bool, rep: int, scratch: Path) -> list[Workload]:
    """The issue's workloads with seeds of this repetition: one stream and 32 of random prose, a shared
    prefix, and streaming chat about real text (one stream and 32)."""
    n, n1, out, sys_len, gsp_out = (8, 2, 16, 300, 16) if quick else (64, 8, 128, 1300, 64)
    seed = 1000 * (rep + 1)
    rand = ["--dataset-name", "random", "--random-input-len", "200", "--random-range-ratio", "1",
            "--random-output-len", str(out)]  # fmt: skip
    gsp = ["--dataset-name", "shared-prefix", "--gsp-num-groups", "1", "--gsp-prompts-per-group", str(n),
           "--gsp-system-prompt-len", str(sys_len), "--gsp-question-len", "20", "--gsp-output-len", str(gsp_out)]  # fmt: skip

    def chat(k: int, s: int) -> list[str]:
        path = chat_prompts(scratch / f"chat-{rep}-{k}.jsonl", k, s)
        return ["--backend", "openai-chat", "--dataset-name", "jsonl", "--dataset-path", str(path)]

    return [
        Workload("single", f"one stream: {n1} x 200-token prompts, {out} out", [*rand, "--num-prompts", str(n1),
                 "--seed", str(seed + 1)], 1, (1.0, None)),
        Workload("random-c32", f"{n} x 200-token prompts, {out} out, 32 concurrent",
                 [*rand, "--num-prompts", str(n), "--seed", str(seed + 2)], 32, (3.0, None)),
        Workload("shared-prefix", f"{n} requests, {sys_len}-token shared prefix + 20, {gsp_out} out, 32 concurrent",
                 [*gsp, "--seed", str(seed + 3)], 32, (10.0, 0.2)),
        Workload("chat-single", f"streaming chat on real text, one stream: {n1} requests, 128 out",
                 chat(n1, seed + 4), 1),
        Workload("chat-c32", f"streaming chat on real text, 32 concurrent: {n} requests, 128 out",
                 chat(n, seed + 5), 32),
    ]  # fmt: skip


def bench_argv(base_url: str, w: Workload, timeout: float) -> list[str]:
    backend = [] if "--backend" in w.flags else ["--backend", "openai"]
    return [
        "bench", "serve", *backend, "--base-url", base_url, "--max-concurrency", str(w.concurrency),
        "--request-timeout", str(timeout), "--total-timeout", str(timeout), "--warmup-requests", "0",
        "--disable-tqdm", *w.flags,
    ]  # fmt: skip


def run_bench(argv: list[str], tok) -> dict:
    """One `kiln bench serve` run through its Python API."""
    from kiln.bench.cli import register
    from kiln.bench.metrics import compute_metrics
    from kiln.bench.serve import benchmark
    from kiln.bench.workloads import build_workload

    parser = argparse.ArgumentParser(prog="kiln")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    records, duration = asyncio.run(benchmark(args, build_workload(args, tok), tok))
    return compute_metrics(records, duration)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    label: str
    cmd: list[str]
    url: str
    log: Path
    proc: object = None
    shown: str = ""  # the command as a user would type it (no port, no machine paths)
    cpu_at: dict = field(default_factory=dict)

    def cpu(self) -> tuple[float, float]:
        """CPU seconds (user + system) of the server's first process and of all its children so far; a child
        that has exited leaves its last figure in `cpu_at`."""
        import psutil

        root = psutil.Process(self.proc.pid)
        own = sum(root.cpu_times()[:2])
        for c in root.children(recursive=True):
            try:
                self.cpu_at[c.pid] = sum(c.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
        return own, sum(self.cpu_at.values())


def warm_up(url: str, timeout: float = 600.0) -> None:
    """One short request on a prompt no workload uses, so nothing a workload asks is cached beforehand."""
    import httpx

    body = {"prompt": "Warm-up: list three colours.", "max_tokens": 8, "temperature": 0.0, "stream": False}
    httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, trust_env=False).raise_for_status()


def servers(model: Path, kiln_args: list[str], logdir: Path) -> list[Server]:
    home = str(Path.home())
    kp, lp = free_port(), free_port()
    kiln = [sys.executable, "-m", "kiln.cli", "serve", "--host", "127.0.0.1", "--port", str(kp), *kiln_args]
    q4 = llama_cpp.quantize(model, "Q4_0")
    llama = llama_cpp.server_command(q4, lp, LLAMA_PARALLEL, LLAMA_CTX)
    return [
        Server("Kiln", kiln, f"http://127.0.0.1:{kp}", logdir / "kiln-serve.log",
               shown=" ".join(["kiln", *kiln[3:]]).replace(str(kp), "PORT")),
        Server(LLAMA, llama, f"http://127.0.0.1:{lp}", logdir / "llama-server.log",
               shown=" ".join(llama).replace(str(lp), "PORT").replace(home, "~")),
    ]  # fmt: skip


def one_run(s: Server, w: Workload, rep: int, tok, timeout: float) -> dict:
    load = os.getloadavg()[0]
    front0, kids0, client0 = *s.cpu(), time.process_time()
    m = run_bench(bench_argv(s.url, w, timeout), tok)
    front1, kids1, client1 = *s.cpu(), time.process_time()
    toks = max(1, m["total_output_tokens"])
    row = {"server": s.label, "workload": w.name, "rep": rep, "load_1min": load}
    row |= {k: m.get(k) for k in ("completed", "failed", "output_throughput", "mean_ttft_ms", "median_tpot_ms",
                                  "total_output_tokens", "prefix_cache_hit_rate")}  # fmt: skip
    row["cpu_ms_per_token"] = 1000 * (front1 - front0 + kids1 - kids0) / toks
    row["front_cpu_ms_per_token"] = 1000 * (front1 - front0) / toks
    row["client_cpu_ms_per_token"] = 1000 * (client1 - client0) / toks  # the benchmark client, this process
    print(f"   rep {rep} {w.name:14s} {s.label:15s} {m['output_throughput']:7.1f} tok/s  TTFT "
          f"{m.get('mean_ttft_ms') or 0:7.0f} ms  load {load:.2f}", flush=True)  # fmt: skip
    return row


def in_turn(srv: list, rep: int, i: int) -> list:
    """Which server runs workload `i` of repetition `rep` first: A/B, then B/A, so neither always runs second
    (on a warmer cache, or later in a drifting hour)."""
    return srv if (rep + i) % 2 == 0 else srv[::-1]


def collect(a: argparse.Namespace) -> dict:
    from kiln.bench.workloads import load_tokenizer
    from kiln.loader.default_model import default_model_path

    model = Path(a.model_path or default_model_path())
    tok = load_tokenizer(str(model))
    logdir = a.results.parent / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    llama_cpp.build()
    data: dict = {"quick": a.quick, "reps": a.reps, "model": model.name, "versions": versions(), "runs": []}
    data["load_average_start"] = os.getloadavg()
    srv = servers(model, a.kiln_arg, logdir)
    data["commands"] = {s.label: s.shown for s in srv}
    with ExitStack() as stack:
        for s in srv:  # both up, each started and warmed once, for the whole run
            t0 = time.monotonic()
            s.proc = stack.enter_context(llama_cpp.running(s.cmd, s.url, s.log, a.ready_timeout))
            warm_up(s.url)
            print(f"== {s.label} ready in {time.monotonic() - t0:.0f} s", flush=True)
        for rep in range(a.reps):
            wls = [w for w in workloads(a.quick, rep, logdir) if not a.only or w.name in a.only.split(",")]
            data["workloads"] = [asdict(w) for w in wls]
            for i, w in enumerate(wls):
                data["runs"] += [one_run(s, w, rep, tok, a.timeout) for s in in_turn(srv, rep, i)]
    data["load_average_end"] = os.getloadavg()
    return data


def versions() -> dict:
    import subprocess

    import torch

    import kiln

    r = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    return {
        "kiln": f"{kiln.__version__} (git {r.stdout.strip() or 'unknown'})", "torch": torch.__version__,
        "llama.cpp": llama_cpp.version(), "python": sys.version.split()[0],
        "cpu": f"{cpu}, {os.cpu_count()} logical cores",
    }  # fmt: skip


# ---- report ----------------------------------------------------------------------------------------------
def _f(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def paired(data: dict, wname: str, key: str) -> list[float]:
    """Kiln's figure over llama.cpp's, per repetition."""
    by = {(r["server"], r["rep"]): r.get(key) for r in data["runs"] if r["workload"] == wname}
    reps = sorted({rep for _, rep in by})
    return [
        by["Kiln", r] / by[LLAMA, r] for r in reps if by.get(("Kiln", r)) is not None and by.get((LLAMA, r))
    ]


def figures(data: dict, wname: str, server: str, key: str) -> list[float]:
    rows = [r for r in data["runs"] if r["workload"] == wname and r["server"] == server]
    return [r[key] for r in rows if r.get(key) is not None]


def _mm(xs: list[float], spec: str = ".1f") -> str:
    return f"{min(xs):{spec}} / {statistics.median(xs):{spec}}" if xs else "n/a"


def verdict(tok: list[float], ttft: list[float], target: tuple) -> str:
    least, most = target
    if least is None:
        return "—"
    ok = bool(tok) and min(tok) >= least and (most is None or (bool(ttft) and max(ttft) <= most))
    want = f"≥ {least:g}x" + (f", TTFT ≤ {most:g}x" if most else "")
    return f"{want}: {'yes' if ok else '**no**'}"


def headline(data: dict) -> list[str]:
    lines = ["| workload | Kiln tok/s, min / median | llama.cpp Q4_0 tok/s, min / median | tok/s ratio, min / "
             "median | mean TTFT ratio, min / median | load avg (1 min) | target: met |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for w in data["workloads"]:
        tok, ttft = paired(data, w["name"], "output_throughput"), paired(data, w["name"], "mean_ttft_ms")
        loads = [r["load_1min"] for r in data["runs"] if r["workload"] == w["name"]]
        lines.append(
            f"| {w['label']} | {_mm(figures(data, w['name'], 'Kiln', 'output_throughput'))} | "
            f"{_mm(figures(data, w['name'], 'llama.cpp Q4_0', 'output_throughput'))} | {_mm(tok, '.2f')} | "
            f"{_mm(ttft, '.2f')} | {min(loads):.2f}-{max(loads):.2f} | {verdict(tok, ttft, tuple(w['target']))} |"
        )
    return lines


def cpu_table(data: dict) -> list[str]:
    lines = [
        "| workload | Kiln CPU ms / output token (front) | llama.cpp CPU ms / output token | the client's, "
        "against Kiln / llama.cpp |",
        "|---|---|---|---|",
    ]
    for w in data["workloads"]:
        k = figures(data, w["name"], "Kiln", "cpu_ms_per_token")
        f = figures(data, w["name"], "Kiln", "front_cpu_ms_per_token")
        ll = figures(data, w["name"], LLAMA, "cpu_ms_per_token")
        ck = figures(data, w["name"], "Kiln", "client_cpu_ms_per_token")
        cl = figures(data, w["name"], LLAMA, "client_cpu_ms_per_token")
        client = f"{statistics.median(ck):.2f} / {statistics.median(cl):.2f}" if ck and cl else "n/a"
        if k and ll:
            med = statistics.median
            lines.append(f"| {w['name']} | {med(k):.1f} ({med(f):.2f}) | {med(ll):.1f} | {client} |")
    return lines


def runs_table(data: dict) -> list[str]:
    lines = ["| rep | workload | server | ok / failed | output tok/s | mean TTFT ms | TPOT p50 ms | load |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in data["runs"]:
        lines.append(f"| {r['rep']} | {r['workload']} | {r['server']} | {r['completed']} / {r['failed']} | "
                     f"{_f(r['output_throughput'])} | {_f(r['mean_ttft_ms'], '.0f')} | {_f(r['median_tpot_ms'])} | "
                     f"{r['load_1min']:.2f} |")  # fmt: skip
    return lines


def plot_ratios(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w["name"] for w in data["workloads"]]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, w in enumerate(data["workloads"]):
        ratios = paired(data, w["name"], "output_throughput")
        ax.scatter([i] * len(ratios), ratios, color="tab:blue", zorder=3)
        if w["target"][0]:
            ax.hlines(w["target"][0], i - 0.3, i + 0.3, color="tab:red", lw=2, zorder=2)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set(yscale="log", ylabel="Kiln / llama.cpp Q4_0 output tok/s",
           title="Paired ratio per repetition (dots) and target (red)")  # fmt: skip
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(data: dict, md: Path, img: Path) -> None:
    img.parent.mkdir(parents=True, exist_ok=True)
    plot_ratios(data, img)
    v, la0, la1 = data["versions"], data["load_average_start"], data["load_average_end"]
    lines = [
        "# Kiln vs llama.cpp's llama-server, side by side",
        "",
        f"Generated by `.venv/bin/python benchmarks/compare.py{' --quick' if data['quick'] else ''}`"
        + (": a smoke run, not figures to quote." if data["quick"] else f", {data['reps']} repetitions."),
        "Both servers up for the whole run on 127.0.0.1, each configured once; every repetition runs each workload "
        "on both, back to back, in alternating order, with prompts of its own. Ratios are Kiln over llama.cpp, "
        "paired per repetition. Client: `kiln bench serve` (streaming, greedy, `ignore_eos`).",
        "",
        f"Model: `{data['model']}` (llama.cpp: requantized to Q4_0). Host: {v['cpu']}; load average "
        f"{la0[0]:.2f} / {la0[1]:.2f} / {la0[2]:.2f} at the start, {la1[0]:.2f} / {la1[1]:.2f} / {la1[2]:.2f} at "
        "the end.",
        "",
        *headline(data),
        "",
        f"![paired ratios]({os.path.relpath(img, md.parent)})",
        "",
        "## CPU per output token (median over repetitions)",
        "",
        "Each server's process tree, user + system seconds over the run, divided by its output tokens; for Kiln "
        "the front's own share (HTTP, prompt tokenization, streaming; the engine detokenizes) in parentheses; "
        "the last column is the benchmark client's, which shares the host's cores with the server under test.",
        "",
        *cpu_table(data),
        "",
        "## Every run",
        "",
        *runs_table(data),
        "",
        "## Versions",
        "",
        *[f"- {k}: {val}" for k, val in v.items()],
        "",
        "## Commands",
        "",
        "```",
        "# llama.cpp (benchmarks/llama_cpp.py builds it into ~/.cache/kiln/llama.cpp-<version>/)",
        f"pip download --no-deps --no-binary :all: llama-cpp-python=={llama_cpp.SDIST_VERSION}",
        "cmake -S <sdist>/vendor/llama.cpp -B build " + " ".join(llama_cpp.CMAKE_FLAGS),
        "cmake --build build --target " + " ".join(llama_cpp.TARGETS) + " -j 2",
        "llama-quantize --allow-requantize <default model .gguf> <its .Q4_0.gguf> Q4_0",
        *[f"# {label}\n{cmd}" for label, cmd in data["commands"].items()],
        "# each workload, against each server (seeds and chat files per repetition)",
        *[" ".join(bench_argv("URL", Workload(**w), 1800)) for w in data["workloads"]],
        "```",
        "",
    ]
    md.write_text("\n".join(lines).replace(str(Path.home()), "~"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short smoke run (few short requests)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every workload on both servers")
    p.add_argument("--only", default="", help="comma-separated workload names (default: all)")
    p.add_argument("--kiln-arg", action="append", default=[], help="a `kiln serve` argument (default: none)")
    p.add_argument("--model-path", default=None, help="GGUF to serve (default: Kiln's default model)")
    p.add_argument("--results", type=Path, default=RESULTS, help="raw results JSON (written, or read)")
    p.add_argument("--render-only", action="store_true", help="re-render the docs from --results")
    p.add_argument("--out-md", type=Path, default=ROOT / "docs" / "benchmarks_compare.md")
    p.add_argument("--img", type=Path, default=ROOT / "docs" / "img" / "compare_ratios.png")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one benchmark run may take")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take to start")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.render_only:
        data = json.loads(a.results.read_text())
    else:
        data = collect(a)
        a.results.parent.mkdir(parents=True, exist_ok=True)
        a.results.write_text(json.dumps(data))
    write_report(data, a.out_md, a.img)
    print(f"wrote {a.out_md} and {a.img}; raw results in {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
