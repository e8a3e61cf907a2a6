"""GGUF reading: an HF-style config from the metadata, HF-named fp tensors, and the tokenizer.

The header is parsed here directly (struct over a memory map), skipping the vocabulary arrays, so
reading the config takes milliseconds; tensor data is only touched by `iter_gguf_tensors`.
"""

from __future__ import annotations

import os
import re
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from kiln.layers.quant_rows import BYTES_PER_BLOCK, GGUFRows

# GGUF metadata value types: fixed-size scalars (struct format); 8 is string, 9 is array.
_SCALAR_FORMATS = {
    t: "<" + c for t, c in zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True)
}
_STRING, _ARRAY = 8, 9
_MAX_KEPT_ARRAY = 1024  # longer arrays (vocabulary, scores, merges) are skipped; only their length is kept

# GGUF architecture -> (HF model_type, HF architecture class)
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# Architectures whose q/k rows the HF->GGUF converter interleaved per head (rotary pairs).
_PERMUTED_ARCHS = {"llama", "mistral"}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_IGNORED_TENSORS = {"rope_freqs.weight"}  # llama3 rope factors; not an HF parameter
_TENSOR_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (rows first)
    qtype: GGMLQuantizationType
    offset: int  # absolute, in bytes from the start of the file
    nbytes: int


@dataclass(frozen=True)
class _Header:
    metadata: dict[str, Any]
    array_lengths: dict[str, int]  # length of every array, including the skipped ones
    tensors: tuple[_TensorInfo, ...]


class _Cursor:
    """Sequential little-endian reads over a buffer."""

    def __init__(self, buf: Any, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def unpack(self, fmt: str) -> Any:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def unpack_tuple(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        length = self.unpack("<Q")
        start, self.pos = self.pos, self.pos + length
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        buf, pos = self.buf, self.pos
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        self.pos = pos


def _read_value(cur: _Cursor, vtype: int, key: str, lengths: dict[str, int]) -> Any:
    if vtype in _SCALAR_FORMATS:
        return cur.unpack(_SCALAR_FORMATS[vtype])
    if vtype == _STRING:
        return cur.string()
    if vtype != _ARRAY:
        raise ValueError(f"GGUF metadata key {key!r} has unknown value type {vtype}")
    etype, count = cur.unpack("<IQ")
    lengths[key] = count
    if count > _MAX_KEPT_ARRAY:
        if etype == _STRING:
            cur.skip_strings(count)
        elif etype in _SCALAR_FORMATS:
            cur.pos += count * struct.calcsize(_SCALAR_FORMATS[etype])
        else:
            raise ValueError(f"GGUF metadata key {key!r}: cannot skip an array of type {etype}")
        return None
    return [_read_value(cur, etype, key, {}) for _ in range(count)]


_KNOWN_QTYPES = frozenset(int(q) for q in GGMLQuantizationType)


def _read_header(path: str) -> _Header:
    if os.path.getsize(path) == 0:  # np.memmap's own error would not name the file
        raise ValueError(f"{path} is empty (0 bytes), not a GGUF file; download the file again")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(data[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (bad magic bytes)")
    try:
        header = _parse_header(_Cursor(data))
    except (struct.error, OverflowError, MemoryError) as e:  # a count or length read past the file's end
        raise ValueError(
            f"{path}: the GGUF header is truncated or corrupt ({e}); download the file again"
        ) from e
    except ValueError as e:  # a version or type code Kiln does not read
        raise ValueError(f"{path}: {e}") from e
    for t in header.tensors:
        if t.offset + t.nbytes > len(data):
            raise ValueError(
                f"{path} is truncated: tensor {t.name!r} ends at byte {t.offset + t.nbytes:,} and the file has "
                f"{len(data):,} bytes; download the file again"
            )
    return header


def _parse_header(cur: _Cursor) -> _Header:
    version, n_tensors, n_kv = cur.unpack("<4xIQQ")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = _read_value(cur, cur.unpack("<I"), key, lengths)
    raw = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = cur.unpack_tuple(f"<{cur.unpack('<I')}Q")
        qtype, offset = cur.unpack("<IQ")
        if qtype not in _KNOWN_QTYPES:
            raise ValueError(
                f"tensor {name!r} has quantization type {qtype}, which the gguf package does not know: the file "
                "is corrupt, or newer than this gguf package (upgrade it)"
            )
        raw.append((name, tuple(reversed(dims)), GGMLQuantizationType(qtype), offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors = tuple(
        _TensorInfo(name, shape, qtype, data_start + offset, _nbytes(shape, qtype))
        for name, shape, qtype, offset in raw
    )
    return _Header(metadata, lengths, tensors)


def _nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=np.int64)) // block_size * type_size


def _arch(header: _Header) -> str:
    arch = header.metadata.get("general.architecture", "")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported by Kiln (supported: {', '.join(_ARCHITECTURES)})"
        )
    return arch


def _uniform(value: Any, key: str) -> Any:
    """A per-layer array must hold one value for Kiln's models."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF {key} varies per layer ({value}); Kiln needs one value")
        return value[0]
    return value


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "type": kind}
    if factor is not None:
        scaling["factor"] = float(factor)
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _config_from_header(header: _Header) -> dict[str, Any]:
    meta, arch = header.metadata, _arch(header)
    model_type, architecture = _ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        model_type, architecture = _ARCHITECTURES["mistral"]
    names = {t.name for t in header.tensors}
    hidden = int(meta[f"{arch}.embedding_length"])
    heads = int(_uniform(meta[f"{arch}.attention.head_count"], "head_count"))
    kv_heads = int(_uniform(meta.get(f"{arch}.attention.head_count_kv", heads), "head_count_kv"))
    head_dim = meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count"))
    vocab = meta.get(f"{arch}.vocab_size", header.array_lengths.get("tokenizer.ggml.tokens"))
    if vocab is None:
        vocab = next(t.shape[0] for t in header.tensors if t.name == "token_embd.weight")
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_uniform(meta[f"{arch}.feed_forward_length"], "feed_forward_length")),
        "num_hidden_layers": int(meta[f"{arch}.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(head_dim) if head_dim is not None else hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    scaling = _rope_scaling(meta, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if f"{arch}.attention.sliding_window" in meta:
        config["sliding_window"] = int(meta[f"{arch}.attention.sliding_window"])
    config["kiln_gguf"] = _gguf_summary(header, arch)
    return config


def _gguf_summary(header: _Header, arch: str) -> dict[str, Any]:
    file_type = header.metadata.get("general.file_type")
    try:
        file_type_name = LlamaFileType(file_type).name if file_type is not None else None
    except ValueError:
        file_type_name = None
    numel = sum(
        int(np.prod(t.shape, dtype=np.int64)) for t in header.tensors if t.name not in _IGNORED_TENSORS
    )
    return {
        "architecture": arch,
        "name": header.metadata.get("general.name"),
        "file_type": file_type,
        "file_type_name": file_type_name,
        "tensor_types": dict(Counter(t.qtype.name for t in header.tensors)),
        "weight_bytes_f32": numel * 4,
        "weight_bytes_file": sum(t.nbytes for t in header.tensors),
        # per GGML type Kiln's CPU kernels may keep in blocks: [linear params, their bytes, embedding bytes]
        # (the embedding's for a tied LM head); which types a load keeps is --cpu-gemm's choice
        "block_types": _block_types(header),
        # per GGML type, the projections' [params, rows] (the matrices but the embedding and the LM head): what
        # --quantization int8 rounds at load where --cpu-gemm does not keep the type's blocks
        "linear_types": _linear_types(header),
    }


def _linear_types(header: _Header) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for t in header.tensors:
        if len(t.shape) == 2 and t.name not in ("token_embd.weight", "output.weight"):
            counts = found.setdefault(t.qtype.name, [0, 0])
            counts[0] += int(np.prod(t.shape, dtype=np.int64))
            counts[1] += t.shape[0]
    return found


def _block_types(header: _Header) -> dict[str, list[int]]:
    kept: dict[str, list[int]] = {}
    for t in header.tensors:
        if t.qtype.name not in BYTES_PER_BLOCK or len(t.shape) != 2:
            continue
        counts = kept.setdefault(t.qtype.name, [0, 0, 0])
        if t.name == "token_embd.weight":
            counts[2] += t.nbytes
        else:
            counts[0] += int(np.prod(t.shape, dtype=np.int64))
            counts[1] += t.nbytes
    return kept


def read_gguf_config(path: str) -> dict:
    """An HF-style config.json dict from the GGUF metadata alone (no tensor data is read)."""
    return _config_from_header(_read_header(os.fspath(path)))


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for tensors that are not HF parameters."""
    if gguf_name in _IGNORED_TENSORS:
        return None
    match = _TENSOR_NAME.match(gguf_name)
    if match is not None:
        layer, part, suffix = match.groups()
        if layer is None and part in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[part]}.{suffix}"
        if layer is not None and part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart known to Kiln")


def unpermute_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the converter's per-head rotary interleave of q/k rows (weights or biases)."""
    dim = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, dim, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def _dequantize(data: np.ndarray, info: _TensorInfo) -> np.ndarray:
    raw = data[info.offset : info.offset + info.nbytes]
    rows = raw.reshape(*info.shape[:-1], -1) if len(info.shape) > 1 else raw
    values = gguf.quants.dequantize(rows, info.qtype)
    return values.reshape(info.shape)


def iter_gguf_tensors(path: str, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, dequantized tensor in HF layout), one tensor at a time."""
    path = os.fspath(path)
    header = _read_header(path)
    arch = _arch(header)
    heads = int(_uniform(header.metadata[f"{arch}.attention.head_count"], "head_count"))
    kv_heads = int(_uniform(header.metadata.get(f"{arch}.attention.head_count_kv", heads), "head_count_kv"))
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        name = hf_tensor_name(info.name)
        if name is None:
            continue
        values = _dequantize(data, info)
        raw = _raw_rows(data, info)
        if arch in _PERMUTED_ARCHS and (".attn_q." in info.name or ".attn_k." in info.name):
            n_head = heads if ".attn_q." in info.name else kv_heads
            values = unpermute_rows(values, n_head)
            raw = unpermute_rows(raw, n_head) if raw is not None else None
        if not values.flags.writeable or not values.flags.c_contiguous:
            values = np.array(values, order="C")
        tensor = torch.from_numpy(values).to(dtype)
        if raw is not None and dtype == torch.float32:  # the quantized kernels take float32 activations
            tensor.gguf_rows = GGUFRows(info.qtype.name, torch.from_numpy(np.array(raw, order="C")))
        yield name, tensor


def _raw_rows(data: np.ndarray, info: _TensorInfo) -> np.ndarray | None:
    """The GGML blocks of a matrix of a type in BYTES_PER_BLOCK as rows [N, K / block * bytes per block] (a view
    of the file)."""
    if info.qtype.name not in BYTES_PER_BLOCK or len(info.shape) != 2:
        return None
    return data[info.offset : info.offset + info.nbytes].reshape(info.shape[0], -1)
