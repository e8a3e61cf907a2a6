"""Tensor parallelism: `kiln serve --tp-size 1` against `--tp-size 2` (or any sizes) with `kiln bench serve`, 32
streams and one stream: output tok/s, mean TTFT, and the share of rank 0's decode time spent in collectives (the
"comm share" of its decode log lines, waiting for the other ranks included).

On a host with few cores tp cannot speed anything up (the ranks split the same cores); the figure to watch is the
communication share. At tp 1 nothing is broadcast and no collective runs.

The default model (9 attention heads, 3 KV heads) splits over 1 or 3 ranks only, so by default the benchmark
builds a random-weight Llama of the default model's width with 8 heads and 4 KV heads (the default model's
tokenizer), which splits over 1, 2 and 4.

    python benchmarks/bench_tp.py [--tp 1 2] [--model-path DIR] [--num-prompts 64] [--input-len 128]
        [--output-len 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

RANDOM_LLAMA = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def build_random_llama(out_dir: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.loader.default_model import default_model_path
    from kiln.text.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    cfg = LlamaConfig(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **RANDOM_LLAMA
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, tp: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "kiln.cli",
        "serve",
        "--model-path",
        model,
        "--tp-size",
        str(tp),
        "--port",
        str(port),
    ]
    cmd += ["--device", "cpu", "--max-total-tokens", "32768", "--decode-log-interval", "10"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve --tp-size {tp} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise TimeoutError(f"kiln serve --tp-size {tp} not ready")


def comm_shares(log_text: str) -> list[float]:
    return [float(x) for x in re.findall(r"comm share: ([0-9.]+)", log_text)]


def bench(url: str, streams: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "kiln.cli", "bench", "serve", "--backend", "kiln", "--base-url", url]
    cmd += [
        "--dataset-name",
        "random",
        "--num-prompts",
        str(args.num_prompts if streams > 1 else args.one_stream),
    ]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--random-range-ratio", "1", "--max-concurrency", str(streams), "--ignore-eos", "--disable-tqdm"]
    cmd += ["--output-json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    return json.loads(out.read_text().splitlines()[-1])


def run_tp(model: str, tp: int, args: argparse.Namespace, work: Path) -> list[dict]:
    log = work / f"serve-tp{tp}.log"
    proc, url = start_server(model, tp, log)
    rows = []
    try:
        for streams in (32, 1):
            before = len(comm_shares(log.read_text()))
            record = bench(url, streams, args, work / f"tp{tp}-{streams}.json")
            shares = comm_shares(log.read_text())[before:]
            rows.append(
                {
                    "tp": tp,
                    "streams": streams,
                    "output_tok_s": record["output_throughput"],
                    "mean_ttft_ms": record["mean_ttft_ms"],
                    "comm_share": statistics.median(shares) if shares else None,
                    "failed": record["failed"],
                }
            )
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--model-path", default=None, help="default: a random Llama built for the run")
    p.add_argument("--num-prompts", type=int, default=64, help="requests of the 32-stream run")
    p.add_argument("--one-stream", type=int, default=4, help="requests of the one-stream run")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-tp-") as tmp:
        work = Path(tmp)
        model = args.model_path or build_random_llama(work / "model")
        rows = [row for tp in args.tp for row in run_tp(model, tp, args, work)]
    print(f"{'tp':>3} {'streams':>7} {'output tok/s':>12} {'mean TTFT ms':>12} {'comm share':>10}")
    for r in rows:
        share = "-" if r["comm_share"] is None else f"{r['comm_share']:.3f}"
        print(
            f"{r['tp']:>3} {r['streams']:>7} {r['output_tok_s']:>12.1f} {r['mean_ttft_ms']:>12.1f} {share:>10}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
