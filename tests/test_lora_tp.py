"""LoRA adapters at --tp-size 2: each rank holds its share of every slot as the base weights are split (B's rows
of a column-parallel projection, A's columns of a row-parallel one, summed by the all-reduce), and a mixed batch of
two adapters and the base gives transformers' greedy ids with the adapters merged; each rank's slots are what
`kiln plan --tp-size 2` predicts."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import ServerProcess
from lora_models import build_adapters, merged_model
from test_correctness import hf_greedy, make_prompt, token_stream

pytestmark = pytest.mark.slow

NEW = 8


def test_tp2_mixed_batch_equals_transformers(tiny_llama, tmp_path) -> None:
    adapters = build_adapters(tiny_llama, tmp_path / "adapters", ("alpha", "beta"))
    stream = token_stream()
    prompts = [make_prompt(stream, n, 97 * i + 5) for i, n in enumerate((9, 31))]
    want = {}
    for name in (None, "alpha", "beta"):
        model = merged_model(tiny_llama, adapters[name] if name else None)
        with torch.inference_mode():
            want[name] = [hf_greedy(model, p, NEW, set())[0] for p in prompts]
    flags = ["--model-path", tiny_llama, "--tp-size", "2", "--device", "cpu", "--max-total-tokens", "4096"]
    flags += ["--lora-paths", *(f"{n}={p}" for n, p in adapters.items()), "--max-loras-per-batch", "2"]
    srv = ServerProcess(flags, tmp_path / "serve.log")
    try:
        srv.wait_ready(timeout=300)
        batch = [(p, n) for p in prompts for n in (None, "alpha", "beta")]
        params = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
        body = {
            "input_ids": [p for p, _ in batch],
            "sampling_params": params,
            "lora_path": [n for _, n in batch],
        }
        resp = httpx.post(f"{srv.url}/generate", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert [o["output_ids"] for o in resp.json()] == [want[n][prompts.index(p)] for p, n in batch]
        info = httpx.get(f"{srv.url}/get_server_info", timeout=30).json()
        line = next(x for x in info["ledger"]["lines"] if x["name"] == "lora adapter slots")
        measured = info["measured"]["lora_slots"]  # rank 0's
        assert measured > 0 and abs(measured - line["bytes"]) <= 0.01 * measured
    finally:
        srv.stop()
