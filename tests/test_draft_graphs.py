"""Speculative decoding with graphs on (on the CPU: compiled steps): the target's verify shapes are captured with
its decode ones, every captured target step hands out the hidden states an EAGLE head reads (equal to eager's),
the head's own decode steps are captured with its features as an input, and greedy output equals graphs off.
One engine with compiled steps, at batch size 1 only (compiling is the cost here), and one on the CUDA backend's
buffers with capture replaced by re-running the step (nothing compiled)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model
from test_draft_models import PROMPTS, save_deepseek_with_mtp, save_head, save_seven_layer_llama

import kiln
from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.runner import graph_runner
from kiln.runner.graph_backends import BreakablePrefill, CudaGraphDecode
from kiln.runner.graph_runner import verify_rows

pytestmark = pytest.mark.engine

NEW_TOKENS = 10
STEPS = 2  # EAGLE drafts a chain of 2: 3 verify rows per request, one draft decode step after the catch-up
ARGS = dict(max_total_tokens=4096, max_running_requests=4, num_threads=1)
SPEC = dict(speculative_algorithm="EAGLE", speculative_num_steps=STEPS)
# prompts whose first catch-up (every token but the first, and the first new one) is above a head's captured rows
LONG_PROMPTS = sum(len(p) > STEPS + 1 for p in PROMPTS)


@pytest.mark.unit
def test_verify_shapes_are_the_batch_sizes_times_the_draft_tokens() -> None:
    assert verify_rows([1, 2, 4], 3) == [3, 6, 12]
    assert verify_rows([1, 2, 4], 2) == [8]  # 2 and 4 rows are decode shapes already
    assert verify_rows([1, 2], 0) == [] and verify_rows([1, 2], 1) == []
    assert verify_rows([1, 2, 4, 8], 3, most=8) == [3, 6]  # CUDA: within the largest decode graph's rows


@pytest.mark.unit
def test_a_heads_catch_up_shapes_are_sized_by_their_requests() -> None:
    """A catch-up shape holds num_steps + 1 rows per request and computes logits at one row per request: a batch
    takes the shape of its requests (4 catch-ups of 1 token each need the 12-row shape), its logits rows go in
    padded with row 0, and the rows of the eager forward come out."""
    from kiln.core.graph_shapes import catch_up_rows
    from kiln.runner.graph_backends import LogitsRows, dummy_decode_inputs

    assert catch_up_rows([1, 2, 4], 3) == [3, 6, 12] and catch_up_rows([1, 2, 4], 3, most=4) == [3]
    ids, pos, loc, table, mask = dummy_decode_inputs(4, 8, "cpu")
    fb = ForwardBatch(
        ForwardMode.DECODE, ids, pos, loc, torch.tensor([0, 1, 2, 3]), kv_table=table, kv_mask=mask
    )
    rows = LogitsRows(3)
    assert rows.rows_for(fb) == 12 and rows.count(12) == 4
    assert rows.rows_for(replace(fb, logits_index=torch.tensor([1, 3]))) == 6
    assert rows.rows_for(replace(fb, logits_index=None)) == 0  # every row's logits: not a catch-up shape
    assert rows.index(9, "cpu", replace(fb, logits_index=torch.tensor([1, 3]))).tolist() == [1, 3, 0]
    logits, hidden = torch.arange(3.0).unsqueeze(1), torch.arange(3.0).unsqueeze(1) + 10
    picked = rows.select((logits, hidden), replace(fb, logits_index=torch.tensor([1, 3])))
    assert picked[0].flatten().tolist() == [0.0, 1.0] and picked[1].flatten().tolist() == [10.0, 11.0]
    every = LogitsRows()  # a decode or verify step: a batch that wants every row's logits
    assert every.rows_for(fb) == 4 and every.rows_for(replace(fb, logits_index=None)) == 4
    assert every.rows_for(replace(fb, logits_index=torch.tensor([1, 3]))) == 0  # a catch-up: not this step
    assert every.index(4, "cpu", fb) is None
    padded = torch.arange(6.0).unsqueeze(1)
    assert every.select((padded, None), fb)[0].flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> tuple[Path, str]:
    target = build_tiny_model("llama", tmp_path_factory.mktemp("target"))
    return target, save_head(tmp_path_factory.mktemp("head") / "head", target, eagle3=False)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.unit
def test_the_ledger_counts_the_verify_shapes_and_the_draft_steps(paths, device) -> None:
    """`kiln plan` and serve reserve for the graphs speculation adds: the target's verify shapes (on CUDA those
    within the largest decode graph's rows), the draft's decode steps and a head's catch-ups (each size x
    num_steps + 1 rows, on CUDA within the same rows), on CUDA with the draft graphs' buffers; NGRAM has no
    draft steps."""
    from kiln.config import ServerArgs
    from kiln.memory.graph_budget import (
        CPU_COMPILED_STEP_BYTES,
        CUDA_BYTES_PER_FUSED_GRAPH,
        CUDA_BYTES_PER_GRAPH,
    )
    from kiln.scheduler.resolve import plan_ledger

    target, head = paths
    base = dict(model_path=str(target), device=device, device_memory="16GiB", cuda_graph_bs=(1, 2, 4))
    plain = plan_ledger(ServerArgs(**base)).ledger
    eagle_plan = plan_ledger(ServerArgs(**base, **SPEC, speculative_draft_model_path=head))
    eagle = eagle_plan.ledger
    per_graph = CUDA_BYTES_PER_FUSED_GRAPH if eagle_plan.inputs.fused_step_kernels else CUDA_BYTES_PER_GRAPH
    ngram = plan_ledger(ServerArgs(**base, speculative_algorithm="NGRAM", speculative_eagle_topk=1)).ledger
    line = eagle.line("graph reserve").inputs
    config = json.loads((target / "config.json").read_text())
    if device == "cpu":  # 3 x 3 verify rows: 3, 6, 12; the head's decode steps 1, 2, 4 and catch-ups 3, 6, 12
        assert "3 verify shapes + 6 draft steps" in line
        assert eagle.graph_reserve_bytes - plain.graph_reserve_bytes == 9 * CPU_COMPILED_STEP_BYTES
        # a chain of 12 tokens: 12, 24 and 48 rows
        assert ngram.graph_reserve_bytes - plain.graph_reserve_bytes == 3 * CPU_COMPILED_STEP_BYTES
    else:  # within 4 rows: verify 3, the head's decode steps 1, 2, 4 and catch-up 3
        extra = eagle.graph_reserve_bytes - plain.graph_reserve_bytes
        head_steps, catch_up = draft_graph_bytes(config, 4, 4), draft_graph_bytes(config, 3, 1)
        assert extra == (1 + 3 + 1) * per_graph + head_steps + catch_up
        assert f"draft steps {(head_steps + catch_up) / 2**20:.0f} MiB" in line
    # a draft model's catch-up extends on the prefill pieces up to the one holding 4 x 3 tokens: 4, 8 and 16
    pieces = dict(base, cuda_graph_bs_prefill=(4, 8, 16, 32))
    standalone = dict(
        speculative_algorithm="STANDALONE",
        speculative_num_steps=STEPS,
        speculative_draft_model_path=str(target),
    )
    without = plan_ledger(ServerArgs(**pieces)).ledger
    drafting = plan_ledger(ServerArgs(**pieces, **standalone)).ledger
    extra = drafting.graph_reserve_bytes - without.graph_reserve_bytes
    if device == "cpu":
        assert extra == (3 + 3 + 3) * CPU_COMPILED_STEP_BYTES  # verify shapes, decode steps, extends
    else:  # and the draft's decode steps' largest graph, 4 rows
        graphs = 1 + 3 + 3 * config["num_hidden_layers"] * 2
        assert extra == graphs * per_graph + draft_graph_bytes(config, 4, 4)


def draft_graph_bytes(config: dict, rows: int, logits_rows: int) -> int:
    """A CUDA draft graph's buffers as the ledger counts them, for a draft of `config`'s dimensions (the head's
    and the draft model here are the target's): logits at `logits_rows` rows (static and graph), one layer's K and
    V gathered for `rows` rows at the graphs' KV width, bfloat16."""
    from kiln.core.graph_shapes import CUDA_GRAPH_KV_WIDTH

    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_row = 2 * config["num_key_value_heads"] * head_dim * 2
    width = min(config["max_position_embeddings"], CUDA_GRAPH_KV_WIDTH)
    return 2 * logits_rows * config["vocab_size"] * 4 + rows * width * kv_row


@pytest.mark.unit
def test_the_ledger_counts_a_heads_guess_slots(paths) -> None:
    """An EAGLE head's pool mirrors the target's slots (counted per token with the pool) and holds every running
    request's guesses above them: topk x (steps + 1) slots of the head's KV each, a line the headroom pays for. A
    draft model (STANDALONE) drafts within its pool's tokens, so it has no such line."""
    from kiln.config import ServerArgs
    from kiln.scheduler.resolve import plan_ledger

    target, head = paths
    base = dict(model_path=str(target), device="cpu", device_memory="16GiB", max_running_requests=4)
    plain = plan_ledger(ServerArgs(**base)).ledger
    chain = plan_ledger(ServerArgs(**base, **SPEC, speculative_draft_model_path=head)).ledger
    tree = plan_ledger(
        ServerArgs(**base, **SPEC, speculative_draft_model_path=head, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=4)
    ).ledger  # fmt: skip
    head_bytes_per_token = chain.kv_bytes_per_token - plain.kv_bytes_per_token
    assert head_bytes_per_token > 0
    for ledger, topk in ((chain, 1), (tree, 2)):
        guesses = ledger.line("draft guess slots")
        assert guesses.bytes == 4 * topk * (STEPS + 1) * head_bytes_per_token, guesses
        assert f"4 requests x {topk * (STEPS + 1)} guesses" in guesses.inputs
    # a chain drafts num_draft_tokens - 1 steps, as the head is built: one step here, two guesses a request
    short = plan_ledger(
        ServerArgs(**base, **SPEC, speculative_draft_model_path=head, speculative_num_draft_tokens=2)
    ).ledger
    assert short.line("draft guess slots").bytes == 4 * 2 * head_bytes_per_token
    standalone = dict(
        speculative_algorithm="STANDALONE",
        speculative_num_steps=STEPS,
        speculative_draft_model_path=str(target),
    )
    assert not plan_ledger(ServerArgs(**base, **standalone)).ledger.has_line("draft guess slots")


class Recorder:
    """Wraps a runner's forward: each decode step's rows and whether a graph ran it; for the target, the hidden
    states eager decoding hands out for the same batch, computed just before (the replayed step then rewrites
    the same KV slots, so the run goes on as it would have)."""

    def __init__(self, runner, check_hidden: bool):
        self.runner, self.check_hidden = runner, check_hidden
        self.decodes: list[tuple[int, bool]] = []
        self.extends: list[tuple[int, bool]] = []  # (tokens, ran on prefill pieces)
        self.hidden_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.inner = type(runner).forward.__get__(runner)
        runner.forward = self.forward

    def forward(self, fb):
        eager = self._eager_hidden(fb) if self.check_hidden and fb.mode == ForwardMode.DECODE else None
        logits = self.inner(fb)
        if fb.mode == ForwardMode.EXTEND:
            self.extends.append((int(fb.input_ids.shape[0]), self.runner.last_forward_graph))
        elif fb.mode == ForwardMode.DECODE:
            self.decodes.append((fb.kv_table.shape[0], self.runner.last_forward_graph))
            if self.runner.last_forward_graph:
                self.hidden_pairs.append((self.runner.last_hidden, eager))
        return logits

    def _eager_hidden(self, fb) -> torch.Tensor:
        with torch.inference_mode():
            self.runner.model(replace(fb, attn=self.runner.attn_backend.prepare_metadata(fb)))
        return self.runner.model.last_hidden.clone()


def generate(eng) -> list[list[int]]:
    """One request at a time: the captured shapes are batch size 1 and its verify rows."""
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    return [eng.generate(input_ids=p, sampling_params=params)["output_ids"] for p in PROMPTS]


def generate_drafting(eng) -> tuple[list[list[int]], list]:
    """generate's outputs and every draft the drafter proposed, in order."""
    drafter, proposals = eng.scheduler.spec.drafter, []
    propose = drafter.propose

    def recording(inputs):
        drafts = propose(inputs)
        proposals.extend(drafts)
        return drafts

    drafter.propose = recording
    return generate(eng), proposals


@pytest.fixture(scope="module")
def eager(paths) -> tuple[list[list[int]], list]:
    """Greedy outputs with graphs off and the head's drafts."""
    target, head = paths
    eng = kiln.Engine(model_path=str(target), **ARGS, **SPEC, speculative_draft_model_path=head,
                      disable_cuda_graph=True)  # fmt: skip
    try:
        return generate_drafting(eng)
    finally:
        eng.shutdown()


class Lines(logging.Handler):
    """The messages logged while attached."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def graphs(paths):
    """The engine with graphs on, and the lines its startup logged."""
    target, head = paths
    lines, logger = Lines(), logging.getLogger("kiln")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as mp:
            # keep every shape, untimed: on a tiny model the payoff is noise
            mp.setattr(graph_runner, "_time_pair", lambda graph, eager: (graph(), eager(), (1.0, 1.0))[-1])
            eng = kiln.Engine(
                model_path=str(target), **ARGS, **SPEC, speculative_draft_model_path=head, cuda_graph_bs=(1,),
            )  # fmt: skip
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    yield eng, lines.lines
    eng.shutdown()


def assert_hidden_as_eager(steps: Recorder) -> None:
    """Every hidden state a captured step handed out equals what the eager step computes (shape included)."""
    for hidden, expected in steps.hidden_pairs:
        torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)


def test_eagle_with_graphs_matches_graphs_off(graphs, eager) -> None:
    eng, _ = graphs
    target_runner = eng.scheduler.runner
    drafter = eng.scheduler.spec.drafter
    assert target_runner.graphs.captured("verify") == [STEPS + 1]  # bs 1 x num_draft_tokens
    assert target_runner.graphs.captured("decode") == [1]
    assert drafter.runner.graphs.captured("decode") == [1]  # the head's own steps, features as an input
    assert drafter.runner.graphs.captured("extend") == [STEPS + 1]  # its catch-ups, the target's features in
    from kiln.scheduler.engine_proc import _draft_graphs

    assert _draft_graphs(eng.scheduler.spec)["decode"]["captured"] == [1]  # /status's draft_graphs
    target = Recorder(target_runner, check_hidden=True)
    draft = Recorder(drafter.runner, check_hidden=False)
    # the replayed target steps handed the head its hidden states, and its replayed catch-ups and steps drafted
    # what it drafts without graphs
    assert generate_drafting(eng) == eager and any(eager[1])
    assert (STEPS + 1, True) in target.decodes and (1, True) in draft.decodes
    # the head's catch-ups after each verify are decode rows on captured shapes; only a prompt longer than the
    # captured rows (its catch-up is the prompt's tokens after the first and the first new one) is an extend
    assert all(graph for _, graph in draft.decodes) and len(draft.extends) == LONG_PROMPTS
    assert target.hidden_pairs
    assert_hidden_as_eager(target)


def test_capture_logs_name_the_verify_and_draft_shapes(graphs) -> None:
    """SGLang's lines: the target's verify capture with its num_tokens_per_req, its decode capture, then the
    draft's begin line that operators watch for."""
    text = "\n".join(graphs[1])
    verify = (
        f"Capture target verify CPU graph begin. backend=inductor, num_tokens_per_req={STEPS + 1}, bs=[1]"
    )
    assert verify in text
    assert "Capture target decode CPU graph begin. backend=inductor, num_tokens_per_req=1, bs=[1]" in text
    draft = "Capture draft cpu graph begin. This can take up to several minutes. avail mem="
    assert draft in text and "num_tokens_per_req=1, bs=[1]" in text.split(draft)[1]
    extend = "Capture draft extend cpu graph begin. This can take up to several minutes. avail mem="
    assert extend in text and f"num_tokens_per_req={STEPS + 1}, bs=[1]" in text.split(extend)[1]
    assert "Capture draft extend cpu graph end." in text


def _replaying_capture(fn, pool):
    """Stands in for CUDA graph capture on the CPU: a replay runs fn again, so what is tested is what the CUDA
    backend adds around its graphs: the static buffers (a head's features in, hidden states out) and padding."""
    fn()
    return fn, pool


def replaying_engine(target, max_bs: int, prefill: bool = False, **kwargs) -> kiln.Engine:
    """An engine on the CUDA backends' buffers (decode, and prefill pieces when asked) with capture replaced by
    re-running the captured function."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            graph_runner,
            "CompiledDecode",
            lambda model, attn, device, **kw: CudaGraphDecode(
                model, device, max_bs, 512, _replaying_capture, **kw
            ),
        )
        if prefill:
            mp.setattr(graph_runner, "CompiledPrefill",
                       lambda model, attn, device: BreakablePrefill(model, attn, device, _replaying_capture))  # fmt: skip
        return kiln.Engine(model_path=str(target), **ARGS, **kwargs)


def test_cuda_graph_buffers_hand_out_hidden_states_and_take_features(paths, eager) -> None:
    """The CUDA decode backend for the target (decode and verify rows) and the EAGLE head, with capture replaced
    by re-running the captured function: eager's tokens and drafts, the hidden states eager hands out."""
    target, head = paths
    eng = replaying_engine(target, 8, **SPEC, speculative_draft_model_path=head, cuda_graph_bs=(1, 2))
    try:
        drafter = eng.scheduler.spec.drafter
        assert eng.scheduler.runner.graphs.captured("verify") == [3, 6]
        assert drafter.runner.graphs.captured("decode") == [1, 2]
        target_steps = Recorder(eng.scheduler.runner, check_hidden=True)
        draft_steps = Recorder(drafter.runner, check_hidden=False)
        assert generate_drafting(eng) == eager
        assert (STEPS + 1, True) in target_steps.decodes and (1, True) in draft_steps.decodes
        assert_hidden_as_eager(target_steps)
    finally:
        eng.shutdown()


def test_an_eagle3_heads_catch_ups_replay_their_own_shapes(tmp_path) -> None:
    """EAGLE-3's catch-ups take the target's three hidden states, wider than the head's own that its decode steps
    take: they run on shapes of their own (batch sizes x num_steps + 1 rows), with the tokens of plain decoding.
    CUDA backends with capture replaced by re-running, as above; a target deep enough for EAGLE-3's layers."""
    target = save_seven_layer_llama(tmp_path / "target")
    head = save_head(tmp_path / "head3", target, eagle3=True)
    spec = dict(SPEC, speculative_algorithm="EAGLE3")
    off = kiln.Engine(model_path=str(target), **ARGS, **spec, speculative_draft_model_path=head,
                      disable_cuda_graph=True)  # fmt: skip
    try:
        expected = generate_drafting(off)
    finally:
        off.shutdown()
    eng = replaying_engine(target, 8, **spec, speculative_draft_model_path=head, cuda_graph_bs=(1, 2))
    try:
        graphs = eng.scheduler.spec.drafter.runner.graphs
        assert graphs.captured("decode") == [1, 2] and graphs.captured("extend") == [3, 6]
        width = json.loads((target / "config.json").read_text())["hidden_size"]
        assert graphs.phases["decode"].backend.feature_width == width
        assert graphs.phases["extend"].backend.feature_width == 3 * width
        replays: list[int] = []
        replay = graphs.phases["extend"].backend.replay
        graphs.phases["extend"].backend.replay = lambda bs, fb: (replays.append(bs), replay(bs, fb))[1]
        draft_steps = Recorder(eng.scheduler.spec.drafter.runner, check_hidden=False)
        assert generate_drafting(eng) == expected and any(expected[1])
        # a catch-up (one request at a time: 1 to 3 rows) replays the 3-row shape; nothing runs eagerly but the
        # catch-ups on longer prompts, extends
        assert replays and set(replays) == {3} and all(graph for _, graph in draft_steps.decodes)
        assert len(draft_steps.extends) == LONG_PROMPTS
    finally:
        eng.shutdown()


def test_nextn_catch_ups_replay_the_heads_shapes(tmp_path) -> None:
    """NEXTN, DeepSeek-V3's MTP layer (latent attention, experts) as the head: its decode steps and catch-ups are
    captured and replayed, drafting what it drafts without graphs. CUDA backends with capture replaced by
    re-running, as above."""
    target = save_deepseek_with_mtp(tmp_path / "deepseek")
    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=STEPS)
    off = kiln.Engine(model_path=str(target), **ARGS, **spec, disable_cuda_graph=True)
    try:
        expected = generate_drafting(off)
    finally:
        off.shutdown()
    eng = replaying_engine(target, 8, **spec, cuda_graph_bs=(1, 2))
    try:
        graphs = eng.scheduler.spec.drafter.runner.graphs
        assert graphs.captured("decode") == [1, 2] and graphs.captured("extend") == [3, 6]
        draft_steps = Recorder(eng.scheduler.spec.drafter.runner, check_hidden=False)
        assert generate_drafting(eng) == expected and any(expected[1])
        assert draft_steps.decodes and all(graph for _, graph in draft_steps.decodes)
        assert len(draft_steps.extends) == LONG_PROMPTS  # every other catch-up ran as decode rows
    finally:
        eng.shutdown()


def test_standalone_catch_up_extends_run_on_prefill_pieces(paths, eager) -> None:
    """A draft model's catch-up extends (1 + accepted tokens) take the prefill token counts up to the largest
    batch x num_draft_tokens; the target drafting for itself accepts every draft, so they are 3 tokens (padded to
    4) after the first. CUDA backends with capture replaced by re-running, as above."""
    target, _ = paths
    eng = replaying_engine(
        target, 8, prefill=True, speculative_algorithm="STANDALONE", speculative_num_steps=STEPS,
        speculative_draft_model_path=str(target), cuda_graph_bs=(1,), cuda_graph_bs_prefill=(4, 8),
    )  # fmt: skip
    try:
        draft_runner = eng.scheduler.spec.drafter.runner
        assert draft_runner.graphs.captured("prefill") == [4]  # 4 holds 1 x 3 tokens: 8 is not needed
        steps = Recorder(draft_runner, check_hidden=False)
        assert generate(eng) == eager[0]
        assert (STEPS + 1, True) in steps.extends
    finally:
        eng.shutdown()


def test_tree_drafts_capture_topk_rows_per_request(paths, eager) -> None:
    """A tree of topk 2: the head's decode steps run 2 rows per request (SGLang's draft decode graph's
    num_tokens_per_req), the target verifies num_draft_tokens rows per request; CUDA backends as above."""
    target, head = paths
    eng = replaying_engine(
        target, 16, speculative_algorithm="EAGLE", speculative_draft_model_path=head, speculative_num_steps=2,
        speculative_eagle_topk=2, speculative_num_draft_tokens=4, cuda_graph_bs=(1, 2),
    )  # fmt: skip
    try:
        drafter = eng.scheduler.spec.drafter
        assert eng.scheduler.runner.graphs.captured("verify") == [4, 8]
        assert drafter.runner.graphs.captured("decode") == [2, 4]
        target_steps = Recorder(eng.scheduler.runner, check_hidden=True)
        draft_steps = Recorder(drafter.runner, check_hidden=False)
        assert generate(eng) == eager[0]
        assert drafter.drafted_tokens > 0
        assert (4, True) in target_steps.decodes and (2, True) in draft_steps.decodes
        assert_hidden_as_eager(target_steps)
    finally:
        eng.shutdown()
