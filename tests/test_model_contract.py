"""The model contract: outside kiln/models, kiln/loader and kiln/layers, nothing reads a model's HF config. Every
other module knows a model through kiln.models.spec.ModelSpec (or the ModelConfig that holds it), so a new family
is a model file and its registry line. This test walks the package's syntax trees and names each read it finds: an
HF config key as a string (`cfg.get("num_attention_heads")`, `getattr(hf, "rope_theta")`), a name that holds a raw
config (`hf_config`, `text_config`, ...), or an import of the dict arithmetic ModelSpec wraps."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kiln.models.registry import MODELS
from kiln.models.spec import LayerSpec, ModelSpec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent / "kiln"
MODEL_PACKAGES = ("models", "loader", "layers")
# names that hold or fetch a raw config, and the private arithmetic over it
RAW_NAMES = {
    "hf_config", "config_dict", "text_config", "draft_hf_config", "read_hf_config", "AutoConfig",
    "PretrainedConfig", "_config",
}  # fmt: skip
RAW_MODULES = {"kiln.models.shapes", "kiln.models.tp_split"}
# strings that are HF config keys and mean something else where they appear: SGLang's /model_info answer names
# "model_type" and "architectures" (filled from the spec), a tokenizer has an eos_token_id, a storage identity a
# dtype
NOT_CONFIG_READS = {"model_type", "architectures", "eos_token_id", "dtype"}


def config_keys() -> set[str]:
    """Every key transformers' configs of the registered families hold, defaults included."""
    from transformers import AutoConfig

    types = {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "qwen3_next",
        "deepseek_v3",
        "gemma2",
        "gemma3_text",
    }
    types |= {name.removesuffix("ForCausalLM").lower() for name in MODELS} & {"mixtral", "phi3"}
    keys: set[str] = set()
    for model_type in types:
        keys |= set(AutoConfig.for_model(model_type).to_dict())
    return keys - NOT_CONFIG_READS


def config_reads(source: str, keys: set[str]) -> list[str]:
    """Where `source` reads a raw config: (line, what) for each string key, raw name and raw import."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in keys:
            found.append(f"{node.lineno}: config key {node.value!r}")
        name = (
            node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        )
        if isinstance(node, ast.arg):
            name = node.arg
        if name in RAW_NAMES:
            found.append(f"{node.lineno}: raw config name {name}")
        if isinstance(node, ast.ImportFrom) and node.module in RAW_MODULES:
            found.append(f"{node.lineno}: imports {node.module}")
        if isinstance(node, ast.ImportFrom) and any(a.name in RAW_NAMES for a in node.names):
            found.append(
                f"{node.lineno}: imports {', '.join(a.name for a in node.names if a.name in RAW_NAMES)}"
            )
    return found


def test_no_module_outside_the_model_packages_reads_an_hf_config():
    keys = config_keys()
    reads = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] in MODEL_PACKAGES:
            continue
        found = config_reads(path.read_text(), keys)
        if found:
            reads[str(path.relative_to(ROOT.parent))] = found
    assert not reads, (
        "HF config reads outside kiln/models, kiln/loader, kiln/layers (ask the ModelSpec):\n"
        + "\n".join(f"  {path}:{line}" for path, lines in reads.items() for line in lines)
    )


def test_the_walk_finds_each_kind_of_read():
    keys = config_keys()
    source = (
        "from kiln.models.shapes import kv_dims\n"
        "def f(cfg, hf_config):\n"
        "    a = cfg.get('num_attention_heads')\n"
        "    b = getattr(x, 'rms_norm_eps', None)\n"
        "    return spec._config\n"
    )
    assert sorted(config_reads(source, keys)) == [
        "1: imports kiln.models.shapes",
        "2: raw config name hf_config",
        "3: config key 'num_attention_heads'",
        "4: config key 'rms_norm_eps'",
        "5: raw config name _config",
    ]


def test_a_spec_describes_each_layer():
    """Per layer: its attention kind (full, sliding with its window, latent, linear) and whether its MLP is sparse,
    with the KV layers counted from them."""
    qwen3_next = ModelSpec.from_config(
        {
            "model_type": "qwen3_next",
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "vocab_size": 128,
            "num_experts": 4,
            "full_attention_interval": 2,
        }  # fmt: skip
    )
    assert [layer.attention for layer in qwen3_next.layers] == ["linear_attention", "full_attention"] * 2
    assert qwen3_next.kv_layers == 2 and qwen3_next.has_linear_attention and qwen3_next.num_layers == 4
    assert all(layer.sparse_mlp for layer in qwen3_next.layers)
    latent = ModelSpec.from_config(
        {
            "model_type": "deepseek_v3",
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "vocab_size": 128,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "n_routed_experts": 4,
            "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 1,
        }  # fmt: skip
    )
    assert (
        latent.layers
        == (LayerSpec("latent_attention"),) + (LayerSpec("latent_attention", sparse_mlp=True),) * 2
    )
    assert latent.is_mla and latent.nextn_layers == 1 and latent.kv_dims(2)[:2] == (40, 0)
    mistral = ModelSpec.from_config(
        {
            "model_type": "mistral",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 128,
            "sliding_window": 32,
        }  # fmt: skip
    )
    assert mistral.layers == (LayerSpec("sliding_attention", window=32),) * 2
    gemma2 = ModelSpec.from_config(
        {
            "model_type": "gemma2",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 128,
            "sliding_window": 16,
            "attn_logit_softcapping": 50.0,
            "layer_types": ["sliding_attention", "full_attention"],
        }  # fmt: skip
    )
    assert gemma2.layers == (
        LayerSpec("sliding_attention", window=16, softcap=50.0),
        LayerSpec("full_attention", softcap=50.0),
    )


def test_a_config_without_a_sizing_field_is_refused_naming_it():
    with pytest.raises(ValueError, match="no 'vocab_size'"):
        ModelSpec.from_config(
            {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
            defaults={"vocab_size": 32000},  # transformers' default does not stand in for a model's size
        )
