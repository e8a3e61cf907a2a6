"""LoRA adapters for the tests: built by PEFT on a tiny base model (lora_B set non-zero: PEFT starts it at zero),
saved in PEFT's layout, and the reference, transformers' model with the adapter merged (merge_and_unload)."""

from __future__ import annotations

from pathlib import Path

import torch

# two adapters of different ranks, scalings and target modules (every projection covered by one or the other)
ADAPTERS = {
    "alpha": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True
    ),
    "beta": dict(r=4, lora_alpha=8, target_modules=["v_proj", "gate_proj", "up_proj", "down_proj"]),
    "gamma": dict(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]),
}


def build_adapter(base: str, out: Path, seed: int, **config) -> str:
    """A PEFT LoRA adapter of `base` with random A and B (std 0.1), saved in `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(out)
    return str(out)


def build_adapters(base: str, root: Path, names: tuple[str, ...] = tuple(ADAPTERS)) -> dict[str, str]:
    return {name: build_adapter(base, root / name, i + 1, **ADAPTERS[name]) for i, name in enumerate(names)}


def merged_model(base: str, adapter: str | None):
    """transformers' float32 model with the adapter merged into its weights (the base alone for None)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def greedy_under_each(
    base: str, adapters: dict[str, str], prompts: list[list[int]], new: int
) -> dict[str | None, list[list[int]]]:
    """transformers' greedy ids of every prompt under each adapter merged, and under the base (None)."""
    from test_correctness import hf_greedy

    out: dict[str | None, list[list[int]]] = {}
    for name in (None, *adapters):
        model = merged_model(base, adapters.get(name) if name else None)
        with torch.inference_mode():
            out[name] = [hf_greedy(model, p, new, set())[0] for p in prompts]
    return out
