"""--load-format dummy (SGLang's dummy loader): a model directory holding only its config.json and tokenizer is
served with random weights, the same ones every load, in the bytes the ledger plans; a GGUF file, which is its
weights, is refused naming the flag."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import kiln
from kiln.loader.model_config import load_model_config
from kiln.loader.weights import load_model
from kiln.models.spec import ModelSpec

model_spec = ModelSpec.from_config  # a model config dict's spec


pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def config_only(tiny_llama, tmp_path_factory) -> str:
    """The tiny Llama's directory without its weights."""
    out = tmp_path_factory.mktemp("config-only")
    for f in Path(tiny_llama).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return str(out)


def test_a_config_only_directory_is_served_with_dummy_weights(config_only):
    engine = kiln.Engine(
        model_path=config_only,
        load_format="dummy",
        disable_cuda_graph=True,
        max_total_tokens=2048,
        num_threads=1,
    )
    try:
        out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        assert len(out["output_ids"]) == 4
        runner = engine.scheduler.runner
        config = json.loads(Path(config_only, "config.json").read_text())
        assert runner.measured["weights"] == model_spec(config).weight_bytes(1, 4)  # float32 on the CPU
        assert all(p.abs().max() <= 1e-3 for p in runner.model.parameters())
    finally:
        engine.shutdown()


def test_dummy_weights_are_the_same_every_load_and_not_the_checkpoints(config_only, tiny_llama):
    cfg = load_model_config(config_only)

    def params(path: str, dummy: bool) -> dict[str, torch.Tensor]:
        model = load_model(load_model_config(path), torch.float32, "cpu", 64, dummy=dummy).model
        return dict(model.named_parameters())

    first, second = params(config_only, True), params(config_only, True)
    assert first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)
    real = params(tiny_llama, False)
    assert not torch.equal(
        first["model.layers.0.mlp.down_proj.weight"], real["model.layers.0.mlp.down_proj.weight"]
    )
    assert cfg.architecture == load_model_config(tiny_llama).architecture


def test_a_gguf_file_is_refused_with_dummy(default_model):
    with pytest.raises(ValueError, match="--load-format dummy builds a model from a config.json"):
        load_model(load_model_config(default_model), torch.float32, "cpu", 64, dummy=True)
