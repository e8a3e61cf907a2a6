"""FP8 block-quantized checkpoints as DeepSeek ships them, made from a transformers model for the tests:
e4m3 values and one float32 `weight_scale_inv` per block, per-expert tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's FP8 layout: e4m3 values and one float32 scale_inv per block x block tile (w = q * scale_inv)."""
    rows, cols = w.shape
    tiles_r, tiles_c = -(-rows // block), -(-cols // block)
    padded = torch.zeros(tiles_r * block, tiles_c * block)
    padded[:rows, :cols] = w
    tiles = padded.view(tiles_r, block, tiles_c, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return q.float() * full[: q.shape[0], : q.shape[1]]


def quantizable(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek's FP8 checkpoints keep in FP8: the linear weights, not embeddings, lm head, router or norms."""
    return t.dim() == 2 and (name.endswith("proj.weight") or name.endswith("_with_mqa.weight"))


def fp8_checkpoint(model, block: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the FP8 checkpoint with per-expert tensors, as DeepSeek ships it; the dequantized state dict for
    transformers)."""
    tensors, dequantized = {}, {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            prefix, parts = name.rsplit(".", 1)[0], []
            for e in range(t.shape[0]):
                pieces = t[e].chunk(2) if name.endswith("gate_up_proj") else (t[e],)
                kinds = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
                rebuilt = []
                for kind, piece in zip(kinds, pieces):
                    q, s = quantize_blocks(piece, block)
                    tensors[f"{prefix}.{e}.{kind}_proj.weight"] = q
                    tensors[f"{prefix}.{e}.{kind}_proj.weight_scale_inv"] = s
                    rebuilt.append(dequantize_reference(q, s, block))
                parts.append(torch.cat(rebuilt))
            dequantized[name] = torch.stack(parts)
        elif quantizable(name, t):
            q, s = quantize_blocks(t, block)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = q, s
            dequantized[name] = dequantize_reference(q, s, block)
        else:
            tensors[name] = dequantized[name] = t
    return tensors, dequantized


def save_fp8_model(model, tok, path: Path, block: int, architecture: str) -> dict[str, torch.Tensor]:
    """Saves `model` as an FP8 checkpoint (with its tokenizer and a quantization_config) and loads the
    dequantized weights back into it, so transformers computes what the checkpoint holds; returns the tensors."""
    from safetensors.torch import save_file

    tensors, dequantized = fp8_checkpoint(model, block)
    model.load_state_dict(dequantized)
    model.config.save_pretrained(path)
    tok.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [architecture]
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block], "activation_scheme": "dynamic",
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, path / "model.safetensors")
    return tensors
