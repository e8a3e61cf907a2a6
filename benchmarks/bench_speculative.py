"""NGRAM speculative decoding at batch 1 against plain decoding, on the default model (or --model-path): copy-heavy
prompts (edit this code, repeat a list with changes, answer with quotes) and prompts with nothing to copy. Prints
per prompt kind the decode tok/s of each (each prompt's median time of --reps runs each way), whether the greedy
outputs are identical, and the accept length.

    .venv/bin/python benchmarks/bench_speculative.py [--max-new-tokens 128] [--model-path PATH] [--cpu-gemm exact]
        [--reps 3]    # runs of each prompt each way, alternating; each prompt's median time counts
        [--topk 10]   # NGRAM's breadth: 1 drafts a chain, more a breadth-first tree of earlier matches
        [--cuda-graph-bs 1 2 4 8 12]  # compiled steps (the CPU's default is eager)
"""

from __future__ import annotations

import argparse
import statistics
import time

import kiln
from kiln.scheduler.spec_step import SpecDecoder
from kiln.speculative.ngram import NgramDrafter
from kiln.speculative.settings import NGRAM_DRAFT_TOKENS

CART = """def total(items):
    result = 0
    for item in items:
        if item.price > 0:
            result += item.price * item.quantity
    return result
"""
ORDERS = """def load_orders(path):
    orders = []
    with open(path) as handle:
        for line in handle:
            fields = line.strip().split(",")
            if len(fields) != 3:
                continue
            name, price, quantity = fields
            orders.append(Order(name, float(price), int(quantity)))
    return orders
"""
# An edit asked as a file's old and new text, the form code-editing tools send: SmolLM2-135M answers it with the
# edited code. Asked as an instruction (REWRITES) it writes a new one-line function instead, and there is nothing
# for NGRAM to copy; that prompt is measured on its own line.
COPY = {
    "edit code (cart.py)": f"# file: cart.py (old)\n{CART}\n# file: cart.py (new: result renamed to subtotal)\n",
    "edit code (orders.py)": f"# file: orders.py (old)\n{ORDERS}\n# file: orders.py (new: orders renamed to records)\n",
    "repeat a list": "Shopping list: apples, bread, cheese, dates, eggs, flour, grapes, honey, ice, jam.\n"
    "Write the same list again but replace cheese with butter:\n",
    "quote": "Text: The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill.\n"
    "Quote the text exactly, then say who watches:\n",
}
REWRITES = {
    "edit code, asked as an instruction": "Rename the variable result to subtotal in this function and return it "
    f"unchanged otherwise:\n{CART}\nThe edited function:\n",
}
NO_COPY = {
    "story": "Write a short original story about a lighthouse keeper.",
    "facts": "List five facts about the planet Mars.",
}


def decode(engine, prompt: str, max_new: int, spec: SpecDecoder | None) -> tuple[list[int], float]:
    engine.scheduler.spec = spec
    engine.scheduler.flush_cache()
    start = time.perf_counter()
    out = engine.generate(prompt, {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True})
    seconds = time.perf_counter() - start
    engine.scheduler.spec = None
    return out["output_ids"], seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--cpu-gemm", default="auto")
    parser.add_argument("--topk", type=int, default=1, help="NGRAM's breadth (--speculative-eagle-topk)")
    parser.add_argument(
        "--cuda-graph-bs",
        type=int,
        nargs="*",
        default=None,
        help="decode batch sizes to compile (the verify step's rows run on them too); default: eager, the CPU's default",
    )
    parser.add_argument("--reps", type=int, default=3, help="runs of each prompt each way; the median counts")
    args = parser.parse_args()
    graphs = (
        {"cuda_graph_bs": tuple(args.cuda_graph_bs)} if args.cuda_graph_bs else {"disable_cuda_graph": True}
    )
    engine = kiln.Engine(model_path=args.model_path, cpu_gemm=args.cpu_gemm, **graphs)
    decode(engine, "warm up", 8, None)
    groups = (
        ("copy-heavy", COPY),
        ("nothing to copy", NO_COPY),
        ("asked to edit, answered with a rewrite", REWRITES),
    )
    for kind, prompts in groups:
        plain_s = spec_s = 0.0
        tokens, same, lengths = 0, True, []
        for name, prompt in prompts.items():
            plain_runs, spec_runs = [], []
            for _ in range(args.reps):  # alternating, so a slow spell of the host falls on both
                plain_ids, seconds = decode(engine, prompt, args.max_new_tokens, None)
                plain_runs.append(seconds)
                drafter = NgramDrafter(max_breadth=args.topk, max_nodes=NGRAM_DRAFT_TOKENS - 1)
                spec = SpecDecoder(drafter, NGRAM_DRAFT_TOKENS - 1, NGRAM_DRAFT_TOKENS)
                spec_ids, seconds = decode(engine, prompt, args.max_new_tokens, spec)
                spec_runs.append(seconds)
                same &= spec_ids == plain_ids
            plain_one, spec_one = statistics.median(plain_runs), statistics.median(spec_runs)
            plain_s += plain_one
            spec_s += spec_one
            tokens += len(plain_ids)
            lengths.append(spec.accept_length())
            print(
                f"  {name}: identical={spec_ids == plain_ids} accept_length={spec.accept_length():.2f} "
                f"speed-up {plain_one / spec_one:.2f}x (median of {args.reps})"
            )
        print(
            f"{kind}: plain {tokens / plain_s:.1f} tok/s, NGRAM {tokens / spec_s:.1f} tok/s "
            f"({plain_s / spec_s:.2f}x), identical={same}, accept length "
            f"{sum(lengths) / len(lengths):.2f}"
        )


if __name__ == "__main__":
    main()
