"""The device sampler (kiln.runner.device_sampler): the CPU sampler's tokens and logprobs row for row, filtered rows
drawn from the sampler's distribution, and no host sync before its one read-back. On the CPU the device work is
checked for the operations that would wait for a GPU (an item, a nonzero, a unique: anything whose result shape or
value the host must see); on CUDA torch's sync debug mode checks the same step for any sync at all."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.runner.device_sampler import PendingSample, SamplingBatch, sample_on_device, sample_packed, unpack
from kiln.runner.sampler import SamplingRow, sample, target_probs
from kiln.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
V = 5000  # wide enough for the sampler's two-level draw


def mixed_rows(mask: torch.Tensor) -> list[SamplingRow]:
    """One row of each kind the sampler handles, each seeded afresh (a call consumes its generators)."""

    def row(seed=None, prompt=(), output=(), banned=(), vocab_mask=None, **kw) -> SamplingRow:
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return SamplingRow(
            SamplingParams(seed=seed, **kw), gen, list(prompt), list(output), list(banned), vocab_mask
        )

    return [
        row(temperature=0.0),
        row(seed=1, temperature=0.8),
        row(seed=2, temperature=1.3, logprobs=True, top_logprobs_num=3),
        row(temperature=0.0, repetition_penalty=1.3, prompt=[4, 9, 9], output=[17, 4]),
        row(seed=3, frequency_penalty=15.0, presence_penalty=0.4, output=[1, 1, 2, 3000], logprobs=True),
        row(temperature=0.0, logit_bias={11: 50.0, 13: 49.0}, banned=[11, 12], top_logprobs_num=2),
        row(seed=4, temperature=0.0, vocab_mask=mask, logprobs=True),
        row(seed=5, temperature=1.0, banned=[0, 1, 2], vocab_mask=mask),
    ]


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3
    logits[3, 4], logits[3, 5] = 20.0, 18.0  # the repetition penalty takes 4 below 5
    logits[4, 1] = 30.0  # certain, but for the frequency penalty
    logits[5, 11], logits[5, 13] = 1.0, 0.0  # the bias lifts both, the ban takes 11 out
    return logits.to(DEVICE)


def grammar_mask() -> torch.Tensor:
    mask = torch.zeros(V, dtype=torch.bool)
    mask[100:400] = True
    return mask


def test_the_cpu_samplers_tokens_and_logprobs():
    """Unfiltered rows (greedy after bias, penalties, bans and grammar masks; sampled with a seed) get the CPU
    sampler's tokens exactly, and every logprob it reports."""
    logits = logits_for(8)
    want = sample(logits.cpu(), mixed_rows(grammar_mask()))
    got = sample_on_device(logits, mixed_rows(grammar_mask()))
    assert got.next_token_ids == want.next_token_ids
    # each processing step bit: the repetition penalty, the frequency penalty, a ban over a bias, the grammar mask
    ids = got.next_token_ids
    assert ids[3] == 5 and ids[4] != 1 and ids[5] == 13 and 100 <= ids[6] < 400 and 100 <= ids[7] < 400
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        assert (g is None) == (w is None) and (g is None or g == pytest.approx(w, abs=1e-5))
    for g, w in zip(got.top_logprobs, want.top_logprobs, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert [t for t, _ in g] == [t for t, _ in w]
            assert [v for _, v in g] == pytest.approx([v for _, v in w], abs=1e-5)


@pytest.mark.parametrize(
    "kw", [{"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.2}, {"top_k": 4, "top_p": 0.9, "temperature": 0.7}]
)
def test_filtered_rows_draw_from_the_samplers_distribution(kw):
    """Top-k, top-p and min-p rows, drawn over the whole sorted vocabulary: each token's frequency over 3000 draws
    is the probability target_probs (what the CPU sampler draws from) gives it."""
    n = 3000
    logits = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.1, 0.08, 0.07]))
    logits = torch.cat((logits, torch.full((V - 6,), -30.0))).expand(n, -1).contiguous()
    gen = torch.Generator().manual_seed(7)
    rows = [SamplingRow(SamplingParams(**kw), gen, [], []) for _ in range(n)]
    want = target_probs(logits[:1], rows[:1])[0, :6]
    got = torch.bincount(torch.tensor(sample_on_device(logits.to(DEVICE), rows).next_token_ids), minlength=V)
    assert got[6:].sum() == 0
    torch.testing.assert_close(got[:6].float() / n, want, atol=0.03, rtol=0)


SYNCING = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}


class Syncs(TorchDispatchMode):
    """Records the operations that make the host wait for a GPU's result."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in SYNCING:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def no_host_reads(monkeypatch) -> None:
    """Reads of a tensor's values by the host that bypass the dispatcher (tolist, numpy, item) raise."""
    for name in ("tolist", "numpy", "item"):

        def refuse(*args, _name=name, **kwargs):
            raise AssertionError(f"the device work read values back with .{_name}()")

        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_the_device_work_waits_for_nothing(monkeypatch):
    """From the host's batch to the packed result the device runs nothing the host must read back; the one read
    is `unpack`'s. The same rows through the CPU sampler do such reads (the detector sees them)."""
    logits = logits_for(8)
    rows = mixed_rows(grammar_mask())
    batch = SamplingBatch.build(rows, V)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with monkeypatch.context() as patched, Syncs() as syncs:
            no_host_reads(patched)
            packed = sample_packed(logits, batch.to(logits.device))
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert syncs.seen == []
    assert (
        unpack(packed, batch).next_token_ids
        == sample(logits.cpu(), mixed_rows(grammar_mask())).next_token_ids
    )
    with Syncs() as syncs:
        sample(logits.cpu(), mixed_rows(grammar_mask()))
    assert syncs.seen


def test_a_pending_sample_launches_without_waiting_and_reads_back_the_samplers_tokens():
    """The overlap schedule's launched sampling (PendingSample): its chosen ids stay where the logits are, for the
    next step to read, and its result is the sampler's (sample_on_device's on a GPU, the CPU sampler's on the
    CPU), for mixed rows and for plain greedy ones. On a GPU launching it waits for nothing (torch's sync check
    raises): the read-back is a pinned copy under way, waited for by `result` alone."""
    logits = logits_for(8)
    greedy_rows = [SamplingRow(SamplingParams(temperature=0.0), None, [], []) for _ in range(8)]
    want = (sample_on_device if DEVICE == "cuda" else sample)(logits, mixed_rows(grammar_mask()))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        mixed = PendingSample(logits, mixed_rows(grammar_mask()))
        greedy = PendingSample(logits, greedy_rows)
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert mixed.ids.device.type == DEVICE and mixed.ids.dtype == torch.int64
    got = mixed.result()
    assert mixed.ids.tolist() == got.next_token_ids == want.next_token_ids
    assert got.logprobs == pytest.approx(want.logprobs) and got.top_logprobs == want.top_logprobs
    argmax = logits.argmax(-1).tolist()
    assert greedy.ids.tolist() == greedy.result().next_token_ids == argmax
