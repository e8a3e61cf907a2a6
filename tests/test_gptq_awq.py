"""GPTQ and AWQ checkpoints (kiln/loader/packed_int.py): a tiny random Llama whose linears are integers times fp16
group scales, packed as AutoGPTQ's QuantLinear.pack and AutoAWQ's WQLinear_GEMM.from_linear write them (their loops,
transcribed below), is served token-identical to transformers' float32 greedy on the same weights dequantized: GPTQ
v1 4-bit with plain groups and with act-order, GPTQ v2 8-bit over whole rows, AWQ 4-bit. `kiln plan` counts the
linears at the serving dtype (Kiln dequantizes them at load); a variant Kiln cannot read is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from model_equality import assert_serves_as, random_model
from safetensors.torch import save_file

import kiln
import kiln.plan as plan
from kiln.loader.packed_int import dequantized_stream, packed_format

pytestmark = pytest.mark.engine

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
)  # fmt: skip
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
CASES = {
    "gptq-4bit-g32": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False},
    "gptq-4bit-g64-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True},
    "gptq-4bit-g64-symmetric": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True},
    "gptq_v2-8bit-rows": {
        "quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "checkpoint_format": "gptq_v2",
    },
    "awq-4bit-g32": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
}  # fmt: skip


def gptq_pack(q: np.ndarray, zeros: np.ndarray, bits: int, zero_offset: int) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ's QuantLinear.pack: q [in, out] packed along the input dimension, zeros [groups, out] (less one in
    the v1 format) along the output one, low bits first."""
    intweight = q.astype(np.uint32)
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 32 // bits):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    stored = (zeros - zero_offset).astype(np.uint32)
    qzeros = np.zeros((stored.shape[0], stored.shape[1] // 32 * bits), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 32 // bits):
            qzeros[:, col] |= stored[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    return qweight.view(np.int32), qzeros.view(np.int32)


def awq_pack(values: np.ndarray) -> np.ndarray:
    """AutoAWQ's WQLinear_GEMM.from_linear: [rows, out] 4-bit values packed along the output dimension, eight a
    word in the order [0, 2, 4, 6, 1, 3, 5, 7]."""
    values = values.astype(np.uint32)
    packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for col in range(values.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return packed.view(np.int32)


def quantized_linear(
    shape: tuple[int, int], quant: dict, rng: np.random.Generator
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A random linear of integers and fp16 scales: its float32 weight [out, in] and its parts as the method
    stores them."""
    out, k = shape
    bits = quant["bits"]
    group = k if quant["group_size"] == -1 else quant["group_size"]
    groups = k // group
    top = (1 << bits) - 1
    q = rng.integers(0, top + 1, size=(k, out))
    zeros = rng.integers(1, top + 1, size=(groups, out))  # v1 stores zero - 1: zero 0 would wrap
    if quant.get("sym"):  # GPTQ's symmetric grid: the middle of the range
        zeros[:] = 1 << (bits - 1)
    scales = torch.tensor(rng.uniform(0.006, 0.03, size=(groups, out)) * 16 / (1 << bits)).half()
    if quant.get("desc_act"):  # act-order: columns of one group anywhere along the input
        g_idx = rng.permutation(np.arange(k) // group)
    else:
        g_idx = np.arange(k) // group
    weight = ((torch.tensor(q - zeros[g_idx])).float() * scales.float()[g_idx]).t().contiguous()
    if quant["quant_method"] == "awq":
        parts = {"qweight": awq_pack(q), "qzeros": awq_pack(zeros), "scales": scales}
    else:
        v1 = (
            quant.get("checkpoint_format", "gptq") == "gptq"
        )  # GPTQ's v1 format stores each zero point less one
        qweight, qzeros = gptq_pack(q, zeros, bits, 1 if v1 else 0)
        parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx.astype(np.int32)}
    return weight, {name: torch.as_tensor(v) for name, v in parts.items()}


@pytest.fixture(scope="module")
def base():
    from transformers import LlamaConfig, LlamaForCausalLM

    model, tok = random_model(LlamaConfig, LlamaForCausalLM, 11, **TINY)
    return model.eval(), tok


def quantized_checkpoint(base, quant: dict, out: Path, seed: int = 0):
    """The base model with every decoder linear replaced by a quantized one: saved in the method's layout at `out`,
    and the reference model holding the same weights dequantized."""
    model, tok = base
    rng = np.random.default_rng(seed)
    saved, reference = {}, {}
    for name, tensor in model.state_dict().items():
        if name.endswith(tuple(f"{linear}.weight" for linear in LINEARS)):
            reference[name], parts = quantized_linear(tuple(tensor.shape), quant, rng)
            saved |= {f"{name.removesuffix('weight')}{part}": value for part, value in parts.items()}
        else:
            saved[name] = reference[name] = tensor.detach().clone()
    model.config.save_pretrained(out)
    tok.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    save_file(
        {n: t.contiguous() for n, t in saved.items()}, out / "model.safetensors", metadata={"format": "pt"}
    )
    ref = type(model)(model.config).eval()
    ref.load_state_dict(reference)
    return ref


@pytest.mark.parametrize("case", list(CASES))
def test_a_packed_checkpoint_serves_as_its_dequantized_weights(case: str, base, tmp_path: Path) -> None:
    ref = quantized_checkpoint(base, CASES[case], tmp_path)
    q_proj = ref.model.layers[0].self_attn.q_proj.weight
    assert q_proj.abs().max() > 0 and not torch.equal(q_proj, base[0].model.layers[0].self_attn.q_proj.weight)
    assert_serves_as(str(tmp_path), ref, cpu_gemm="exact")


def test_symmetric_4bit_gptq_multiplies_as_q4_0_blocks(base, tmp_path: Path, capsys) -> None:
    """Symmetric 4-bit GPTQ without act-order is exactly GGML's Q4_0 (d = the group's scale, a weight d x (q - 8)):
    under --cpu-gemm auto Kiln's integer kernels multiply those blocks, the plan counts them (18 B a 32 weights)
    as the engine holds them, and the logits stay within the integer path's rounding of the dequantized model."""
    from model_equality import BASE_ARGS, spy_logits

    from kiln.platform import gguf_block_types

    if "Q4_0" not in gguf_block_types("auto"):
        pytest.skip("Kiln's integer kernels do not run on this CPU")
    ref = quantized_checkpoint(base, CASES["gptq-4bit-g64-symmetric"], tmp_path)
    assert plan.main(["--model-path", str(tmp_path), "--device", "cpu", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    eng = kiln.Engine(model_path=str(tmp_path), **{**BASE_ARGS, "max_total_tokens": 4096})
    try:
        attn = eng.scheduler.runner.model.model.layers[0].self_attn
        assert attn.o_proj.packed and attn.o_proj.weight.dtype == torch.uint8  # Q4_0 blocks, integer layout
        assert eng.scheduler.runner.measured["weights"] == planned["weight_bytes"]
        prompt = list(range(20, 60))
        logits, ids = spy_logits(eng, prompt)
    finally:
        eng.shutdown()
    from model_equality import reference_logits

    with torch.inference_mode():
        want = reference_logits(ref, prompt, ids)
    kl = torch.nn.functional.kl_div(
        logits.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none"
    )
    assert kl.sum(-1).max() < 1e-3, kl.sum(-1)
    assert (logits.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_plan_counts_the_linears_as_served(base, tmp_path: Path, capsys) -> None:
    """Dequantized at load, the linears take what the float checkpoint's do: the plans agree."""
    quantized_checkpoint(base, CASES["awq-4bit-g32"], tmp_path / "awq")
    base[0].save_pretrained(tmp_path / "float")
    base[1].save_pretrained(tmp_path / "float")
    weights = []
    for path in (tmp_path / "awq", tmp_path / "float"):
        assert plan.main(["--model-path", str(path), "--device", "cpu", "--json"]) == 0
        weights.append(json.loads(capsys.readouterr().out)["weight_bytes"])
    assert weights[0] == weights[1]


@pytest.mark.unit
@pytest.mark.parametrize(
    "quant, field",
    [
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
        ({"quant_method": "gptq", "bits": 3}, "bits 3"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point false"),
    ],
)
def test_variants_kiln_cannot_read_are_named(quant: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        packed_format(quant)


@pytest.mark.unit
def test_a_missing_part_and_a_reordering_g_idx_are_named() -> None:
    fmt = packed_format({"quant_method": "gptq", "bits": 4, "group_size": 32})
    assert fmt is not None
    words = torch.zeros(8, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="a.qzeros is missing"):
        list(dequantized_stream(iter([("a.qweight", words), ("a.scales", torch.ones(2, 8).half())]), fmt))
    parts = [
        ("a.qweight", words),
        ("a.qzeros", torch.zeros(2, 1, dtype=torch.int32)),
        ("a.scales", torch.ones(2, 8)),
    ]
    shuffled = torch.arange(64).flip(0) // 32
    with pytest.raises(ValueError, match="reorders the input columns"):
        list(dequantized_stream(iter([*parts, ("a.g_idx", shuffled)]), fmt))
    names = [n for n, _ in dequantized_stream(iter([*parts, ("a.g_idx", torch.arange(64) // 32)]), fmt)]
    assert names == ["a.weight"]


def test_plan_refuses_a_variant_by_name(base, tmp_path: Path, capsys) -> None:
    quantized_checkpoint(base, CASES["awq-4bit-g32"], tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert plan.main(["--model-path", str(tmp_path), "--device", "cpu"]) == 2
    assert "quantization_config version 'gemv'" in capsys.readouterr().err
