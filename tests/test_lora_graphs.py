"""LoRA inside the CPU's compiled decode steps (--enable-lora with --cuda-graph-max-bs): a batch mixing adapters and
the base replays the compiled step, whose dense delta reads the slot buffers, and gives transformers' greedy ids
with each adapter merged (float32); a new mix of adapters does not recompile; a batch of one adapter or of the base
runs eagerly, where that is cheaper; an adapter loaded after capture is read by the compiled code from its slot, not
baked in at capture."""

from __future__ import annotations

import gc

import pytest
import torch
from lora_models import build_adapters, greedy_under_each
from model_equality import one_torch_thread  # noqa: F401 (a module fixture: one torch thread)
from test_correctness import make_prompt, token_stream

import kiln
from kiln.runner import graph_runner

pytestmark = pytest.mark.engine

NEW = 6
LENS = (3, 17, 40, 9)
ARGS = dict(max_total_tokens=4096, max_running_requests=8, num_threads=1, max_loras_per_batch=3)


@pytest.fixture(scope="module")
def adapters(tiny_llama: str, tmp_path_factory) -> dict[str, str]:
    return build_adapters(tiny_llama, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    stream = token_stream()
    return [make_prompt(stream, n, 41 * i + 7) for i, n in enumerate(LENS)]


@pytest.fixture(scope="module")
def want(tiny_llama: str, adapters: dict[str, str], prompts) -> dict[str | None, list[list[int]]]:
    """transformers' greedy ids of every prompt under each adapter merged, and under the base (None)."""
    return greedy_under_each(tiny_llama, adapters, prompts, NEW)


class Steps:
    """Each decode step's rows and whether it replayed compiled code (the runner's last_forward_graph)."""

    def __init__(self, runner):
        self.decodes: list[tuple[int, bool]] = []
        inner = type(runner).forward.__get__(runner)

        def forward(fb):
            out = inner(fb)
            if fb.kv_table is not None and fb.mode.name == "DECODE":
                self.decodes.append((int(fb.kv_table.shape[0]), runner.last_forward_graph))
            return out

        runner.forward = forward


@pytest.fixture(scope="module")
def engine(tiny_llama: str, adapters: dict[str, str]):
    # the engine forbids recompiles once captured, for the whole process: later tests compile functions
    dynamo = torch._dynamo.config.patch(error_on_recompile=torch._dynamo.config.error_on_recompile)
    with pytest.MonkeyPatch.context() as mp, dynamo:
        mp.setattr(graph_runner, "MAX_SLOWDOWN", 1e9)  # keep every shape whatever its timing against eager
        paths = tuple(f"{name}={adapters[name]}" for name in ("alpha", "beta"))
        # one shape (each compiles at a cold start): every batch below has 3 or 4 rows, run at bs=4
        eng = kiln.Engine(model_path=tiny_llama, lora_paths=paths, cuda_graph_bs=(4,), **ARGS)
        eng.steps = Steps(eng.scheduler.runner)
        try:
            yield eng
        finally:
            eng.shutdown()
            gc.collect()


def run(eng: kiln.Engine, prompts: list[list[int]], loras: list[str | None]) -> list[list[int]]:
    params = [{"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True} for _ in prompts]
    eng.steps.decodes.clear()
    outs = eng.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
    return [o["output_ids"] for o in outs]


def compiled_frames() -> int:
    """Frames dynamo has compiled in this process: a recompile of the decode step adds one."""
    return torch._dynamo.utils.counters["frames"]["total"]


def test_decode_graphs_are_captured_under_lora(engine, want) -> None:
    assert engine.parts.args.disable_prefill_graph and not engine.parts.args.disable_cuda_graph
    assert engine.scheduler.runner.graphs.captured("decode") == [4]
    assert want["alpha"] != want[None] and want["beta"] != want[None] and want["gamma"] != want[None]


def test_mixed_batch_replays_compiled_steps(engine, prompts, want) -> None:
    """Two adapters and the base in one batch of 4: every decode step replays the compiled bs=4 step (padded rows
    and base rows add nothing), and the ids are transformers' with each row's adapter merged."""
    loras = ["alpha", None, "beta", "alpha"]
    got = run(engine, prompts, loras)
    assert got == [want[n][i] for i, n in enumerate(loras)]
    decodes = engine.steps.decodes
    assert len(decodes) >= NEW - 1 and all(graph for _, graph in decodes), decodes
    assert engine.check_integrity()["ok"]


def test_batches_replay_where_the_dense_delta_pays_and_never_recompile(engine, prompts, want) -> None:
    """Batches of two adapters (more than half of the 3 slots, where eager would run the dense form too) replay the
    steps captured at startup whatever their mix, padded or not: nothing in them is guarded on which adapters a
    batch holds. A batch of one adapter, or of the base alone, runs eagerly: the grouped form or no delta at all
    is cheaper than the compiled step's dense delta over every slot (LoraBatch.compiled_pays)."""
    before = compiled_frames()
    for loras, compiled in (
        (["beta", "alpha", "alpha", "beta"], True),
        (["alpha", "beta", None], True),
        (["beta"] * 4, False),
        ([None, "beta", None, "beta"], False),
        ([None] * 4, False),
    ):
        got = run(engine, prompts[: len(loras)], loras)
        assert got == [want[n][i] for i, n in enumerate(loras)], loras
        decodes = engine.steps.decodes
        assert decodes and all(graph == compiled for _, graph in decodes), (loras, decodes)
    assert compiled_frames() == before


def test_adapter_loaded_after_capture(engine, adapters, prompts, want) -> None:
    """gamma, loaded at runtime into a slot no adapter held at capture: the compiled steps read its weights and
    scaling from the slot buffers (inputs of the compiled code, not constants), beside alpha and the base."""
    assert engine.load_lora_adapter("gamma", adapters["gamma"])["success"]
    try:
        before = compiled_frames()
        loras = ["gamma", "alpha", None, "gamma"]
        got = run(engine, prompts, loras)
        assert got == [want[n][i] for i, n in enumerate(loras)]
        assert all(graph for _, graph in engine.steps.decodes)
        assert compiled_frames() == before
    finally:
        engine.unload_lora_adapter("gamma")


@pytest.mark.parametrize(
    "device, backend, asked, eager",
    [
        ("cpu", "auto", False, False),  # compiled decode steps as --cuda-graph-max-bs asks
        ("cpu", "auto", True, True),  # --disable-cuda-graph still wins
        ("cpu", "triton", False, True),  # Triton's kernels (the interpreter on the CPU) are not compiled
        ("cuda", "auto", False, True),  # CUDA graphs with the Triton kernels: not run on a GPU yet
    ],
)
def test_resolve_keeps_decode_graphs_on_the_cpu_only(device, backend, asked, eager) -> None:
    from kiln.config import ServerArgs
    from kiln.scheduler.lora_resolve import resolve_lora

    args = ServerArgs(
        model_path="m", enable_lora=True, max_lora_rank=8, lora_backend=backend, disable_cuda_graph=asked
    )
    out = resolve_lora(args, device)
    assert out.disable_cuda_graph is eager and out.disable_prefill_graph
