"""n > 1: several samples of one prompt. The prompt is prefilled alone first (a prefill-only request), so that
its samples, admitted after it finished, all read its KV from the prefix cache instead of each computing it.
One plan serves the in-process Engine and the HTTP server alike."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kiln.sampling_params import InvalidParam, SamplingParams


@dataclass(frozen=True)
class Sample:
    """One generation: a sample of prompt `index`."""

    index: int
    input_ids: list[int]
    params: SamplingParams
    rid: str | None = None  # None: the front names it


@dataclass(frozen=True)
class FanOut:
    warm: list[list[int]]  # prompts to prefill alone, each to the end, before any sample starts
    samples: list[Sample]  # prompt by prompt, n of each
    num_prompts: int
    loras: tuple[str | None, ...] = ()  # each prompt's LoRA adapter (empty: the base model for all)

    def lora(self, index: int) -> str | None:
        return self.loras[index] if self.loras else None

    def warm_loras(self) -> list[str | None]:
        """The adapter of each warm prompt (those sampled more than once), in warm's order."""
        counts = [0] * self.num_prompts
        for sample in self.samples:
            counts[sample.index] += 1
        return [self.lora(i) for i in range(self.num_prompts) if counts[i] > 1]

    def groups(self) -> list[list[Sample]]:
        """The samples of each prompt, in prompt order."""
        by_prompt: list[list[Sample]] = [[] for _ in range(self.num_prompts)]
        for sample in self.samples:
            by_prompt[sample.index].append(sample)
        return by_prompt


def prefill_only_params() -> SamplingParams:
    """A request that computes its prompt's KV, leaves it in the prefix cache and generates nothing."""
    return SamplingParams(max_new_tokens=0)


def fan_out(
    prompts: Sequence[list[int]], params: Sequence[SamplingParams], rids: Sequence[str] | None = None
) -> FanOut:
    """params[i].n samples of prompts[i], named by `rids` in order when given; a warm-up prefill for every
    prompt sampled more than once."""
    if len(params) != len(prompts):  # zip would drop the prompts without params
        raise InvalidParam("sampling_params", f"got {len(params)} sampling params for {len(prompts)} prompts")
    samples = [
        Sample(i, ids, sample_params(p, j))
        for i, (ids, p) in enumerate(zip(prompts, params))
        for j in range(p.n)
    ]
    if rids is not None:
        if len(rids) != len(samples):
            raise InvalidParam("rid", f"got {len(rids)} request ids for {len(samples)} generations")
        repeated = [rid for rid, count in Counter(rids).items() if count > 1]
        if repeated:  # one rid, two generations: their outputs could not be told apart
            raise InvalidParam("rid", f"request id {repeated[0]!r} is given to more than one generation")
        samples = [Sample(s.index, s.input_ids, s.params, rid) for s, rid in zip(samples, rids)]
    warm = [ids for ids, p in zip(prompts, params) if p.n > 1]
    return FanOut(warm, samples, len(prompts))


def sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """Sample j's params. A seeded prompt's samples would all draw the same tokens from one seed: sample j gets
    seed + j (vLLM's choice), so that n=1 keeps its seed and the set of n samples is reproducible."""
    if params.seed is None or j == 0:
        return params
    seed = params.seed + j
    if seed >= 2**64:  # past what a torch.Generator takes: wrap around, as the 64-bit seed would
        seed -= 2**64
    return replace(params, seed=seed)
