"""Greedy decoding under integer compute (`--cpu-gemm auto`, the default model's GGUF blocks multiplied in int8) is
batch-invariant: a prompt decodes to the same tokens alone and in a batch of others, and NGRAM speculation (whose
verify rows share a prefix in one decode batch) gives plain decoding's tokens. Rounding activations to int8 turns a
last-bit difference in attention into a whole quantization step, so this holds only because every row's arithmetic
is independent of the batch around it (the decode kernel pads its last tile rather than computing it another way)."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.platform import cpu_runs_kiln_kernel
from kiln.runner import graph_runner
from kiln.scheduler.spec_step import SpecDecoder
from kiln.speculative.ngram import NgramDrafter

pytestmark = pytest.mark.engine

if not cpu_runs_kiln_kernel():
    pytest.skip("integer compute needs Kiln's CPU kernels (AVX2)", allow_module_level=True)

PROMPTS = [
    "Write a short original story about a lighthouse keeper.",
    "hi",
    "Shopping list: apples, bread, cheese, dates, eggs, flour, grapes, honey, ice, jam.\n"
    "Write the same list again but replace cheese with butter:\n",
    "What is the capital of France? Answer in one sentence and then explain the history of the city in detail.",
]
GREEDY = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    eng = kiln.Engine(disable_cuda_graph=True, cpu_gemm="auto")
    assert eng.scheduler.runner.model_config.model_path.endswith(".gguf")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def alone(engine) -> list[list[int]]:
    return [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]


def test_a_prompt_decodes_alike_alone_and_in_a_batch(engine, alone):
    batched = [out["output_ids"] for out in engine.generate(PROMPTS, GREEDY)]
    assert batched == alone


def test_ngram_speculation_keeps_integer_compute_greedy_output(engine, alone):
    spec = SpecDecoder(NgramDrafter(), 7, 8)
    engine.scheduler.spec = spec
    try:
        speculated = [out["output_ids"] for out in engine.generate(PROMPTS, GREEDY)]
    finally:
        engine.scheduler.spec = None
    assert speculated == alone
    assert spec.totals.accepted_drafts > 0  # the list prompt copies: drafts were verified and kept
    assert engine.check_integrity()["ok"]


def test_compiled_steps_decode_as_eager_ones(alone):
    """A compiled batch-1 step gives the eager step's tokens, so a server that runs some shapes compiled and the
    rest eagerly (a batch size not captured, or one whose graph did not pay) decodes a prompt alike alone, batched
    and speculated: the compiled step's RMSNorm is Kiln's kernel as an opaque op, not inductor's own fused sum."""
    # the engine forbids recompiles once captured, for the whole process: later tests compile functions
    dynamo = torch._dynamo.config.patch(error_on_recompile=torch._dynamo.config.error_on_recompile)
    with pytest.MonkeyPatch.context() as mp, dynamo:
        mp.setattr(graph_runner, "MAX_SLOWDOWN", 1e9)  # keep the shape whatever its timing against eager
        compiled = kiln.Engine(cuda_graph_bs=(1,), cpu_gemm="auto")
        _check_compiled_against_eager(compiled, alone)


def _check_compiled_against_eager(compiled, alone) -> None:
    try:
        runner, graph_steps = compiled.scheduler.runner, []
        inner = type(runner).forward.__get__(runner)

        def forward(fb):
            out = inner(fb)
            graph_steps.append(runner.last_forward_graph)
            return out

        runner.forward = forward
        assert [compiled.generate(p, GREEDY)["output_ids"] for p in PROMPTS] == alone
        assert sum(graph_steps) >= len(PROMPTS) * (GREEDY["max_new_tokens"] - 1)  # every decode step compiled
        compiled.scheduler.spec = SpecDecoder(NgramDrafter(), 7, 8)  # verify rows: eager batches of up to 8
        assert [out["output_ids"] for out in compiled.generate(PROMPTS, GREEDY)] == alone
    finally:
        compiled.shutdown()
