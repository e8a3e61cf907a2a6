"""Speculative decoding: the verify step keeps greedy output identical whatever the drafter proposes (NGRAM,
an always-wrong drafter, a random one, an oracle whose chains run past stop ids and max_new_tokens), with n > 1,
aborts, retraction, chunked prefill and radix hits, and the KV pool intact afterwards; speculative sampling
keeps the target distribution (a chi-square test through verify.py); the flags resolve and refuse as SGLang's."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

import kiln
from kiln.config import ServerArgs
from kiln.runner.sampler import SamplingRow, target_probs
from kiln.sampling_params import SamplingParams
from kiln.scheduler.io import AbortReq, GenerateReq, ReqOutput
from kiln.scheduler.spec_step import SpecDecoder
from kiln.speculative.base import Drafter, DraftInput
from kiln.speculative.ngram import NgramDrafter, longest_suffix_match
from kiln.speculative.settings import resolve
from kiln.speculative.verify import Chain, verify_sampled

pytestmark = pytest.mark.engine

NUM_DRAFT = 6
COPY_PROMPTS = [
    list(range(300, 340)) * 3,
    [7, 8, 9, 10, 11, 12] * 12 + [13, 14],
    list(range(1000, 1064)) + list(range(1000, 1030)),
]


class WrongDrafter:
    """Proposes a token the tiny model never picks, every time."""

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        return [[3] * item.num_draft for item in inputs]

    def accepted(self, rid, tokens, hidden) -> None:
        pass

    def release(self, rid) -> None:
        pass


class RandomDrafter(WrongDrafter):
    def __init__(self, vocab: int, seed: int = 0):
        self.rng, self.vocab = random.Random(seed), vocab

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        return [
            [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(0, item.num_draft))]
            for item in inputs
        ]


class OracleDrafter(WrongDrafter):
    """Proposes the plain-decoding continuation (known from a reference run): long chains, mostly accepted."""

    def __init__(self, references: dict[tuple[int, ...], list[int]]):
        self.references = references

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        out = []
        for item in inputs:
            for prompt, ref in self.references.items():
                n = len(prompt)
                if tuple(item.token_ids[:n]) == prompt:
                    done = len(item.token_ids) - n
                    out.append(ref[done : done + item.num_draft])
                    break
            else:
                out.append([])
        return out


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return kiln.Engine(
        model_path=tiny_llama,
        device="cpu",
        disable_cuda_graph=True,
        max_total_tokens=4096,
        chunked_prefill_size=64,
    )


def _run(
    engine,
    prompts,
    params: dict,
    drafter: Drafter | None,
    abort_after: int | None = None,
    num_draft: int = NUM_DRAFT,
    logprobs_out: list | None = None,
):
    """Outputs by prompt index (ids, last ReqOutput) through the scheduler, with `drafter` or without; each
    request's logprobs appended to `logprobs_out` when given."""
    sched = engine.scheduler
    sched.spec = SpecDecoder(drafter, num_draft, num_draft + 1) if drafter is not None else None
    rids = [f"r{i}-{random.random()}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts):
        sched.add_request(GenerateReq(rid, list(prompt), SamplingParams(**params).normalize()))
    ids: dict[str, list[int]] = {rid: [] for rid in rids}
    logprobs: dict[str, list] = {rid: [] for rid in rids}
    last: dict[str, ReqOutput] = {}
    steps = 0
    while sched.has_work:
        for out in sched.step():
            ids[out.rid].extend(out.new_ids)
            logprobs[out.rid].extend(out.logprobs or [])
            last[out.rid] = out
        steps += 1
        if abort_after is not None and steps == abort_after:
            sched.abort(AbortReq(rids[0]))
    report = sched.check_integrity()
    assert report["ok"], report
    spec, sched.spec = sched.spec, None
    if logprobs_out is not None:
        logprobs_out.extend(logprobs[r] for r in rids)
    return [ids[r] for r in rids], [last[r] for r in rids], spec


GREEDY = {"max_new_tokens": 24, "temperature": 0.0}


@pytest.fixture(scope="module")
def reference(engine):
    ids, _, _ = _run(engine, COPY_PROMPTS, GREEDY, None)
    return ids


def test_ngram_greedy_identical_and_accepts(engine, reference):
    ids, outs, spec = _run(engine, COPY_PROMPTS, GREEDY, NgramDrafter())
    assert ids == reference
    assert spec.accept_length() > 1.0
    assert all(o.spec_verify_ct > 0 for o in outs)
    meta = outs[0].spec_meta()
    assert meta["spec_accept_length"] == outs[0].completion_tokens / outs[0].spec_verify_ct > 1.0
    assert sum(o.spec_accepted_drafts for o in outs) == spec.totals.accepted_drafts > 0


def test_plain_overlap_and_speculative_steps_commit_through_one_function(engine, reference, tiny_llama):
    """Every token a request gains joins it in Scheduler.commit, called from Scheduler.update, whether a plain
    decode step sampled it, the overlap schedule's forward thread did, or a verify step accepted it from a draft: a
    token appended anywhere else fails the test, and what commit kept adds up to every request's output."""
    overlapped = kiln.Engine(
        model_path=tiny_llama, device="cpu", disable_cuda_graph=True, max_total_tokens=4096,
        chunked_prefill_size=64, enable_overlap_schedule=True,
    )  # fmt: skip
    assert overlapped.scheduler.forward_thread is not None  # decode steps launched one ahead
    for eng, drafter in ((engine, None), (engine, NgramDrafter()), (overlapped, None)):
        spy = CommitSpy(eng.scheduler)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(eng.scheduler, "commit", spy.commit)
            mp.setattr(eng.scheduler, "update", spy.update)
            mp.setattr(eng.scheduler.out, "append_token", spy.append_token)
            ids, _, spec = _run(eng, COPY_PROMPTS, GREEDY, drafter)
        assert ids == reference and sum(spy.kept) == sum(map(len, ids)), (drafter, spy.kept)
        assert drafter is None or (
            spec.totals.accepted_drafts > 0 and max(spy.kept) > 1
        )  # drafts in one call


class CommitSpy:
    """Scheduler.commit wrapped to note what each call kept, and the output processor's append_token wrapped
    to fail unless it runs inside commit, for the request being committed."""

    def __init__(self, sched):
        self.real_commit, self.real_append = sched.commit, sched.out.append_token
        self.real_update = sched.update
        self.updating = False
        self.inside: list = []
        self.kept: list[int] = []

    def update(self, plan, result) -> None:
        self.updating = True
        try:
            self.real_update(plan, result)
        finally:
            self.updating = False

    def commit(self, req, tokens, *args, **kwargs) -> int:
        assert self.updating, "a token was committed outside Scheduler.update"
        self.inside.append(req)
        try:
            self.kept.append(self.real_commit(req, tokens, *args, **kwargs))
        finally:
            self.inside.pop()
        return self.kept[-1]

    def append_token(self, req, *args):
        assert self.inside == [req], "a token joined a request outside Scheduler.commit"
        return self.real_append(req, *args)


def test_wrong_and_random_drafters_identical(engine, reference):
    vocab = engine.parts.model_config.vocab_size
    for drafter in (WrongDrafter(), RandomDrafter(vocab)):
        ids, _, _ = _run(engine, COPY_PROMPTS, GREEDY, drafter)
        assert ids == reference


def test_chains_cut_at_stop_ids_stop_strings_and_max_tokens(engine, reference):
    oracle = OracleDrafter({tuple(p): r for p, r in zip(COPY_PROMPTS, reference)})
    stop_id = reference[0][9]
    stop_text = engine.tokenizer.decode(reference[1][5:7])
    for params in (
        {"max_new_tokens": 13, "temperature": 0.0},
        {"max_new_tokens": 24, "temperature": 0.0, "stop_token_ids": [stop_id]},
        {"max_new_tokens": 24, "temperature": 0.0, "stop": [stop_text]},
        {"max_new_tokens": 24, "temperature": 0.0, "min_new_tokens": 12, "stop_token_ids": [stop_id]},
    ):
        plain, plain_outs, _ = _run(engine, COPY_PROMPTS, params, None)
        ids, outs, spec = _run(engine, COPY_PROMPTS, params, oracle)
        assert ids == plain, params
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in plain_outs]
        assert spec.accept_length() > 2.0


def test_n_samples_abort_and_radix_hits(engine, reference):
    # n > 1 through the fan-out: every sample greedy, so each equals the reference
    engine.scheduler.spec = SpecDecoder(NgramDrafter(), NUM_DRAFT, NUM_DRAFT + 1)
    try:
        samples = engine.generate(input_ids=COPY_PROMPTS[0], sampling_params={**GREEDY, "n": 2})
    finally:
        engine.scheduler.spec = None
    assert [s["output_ids"] for s in samples] == [reference[0]] * 2
    # an abort mid-stream; the others still match, and the prompts now hit the radix cache
    ids, outs, _ = _run(engine, COPY_PROMPTS, GREEDY, NgramDrafter(), abort_after=6)
    assert outs[0].finish_reason["type"] == "abort"
    assert ids[1:] == reference[1:]
    assert all(o.cached_tokens > 0 for o in outs[1:])


def test_retraction_on_a_tiny_pool(tiny_llama):
    small = kiln.Engine(
        model_path=tiny_llama,
        device="cpu",
        disable_cuda_graph=True,
        max_total_tokens=200,
        chunked_prefill_size=32,
    )
    prompts = [[50 + k, 60 + k, 70, 80, 50 + k, 60 + k, 70, 80, 90 + k] for k in range(8)]
    params = {"max_new_tokens": 40, "temperature": 0.0}
    ids, outs, _ = _run(small, prompts, params, NgramDrafter())  # first, on the cold pool, where it retracts
    assert small.scheduler.counters.retracted > 0
    assert sum(o.num_retractions for o in outs) > 0
    plain, _, _ = _run(small, prompts, params, None)
    assert ids == plain


def test_paged_pool_frees_whole_pages_only(tiny_llama, reference):
    paged = kiln.Engine(
        model_path=tiny_llama, device="cpu", disable_cuda_graph=True, max_total_tokens=2048, page_size=4
    )
    ids, _, _ = _run(paged, COPY_PROMPTS, GREEDY, RandomDrafter(paged.parts.model_config.vocab_size))
    assert ids == reference  # _run checked the pool's integrity after the run


def test_sampling_runs_and_is_seeded(engine):
    params = {"max_new_tokens": 24, "temperature": 0.8, "top_p": 0.9, "seed": 5}
    first, _, _ = _run(engine, COPY_PROMPTS[:2], params, NgramDrafter())
    again, _, _ = _run(engine, COPY_PROMPTS[:2], params, NgramDrafter())
    assert first == again and all(len(x) == 24 for x in first)


# ---------------------------------------------------------------------------------------------- verify.py
def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert int(counts[~keep].sum()) == 0, "drew a token of zero probability"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("draft_kind", ["point", "distribution"])
@pytest.mark.unit
def test_speculative_sampling_keeps_the_target_distribution(draft_kind):
    vocab, trials = 6, 3000
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=0.9, top_k=5).normalize()
    generator = torch.Generator().manual_seed(1)
    rows = [SamplingRow(params, generator, [1, 2], [3] * j) for j in range(3)]
    target = target_probs(logits, rows)[0]
    draft_probs = torch.softmax(torch.randn(2, vocab), -1) if draft_kind == "distribution" else None
    counts = torch.zeros(vocab)
    draft_rng = torch.Generator().manual_seed(2)
    accepted = 0
    for _ in range(trials):
        if draft_probs is None:
            draft = [int(torch.argmax(target)), 2]  # a fixed proposal, like NGRAM's
        else:
            draft = [int(torch.multinomial(draft_probs[j], 1, generator=draft_rng)) for j in range(2)]
        verdict = verify_sampled(Chain(logits, rows, draft, draft_probs))
        counts[verdict.tokens[0]] += 1
        accepted += verdict.accepted
    assert accepted > 0
    # 5 degrees of freedom at most; 20.5 is the 0.999 quantile
    assert _chi_square(counts, target) < 20.5


@pytest.mark.unit
def test_target_probs_follow_the_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    row = SamplingRow(SamplingParams(temperature=1.0, top_k=2).normalize(), None, [], [])
    probs = target_probs(logits, [row])[0]
    assert probs[2:].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
    greedy = SamplingRow(SamplingParams(temperature=0.0).normalize(), None, [], [])
    assert target_probs(logits, [greedy])[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.unit
def test_ngram_matches_the_longest_recent_suffix():
    import numpy as np

    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3])
    start, length = longest_suffix_match(tokens, 1, 12)
    assert (start, length) == (7, 3)  # the most recent "1 2 3" is followed by 4 5
    drafter = NgramDrafter(patience=2)
    item = DraftInput("a", tokens.tolist(), 4)
    assert drafter.propose([item]) == [[4, 5, 1, 2]]
    for _ in range(2):  # nothing accepted twice: the drafter backs off
        drafter.propose([item])
        drafter.accepted("a", [7], None)
    assert drafter.propose([item]) == [[]]


@pytest.mark.unit
def test_ngram_draft_length_follows_acceptance():
    """A request proposes FIRST_BUDGET drafts, twice as many after a step that kept them all (never past the
    step's room), and the accepted count plus one after a step that rejected some."""
    from kiln.speculative.ngram import FIRST_BUDGET

    copy = list(range(100, 140))
    item = DraftInput("a", copy + copy[:5], 11)
    drafter = NgramDrafter()
    lengths = []
    for accepted in (FIRST_BUDGET, 2 * FIRST_BUDGET, 2, 0):
        (draft,) = drafter.propose([item])
        lengths.append(len(draft))
        drafter.accepted("a", draft[:accepted] + [0], None)
    assert lengths == [FIRST_BUDGET, 2 * FIRST_BUDGET, 11, 3]
    assert len(drafter.propose([item])[0]) == 1


# ---------------------------------------------------------------------------------------------- flags
def _args(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli(parser.parse_args(list(argv)))


@pytest.mark.unit
def test_flags_resolve_with_sglang_defaults():
    ngram = resolve(_args("--speculative-algorithm", "ngram"), "LlamaForCausalLM")
    assert (ngram.algorithm, ngram.num_draft_tokens, ngram.num_steps, ngram.topk) == ("NGRAM", 12, 1, 10)
    eagle = resolve(
        _args("--speculative-algorithm", "EAGLE", "--speculative-draft-model", "d"), "LlamaForCausalLM"
    )
    assert (eagle.num_steps, eagle.topk, eagle.num_draft_tokens) == (5, 4, 8)
    other = resolve(_args("--speculative-algorithm", "NEXTN"), "DeepseekV3ForCausalLM")
    assert (other.num_steps, other.num_draft_tokens) == (3, 4)
    assert resolve(_args(), "LlamaForCausalLM") is None


@pytest.mark.unit
def test_flags_refused_naming_the_range():
    with pytest.raises(ValueError, match="--speculative-eagle-topk 0 must be >= 1"):
        resolve(_args("--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "0"), "x")
    with pytest.raises(ValueError, match=r"--speculative-num-draft-tokens 9 .* valid range is 2\.\.4"):
        resolve(
            _args(
                "--speculative-algorithm",
                "NGRAM",
                "--speculative-eagle-topk",
                "1",  # a chain: 3 steps make 4 tokens at most
                "--speculative-num-steps",
                "3",
                "--speculative-num-draft-tokens",
                "9",
            ),
            "x",
        )
    with pytest.raises(ValueError, match="STANDALONE needs --speculative-draft-model-path"):
        resolve(_args("--speculative-algorithm", "STANDALONE"), "x")
