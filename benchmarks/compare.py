"""Kiln vs llama.cpp's `llama-server` vs transformers `generate()` on the same workloads, on this machine.

Starts one server at a time on 127.0.0.1 (Kiln, then llama-server on the shipped GGUF and on a Q4_0
requantization), drives each with `kiln bench serve`'s engine, runs transformers in-process as the no-server
baseline, and writes docs/benchmarks_compare.md plus PNG plots in docs/img/.

    .venv/bin/python benchmarks/compare.py            # the full run (~30 min on 2 cores)
    .venv/bin/python benchmarks/compare.py --quick    # a smoke run with a few short requests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# decode steps compiled at SGLang's batch sizes up to 32, the workloads' concurrency (the CPU default compiles
# nothing: ~30-40 s a shape at the first start, ~5 s a shape from the cache after)
KILN_FLAGS = ["--max-running-requests", "64", "--max-total-tokens", "65536", "--cuda-graph-max-bs", "32"]
RESULTS = Path("~/.cache/kiln/compare/results.json").expanduser()


@dataclass
class Workload:
    """One `kiln bench serve` workload: its flags, concurrency, and the tokens one request can occupy."""

    name: str
    label: str
    flags: list[str]
    concurrency: int
    tokens_per_request: int


def workloads(quick: bool) -> list[Workload]:
    """(a) 32 streams of prose, (b) shared prefix, a concurrency-8 point for the sweep, (c) one stream."""
    n, out, sys_len, gsp_out = (8, 16, 300, 16) if quick else (64, 128, 1300, 64)
    common = ["--dataset-name", "random", "--random-input-len", "200", "--random-range-ratio", "1"]
    rand = [*common, "--random-output-len", str(out), "--ignore-eos"]
    gsp = [
        "--dataset-name", "shared-prefix", "--gsp-num-groups", "1", "--gsp-prompts-per-group", str(n),
        "--gsp-system-prompt-len", str(sys_len), "--gsp-question-len", "20", "--gsp-output-len", str(gsp_out),
        "--ignore-eos",
    ]  # fmt: skip
    return [
        Workload("random-c32", f"(a) {n} x 200-token prompts, {out} out, 32 concurrent",
                 [*rand, "--num-prompts", str(n), "--seed", "1"], 32, 200 + out),
        Workload("shared-prefix", f"(b) {n} requests, {sys_len}-token shared prefix + 20, {gsp_out} out, 32 concurrent",
                 [*gsp, "--seed", "4"], 32, sys_len + 20 + gsp_out),
        Workload("random-c8", f"{max(4, n // 4)} x 200-token prompts, {out} out, 8 concurrent",
                 [*rand, "--num-prompts", str(max(4, n // 4)), "--seed", "2"], 8, 200 + out),
        Workload("single", f"(c) one stream: {2 if quick else 4} x 200-token prompts, {out} out",
                 [*rand, "--num-prompts", str(2 if quick else 4), "--seed", "3"], 1, 200 + out),
    ]  # fmt: skip


def bench_argv(base_url: str, w: Workload, timeout: float) -> list[str]:
    return [
        "bench", "serve", "--backend", "openai", "--base-url", base_url, "--max-concurrency", str(w.concurrency),
        "--request-timeout", str(timeout), "--total-timeout", str(timeout), "--warmup-requests", "0",
        "--disable-tqdm", *w.flags,
    ]  # fmt: skip


def run_bench(argv: list[str], tok) -> dict:
    """One `kiln bench serve` run via its Python API; the metrics plus per-request TTFT/TPOT lists."""
    from kiln.bench.cli import register
    from kiln.bench.metrics import compute_metrics, format_result
    from kiln.bench.serve import benchmark
    from kiln.bench.workloads import build_workload

    parser = argparse.ArgumentParser(prog="kiln")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    convs = build_workload(args, tok)
    records, duration = asyncio.run(benchmark(args, convs, tok))
    m = compute_metrics(records, duration)
    print(format_result(m, args.backend, args.request_rate, args.max_concurrency), flush=True)
    ok = [r for r in records if r.success]
    m["ttfts_ms"] = [r.ttft * 1000 for r in ok]
    m["tpots_ms"] = [t * 1000 for r in ok if (t := r.tpot) is not None]
    m["command"] = "kiln " + " ".join(argv)
    return m


def warm_up(url: str, timeout: float = 600.0) -> None:
    """One short request on a prompt no workload uses, so no benchmark prompt is cached beforehand."""
    import httpx

    body = {"prompt": "Warm-up: list three colours.", "max_tokens": 8, "temperature": 0.0, "stream": False}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, trust_env=False)
    resp.raise_for_status()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_kiln(wls: list[Workload], tok, logdir: Path, timeout: float, flags: list[str]) -> tuple[dict, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    results = {}
    with llama_cpp.running(cmd, url, logdir / "kiln-serve.log"):
        warm_up(url)
        for w in wls:
            print(f"== kiln: {w.name}", flush=True)
            results[w.name] = run_bench(bench_argv(url, w, timeout), tok)
    return results, "kiln serve --host 127.0.0.1 --port PORT " + " ".join(flags)


def run_llama(model: Path, wls: list[Workload], tok, logdir: Path, timeout: float) -> tuple[dict, list[str]]:
    """One llama-server per concurrency level (--parallel = concurrency, ctx = slots x tokens per request)."""
    results, cmds = {}, []
    for conc in sorted({w.concurrency for w in wls}, reverse=True):
        group = [w for w in wls if w.concurrency == conc]
        per_slot = math.ceil((max(w.tokens_per_request for w in group) + 64) / 256) * 256
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = llama_cpp.server_command(model, port, conc, conc * per_slot)
        cmds.append(" ".join(cmd).replace(str(port), "PORT"))
        with llama_cpp.running(cmd, url, logdir / f"llama-server-{model.stem}-p{conc}.log"):
            warm_up(url)
            for w in group:
                print(f"== llama-server {model.name}: {w.name}", flush=True)
                results[w.name] = run_bench(bench_argv(url, w, timeout), tok)
    return results, cmds


def hf_baseline(model_path: str, wls: list[Workload], tok, max_requests: int, threads: int) -> dict:
    """transformers generate(), greedy, batch = concurrency, fixed output length; output tok/s per workload."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.bench.cli import register
    from kiln.bench.workloads import build_workload

    torch.set_num_threads(threads)
    d, f = os.path.dirname(model_path), os.path.basename(model_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(d, gguf_file=f, padding_side="left")
    hf_tok.pad_token = hf_tok.pad_token or hf_tok.eos_token
    parser = argparse.ArgumentParser(prog="kiln")
    register(parser.add_subparsers(dest="command"))
    results = {}
    for w in wls:
        args = parser.parse_args(bench_argv("http://unused", w, 1))
        turns = [c.turns[0] for c in build_workload(args, tok)][:max_requests]
        print(f"== transformers generate(): {w.name} ({len(turns)} requests)", flush=True)
        start, out_tokens, lat = time.perf_counter(), 0, []
        for i in range(0, len(turns), w.concurrency):
            batch = turns[i : i + w.concurrency]
            n_out = max(t.output_len for t in batch)
            enc = hf_tok(
                [t.prompt for t in batch], return_tensors="pt", padding=True, add_special_tokens=False
            )
            t0 = time.perf_counter()
            with torch.inference_mode():
                gen = model.generate(**enc, max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False)
            lat += [time.perf_counter() - t0] * len(batch)
            out_tokens += (gen.shape[1] - enc["input_ids"].shape[1]) * len(batch)
        dur = time.perf_counter() - start
        results[w.name] = {
            "completed": len(turns), "failed": 0, "duration": dur, "total_output_tokens": out_tokens,
            "output_throughput": out_tokens / dur, "mean_e2e_latency_ms": 1000 * sum(lat) / len(lat),
        }  # fmt: skip
        print(f"   {out_tokens} tokens in {dur:.1f} s: {out_tokens / dur:.1f} tok/s", flush=True)
    return results


def versions() -> dict:
    import subprocess

    import torch
    import transformers

    import kiln

    def git(*a: str) -> str:
        r = subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, timeout=60)
        return r.stdout.strip() or "unknown"

    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    return {
        "kiln": f"{kiln.__version__} (git {git('describe', '--always', '--dirty')})",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "llama.cpp": llama_cpp.version() if llama_cpp.binary("llama-server").exists() else "not built", "python": sys.version.split()[0],
        "cpu": f"{cpu}, {os.cpu_count()} logical cores", "load_average_start": " ".join(map(str, os.getloadavg())),
    }  # fmt: skip


# ---- report: markdown table, ratios against the targets, plots ----------------------------------------
TARGETS = {  # workload -> (min output tok/s ratio, max mean-TTFT ratio, min prefix hit rate)
    "random-c32": (3.0, None, None),
    "shared-prefix": (8.0, 0.2, 0.9),
    "single": (0.6, None, None),
}


def _f(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def fastest_llama(runs: dict, wname: str) -> str | None:
    cands = [k for k in runs if k.startswith("llama.cpp") and wname in runs[k]]
    return max(cands, key=lambda k: runs[k][wname]["output_throughput"], default=None)


def results_table(data: dict) -> list[str]:
    lines = []
    for w in data["workloads"]:
        lines += [f"### {w['label']}", "", "| server | ok / failed | output tok/s | mean TTFT (ms) | "
                  "TPOT p50 (ms) | TPOT p99 (ms) | prefix hit rate |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for server, runs in data["runs"].items():
            m = runs.get(w["name"])
            if m is None:
                continue
            hit = m.get("prefix_cache_hit_rate")
            lines.append(
                f"| {server} | {m['completed']} / {m['failed']} | {_f(m['output_throughput'])} | "
                f"{_f(m.get('mean_ttft_ms'), '.0f')} | {_f(m.get('median_tpot_ms'))} | {_f(m.get('p99_tpot_ms'))} | "
                f"{'n/a' if hit is None else format(hit, '.1%')} |"
            )
        lines.append("")
    return lines


def ratio_table(data: dict) -> list[str]:
    runs = data["runs"]
    lines = ["| workload | Kiln tok/s | llama.cpp fastest config | its tok/s | tok/s ratio | mean TTFT ratio | "
             "Kiln hit rate | target | met |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for wname, (min_tok, max_ttft, min_hit) in TARGETS.items():
        best, kiln = fastest_llama(runs, wname), runs.get("Kiln", {}).get(wname)
        if best is None or kiln is None:
            continue
        ll = runs[best][wname]
        tok = kiln["output_throughput"] / ll["output_throughput"] if ll["output_throughput"] else None
        ttft = kiln["mean_ttft_ms"] / ll["mean_ttft_ms"] if ll.get("mean_ttft_ms") else None
        hit = kiln.get("prefix_cache_hit_rate")
        want = [f"tok/s >= {min_tok}x"] + ([f"TTFT <= {max_ttft}x"] if max_ttft else [])
        want += [f"hit >= {min_hit:.0%}"] if min_hit else []
        met = tok is not None and tok >= min_tok
        met &= max_ttft is None or (ttft is not None and ttft <= max_ttft)
        met &= min_hit is None or (hit is not None and hit >= min_hit)
        lines.append(
            f"| {wname} | {_f(kiln['output_throughput'])} | {best} | {_f(ll['output_throughput'])} | "
            f"{_f(tok, '.2f')}x | {_f(ttft, '.2f')}x | {'n/a' if hit is None else format(hit, '.1%')} | "
            f"{', '.join(want)} | {'yes' if met else '**no**'} |"
        )
    return lines


SWEEP = (("single", 1), ("random-c8", 8), ("random-c32", 32))


def plot_throughput(data: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for server, runs in data["runs"].items():
        pts = [(c, runs[n]["output_throughput"]) for n, c in SWEEP if n in runs]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=server, ls="--" if "transformers" in server else "-")
    ax.set(xscale="log", xlabel="concurrent streams (transformers: batch size)", ylabel="output tok/s",
           title="Output throughput vs concurrency (200-token prompts)")  # fmt: skip
    ax.set_xticks([c for _, c in SWEEP], [str(c) for _, c in SWEEP])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(data: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    servers = [s for s, r in data["runs"].items() if any("ttfts_ms" in m for m in r.values())]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for row, wname in enumerate(("random-c32", "shared-prefix")):
        for col, (key, title) in enumerate((("ttfts_ms", "TTFT (ms)"), ("tpots_ms", "TPOT (ms)"))):
            ax = axes[row][col]
            have = [s for s in servers if data["runs"][s].get(wname, {}).get(key)]
            if have:
                ax.boxplot([data["runs"][s][wname][key] for s in have], tick_labels=have)
            ax.set_title(f"{wname}: {title}", fontsize=10)
            ax.tick_params(axis="x", labelsize=7)
            ax.set_yscale("log")
            ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(data: dict, md: Path, img_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    img_dir.mkdir(parents=True, exist_ok=True)
    plot_throughput(data, img_dir / "compare_throughput.png")
    plot_latency(data, img_dir / "compare_latency.png")
    rel = os.path.relpath(img_dir, md.parent)
    v, cmds = data["versions"], data["commands"]
    lines = [
        "# Kiln vs llama.cpp vs transformers on this machine",
        "",
        "Generated by `.venv/bin/python benchmarks/compare.py"
        + (" --quick`; a smoke run, not figures to quote." if data["quick"] else "` from one run."),
        "Each server ran alone on 127.0.0.1; the client is `kiln bench serve` (OpenAI `/v1/completions`, "
        "greedy, `ignore_eos`). TTFT/TPOT in ms; TPOT excludes the first token. transformers runs in-process "
        "(`generate()`, batch = concurrency), so only its output tok/s is reported.",
        "",
        f"Model: `{os.path.basename(data['model'])}`.",
        "",
        "## Ratios (Kiln / llama.cpp in its fastest configuration per workload)",
        "",
        *ratio_table(data),
        "",
        "## Results",
        "",
        *results_table(data),
        f"![output tok/s vs concurrency]({rel}/compare_throughput.png)",
        "",
        f"![TTFT and TPOT distributions]({rel}/compare_latency.png)",
        "",
        "## Versions and machine",
        "",
        *[f"- {k}: {val}" for k, val in v.items()],
        "",
        "## Commands",
        "",
        "```",
        "# llama.cpp build (cached in ~/.cache/kiln/llama.cpp-<version>/, benchmarks/llama_cpp.py)",
        f"pip download --no-deps --no-binary :all: llama-cpp-python=={llama_cpp.SDIST_VERSION}",
        "cmake -S <sdist>/vendor/llama.cpp -B build " + " ".join(llama_cpp.CMAKE_FLAGS),
        "cmake --build build --target " + " ".join(llama_cpp.TARGETS) + " -j 2",
    ]
    if "quantize" in cmds:
        lines.append(cmds["quantize"])
    for server, cmd in cmds.items():
        if server != "quantize":
            lines += [f"# {server}", *(cmd if isinstance(cmd, list) else [cmd])]
    lines.append("# workloads (against each server's URL)")
    first = next(iter(data["runs"].values()), {})
    lines += [m["command"].replace(m["command"].split("--base-url ")[1].split()[0], "URL")
              for m in first.values() if "command" in m]  # fmt: skip
    lines += ["```", ""]
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(lines))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short smoke run (few short requests)")
    p.add_argument("--only", default="kiln,llama-shipped,llama-q4_0,transformers",
                   help="comma-separated subset of kiln, llama-shipped, llama-q4_0, transformers")  # fmt: skip
    p.add_argument("--kiln-arg", action="append", default=[], help="extra `kiln serve` argument, repeatable")
    p.add_argument("--model-path", default=None, help="GGUF to serve (default: Kiln's default model)")
    p.add_argument("--results", type=Path, default=RESULTS, help="raw results JSON (written, or read)")
    p.add_argument("--render-only", action="store_true", help="re-render the docs from --results")
    p.add_argument("--out-md", type=Path, default=ROOT / "docs" / "benchmarks_compare.md")
    p.add_argument("--img-dir", type=Path, default=ROOT / "docs" / "img")
    p.add_argument("--hf-max-requests", type=int, default=32, help="requests per workload for transformers")
    p.add_argument("--hf-threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads for transformers (default: all cores, like kiln serve)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one benchmark run may take")
    return p.parse_args(argv)


def collect(a: argparse.Namespace) -> dict:
    from kiln.bench.workloads import load_tokenizer
    from kiln.loader.default_model import default_model_path

    only = set(a.only.split(","))
    model = Path(a.model_path or default_model_path())
    wls = workloads(a.quick)
    tok = load_tokenizer(str(model))
    logdir = a.results.parent / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    if only & {"llama-shipped", "llama-q4_0"}:
        llama_cpp.build()
    data: dict = {"quick": a.quick, "versions": versions(), "workloads": [asdict(w) for w in wls]}
    data["model"], data["runs"], data["commands"] = str(model), {}, {}
    if "kiln" in only:
        data["runs"]["Kiln"], data["commands"]["Kiln"] = run_kiln(
            wls, tok, logdir, a.timeout, KILN_FLAGS + a.kiln_arg
        )
    for key, label, qtype in (
        ("llama-shipped", "llama.cpp (shipped GGUF)", None),
        ("llama-q4_0", "llama.cpp Q4_0", "Q4_0"),
    ):
        if key in only:
            gguf = llama_cpp.quantize(model, qtype) if qtype else model
            data["runs"][label], data["commands"][label] = run_llama(gguf, wls, tok, logdir, a.timeout)
    if "llama-q4_0" in only:
        cmd = llama_cpp.quantize_command(model, llama_cpp.quantize(model, "Q4_0"))
        data["commands"]["quantize"] = " ".join(cmd)
    if "transformers" in only:
        data["runs"]["transformers generate()"] = hf_baseline(
            str(model), wls, tok, a.hf_max_requests, a.hf_threads
        )
    data["versions"]["load_average_end"] = " ".join(map(str, os.getloadavg()))
    return data


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.render_only:
        data = json.loads(a.results.read_text())
    else:
        data = collect(a)
        a.results.parent.mkdir(parents=True, exist_ok=True)
        a.results.write_text(json.dumps(data))
    write_report(data, a.out_md, a.img_dir)
    print(f"wrote {a.out_md} and plots in {a.img_dir}; raw results in {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
