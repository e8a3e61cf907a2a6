"""Greedy output through a real `kiln serve` and the official openai client equals Hugging Face transformers'
greedy output on the same weights (float32), streaming and not, alone and concurrently."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import hf_model_of_gguf
from openai import AsyncOpenAI, OpenAI

pytestmark = pytest.mark.server

NEW_TOKENS = 12
PROMPTS = [
    "The capital of France is",
    "Photosynthesis converts light energy into",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def reference(default_model):
    """(prompt ids, greedy continuation ids) per prompt, from transformers reading the same GGUF."""
    from kiln.text.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model)
    model = hf_model_of_gguf(default_model)
    cases = []
    with torch.inference_mode():
        for text in PROMPTS:
            ids = tok.encode(text)
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
            gen = out[0, len(ids) :].tolist()
            if tok.eos_token_id in gen:
                gen = gen[: gen.index(tok.eos_token_id)]
            cases.append((ids, tok.decode(gen, skip_special_tokens=True)))
    del model
    return cases


def test_non_streaming_matches_transformers(server, reference):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="x")
    model = client.models.list().data[0].id
    for ids, expected in reference:
        r = client.completions.create(model=model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0)
        assert r.choices[0].text == expected, (ids, r.choices[0].text, expected)


def test_streaming_concurrent_matches_transformers(server, reference):
    model = OpenAI(base_url=f"{server.url}/v1", api_key="x").models.list().data[0].id
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x")

    async def one(ids):
        stream = await client.completions.create(
            model=model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once():
        return await asyncio.wait_for(asyncio.gather(*(one(ids) for ids, _ in reference)), timeout=300)

    texts = asyncio.run(all_at_once())
    assert texts == [expected for _, expected in reference]
