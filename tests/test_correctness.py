"""Greedy output of the in-process Engine is token-identical to Hugging Face transformers (float32, same
weights), whatever the batching: each prompt alone, all batched, chunked prefill, radix-cache hits, page size
4, no radix cache, lpm scheduling and retraction under a tiny pool. Under bfloat16 the first differing token
is in the float32 reference's top-5.

On the default model (SmolLM2 GGUF, read by transformers too) and on small random-weight Llama and Qwen3.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import default_tokenizer_source, hf_model_of_gguf

import kiln
from kiln.core.forward_batch import ForwardMode
from kiln.loader.kept_dirs import is_kept, keep
from kiln.loader.weights import load_model
from kiln.runner import model_runner

pytestmark = pytest.mark.engine

NEW_TOKENS = 8
# 22 prompts of 1 .. 2000 tokens; most short, two long
PROMPT_LENS = [1, 2, 3, 5, 8, 12, 17, 24, 32, 40, 50, 64, 77, 100, 128, 150, 200, 256, 333, 400, 1000, 2000]
# The default model is ~100x the cost of the small ones: its configuration variants run the prompts under
# SHORT tokens (the long ones run alone, batched and chunked), bfloat16 those under BF16_SHORT.
SHORT, BF16_SHORT = 1000, 130
SHARED_PREFIX = 300  # two prompts sharing this many tokens
# 8 requests whose KV outgrows the pool mid-decode (the admission reserve underestimates it); run alone
# each must produce the same tokens. Smaller on the default model, where every decode step is ~50 ms.
RETRACT = {"small": dict(new=64, pool=256), "default": dict(new=24, pool=128)}
RETRACT_N = 8
# One torch thread: on a shared 2-core machine, 2 threads spin against other processes and small ops get
# 5-15x slower; the comparison does not depend on the thread count.
THREADS = 1
# exact: GGUF blocks multiplied in float32, so the default model stays comparable with transformers token for token
BASE_ARGS = dict(max_total_tokens=8192, max_running_requests=32, num_threads=THREADS, cpu_gemm="exact")

TEXT = """\
The river town woke slowly in the autumn fog. Fishermen dragged their boats over the wet stones while the
baker, who had been up since three, stacked loaves of rye bread in the narrow window of his shop. Children
ran past the church with their satchels bouncing, shouting about a fox that had been seen near the mill.
In the old library on the hill, a clerk catalogued maps of coastlines that no longer existed: harbours
silted up centuries ago, islands swallowed by storms, roads that once led to markets now buried under
forest. She wrote each entry by hand, in brown ink, noting the scale, the surveyor and the year.
Photosynthesis converts light energy into chemical energy stored in glucose. In the chloroplasts, water
molecules are split, oxygen is released, and the energy carried by ATP and NADPH drives the Calvin cycle,
which fixes carbon dioxide into three-carbon sugars. Plants regulate the opening of their stomata to
balance the intake of carbon dioxide against the loss of water vapour on hot and dry afternoons.
def merge(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
The committee met on Tuesday to review the budget for the coming year. After a long debate about the
costs of repairing the bridge, members agreed to postpone the new sports hall and to raise the fee for
parking permits by twelve percent, starting in March.
"""


# ---------------------------------------------------------------- prompts and the reference


@functools.cache
def token_stream() -> list[int]:
    from kiln.text.tokenizer import load_tokenizer

    return list(load_tokenizer(default_tokenizer_source()).encode(TEXT))


def make_prompt(stream: list[int], length: int, offset: int) -> list[int]:
    """`length` tokens of the text, repeated as needed, starting `offset` tokens in."""
    reps = (offset + length) // len(stream) + 1
    return (stream * reps)[offset : offset + length]


@dataclass
class Case:
    ids: list[int]
    ref: list[int] = field(default_factory=list)  # greedy ids, EOS included when it stopped there
    top5: list[list[int]] = field(default_factory=list)  # the reference's top-5 at each generated position


@dataclass
class Reference:
    prompts: list[Case]  # one per PROMPT_LENS entry, no shared prefixes
    shared: list[Case]  # two prompts sharing SHARED_PREFIX tokens
    retract: list[Case]  # short prompts for the tiny-pool scenario


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int, eos: set[int]) -> tuple[list[int], list[list[int]]]:
    """Greedy decoding with the KV cache: argmax of the raw logits, no processors, stops at EOS."""
    out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    gen: list[int] = []
    top: list[list[int]] = []
    for _ in range(n):
        logits = out.logits[0, -1].float()
        tok = int(logits.argmax())
        gen.append(tok)
        top.append(logits.topk(5).indices.tolist())
        if tok in eos:
            break
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return gen, top


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        model = hf_model_of_gguf(path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def build_reference(path: str) -> Reference:
    stream = token_stream()
    prompts = [Case(make_prompt(stream, n, 41 * i)) for i, n in enumerate(PROMPT_LENS)]
    prefix = make_prompt(stream, SHARED_PREFIX, 500)
    shared = [Case(prefix + make_prompt(stream, 20, 7)), Case(prefix + make_prompt(stream, 33, 170))]
    retract = [Case(make_prompt(stream, 20 + 3 * i, 13 * i + 5)) for i in range(RETRACT_N)]
    answered = prompts + shared
    kept = kept_reference(path, answered) if path.endswith(".gguf") else None
    if kept is not None and is_kept(kept):
        for case, (ref, top5) in zip(answered, json.loads((kept / "reference.json").read_text())):
            case.ref, case.top5 = ref, top5
        return Reference(prompts, shared, retract)
    model = load_hf(path)
    cfg_eos = model.config.eos_token_id
    eos = set(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]) - {None}
    for case in answered:
        case.ref, case.top5 = hf_greedy(model, case.ids, NEW_TOKENS, eos)
    del model
    gc.collect()
    if kept is not None:
        text = json.dumps([[case.ref, case.top5] for case in answered])
        keep(kept, lambda d: (d / "reference.json").write_text(text))
    return Reference(prompts, shared, retract)


def kept_reference(path: str, cases: list[Case]) -> Path:
    """Where transformers' answers on the default model are kept (the slowest part of this module's setup): keyed
    by the file's bytes, the versions that read and run it, the prompts and the code that decodes them, so any
    change to one of those computes them again."""
    from importlib.metadata import version

    from kiln.loader.kept_dirs import content_kept_dir

    what = json.dumps([[c.ids for c in cases], NEW_TOKENS, inspect.getsource(hf_greedy)])
    return content_kept_dir(
        Path("~/.cache/kiln/test-reference").expanduser(),
        path,
        *(f"{p} {version(p)}" for p in ("transformers", "gguf", "torch")),
        hashlib.sha256(what.encode()).hexdigest(),
    )


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=["default_model", "tiny_llama", "tiny_qwen3"])
def model_path(request) -> str:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ref(model_path: str) -> Reference:
    torch.set_num_threads(THREADS)
    return build_reference(model_path)


class Engines:
    """One Engine per configuration, built on first use; only the latest is kept alive (memory).

    Engines of one model share its loaded weights (per dtype): each configuration still gets its own pools,
    cache and scheduler, but the GGUF is dequantized once rather than once per configuration."""

    def __init__(self, path: str):
        self.path = path
        self.key: tuple | None = None
        self.engine: kiln.Engine | None = None
        self.weights: dict[tuple, torch.nn.Module] = {}

    def _load_model(self, cfg, dtype, device, max_positions, *args, **kw):
        key = (cfg.model_path, dtype, device, max_positions)
        if key not in self.weights:
            self.weights[key] = load_model(cfg, dtype, device, max_positions, *args, **kw)
        return self.weights[key]

    def build(self, **args) -> kiln.Engine:
        """A new Engine on this model's shared weights, which the caller shuts down."""
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(model_runner, "load_model", self._load_model)
            return kiln.Engine(model_path=self.path, **args)

    def get(self, **overrides) -> kiln.Engine:
        args = {**BASE_ARGS, **overrides}
        key = tuple(sorted(args.items()))
        if key != self.key:
            self.close()
            self.engine = self.build(**args)
            self.key = key
        assert self.engine is not None
        self.engine.scheduler.flush_cache()
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine, self.key = None, None
        gc.collect()


@pytest.fixture(scope="module")
def engines(model_path: str):
    e = Engines(model_path)
    yield e
    e.close()
    e.weights.clear()


def is_default(model_path: str) -> bool:
    return model_path.endswith(".gguf")


def short(model_path: str, cases: list[Case], below: int = SHORT) -> list[Case]:
    """The cases a variant runs: all on the small models, those under `below` tokens on the default one."""
    return [c for c in cases if len(c.ids) < below or not is_default(model_path)]


# ---------------------------------------------------------------- helpers


def greedy(n: int = NEW_TOKENS, **kw) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, **kw}


def run(eng: kiln.Engine, cases: list[Case], **kw) -> list[dict]:
    return eng.generate(input_ids=[c.ids for c in cases], sampling_params=[greedy(**kw) for _ in cases])


def assert_same(outs: list[dict], cases: list[Case], what: str) -> None:
    bad = []
    for out, case in zip(outs, cases):
        got = out["output_ids"]
        if got != case.ref:
            i = next(
                (k for k, (a, b) in enumerate(zip(got, case.ref)) if a != b), min(len(got), len(case.ref))
            )
            bad.append(f"prompt of {len(case.ids)} tokens: first difference at {i}: {got} != {case.ref}")
    assert not bad, f"{what}: {len(bad)}/{len(cases)} differ from transformers:\n" + "\n".join(bad)


def assert_idle(eng: kiln.Engine) -> dict:
    rep = eng.check_integrity()
    assert rep["ok"], rep
    assert rep["in_use"] == 0, rep
    assert rep["free"] + rep["cached"] == rep["total"], rep
    return rep


def spy_forward(eng: kiln.Engine) -> list[tuple[ForwardMode, int]]:
    """Record (mode, #tokens) of every forward pass the engine's runner makes from now on."""
    runner = eng.scheduler.runner
    calls: list[tuple[ForwardMode, int]] = []
    inner = type(runner).forward.__get__(runner)

    def forward(fb):
        calls.append((fb.mode, int(fb.input_ids.numel())))
        return inner(fb)

    runner.forward = forward
    return calls


# ---------------------------------------------------------------- scenarios


def test_reference_is_sane(ref: Reference) -> None:
    assert len(ref.prompts) >= 20 and {len(c.ids) for c in ref.prompts} >= {1, 2000}
    assert all(len(c.ref) == len(c.top5) >= 1 for c in ref.prompts + ref.shared)
    assert all(c.ref[i] == c.top5[i][0] for c in ref.prompts for i in range(len(c.ref)))


def test_each_prompt_alone(engines: Engines, ref: Reference) -> None:
    eng = engines.get()
    outs = []
    for case in ref.prompts:
        eng.scheduler.flush_cache()
        (out,) = run(eng, [case])
        assert out["meta_info"]["cached_tokens"] == 0
        assert out["meta_info"]["prompt_tokens"] == len(case.ids)
        outs.append(out)
        assert_idle(eng)
    assert_same(outs, ref.prompts, "alone")


def test_bad_sampling_params_raise_naming_the_key(engines: Engines) -> None:
    """The Engine raises, as SGLang's does, rather than returning an empty text with an abort reason."""
    from kiln.sampling_params import InvalidParam

    eng = engines.get()
    for params, key in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"bogus": 1}, "bogus"),
        # values of the wrong type: named, not a TypeError from inside a comparison
        ({"stop": 5}, "stop"),
        ({"max_new_tokens": "ten"}, "max_new_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop_token_ids": "x"}, "stop_token_ids"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ]:
        with pytest.raises(InvalidParam) as bad:
            eng.generate(input_ids=[1, 2, 3], sampling_params=params)
        assert bad.value.param == key
    with pytest.raises(InvalidParam, match="got 2 sampling params for 3 prompts"):
        eng.generate(input_ids=[[1, 2], [3, 4], [5, 6]], sampling_params=[{"max_new_tokens": 1}] * 2)
    for nothing in ({}, {"prompt": []}, {"input_ids": []}):  # SGLang's Engine refuses a call without a prompt
        with pytest.raises(InvalidParam, match="either a prompt or input_ids"):
            eng.generate(**nothing, sampling_params={"max_new_tokens": 1})
    assert eng.generate(input_ids=[1, 2], sampling_params={"stop": "x", "max_new_tokens": 1})["output_ids"]
    assert_idle(eng)


def test_a_shut_down_engine_says_so(engines: Engines) -> None:
    eng = engines.build(**BASE_ARGS)
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})


def test_streamed_chunks_end_as_the_call_does(engines: Engines, ref: Reference) -> None:
    """stream=True (SGLang's Engine): each generation's chunks grow one another and end at the reference
    tokens; a stream closed early aborts what still runs and gives its pages back."""
    eng = engines.get()
    cases = ref.prompts[:3]
    chunks = list(
        eng.generate(input_ids=[c.ids for c in cases], sampling_params=[greedy() for _ in cases], stream=True)
    )
    outs = []
    for k, case in enumerate(cases):
        mine = [c for c in chunks if c["index"] == k]
        assert len(mine) == len(case.ref), f"generation {k}: {len(mine)} chunks"  # one a token
        assert [len(c["output_ids"]) for c in mine] == list(range(1, len(mine) + 1))
        assert all(b["output_ids"][: len(a["output_ids"])] == a["output_ids"] for a, b in zip(mine, mine[1:]))
        assert all(b["text"].startswith(a["text"]) for a, b in zip(mine, mine[1:]))
        assert mine[-1]["meta_info"]["finish_reason"] is not None
        outs.append(mine[-1])
    assert_same(outs, cases, "streamed")
    stream = eng.generate(input_ids=cases[0].ids, sampling_params=greedy(64, ignore_eos=True), stream=True)
    with pytest.raises(RuntimeError, match="stream open"):  # held from the call, before its first chunk
        eng.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1}, stream=True)
    first = next(stream)
    assert "index" not in first and len(first["output_ids"]) == 1
    with pytest.raises(RuntimeError, match="stream open"):
        eng.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    stream.close()
    assert_idle(eng)
    dropped = eng.generate(input_ids=cases[0].ids, sampling_params=greedy(64, ignore_eos=True), stream=True)
    next(dropped)
    del dropped  # dropped mid-way: collected, closed, its request aborted
    assert_idle(eng)
    assert eng.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})["output_ids"]


def test_all_batched(engines: Engines, ref: Reference) -> None:
    eng = engines.get()
    calls = spy_forward(eng)
    outs = run(eng, ref.prompts)
    assert_same(outs, ref.prompts, "batched")
    prefills = [n for mode, n in calls if mode == ForwardMode.EXTEND]
    assert prefills[0] > 2000, f"expected the prompts prefilled together, got extends {prefills}"
    assert_idle(eng)


def test_radix_cache_hits(engines: Engines, ref: Reference) -> None:
    eng = engines.get()
    case = ref.prompts[18]  # 333 tokens
    first, second = run(eng, [case]), run(eng, [case])
    assert first[0]["meta_info"]["cached_tokens"] == 0
    assert second[0]["meta_info"]["cached_tokens"] >= len(case.ids) - 1 - eng.scheduler.kv.page_size
    assert_same(first + second, [case, case], "same prompt twice")
    a, b = ref.shared
    out_a, out_b = run(eng, [a]), run(eng, [b])
    assert out_b[0]["meta_info"]["cached_tokens"] >= SHARED_PREFIX - eng.scheduler.kv.page_size
    assert_same(out_a + out_b, ref.shared, "shared prefix")
    assert_idle(eng)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(dict(chunked_prefill_size=64), id="chunked64"),
        pytest.param(dict(page_size=4, chunked_prefill_size=64), id="page4-chunked64"),
        pytest.param(dict(disable_radix_cache=True), id="no-radix"),
        pytest.param(dict(schedule_policy="lpm", chunked_prefill_size=256), id="lpm"),
    ],
)
def test_config_variants(engines: Engines, ref: Reference, model_path: str, config: dict) -> None:
    eng = engines.get(**config)
    chunk = config.get("chunked_prefill_size")
    # warm the cache with some prompts so a later batch mixes hits and misses (lpm reorders on them)
    warm = run(eng, ref.prompts[13:16] + ref.shared[:1])
    assert_same(warm, ref.prompts[13:16] + ref.shared[:1], f"{config} warm-up")
    calls = spy_forward(eng)
    full = config == {"chunked_prefill_size": 64}
    cases = (ref.prompts if full else short(model_path, ref.prompts)) + ref.shared[1:]
    outs = run(eng, cases)
    assert_same(outs, cases, f"{config} batched")
    if chunk:
        extends = [n for mode, n in calls if mode == ForwardMode.EXTEND]
        assert max(extends) <= chunk, f"an extend of {max(extends)} tokens with chunked_prefill_size {chunk}"
    hits = [o["meta_info"]["cached_tokens"] for o in outs]
    if config.get("disable_radix_cache"):
        assert not any(hits), hits
    else:
        assert hits[-1] >= SHARED_PREFIX - eng.scheduler.kv.page_size, hits
    assert_idle(eng)


def test_bfloat16_first_difference_in_top5(engines: Engines, ref: Reference, model_path: str) -> None:
    eng = engines.get(dtype="bfloat16")
    assert eng.scheduler.runner.dtype == torch.bfloat16
    cases = short(model_path, ref.prompts, BF16_SHORT) + ref.shared
    outs = run(eng, cases)
    bad = []
    for out, case in zip(outs, cases):
        got = out["output_ids"]
        i = next((k for k, (a, b) in enumerate(zip(got, case.ref)) if a != b), None)
        if i is not None and got[i] not in case.top5[i]:
            bad.append(f"prompt of {len(case.ids)}: token {got[i]} at {i} not in top-5 {case.top5[i]}")
    assert not bad, "\n".join(bad)
    assert_idle(eng)


def test_retraction_keeps_outputs(engines: Engines, ref: Reference, model_path: str) -> None:
    cfg = RETRACT["default" if is_default(model_path) else "small"]
    eng = engines.get(max_total_tokens=cfg["pool"], max_running_requests=RETRACT_N)
    params = greedy(cfg["new"], ignore_eos=True)
    alone = []
    for case in ref.retract:
        (out,) = eng.generate(input_ids=[case.ids], sampling_params=[params])
        alone.append(out["output_ids"])
        assert out["meta_info"]["num_retractions"] == 0
    eng.scheduler.flush_cache()
    outs = eng.generate(input_ids=[c.ids for c in ref.retract], sampling_params=[params] * len(ref.retract))
    retractions = [o["meta_info"]["num_retractions"] for o in outs]
    assert sum(retractions) > 0, "the tiny pool did not force a retraction; shrink its pool"
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * len(outs)
    for out, expect, case in zip(outs, alone, ref.retract):
        assert out["output_ids"] == expect, f"prompt of {len(case.ids)} tokens, retractions {retractions}"
        assert len(expect) == cfg["new"]
    assert_idle(eng)
