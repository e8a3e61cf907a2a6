"""Accuracy of Kiln on pre-quantized safetensors checkpoints (GPTQ, AWQ, compressed-tensors): KL divergence and top-1
agreement of Kiln's logits against transformers' float32 logits on the same weights dequantized, teacher-forced over
windows of text.

These machines reach no model hub, so each checkpoint is the tests' tiny random Llama (tests/test_gptq_awq.py,
tests/test_compressed_tensors.py: packed by the formats' published loops, or compressed by compressed-tensors itself)
at a larger width; the reference is the float32 model transformers holds for it (the dequantized twin for GPTQ/AWQ,
transformers' own decompression for compressed-tensors). Kiln runs `--cpu-gemm exact` and `auto` (its default:
symmetric 4-bit GPTQ as Q4_0 blocks in the integer kernels, the other formats in float32).

    python benchmarks/kl_prequantized.py [--windows 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

from kl_divergence import (  # noqa: E402
    english_text,
    load_runner,
    summarize,
    teacher_forced_logits,
    token_divergence,
    token_windows,  # noqa: E402
)

WIDTH = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    head_dim=32, max_position_embeddings=2048, tie_word_embeddings=False,
)  # fmt: skip
GPTQ_AWQ = {
    "gptq 4-bit g128": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False},
    "gptq 4-bit g128 symmetric (Q4_0 blocks)": {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
    },
    "gptq 4-bit g128 act-order": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
    "awq 4-bit g128": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
}  # fmt: skip
COMPRESSED = ("w8a8-int8-channel", "fp8-channel", "w4a16-group32")


def checkpoints(root: Path):
    """(name, directory, transformers' float32 reference) of each format."""
    import test_compressed_tensors as ct
    import test_gptq_awq as gptq_awq
    from model_equality import random_model
    from transformers import LlamaConfig, LlamaForCausalLM

    base = random_model(LlamaConfig, LlamaForCausalLM, 7, **WIDTH)
    base[0].eval()
    for name, quant in GPTQ_AWQ.items():
        path = root / name.replace(" ", "_")
        path.mkdir()
        yield name, path, gptq_awq.quantized_checkpoint(base, {**quant}, path)
    for case in COMPRESSED:
        path = root / case
        path.mkdir()
        ct.compressed_checkpoint(base, case, path)
        yield f"compressed-tensors {case}", path, ct.transformers_reference(base, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    text, source = english_text()
    rows, figures = [], {}
    print(f"text: {source}; {args.windows} windows; every position of each window scored", flush=True)
    with tempfile.TemporaryDirectory(prefix="kiln-kl-prequantized-") as tmp:
        for name, path, reference in checkpoints(Path(tmp)):
            windows = token_windows(str(path), text, args.windows)
            with torch.inference_mode():
                base = [reference(torch.tensor([w])).logits[0].float() for w in windows]
            for mode in ("exact", "auto"):
                runner = load_runner(str(path), mode)
                with torch.inference_mode():
                    scores = [
                        token_divergence(b, teacher_forced_logits(runner, w)) for b, w in zip(base, windows)
                    ]
                kl, same = (torch.cat(parts) for parts in zip(*scores))
                d = summarize(kl, same)
                figures[f"{name} / {mode}"] = asdict(d)
                rows.append(
                    f"| {name} | {mode} | {d.kl_mean:.2e} | {d.kl_max:.2e} | {100 * d.top1_agreement:.2f} % |"
                )
                print(rows[-1], flush=True)
    print(
        "| checkpoint | Kiln --cpu-gemm | KL mean | KL max | top-1 |\n|---|---|---|---|---|\n"
        + "\n".join(rows)
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
