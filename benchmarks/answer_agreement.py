"""How often the default `--cpu-gemm auto` (integer compute) answers a chat prompt as `--cpu-gemm exact` (float32
on the same weights) does: greedy answers of the default model to a few hundred chat prompts of Kiln's own (made
here from templates, never used to choose what runs in float32), then

- first token: the share of prompts whose first answer token is the same in both modes;
- whole answer: the share whose greedy answers are identical, and the mean length of their common prefix;
- top-1 agreement: exact's answers teacher-forced through auto, the share of answer positions where auto's argmax
  is exact's token (the figure llama-perplexity's --kl-divergence calls "same top"), with the mean KL divergence
  of auto's distribution from exact's at those positions;
- the margin: exact's top-1 minus top-2 logit at the first answer token, for the prompts whose first token flips
  (a flip under a margin of a few hundredths is a near-tie in float32 that any rounding decides).

python benchmarks/answer_agreement.py --prompts 300 --max-tokens 32
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kl_divergence import load_runner, teacher_forced_logits  # noqa: E402

SUBJECTS = (
    "France", "Japan", "Brazil", "Kenya", "Canada", "Italy", "Egypt", "India", "Norway", "Mexico",
    "photosynthesis", "gravity", "the water cycle", "volcanoes", "the moon", "electricity", "rainbows",
    "the heart", "bees", "glaciers", "the internet", "a bicycle", "chess", "the piano", "coffee",
)  # fmt: skip
TEMPLATES = (
    "What is the capital of {}?",
    "Tell me one interesting fact about {}.",
    "Explain {} to a ten-year-old in two sentences.",
    "Write a short poem about {}.",
    "What are three things people often get wrong about {}?",
    "Give me a one-line summary of {}.",
    "Why is {} important?",
    "Write a haiku about {}.",
    "List two questions a student might ask about {}.",
    "Describe {} in exactly one sentence.",
    "What is a common misconception about {}?",
    "How would you teach someone about {} in five minutes?",
)


def chat_prompts(count: int) -> list[str]:
    pairs = itertools.product(TEMPLATES, SUBJECTS)
    return [template.format(subject) for template, subject in itertools.islice(pairs, count)]


def greedy_answers(mode: str, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy answer ids) of each prompt under --cpu-gemm `mode`."""
    from kiln import Engine
    from kiln.text.tokenizer import apply_chat_template

    engine = Engine(cpu_gemm=mode, max_running_requests=32)
    try:
        ids = [apply_chat_template(engine.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
        params = {"temperature": 0.0, "max_new_tokens": max_tokens}
        outs = engine.generate(input_ids=ids, sampling_params=params)
        return ids, [o["output_ids"] for o in outs]
    finally:
        engine.shutdown()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def teacher_forced(model_path: str, prompts: list[list[int]], answers: list[list[int]]) -> dict:
    """Exact's answers through both modes' model runners: auto's top-1 agreement with exact's tokens, the mean KL,
    and exact's first-token margins."""
    runners = {mode: load_runner(model_path, mode) for mode in ("exact", "auto")}
    same = total = 0
    kls, margins = [], []
    for ids, answer in zip(prompts, answers):
        seq = ids + answer
        rows = slice(len(ids) - 1, len(seq) - 1)  # the positions that predict each answer token
        logits = {m: teacher_forced_logits(r, seq)[rows].double() for m, r in runners.items()}
        top = logits["auto"].argmax(-1)
        same += int((top == torch.tensor(answer)).sum())
        total += len(answer)
        base, other = (torch.log_softmax(logits[m], -1) for m in ("exact", "auto"))
        kls.extend((base.exp() * (base - other)).sum(-1).tolist())
        first = torch.topk(logits["exact"][0], 2).values
        margins.append(float(first[0] - first[1]))
    return {"top1": same / total, "positions": total, "kl_mean": statistics.fmean(kls), "margins": margins}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from kiln.loader.default_model import default_model_path

    torch.set_num_threads(2)
    t0 = time.time()
    prompts = chat_prompts(args.prompts)
    ids, exact = greedy_answers("exact", prompts, args.max_tokens)
    _, auto = greedy_answers("auto", prompts, args.max_tokens)
    forced = teacher_forced(default_model_path(), ids, exact)
    flips = [i for i, (a, b) in enumerate(zip(exact, auto)) if a[:1] != b[:1]]
    prefixes = [common_prefix(a, b) for a, b in zip(exact, auto)]
    result = {
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "first_token_same": 1 - len(flips) / len(prompts),
        "answers_identical": sum(a == b for a, b in zip(exact, auto)) / len(prompts),
        "common_prefix_mean": statistics.fmean(prefixes),
        "top1_teacher_forced": forced["top1"],
        "positions": forced["positions"],
        "kl_mean_teacher_forced": forced["kl_mean"],
        "flipped_first_token_margins": sorted(round(forced["margins"][i], 4) for i in flips),
        "seconds": round(time.time() - t0),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
