"""Embedding throughput: `kiln serve` of an embedding model against sentence-transformers on the same weights,
side by side in one run.

The model is laid out as Qwen3-Embedding is (a Qwen3 base model, sentence-transformers' last-token pooling and
Normalize), with random weights at a scaled-down Qwen3-Embedding shape (these machines reach no model hub) and the
default model's tokenizer. Kiln is served as a user would (`kiln serve --model-path DIR`: the pooling config makes
it an embedding server) and driven over HTTP /v1/embeddings, one input a request; sentence-transformers runs
in-process, `SentenceTransformer(DIR).encode`, as its users call it. Figures: inputs/s at 1 concurrent (Kiln one
request at a time; sentence-transformers one input a call) and at 32 (32 concurrent requests; one call of 32, its
batch_size 32). The sides alternate over --reps repetitions and the best is kept.

    pip install -e '.[embedding-bench]'
    python benchmarks/bench_embeddings.py [--reps 3] [--inputs 32] [--layers 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_runs import start_server  # noqa: E402

WORDS = "kiln fires clay pots at high heat while the potter waits for the glaze to set and cool".split()


def build_model(out: Path, layers: int) -> Path:
    """A Qwen3-Embedding-shaped model (hidden 1024, 16 heads, 8 KV heads, as the 0.6B; `layers` of its 28) with
    random weights, saved for sentence-transformers."""
    from transformers import Qwen3Config, Qwen3Model

    from kiln.loader.default_model import default_model_path
    from kiln.text.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3Model(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": 1024,
        "pooling_mode_lasttoken": True,
        "pooling_mode_mean_tokens": False,
    }
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (out / "2_Normalize").mkdir()
    return out


def texts(n: int, seed: int = 0) -> list[str]:
    """Sentences of 8 to 96 words, as a retrieval corpus's passages vary."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 96))) for _ in range(n)]


class KilnSide:
    def __init__(self, model: Path, logdir: Path):
        self.proc, self.url = start_server(["--model-path", str(model)], logdir / "kiln.log")
        self.client = httpx.Client(timeout=600)

    def embed(self, text: str) -> list[float]:
        r = self.client.post(f"{self.url}/v1/embeddings", json={"input": text})
        r.raise_for_status()
        return r.json()["data"][0]["embedding"]

    def run(self, inputs: list[str], concurrency: int) -> float:
        t0 = time.perf_counter()
        if concurrency == 1:
            for text in inputs:
                self.embed(text)
        else:
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(self.embed, inputs))
        return len(inputs) / (time.perf_counter() - t0)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


class SentenceTransformersSide:
    def __init__(self, model: Path):
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(model), device="cpu")

    def embed(self, text: str) -> list[float]:
        return self.model.encode([text], batch_size=1)[0].tolist()

    def run(self, inputs: list[str], concurrency: int) -> float:
        t0 = time.perf_counter()
        if concurrency == 1:
            for text in inputs:
                self.model.encode([text], batch_size=1)
        else:
            for at in range(0, len(inputs), concurrency):
                self.model.encode(inputs[at : at + concurrency], batch_size=concurrency)
        return len(inputs) / (time.perf_counter() - t0)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--inputs", type=int, default=32, help="inputs embedded per side, repetition and concurrency"
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kiln-embed-bench-") as tmp:
        model = build_model(Path(tmp) / "model", a.layers)
        kiln, st = KilnSide(model, Path(tmp)), SentenceTransformersSide(model)
        try:
            probe = texts(4, seed=1)
            cos = min(
                torch.nn.functional.cosine_similarity(
                    torch.tensor(kiln.embed(t)), torch.tensor(st.embed(t)), dim=0
                ).item()
                for t in probe
            )
            for side in (kiln, st):  # warm-up: first calls pay allocator and kernel set-up
                side.run(texts(8, seed=2), 8)
            best: dict[str, float] = {}
            for rep in range(a.reps):
                for concurrency in (1, 32):
                    # new texts each time, the same for both sides: Kiln's prefix cache must not hit a repeat
                    inputs = texts(a.inputs, seed=100 + 2 * rep + (concurrency > 1))
                    for name, side in (("kiln", kiln), ("sentence_transformers", st)):
                        rate = side.run(inputs, concurrency)
                        key = f"{name}@{concurrency}"
                        best[key] = max(best.get(key, 0.0), rate)
                        print(f"rep {rep} {key}: {rate:.1f} inputs/s", flush=True)
        finally:
            kiln.close()
    load = os.getloadavg()
    result = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "loadavg_after": load, "layers": a.layers,
        "inputs": a.inputs, "reps": a.reps, "min_cosine_kiln_vs_st": cos, "best_inputs_per_s": best,
        "ratio_kiln_over_st": {c: best[f"kiln@{c}"] / best[f"sentence_transformers@{c}"] for c in (1, 32)},
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
