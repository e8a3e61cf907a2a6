"""compressed-tensors checkpoints (kiln/loader/compressed.py): a tiny random Llama whose linears the format's own
library quantizes and compresses (its calculate_qparams and compressors, as llm-compressor saves them: W8A8 int8 per
channel, FP8 per tensor and per channel, W4A16 packed in groups, symmetric and not) is served token-identical to
transformers' float32 greedy on the weights transformers itself decompresses from the same directory
(CompressedTensorsConfig(dequantize=True)); `kiln plan` counts the linears at the serving dtype; a format Kiln does
not read is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_equality import assert_serves_as, random_model
from safetensors.torch import save_file

import kiln.plan as plan
from kiln.loader.compressed import dequantized_stream, read_config

pytestmark = pytest.mark.engine

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
)  # fmt: skip
INT8_TOKENS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
FP8_TOKENS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
CASES = {
    "w8a8-int8-channel": (
        "int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, INT8_TOKENS,
    ),
    "fp8-tensor": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "tensor"}, FP8_TOKENS),
    "fp8-channel": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}, FP8_TOKENS),
    "w4a16-group32": (
        "pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
        None,
    ),
    "w4a16-group32-asymmetric": (
        "pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
        None,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def base():
    from transformers import LlamaConfig, LlamaForCausalLM

    model, tok = random_model(LlamaConfig, LlamaForCausalLM, 13, **TINY)
    return model.eval(), tok


def compressed_checkpoint(base, case: str, out: Path) -> None:
    """The base model with its decoder linears quantized and compressed by compressed-tensors, saved at `out`
    with the quantization_config the library writes."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    fmt, weights, activations = CASES[case]
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(
        targets=["Linear"], weights=args, input_activations=activations and QuantizationArgs(**activations)
    )
    compressor = BaseCompressor.get_value_from_registry(fmt)
    model, tok = base
    saved = {}
    for name, w in model.state_dict().items():
        if not name.endswith("_proj.weight"):
            saved[name] = w.clone()
            continue
        if args.strategy == "tensor":
            low, high = w.amin().reshape(1), w.amax().reshape(1)
        elif args.strategy == "channel":
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            grouped = w.view(w.shape[0], -1, args.group_size)
            low, high = grouped.amin(-1), grouped.amax(-1)
        scale, zero_point = calculate_qparams(low, high, args)
        parts = compressor.compress(
            {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme
        )
        saved |= {f"{name.removesuffix('weight')}{part}": t for part, t in parts.items()}
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"], quantization_status="compressed"
    )
    model.config.save_pretrained(out)
    tok.save_pretrained(out)
    hf_config = json.loads((out / "config.json").read_text())
    quant = {**config.model_dump(mode="json"), "quant_method": "compressed-tensors"}
    (out / "config.json").write_text(json.dumps({**hf_config, "quantization_config": quant}))
    save_file(
        {n: t.contiguous() for n, t in saved.items()}, out / "model.safetensors", metadata={"format": "pt"}
    )


def transformers_reference(base, path: Path):
    """A plain float32 Llama holding the weights transformers decompresses from `path` (its compressed-tensors
    integration, not Kiln's loader): no fake quantization in its forward."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    loaded = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    model = type(base[0])(base[0].config).eval()
    weights = {n: t.float() for n, t in loaded.state_dict().items() if n in model.state_dict()}
    model.load_state_dict(weights)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_a_compressed_checkpoint_serves_as_transformers_decompresses_it(
    case: str, base, tmp_path: Path
) -> None:
    compressed_checkpoint(base, case, tmp_path)
    ref = transformers_reference(base, tmp_path)
    quantized, original = (
        ref.model.layers[0].mlp.down_proj.weight,
        base[0].model.layers[0].mlp.down_proj.weight,
    )
    error = (quantized - original).abs().max()
    assert 0 < error < 0.2 * original.abs().max()  # quantized, not garbled
    assert_serves_as(str(tmp_path), ref)


def test_plan_counts_the_linears_as_served(base, tmp_path: Path, capsys) -> None:
    compressed_checkpoint(base, "w4a16-group32", tmp_path / "w4a16")
    base[0].save_pretrained(tmp_path / "float")
    base[1].save_pretrained(tmp_path / "float")
    weights = []
    for path in (tmp_path / "w4a16", tmp_path / "float"):
        assert plan.main(["--model-path", str(path), "--device", "cpu", "--json"]) == 0
        weights.append(json.loads(capsys.readouterr().out)["weight_bytes"])
    assert weights[0] == weights[1]


@pytest.mark.unit
def test_formats_kiln_does_not_read_are_named() -> None:
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
    }
    quant = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"g": group},
    }
    with pytest.raises(ValueError, match="format 'nvfp4-pack-quantized'"):
        read_config(quant)
    group = {"targets": ["Linear"], "input_activations": INT8_TOKENS}
    with pytest.raises(ValueError, match="quantizes no weights"):
        read_config(
            {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": group}}
        )


@pytest.mark.unit
def test_activation_parameters_go_and_a_missing_scale_is_named() -> None:
    quant = {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": CASES["w8a8-int8-channel"][1]}},
    }  # fmt: skip
    stream = [
        ("m.norm.weight", torch.ones(4)),
        ("m.proj.input_scale", torch.ones(1)),
        ("m.proj.weight", torch.ones(4, 4, dtype=torch.int8)),
        ("m.proj.weight_scale", torch.full((4, 1), 0.5)),
        ("m.other.weight", torch.ones(4, 4, dtype=torch.int8)),
    ]
    with pytest.raises(ValueError, match="m.other has only weight"):
        list(dequantized_stream(iter(stream), quant))
    out = dict(dequantized_stream(iter(stream[:4]), quant))
    assert list(out) == ["m.norm.weight", "m.proj.weight"]
    assert torch.equal(out["m.proj.weight"], torch.full((4, 4), 0.5))
