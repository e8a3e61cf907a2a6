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
import statistics
import subprocess
import tempfile
from pathlib import Path

from serve_runs import add_load_args, bench, start_server

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


def start_tp_server(model: str, tp: int, log: Path) -> tuple[subprocess.Popen, str]:
    return start_server(["--model-path", model, "--tp-size", str(tp), "--decode-log-interval", "10"], log)


def comm_shares(log_text: str) -> list[float]:
    return [float(x) for x in re.findall(r"comm share: ([0-9.]+)", log_text)]


def run_tp(model: str, tp: int, args: argparse.Namespace, work: Path) -> list[dict]:
    log = work / f"serve-tp{tp}.log"
    proc, url = start_tp_server(model, tp, log)
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
    add_load_args(p)
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
