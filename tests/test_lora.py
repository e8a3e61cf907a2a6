"""Multi-LoRA serving in the in-process Engine, on a tiny random Llama (and a Qwen3) with adapters built by PEFT (different
ranks, scalings, rsLoRA and target modules): greedy ids equal transformers' with the adapter merged (float32),
each adapter alone and all of them with the base in one batch; the radix cache keeps adapters apart; adapters load
and unload at runtime, more adapters than slots take turns; bad adapters are refused naming what is wrong; the
ledger's slot line is what the slots allocate."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from lora_models import build_adapter, build_adapters, greedy_under_each, merged_model
from model_equality import one_torch_thread  # noqa: F401 (a module fixture: one torch thread)
from test_correctness import hf_greedy, make_prompt, token_stream

import kiln
from kiln.sampling_params import InvalidParam

pytestmark = pytest.mark.engine

NEW = 8
LENS = (3, 17, 40)
ARGS = dict(max_total_tokens=4096, max_running_requests=16, num_threads=1, max_loras_per_batch=2)


@pytest.fixture(scope="module")
def adapters(tiny_llama: str, tmp_path_factory) -> dict[str, str]:
    return build_adapters(tiny_llama, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    stream = token_stream()
    return [make_prompt(stream, n, 53 * i + 11) for i, n in enumerate(LENS)]


@pytest.fixture(scope="module")
def want(tiny_llama: str, adapters: dict[str, str], prompts) -> dict[str | None, list[list[int]]]:
    """transformers' greedy ids of every prompt under each adapter merged, and under the base (None)."""
    return greedy_under_each(tiny_llama, adapters, prompts, NEW)


@pytest.fixture(scope="module")
def engine(tiny_llama: str, adapters: dict[str, str]):
    paths = [f"{name}={adapters[name]}" for name in ("alpha", "beta")]
    eng = kiln.Engine(model_path=tiny_llama, lora_paths=tuple(paths), **ARGS)
    yield eng
    eng.shutdown()
    gc.collect()


def run(eng: kiln.Engine, prompts: list[list[int]], loras: list[str | None]) -> list[list[int]]:
    params = [{"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True} for _ in prompts]
    outs = eng.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
    return [o["output_ids"] for o in outs]


def test_adapters_change_the_output(want) -> None:
    """The references differ: each adapter moves greedy ids away from the base's (the test below is not vacuous)."""
    assert want["alpha"] != want[None] and want["beta"] != want[None] and want["alpha"] != want["beta"]


def test_each_adapter_alone_equals_transformers_merged(engine, prompts, want) -> None:
    for name in (None, "alpha", "beta"):
        assert run(engine, prompts, [name] * len(prompts)) == want[name], name


def test_mixed_batch_of_adapters_and_base(engine, prompts, want) -> None:
    """Every prompt under the base and both adapters, interleaved in one batch."""
    names = [None, "alpha", "beta"]
    batch = [(p, names[(i + j) % 3]) for i, p in enumerate(prompts) for j in range(3)]
    got = run(engine, [p for p, _ in batch], [n for _, n in batch])
    expected = [want[n][prompts.index(p)] for p, n in batch]
    assert got == expected
    assert engine.check_integrity()["ok"]


def test_radix_cache_is_keyed_by_adapter(engine) -> None:
    """A prefix computed under one adapter is reused by that adapter alone: never by another or the base."""
    prompt = make_prompt(token_stream(), 64, 901)
    params = {"max_new_tokens": 1, "temperature": 0.0}

    def cached(lora: str | None) -> int:
        return engine.generate(input_ids=prompt, sampling_params=params, lora_path=lora)["meta_info"][
            "cached_tokens"
        ]

    assert cached("alpha") == 0
    assert cached("beta") == 0
    assert cached(None) == 0
    assert cached("alpha") >= 48  # its own prefix, computed above
    assert cached("beta") >= 48 and cached(None) >= 48  # each computed its own too


def test_more_adapters_than_slots_take_turns(engine, adapters, prompts, want) -> None:
    """A third adapter loaded at runtime, with 2 slots: a batch over all three runs, the third waiting for a slot
    no running request pins; then unloaded, it is refused by name."""
    loaded = engine.load_lora_adapter("gamma", adapters["gamma"])
    assert loaded["success"], loaded
    assert {a["lora_name"] for a in loaded["loaded_adapters"]} == {"alpha", "beta", "gamma"}
    ref = merged_model(engine.parts.args.model_path, adapters["gamma"])
    with torch.inference_mode():
        gamma = [hf_greedy(ref, p, NEW, set())[0] for p in prompts]
    names = ["alpha", "beta", "gamma"]
    batch = [(p, n) for p in prompts for n in names]
    got = run(engine, [p for p, _ in batch], [n for _, n in batch])
    expected = [(gamma if n == "gamma" else want[n])[prompts.index(p)] for p, n in batch]
    assert got == expected
    # unloaded while its requests run or wait for a slot (alpha and beta hold both): they still end on it
    params = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    loras = ["alpha", "beta", "gamma"]
    stream = engine.generate(
        input_ids=[prompts[0]] * 3, sampling_params=[params] * 3, lora_path=loras, stream=True
    )
    outs = {0: None, 1: None, 2: None}
    for i, chunk in enumerate(stream):
        if i == 0:
            assert engine.unload_lora_adapter("gamma")["success"]
        outs[chunk["index"]] = chunk["output_ids"]
    assert [outs[i] for i in range(3)] == [want["alpha"][0], want["beta"][0], gamma[0]]
    assert not engine.scheduler.runner.lora.retiring  # forgotten once its request ended
    with pytest.raises(InvalidParam, match="gamma"):
        run(engine, prompts[:1], ["gamma"])
    assert not engine.unload_lora_adapter("gamma")["success"]
    assert engine.check_integrity()["ok"]


def test_bad_adapters_are_refused_by_name(engine, tiny_llama, tmp_path: Path) -> None:
    too_big = build_adapter(tiny_llama, tmp_path / "big", 7, r=16, lora_alpha=16, target_modules=["q_proj"])
    out = engine.load_lora_adapter("big", too_big)
    assert (
        not out["success"]
        and "rank 16" in out["error_message"]
        and "--max-lora-rank 8" in out["error_message"]
    )
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00\x01not safetensors")
    out = engine.load_lora_adapter("corrupt", str(corrupt))
    assert (
        not out["success"]
        and "'corrupt'" in out["error_message"]
        and "could not be read" in out["error_message"]
    )
    out = engine.load_lora_adapter("missing", str(tmp_path / "nowhere"))
    assert not out["success"] and "adapter_config.json" in out["error_message"]
    out = engine.load_lora_adapter("alpha", too_big)
    assert not out["success"] and "already loaded" in out["error_message"]
    with pytest.raises(InvalidParam, match="'nope' is not loaded"):
        run(engine, [[1, 2, 3]], ["nope"])


def test_ledger_line_is_what_the_slots_allocate(engine) -> None:
    line = next(x for x in engine.parts.ledger.lines if x.name == "lora adapter slots")
    allocated = engine.scheduler.runner.lora.nbytes
    assert allocated > 0 and abs(line.bytes - allocated) <= 0.01 * allocated


def test_target_module_outside_the_slots_is_refused(tiny_llama, adapters) -> None:
    """Slots covering attention only: an adapter on the MLP is refused at startup, naming the module."""
    with pytest.raises(ValueError, match=r"target module (gate|up|down)_proj is not among"):
        kiln.Engine(
            model_path=tiny_llama,
            lora_paths=(f"beta={adapters['beta']}",),
            lora_target_modules=("q_proj", "v_proj"),
            **ARGS,
        )


def test_chunked_prompts_on_one_slot(tiny_llama, adapters) -> None:
    """Prompts chunked 64 tokens at a time, two adapters and the base sharing a single slot: each adapter's
    requests hold the slot through all their chunks and decode steps, the other's wait and then overwrite it."""
    stream = token_stream()
    prompts = [make_prompt(stream, 150 + 7 * i, 300 + 31 * i) for i in range(2)]
    want = {}
    for name in (None, "alpha", "beta"):
        model = merged_model(tiny_llama, adapters[name] if name else None)
        with torch.inference_mode():
            want[name] = [hf_greedy(model, p, NEW, set())[0] for p in prompts]
    paths = tuple(f"{n}={adapters[n]}" for n in ("alpha", "beta"))
    args = {**ARGS, "max_loras_per_batch": 1, "chunked_prefill_size": 64}
    eng = kiln.Engine(model_path=tiny_llama, lora_paths=paths, **args)
    try:
        batch = [(p, n) for p in prompts for n in ("alpha", None, "beta")]
        got = run(eng, [p for p, _ in batch], [n for _, n in batch])
        assert got == [want[n][prompts.index(p)] for p, n in batch]
        assert eng.check_integrity()["ok"]
    finally:
        eng.shutdown()


def test_qwen3_with_biases_and_wider_heads(tiny_qwen3, tmp_path: Path) -> None:
    """A tied Qwen3 whose heads are wider than its hidden size (q_proj 64 -> 128), with q/k norms and biases: an
    adapter on every projection gives transformers' ids merged, beside the base in one batch."""
    adapter = build_adapter(tiny_qwen3, tmp_path / "q3", 11, r=4, lora_alpha=4, target_modules="all-linear")
    prompts = [make_prompt(token_stream(), n, 17 * n) for n in (6, 29)]
    want = {}
    for name, path in ((None, None), ("q3", adapter)):
        with torch.inference_mode():
            want[name] = [hf_greedy(merged_model(tiny_qwen3, path), p, NEW, set())[0] for p in prompts]
    eng = kiln.Engine(model_path=tiny_qwen3, lora_paths=(f"q3={adapter}",), **ARGS)
    try:
        batch = [(p, n) for p in prompts for n in ("q3", None)]
        got = run(eng, [p for p, _ in batch], [n for _, n in batch])
        assert got == [want[n][prompts.index(p)] for p, n in batch]
        assert want["q3"] != want[None]
    finally:
        eng.shutdown()
