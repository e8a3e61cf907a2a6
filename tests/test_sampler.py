"""Sampler: greedy, filtering, seeds, penalties, bans, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.runner import sampler
from kiln.runner.sampler import SamplingRow, apply_penalties, argmax_ids, process_logits, sample
from kiln.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

V = 1000


def row(seed: int | None = 0, prompt=(), output=(), banned=(), **kw) -> SamplingRow:
    p = SamplingParams(seed=seed, **kw)
    gen = (
        None
        if p.is_greedy and seed is None
        else torch.Generator().manual_seed(seed if seed is not None else 0)
    )
    return SamplingRow(p, gen, list(prompt), list(output), list(banned))


def rand_logits(b: int, v: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def freqs(tokens: list[int], n: int) -> list[float]:
    return [tokens.count(i) / len(tokens) for i in range(n)]


def draw_many(probs: list[float], n: int = 2000, seed: int = 1234, **kw) -> list[float]:
    """n draws (n rows sharing one seeded generator) from logits log(probs)."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    gen = torch.Generator().manual_seed(seed)
    rows = [SamplingRow(SamplingParams(**kw), gen, [], []) for _ in range(n)]
    return freqs(sample(logits, rows).next_token_ids, len(probs))


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 9), seed=st.integers(0, 2**31 - 1), ties=st.booleans())
def test_greedy_equals_argmax(b, seed, ties):
    logits = rand_logits(b, seed=seed)
    if ties:
        logits = logits.round()  # many equal maxima: the first index must win
    expected = torch.argmax(logits, -1).tolist()
    assert argmax_ids(logits) == expected
    assert sample(logits, [row(None, temperature=0.0) for _ in range(b)]).next_token_ids == expected
    assert sample(logits, [row(seed + i, top_k=1) for i in range(b)]).next_token_ids == expected
    # a greedy row in a mixed batch still takes the argmax
    mixed = [row(i, temperature=0.0) if i % 2 else row(i) for i in range(b)]
    got = sample(logits, mixed).next_token_ids
    assert [got[i] for i in range(1, b, 2)] == [expected[i] for i in range(1, b, 2)]


def test_argmax_nan_and_bf16_match_torch():
    logits = rand_logits(3)
    logits[1, 7] = float("nan")
    assert argmax_ids(logits) == torch.argmax(logits, -1).tolist()
    half = rand_logits(2).bfloat16()
    assert argmax_ids(half) == torch.argmax(half, -1).tolist()


def test_greedy_uses_processed_logits():
    logits = rand_logits(2)
    top = torch.argmax(logits, -1).tolist()
    rows = [row(None, temperature=0.0, banned=[top[0]]), row(None, temperature=0.0, logit_bias={5: 100.0})]
    processed = process_logits(logits, rows)
    out = sample(logits, rows).next_token_ids
    assert out == torch.argmax(processed, -1).tolist()
    assert out[0] != top[0] and out[1] == 5


def test_seed_reproducible_across_batch_compositions():
    def run(batch_of) -> list[int]:
        gen = torch.Generator().manual_seed(42)
        target = SamplingRow(SamplingParams(temperature=0.9, top_p=0.95, top_k=40), gen, [1, 2], [])
        toks = []
        for step in range(12):
            logits, rows, at = batch_of(step, target)
            toks.append(sample(logits, rows).next_token_ids[at])
            target.output_ids = [*target.output_ids, toks[-1]]
        return toks

    def alone(step, target):
        return rand_logits(1, seed=step), [target], 0

    def crowded(step, target):
        others = [row(100 + step), row(7, temperature=0.0), row(3, top_p=0.5, min_p=0.1), row(9, top_k=3)]
        logits = torch.cat(
            [rand_logits(2, seed=1000 + step), rand_logits(1, seed=step), rand_logits(2, seed=step)]
        )
        return logits, [others[0], others[1], target, others[2], others[3]], 2

    first = run(alone)
    assert run(crowded) == first
    assert len(set(first)) > 3  # really sampled, not collapsed to argmax
    other = SamplingRow(
        SamplingParams(temperature=0.9, top_p=0.95, top_k=40), torch.Generator().manual_seed(43), [], []
    )
    assert [sample(rand_logits(1, seed=s), [other]).next_token_ids[0] for s in range(12)] != first


def test_tiny_top_p_and_full_min_p_give_argmax():
    logits = rand_logits(16, seed=5)
    expected = torch.argmax(logits, -1).tolist()
    assert sample(logits, [row(i, top_p=1e-6) for i in range(16)]).next_token_ids == expected
    assert sample(logits, [row(i, min_p=1.0) for i in range(16)]).next_token_ids == expected


def test_a_temperature_below_sglangs_epsilon_is_greedy():
    """4.2e-153 (found by the OpenAPI fuzzing) divided the logits into inf and sampled NaN: as SGLang, a
    temperature below 1e-6 decodes greedily."""
    logits = rand_logits(16, seed=7)
    expected = torch.argmax(logits, -1).tolist()
    for temperature in (4.2e-153, 1e-7):
        assert sample(logits, [row(i, temperature=temperature) for i in range(16)]).next_token_ids == expected
    assert not SamplingParams(temperature=1e-6).is_greedy


def test_top_k_restricts_to_k_best():
    logits = rand_logits(1, seed=3).expand(300, -1).contiguous()
    gen = torch.Generator().manual_seed(0)
    rows = [SamplingRow(SamplingParams(top_k=5, temperature=5.0), gen, [], []) for _ in range(300)]
    got = set(sample(logits, rows).next_token_ids)
    assert got <= set(logits[0].topk(5).indices.tolist()) and len(got) == 5


def test_distribution_matches_probabilities():
    probs = [0.1, 0.2, 0.3, 0.4]
    for got, want in zip(draw_many(probs), probs, strict=True):
        assert abs(got - want) < 0.03
    # temperature 0.5 squares the probabilities
    sq = [p * p for p in probs]
    want_t = [p / sum(sq) for p in sq]
    for got, want in zip(draw_many(probs, temperature=0.5), want_t, strict=True):
        assert abs(got - want) < 0.03
    # temperature 2 flattens them toward sqrt(p)
    rt = [math.sqrt(p) for p in probs]
    for got, want in zip(draw_many(probs, temperature=2.0), [p / sum(rt) for p in rt], strict=True):
        assert abs(got - want) < 0.03


@pytest.mark.parametrize(
    "kw,want",
    [
        ({"top_p": 0.65}, [0.0, 0.0, 3 / 7, 4 / 7]),  # mass before 0.3 is 0.4 < 0.65; before 0.2 is 0.7
        ({"top_p": 0.75}, [0.0, 2 / 9, 3 / 9, 4 / 9]),  # before 0.1 is 0.9
        ({"top_k": 2}, [0.0, 0.0, 3 / 7, 4 / 7]),
        ({"min_p": 0.6}, [0.0, 0.0, 3 / 7, 4 / 7]),  # keeps p >= 0.6 * 0.4
        ({"min_p": 0.45}, [0.0, 2 / 9, 3 / 9, 4 / 9]),
        ({"top_k": 3, "top_p": 0.65}, [0.0, 0.0, 3 / 7, 4 / 7]),
    ],
)
def test_filters_on_a_four_way_distribution(kw, want):
    got = draw_many([0.1, 0.2, 0.3, 0.4], **kw)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) < 0.035, (got, want)
        if w == 0.0:
            assert g == 0.0


def test_penalties_change_logits_exactly():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0], [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    rows = [
        row(
            0,
            prompt=[0, 1],
            output=[1, 3, 3],
            repetition_penalty=2.0,
            frequency_penalty=0.5,
            presence_penalty=0.25,
        ),
        row(0, prompt=[4], output=[4, 2, 4], frequency_penalty=-0.5),
    ]
    out = apply_penalties(logits.clone(), rows)
    # row 0: repetition over {0, 1, 3}; then counts {1: 1, 3: 2} over the output only
    assert out[0].tolist() == [1.0, -2.0 - 0.5 - 0.25, 0.5, 1.5 - 1.0 - 0.25, -2.0, 0.0]
    # row 1: no repetition penalty; negative frequency penalty raises repeated output tokens
    assert out[1].tolist() == [2.0, -1.0, 1.0, 3.0, -1.0, 0.0]


def test_process_logits_order_bias_then_penalty_then_ban():
    logits = torch.tensor([[1.0, -1.0, 0.5, 3.0]])
    r = row(0, prompt=[0], output=[1], banned=[3], repetition_penalty=2.0, logit_bias={0: 1.0, 1: 3.0})
    out = process_logits(logits, [r])
    # 1 + 1 = 2 -> /2 = 1; -1 + 3 = 2 -> /2 = 1; untouched; banned
    assert out[0].tolist() == [1.0, 1.0, 0.5, float("-inf")]
    assert logits.tolist() == [[1.0, -1.0, 0.5, 3.0]]  # input untouched


def test_sample_does_not_mutate_input():
    logits = rand_logits(3)
    before = logits.clone()
    rows = [row(0, output=[1, 2], repetition_penalty=1.5, banned=[4]), row(None, temperature=0.0), row(2)]
    sample(logits, rows)
    assert torch.equal(logits, before)


def test_banned_ids_never_chosen():
    logits = torch.zeros(400, 8)
    logits[:, 2] = 10.0  # would win almost every draw
    gen = torch.Generator().manual_seed(0)
    rows = [SamplingRow(SamplingParams(), gen, [], [], banned_ids=[2, 5]) for _ in range(400)]
    got = sample(logits, rows).next_token_ids
    assert not {2, 5} & set(got) and len(set(got)) == 6
    greedy = sample(logits[:1], [row(None, temperature=0.0, banned=[2])]).next_token_ids
    assert greedy == [0]


def test_logprobs_equal_log_softmax_of_raw_logits():
    logits = rand_logits(4, seed=9)
    rows = [
        row(
            1,
            logprobs=True,
            top_logprobs_num=5,
            temperature=0.7,
            repetition_penalty=1.3,
            output=[3],
            logit_bias={7: 30.0},
        ),
        row(None, temperature=0.0),
        row(None, temperature=0.0, top_logprobs_num=3),
        row(4, logprobs=True),
    ]
    out = sample(logits, rows)
    ref = torch.log_softmax(logits, -1)
    for i in (0, 2, 3):
        assert out.logprobs[i] == pytest.approx(ref[i, out.next_token_ids[i]].item(), abs=1e-6)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None and out.top_logprobs[3] is None
    for i, n in ((0, 5), (2, 3)):
        vals, ids = ref[i].topk(n)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(vals.tolist(), abs=1e-6)
    assert out.next_token_ids[2] == out.top_logprobs[2][0][0]
    assert out.next_token_ids[0] == 7  # the bias decided the token, but the reported logprobs are raw


def test_fast_path_and_empty_batch():
    logits = rand_logits(5)
    out = sample(logits, [row(None, temperature=0.0) for _ in range(5)])
    assert out.next_token_ids == torch.argmax(logits, -1).tolist()
    assert out.logprobs == [None] * 5 and out.top_logprobs == [None] * 5
    assert sample(torch.zeros(0, V), []).next_token_ids == []


def test_wide_vocab_draw_matches_probabilities_and_skips_zero_weights():
    # 4 live tokens spread over a 8192-wide vocabulary (exercises the two-level draw); others banned
    probs = {17: 0.1, 300: 0.2, 4097: 0.3, 8191: 0.4}
    logits = torch.full((2000, 8192), float("-inf"))
    for tid, p in probs.items():
        logits[:, tid] = math.log(p)
    gen = torch.Generator().manual_seed(7)
    got = sample(logits, [SamplingRow(SamplingParams(), gen, [], []) for _ in range(2000)]).next_token_ids
    assert set(got) == set(probs)
    for tid, p in probs.items():
        assert abs(got.count(tid) / 2000 - p) < 0.03
    # a uniform draw at the very top of [0, 1) still lands on a live token
    w = torch.zeros(2, 8192)
    w[:, 5] = 1.0
    w[1, 8000] = 1e-3
    u = torch.tensor([1.0 - 2**-24, 1.0 - 2**-24])
    assert sampler.draw(w, u).tolist() == [5, 8000]
    assert sampler.draw(w[:, :100], u).tolist() == [5, 5]


def test_probe_and_exact_paths_agree(monkeypatch):
    logits = rand_logits(12, seed=11) * 0.3  # flat: nuclei much wider than the probe
    kws = [dict(top_p=0.9), dict(min_p=0.01), dict(top_k=300, top_p=0.8), dict(top_p=0.5, min_p=0.2)] * 3

    def run() -> list[int]:
        return sample(logits, [row(i, **kw) for i, kw in enumerate(kws)]).next_token_ids

    exact_calls = []
    real = sampler._draw_filtered
    monkeypatch.setattr(sampler, "_draw_filtered", lambda *a: exact_calls.append(1) or real(*a))
    default = run()
    assert len(exact_calls) >= 6  # the wide nuclei went down the exact per-row path
    monkeypatch.setattr(sampler, "TOPK_PROBE", V)  # now every row fits in the probe
    exact_calls.clear()
    assert run() == default and not exact_calls


@pytest.mark.parametrize("penalty", [1e-200, 1e-30])  # rounds to 0 in float32; overflows the quotient
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tiny_repetition_penalty_keeps_the_logits_finite(penalty, temperature):
    """Any penalty above 0 is valid, as in SGLang: dividing a seen token's positive logit by one too small for the
    dtype gives the largest finite logit, not +inf (whose row would sample from NaN probabilities)."""
    from kiln.runner.device_sampler import sample_on_device

    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0, 0.25, 3.0]])
    params = dict(prompt=[2, 3], output=[4], repetition_penalty=penalty, temperature=temperature)
    for sampled in (sample(logits, [row(0, **params)]), sample_on_device(logits, [row(0, **params)])):
        assert sampled.next_token_ids == [2]  # the seen token with the largest positive logit now wins
    assert process_logits(logits, [row(0, **params)]).isfinite()[0, :3].all()
