"""The LoRA delta's methods (kiln.layers.lora): the dense masked form, the grouped form and the Triton kernels (in
Triton's interpreter without a GPU) each compute every row's delta under its own slot, the base rows' none, for a
merged projection's parts of different widths and adapters of ranks below the slots' max; the slot table pins,
evicts least recently used and never evicts a pinned slot; --lora-paths parses SGLang's forms."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ServerArgs, lora_modules, lora_path_pairs
from kiln.layers.lora import LoraBatch, LoraWeights, lora_delta_reference
from kiln.memory.lora_slots import SlotTable

pytestmark = pytest.mark.unit

SLOT_IDS = [2, -1, 0, 2, 2, -1, 1, 0]  # rows of three adapters and the base, interleaved


def filled(method: str) -> tuple[LoraWeights, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    batch = LoraBatch(num_slots=3, max_rank=8, max_rows=16, method=method)
    w = LoraWeights(
        batch, 24, [("q_proj", 0, 16), ("k_proj", 16, 8), ("v_proj", 24, 8)], torch.float32, "cpu"
    )
    for slot, rank in enumerate((8, 4, 2)):
        for part, (_, _, size) in enumerate(w.parts):
            if slot == 1 and part == 1:  # an adapter that leaves k_proj out
                w.write(slot, part, None, None)
                continue
            w.write(slot, part, torch.randn(rank, 24, generator=gen), torch.randn(size, rank, generator=gen))
        batch.scaling[slot] = (0.5, 2.0, 1.5)[slot]
    batch.set_rows(torch.tensor(SLOT_IDS))
    return w, torch.randn(len(SLOT_IDS), 24, generator=gen)


@pytest.mark.parametrize("method", ["dense", "grouped", "torch", "triton"])
def test_delta_methods_equal_the_reference(method: str) -> None:
    w, x = filled(method)
    base = torch.randn(x.shape[0], 32)
    got = w.add_delta(x, base.clone()) - base
    want = lora_delta_reference(x, SLOT_IDS, w).float()
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert got[1].abs().max() == 0 and got[5].abs().max() == 0  # base rows
    assert got[6, 16:24].abs().max() == 0  # slot 1 has no k_proj


def test_slot_table_pins_and_evicts_least_recently_used() -> None:
    table = SlotTable(2)
    assert table.take(10) == (0, True) and table.take(20) == (1, True)
    assert table.take(30) is None  # both pinned
    table.release(0)
    assert table.take(10) == (0, False)  # still there: no write
    table.release(0)
    table.release(1)
    assert table.take(30) == (1, True)  # adapter 20's slot was used less recently than adapter 10's
    assert table.slot_of(10) == 0 and table.slot_of(20) is None
    assert table.drop(30) is None  # pinned: kept until its requests end
    table.release(1)
    assert table.drop(30) == 1 and table.holder == [10, None]


def test_lora_paths_forms() -> None:
    json_form = '{"lora_name": "c", "lora_path": "/x/c", "pinned": true}'
    assert lora_path_pairs(("a=/x/a", "/x/b", json_form)) == (("a", "/x/a"), ("/x/b", "/x/b"), ("c", "/x/c"))
    with pytest.raises(ValueError, match="twice"):
        lora_path_pairs(("a=/x", "a=/y"))
    assert lora_modules(("all",))[0] == "q_proj" and lora_modules(("o_proj", "q_proj")) == (
        "q_proj",
        "o_proj",
    )
    with pytest.raises(ValueError, match="embed_tokens"):
        ServerArgs(enable_lora=True, lora_target_modules=("embed_tokens",))
    assert ServerArgs(lora_paths=("a=/x",)).enable_lora  # SGLang: adapters to load turn LoRA on
    with pytest.raises(ValueError, match="--max-loaded-loras 2 must be >= --max-loras-per-batch 8"):
        ServerArgs(enable_lora=True, max_loaded_loras=2)


def test_plan_prints_the_slot_pool(capsys, model_dir) -> None:
    """`kiln plan --enable-lora` prints the slots as a ledger line: per layer, a merged qkv (all three parts once
    q is targeted) and down_proj, A and B of 8 slots x rank 8 in float32, plus a float32 scaling per slot."""
    import kiln.plan as plan

    tiny = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
        "tie_word_embeddings": True,
    }  # fmt: skip
    argv = ["--model-path", model_dir(tiny), "--device", "cpu", "--device-memory", "24GiB", "--enable-lora"]
    argv += ["--max-lora-rank", "8", "--lora-target-modules", "q_proj", "down_proj"]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    qkv = 8 * 8 * (3 * 64 + 64 + 32 + 32)  # A: 3 parts x in 64; B: q 64 + k 32 + v 32 outputs
    down = 8 * 8 * (128 + 64)
    expected = 2 * (qkv + down) * 4 + 8 * 4
    line = next(x for x in out.splitlines() if x.strip().startswith("lora adapter slots"))
    assert f"{expected:,} B" in line and "q_proj down_proj" in line
