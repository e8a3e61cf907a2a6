"""Loading a safetensors checkpoint (kiln.loader.weights.load_model): a checkpoint lacking one part of a merged
parameter (k_proj of qkv_proj, up_proj of gate_up_proj) is refused naming that tensor; the files an index names
are read and no other; tensors the model has no parameter for are skipped with one warning; a damaged file is
named in the error."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.loader.model_config import load_model_config
from kiln.loader.weights import load_model, safetensors_files

pytestmark = pytest.mark.unit

SHAPE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    torch_dtype="float32",
)


def _build(out: Path, kind: str, max_shard_size: str | None = None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False))
    else:  # tied, with biases on q, k and v (merged qkv_proj.bias)
        model = Qwen3ForCausalLM(
            Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True, attention_bias=True)
        )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(out, max_shard_size=max_shard_size or "1GB")
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return _build(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="module")
def tiny_biased(tmp_path_factory) -> Path:
    torch.manual_seed(1)
    return _build(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A checkpoint in several shards with model.safetensors.index.json."""
    torch.manual_seed(2)
    out = _build(tmp_path_factory.mktemp("sharded"), "llama", max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 2
    return out


def _edited(src: Path, dst: Path, drop: tuple[str, ...] = (), add: dict | None = None) -> Path:
    """A copy of the single-file checkpoint at src without the tensors `drop`, with the tensors `add`."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    for name in drop:
        del tensors[name]
    save_file({**tensors, **(add or {})}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _load(path: Path) -> torch.nn.Module:
    return load_model(load_model_config(str(path)), torch.float32, "cpu", 64).model


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in safetensors_files(str(path)) for k, v in load_file(f).items()}


def _assert_same_weights(model: torch.nn.Module, ckpt: dict[str, torch.Tensor]) -> None:
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    q, k, v = (ckpt[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(attn.qkv_proj.weight, torch.cat((q, k, v)))
    gate, up = (ckpt[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat((gate, up)))
    assert torch.equal(model.model.norm.weight, ckpt["model.norm.weight"])


def test_a_complete_checkpoint_fills_every_merged_part(tiny):
    model = _load(tiny)
    _assert_same_weights(model, _checkpoint(tiny))
    # the loaders are the layers' own again after the load (the check wraps them only while loading)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.weight_loader == qkv.weight_loader


@pytest.mark.parametrize(
    "fixture, dropped",
    [
        ("tiny", "model.layers.1.self_attn.k_proj.weight"),
        ("tiny", "model.layers.0.mlp.up_proj.weight"),
        ("tiny", "model.layers.0.self_attn.q_proj.weight"),
        ("tiny_biased", "model.layers.1.self_attn.v_proj.bias"),
    ],
)
def test_a_checkpoint_lacking_one_part_of_a_merged_parameter_is_refused_naming_it(
    request, tmp_path, fixture, dropped
):
    path = _edited(request.getfixturevalue(fixture), tmp_path / "m", drop=(dropped,))
    with pytest.raises(ValueError, match="lacks 1 tensors") as refused:
        _load(path)
    assert repr(dropped) in str(refused.value)


def test_whole_missing_tensors_are_still_refused(tiny, tmp_path):
    dropped = ("model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match="lacks 2 tensors") as refused:
        _load(_edited(tiny, tmp_path / "m", drop=dropped))
    assert all(repr(name) in str(refused.value) for name in dropped)


def test_only_the_files_the_index_names_are_read(sharded):
    """A Mistral-format consolidated.safetensors beside the HF shards (Mistral's repos ship both)."""
    ckpt = _checkpoint(sharded)
    stray = sharded / "consolidated.safetensors"
    norm = ckpt["model.norm.weight"]  # a name the shards hold too: read, the stray zeros would replace it
    save_file({"model.norm.weight": torch.zeros_like(norm)}, stray, metadata={"format": "pt"})
    try:
        names = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()
        assert sorted(Path(f).name for f in safetensors_files(str(sharded))) == sorted(set(names))
        _assert_same_weights(_load(sharded), ckpt)
    finally:
        stray.unlink()


def test_an_index_naming_an_absent_file_is_refused_naming_it(sharded, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(sharded, path)
    gone = sorted(path.glob("model-*.safetensors"))[-1]
    gone.unlink()
    with pytest.raises(FileNotFoundError, match=gone.name):
        _load(path)


def test_unused_tensors_are_skipped_with_one_warning(tiny, tmp_path, caplog):
    extra = {f"model.layers.0.mlp.adapter_{i}.weight": torch.ones(4, 4) for i in range(5)}
    path = _edited(tiny, tmp_path / "m", add=extra)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        model = _load(path)
    _assert_same_weights(model, _checkpoint(tiny))
    warnings = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(warnings) == 1
    assert "5 checkpoint tensors" in warnings[0]
    assert sum(name in warnings[0] for name in extra) == 3  # up to three examples


def test_a_checkpoint_of_another_model_is_still_refused(tiny, tmp_path):
    """Every tensor under names the model does not hold (Mistral's own format): skipped, and then refused for
    every parameter left unfilled."""
    path = tmp_path / "m"
    shutil.copytree(tiny, path)
    tensors = load_file(tiny / "model.safetensors")
    (path / "model.safetensors").unlink()
    save_file({"x." + k: v for k, v in tensors.items()}, path / "consolidated.safetensors")
    with pytest.raises(ValueError, match="lacks"):
        _load(path)


def test_a_truncated_file_is_named_in_the_error(sharded, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(sharded, path)
    victim = sorted(path.glob("model-*.safetensors"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=victim.name):
        _load(path)
