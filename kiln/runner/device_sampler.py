"""Sampling on the logits' device with one host sync per step.

The CPU sampler (kiln.runner.sampler) reads values back as it goes: a uniform per row, the probe's candidates, the
unique penalised ids. On a GPU each read waits for the stream, and a blocking host-to-device copy waits too, so a
step would stall several times. Here everything the host knows (the rows' parameters, penalised and banned ids,
biases, grammar masks, the rows' uniforms) is laid out on the host as one `SamplingBatch` and sent in pinned,
non-blocking copies; the device then computes without any data-dependent shape (no nonzero, unique or item); and
the chosen ids with their logprobs come back packed in one tensor, one `.tolist()`: the step's one sync. This is
SGLang's and vLLM's arrangement (SamplingBatchInfo, SamplingMetadata).

The semantics are the sampler's, row for row: greedy rows take the processed argmax, plain sampled rows draw with
the same uniform and the same inverse CDF (the same token for the same seed), and filtered rows (top-k, top-p,
min-p) draw from the distribution `target_probs` gives, over the whole sorted vocabulary rather than a probe of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from kiln.core.transfer import read_back, to_device
from kiln.runner.sampler import (
    SampleOutput,
    SamplingRow,
    divide_finite,
    draw,
    filter_mask,
    is_plain_greedy,
    row_uniform,
    sample,
    wants_logprobs,
)

__all__ = ["PendingSample", "SamplingBatch", "sample_on_device", "sample_packed", "sample_step", "unpack"]


def _padded(seqs: Sequence[Sequence[int]], fill: int) -> torch.Tensor:
    """Rows of ids as one [N, longest] int64 tensor, padded with `fill` (at least one column)."""
    width = max([1, *(len(s) for s in seqs)])
    out = torch.full((len(seqs), width), fill, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return out


@dataclass
class SamplingBatch:
    """What the host knows about a step's rows: tensors (CPU until `to`) the device computes with, and the plain
    values the host lays the result out with."""

    greedy: torch.Tensor  # bool [N]
    temperature: torch.Tensor  # float [N] (1 for greedy rows, never read for them)
    top_k: torch.Tensor  # int64 [N], V where the row keeps every token
    top_p: torch.Tensor  # float [N]
    min_p: torch.Tensor  # float [N]
    filtered: torch.Tensor  # bool [N]: top-k, top-p or min-p restricts the row
    uniform: torch.Tensor  # float [N]: each sampled row's draw, from its own generator (0 for greedy rows)
    repetition: torch.Tensor  # float [N] (1: none)
    frequency: torch.Tensor  # float [N]
    presence: torch.Tensor  # float [N]
    # the penalties' ids, padded with V ([0, 1] where no row has a penalty): prompt + output (repetition), and
    # output alone (frequency and presence)
    seen_ids: torch.Tensor  # int64 [N, L]
    output_ids: torch.Tensor  # int64 [N, L']
    bias_index: torch.Tensor  # int64 [B]: flat row * V + id
    bias_value: torch.Tensor  # float [B]
    banned_index: torch.Tensor  # int64 [K]: flat row * V + id
    mask_rows: torch.Tensor  # int64 [M]: rows a grammar restricts
    masks: torch.Tensor  # bool [M, V]: the tokens each of those rows' grammars allow
    logprob_rows: torch.Tensor  # int64 [R]: rows that asked for logprobs
    # host-side layout
    logprob_wanted: list[int]  # the same rows, on the host
    top_logprobs: list[int]  # how many top logprobs each of them asked for
    all_greedy: bool
    any_filtered: bool
    penalised: bool  # whether any row has a repetition, frequency or presence penalty

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab: int) -> SamplingBatch:
        params = [r.params for r in rows]

        def floats(values) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.float32)

        def longs(values) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.long)

        greedy = [p.is_greedy for p in params]
        filtered = [
            not g and (0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0) for g, p in zip(greedy, params)
        ]
        bias = [
            (i * vocab + int(t), float(b))
            for i, p in enumerate(params)
            for t, b in (p.logit_bias or {}).items()
        ]
        masked = [i for i, r in enumerate(rows) if r.vocab_mask is not None]
        wanted = [i for i, p in enumerate(params) if wants_logprobs(p)]
        penalised = any(p.needs_penalties for p in params)
        # the ids the penalties read, laid out only when some row has one (a long prompt is many ids a step)
        history = rows if penalised else []
        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool),
            temperature=floats(1.0 if g else p.temperature for g, p in zip(greedy, params)),
            top_k=longs(p.top_k if 0 < p.top_k < vocab else vocab for p in params),
            top_p=floats(p.top_p for p in params),
            min_p=floats(p.min_p for p in params),
            filtered=torch.tensor(filtered, dtype=torch.bool),
            # drawn for sampled rows only, as the CPU sampler draws them: a seed gives the same tokens on either
            uniform=floats(0.0 if g else float(row_uniform(r)) for g, r in zip(greedy, rows)),
            repetition=floats(p.repetition_penalty for p in params),
            frequency=floats(p.frequency_penalty for p in params),
            presence=floats(p.presence_penalty for p in params),
            seen_ids=_padded([[*r.prompt_ids, *r.output_ids] for r in history], vocab),
            output_ids=_padded([r.output_ids for r in history], vocab),
            bias_index=longs(i for i, _ in bias),
            bias_value=floats(b for _, b in bias),
            banned_index=longs(i * vocab + int(t) for i, r in enumerate(rows) for t in r.banned_ids),
            mask_rows=longs(masked),
            masks=torch.stack([rows[i].vocab_mask.to("cpu") for i in masked])
            if masked
            else torch.zeros(0, vocab, dtype=torch.bool),
            logprob_rows=longs(wanted),
            logprob_wanted=wanted,
            top_logprobs=[params[i].top_logprobs_num for i in wanted],
            all_greedy=all(greedy),
            any_filtered=any(filtered),
            penalised=penalised,
        )

    def to(self, device: torch.device) -> SamplingBatch:
        """The batch on `device`: pinned, non-blocking copies on CUDA, which do not wait for the stream."""
        if device.type == "cpu":
            return self
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = to_device(value, device) if isinstance(value, torch.Tensor) else value
        return SamplingBatch(**moved)


def _processed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The sampler's process_logits with static shapes: grammar masks, bias, penalties, bans."""
    out = logits.float().clone()
    n, vocab = out.shape
    if batch.masks.shape[0]:
        out[batch.mask_rows] = out[batch.mask_rows].masked_fill(~batch.masks, float("-inf"))
    if batch.bias_index.numel():
        out.view(-1).index_add_(0, batch.bias_index, batch.bias_value)
    if batch.penalised:
        # one column past the vocabulary takes the padding, then is dropped
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=out.device)
        seen = seen.scatter_(1, batch.seen_ids, True)[:, :vocab]
        rep = batch.repetition.unsqueeze(-1)
        out = torch.where(seen & (rep != 1.0), torch.where(out > 0, divide_finite(out, rep), out * rep), out)
        counts = torch.zeros(n, vocab + 1, dtype=out.dtype, device=out.device)
        counts = counts.scatter_add_(1, batch.output_ids, torch.ones_like(batch.output_ids, dtype=out.dtype))
        counts = counts[:, :vocab]
        penalty = batch.frequency.unsqueeze(-1) * counts + batch.presence.unsqueeze(-1)
        out = torch.where(counts > 0, out - penalty, out).contiguous()
    if batch.banned_index.numel():
        out.view(-1).index_fill_(0, batch.banned_index, float("-inf"))
    return out


def _sampled(processed: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One id per row drawn from processed logits: plain rows by inverse CDF over the vocabulary in its order (the
    CPU sampler's draw), filtered rows over the vocabulary sorted by weight under their masks."""
    x = processed - processed.amax(-1, keepdim=True)
    w = x.div_(batch.temperature.unsqueeze(-1)).exp_()  # unnormalised probs, max exactly 1
    plain = draw(w, batch.uniform)
    if not batch.any_filtered:
        return plain
    vals, order = w.sort(dim=-1, descending=True, stable=True)
    keep, _ = filter_mask(vals, vals.sum(-1), batch.top_k, batch.top_p, batch.min_p)
    picked = order.gather(1, draw(vals * keep, batch.uniform).unsqueeze(-1)).squeeze(-1)
    return torch.where(batch.filtered, picked, plain)


def sample_packed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The chosen ids, then the logprob rows' chosen logprobs, then their top ids and top logprobs, as one float64
    tensor on the logits' device (float64 holds the ids and the float32 logprobs exactly). No host sync."""
    processed = _processed(logits, batch)
    chosen = processed.argmax(-1)
    if not batch.all_greedy:
        chosen = torch.where(batch.greedy, chosen, _sampled(processed, batch))
    parts = [chosen.double()]
    if batch.logprob_wanted:
        lp = torch.log_softmax(logits[batch.logprob_rows].float(), dim=-1)
        parts.append(lp.gather(1, chosen[batch.logprob_rows].unsqueeze(-1)).squeeze(-1).double())
        n_max = max(batch.top_logprobs)
        if n_max:
            top_v, top_i = lp.topk(n_max, dim=-1)
            parts += [top_i.double().flatten(), top_v.double().flatten()]
    return torch.cat(parts)


def unpack(packed: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    """The step's one sync: `packed` read back and laid out as the sampler's SampleOutput."""
    values = packed.tolist()
    n, wanted = batch.greedy.shape[0], batch.logprob_wanted
    out = SampleOutput([int(v) for v in values[:n]], [None] * n, [None] * n)
    if not wanted:
        return out
    picked = values[n : n + len(wanted)]
    n_max, top = max(batch.top_logprobs), values[n + len(wanted) :]
    half = len(wanted) * n_max
    for j, (i, k) in enumerate(zip(wanted, batch.top_logprobs, strict=True)):
        out.logprobs[i] = picked[j]
        if k:
            ids = top[j * n_max : j * n_max + k]
            out.top_logprobs[i] = [
                (int(t), v) for t, v in zip(ids, top[half + j * n_max : half + j * n_max + k])
            ]
    return out


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
    """The sampler's `sample` for logits on a GPU, with one host sync (see the module docstring)."""
    batch = SamplingBatch.build(rows, logits.shape[-1]).to(logits.device)
    return unpack(sample_packed(logits, batch), batch)


class PendingSample:
    """A step's sampling, launched and not waited for: its chosen ids on the logits' device, which the next step
    reads as its input ids with no host sync (the overlap schedule, as SGLang resolves its future token ids on the
    device), and the read-back of everything under way, waited for when the host takes the tokens (`result`)."""

    def __init__(self, logits: torch.Tensor, rows: list[SamplingRow]):
        n = len(rows)
        self._out: SampleOutput | None = None
        self._batch: SamplingBatch | None = None
        if logits.device.type == "cpu":  # the CPU sampler, done: its tokens are on the host already
            self._out = sample(logits, rows)
            self.ids = torch.tensor(self._out.next_token_ids, dtype=torch.int64)
            return
        if all(is_plain_greedy(r) for r in rows):
            self.ids = logits.argmax(-1)
            packed = self.ids
        else:
            self._batch = SamplingBatch.build(rows, logits.shape[-1]).to(logits.device)
            packed = sample_packed(logits, self._batch)
            self.ids = packed[:n].long()
        self._host, self._wait = read_back(packed)

    def result(self) -> SampleOutput:
        """The tokens (and logprobs) on the host: waits for this step's read-back only."""
        if self._out is None:
            self._wait()
            if self._batch is None:
                ids = self._host.tolist()
                self._out = SampleOutput(ids, [None] * len(ids), [None] * len(ids))
            else:
                self._out = unpack(self._host, self._batch)
        return self._out


def sample_step(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
    """A step's tokens: the CPU sampler's for CPU logits, `sample_on_device` for a GPU's. Plain greedy rows need
    nothing from the host but the argmax, one sync either way."""
    if logits.device.type == "cpu" or all(is_plain_greedy(r) for r in rows):
        return sample(logits, rows)
    return sample_on_device(logits, rows)
