"""Draft models for speculative decoding: STANDALONE (a small Llama on the target's vocabulary), EAGLE and
EAGLE-3 heads with random weights saved in the public checkpoint layouts. Each drafts for a greedy verify loop
on the target's runner; the output must be the target's plain greedy output whatever the draft guesses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, build_tiny_model
from model_equality import one_torch_thread, random_model  # noqa: F401 (one_torch_thread: the fixture)

from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.loader.model_config import read_hf_config
from kiln.models.config import ModelConfig
from kiln.models.spec import ModelSpec
from kiln.runner.model_runner import ModelRunner, PoolSizes
from kiln.speculative.base import DraftInput
from kiln.speculative.draft_model import (
    CatchUpShapes,
    ChainDrafter,
    DraftRefused,
    StandaloneDrafter,
    check_same_vocabulary,
)
from kiln.speculative.eagle import attach_target, build_eagle_drafter
from kiln.speculative.head_kv import target_pool_rows

model_spec = ModelSpec.from_config  # a model config dict's spec


pytestmark = pytest.mark.engine

CONTEXT, RUNNING, POOL = 512, 4, 4096
PROMPTS = [[1, 450, 3681, 310, 3444, 338], [1, 22, 22, 22, 22, 22, 22, 22, 22, 22], [1, 9038, 2501]]
NEW_TOKENS = 12
INTERPRETED_TOKENS = 6  # under Triton's interpreter: two verify steps of three drafts


def make_runner(path: str | Path, num_layers: int | None = None) -> ModelRunner:
    cfg = ModelConfig.from_hf_dict(str(path), read_hf_config(str(path)))
    runner = ModelRunner(cfg, torch.float32, torch.float32, "cpu")
    runner.load(CONTEXT + 8, prepack=False)
    runner.init_memory_pool(PoolSizes(POOL, RUNNING, CONTEXT, 1))
    return runner


def save_seven_layer_llama(out: Path) -> Path:
    """A 7-layer tiny Llama: EAGLE-3's default layers (2, 3, 4) are distinct there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model, tok = random_model(LlamaConfig, LlamaForCausalLM, 0, **dict(TINY["llama"], num_hidden_layers=7))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_seven_layer_llama(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def target(target_dir: Path) -> ModelRunner:
    return make_runner(target_dir)


class TargetLoop:
    """A greedy verify loop over one request on the target's runner: extend of the last token and the drafts,
    keep drafts while they equal the target's argmax, then its bonus token; the rejected rows' KV is freed."""

    def __init__(self, runner: ModelRunner, drafter: ChainDrafter | None, num_draft: int = 4):
        self.runner, self.drafter, self.num_draft = runner, drafter, num_draft
        self.accepted_drafts = 0

    def _extend(self, idx: int, start: int, ids: list[int]) -> torch.Tensor:
        table = self.runner.table.req_to_token
        slots = self.runner.allocator.alloc(len(ids))
        table[idx, start : start + len(ids)] = slots
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.arange(start, start + len(ids)),
            out_cache_loc=slots,
            logits_index=None,
            extend_lens=[len(ids)],
            prefix_lens=[start],
            seq_slots=[table[idx, : start + len(ids)]],
        )
        return self.runner.forward(fb)

    def _hidden(self) -> torch.Tensor | None:
        return getattr(self.runner.model, "last_hidden", None)

    def generate(self, rid: str, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
        idx, table = self.runner.table.alloc(), self.runner.table.req_to_token
        seq = list(prompt)
        seq.append(int(self._extend(idx, 0, seq)[-1].argmax()))
        if self.drafter is not None:
            self.drafter.accepted(rid, seq[1:], self._hidden())
        while len(seq) - len(prompt) < new_tokens:
            slots = table[idx, : len(seq) - 1]
            drafts = (
                self.drafter.propose([DraftInput(rid, list(seq), self.num_draft, kv_slots=slots)])[0]
                if self.drafter
                else []
            )
            start = len(seq) - 1
            best = self._extend(idx, start, [seq[-1], *drafts]).argmax(dim=-1).tolist()
            kept = 0
            while kept < len(drafts) and drafts[kept] == best[kept]:
                kept += 1
            self.accepted_drafts += kept
            rejected = table[idx, start + 1 + kept : start + 1 + len(drafts)]
            if rejected.numel():
                self.runner.allocator.free(rejected.clone())
            new = [*drafts[:kept], best[kept]]
            seq.extend(new)
            if self.drafter is not None:
                hidden = self._hidden()
                self.drafter.accepted(rid, new, None if hidden is None else hidden[: kept + 1])
        self.runner.allocator.free(table[idx, : len(seq) - 1].clone())
        self.runner.table.free(idx)
        if self.drafter is not None:
            self.drafter.release(rid)
        return seq[len(prompt) : len(prompt) + new_tokens]


def record_drafts(drafter: ChainDrafter) -> list:
    """The list every draft the drafter proposes from now on is appended to."""
    drafts, propose = [], drafter.propose

    def recording(inputs):
        out = propose(inputs)
        drafts.extend(out)
        return out

    drafter.propose = recording
    return drafts


def record_modes(runner: ModelRunner) -> list[ForwardMode]:
    """The list the mode of every batch the runner runs from now on is appended to."""
    modes, forward = [], runner.forward

    def recording(fb):
        modes.append(fb.mode)
        return forward(fb)

    runner.forward = recording
    return modes


@pytest.fixture(scope="module")
def plain(target: ModelRunner) -> list[list[int]]:
    loop = TargetLoop(target, None)
    return [loop.generate(str(i), p) for i, p in enumerate(PROMPTS)]


def assert_idle(*runners: ModelRunner, held: int = 0) -> None:
    """Every slot and table row free, but `held`: the slots a head's pool mirrors of the target's (head_kv.py)."""
    for r in runners:
        assert r.allocator.available_size() == r.allocator.size - held
        assert r.table.available_size() == r.table.size


# ---------------------------------------------------------------------------------------------- STANDALONE
def test_standalone_draft_is_lossless(target, target_dir, plain, tmp_path_factory) -> None:
    draft = make_runner(build_tiny_model("llama", tmp_path_factory.mktemp("draft"), seed=1))
    loop = TargetLoop(target, StandaloneDrafter(draft, 4))
    assert [loop.generate(str(i), p) for i, p in enumerate(PROMPTS)] == plain
    assert_idle(target, draft)


def test_standalone_same_model_drafts_the_target_greedy_output(target, plain) -> None:
    """The target drafting for itself guesses every token: propose must be the target's own greedy chain."""
    drafter = StandaloneDrafter(target, 4)
    prompt, expected = PROMPTS[0], plain[0]
    chains = drafter.propose([DraftInput("a", prompt + expected[:1], 4), DraftInput("b", prompt, 3)])
    assert chains == [expected[1:5], expected[:3]]
    chains = drafter.propose([DraftInput("a", prompt + expected[:4], 4)])  # three accepted, catch up on them
    assert chains == [expected[4:8]]
    drafter.release("a")
    drafter.release("b")
    assert_idle(target)


def test_standalone_long_catch_up_goes_in_chunks(target, plain, monkeypatch) -> None:
    import kiln.speculative.draft_model as draft_model

    monkeypatch.setattr(draft_model, "CATCH_UP_CHUNK", 4)
    drafter = StandaloneDrafter(target, 4)
    prompt, expected = PROMPTS[1], plain[1]  # 10 tokens + 1: two chunks of 4, then 3 with the drafting rows
    assert drafter.propose([DraftInput("a", prompt + expected[:1], 4)]) == [expected[1:5]]
    drafter.release("a")
    assert_idle(target)


def test_standalone_accept_length_with_itself(target, plain) -> None:
    loop = TargetLoop(target, StandaloneDrafter(target, 4))
    # drafter and verifier share one pool here: the drafter's rows come and go between the target's steps
    assert loop.generate("a", PROMPTS[0]) == plain[0]
    assert loop.accepted_drafts >= NEW_TOKENS - 4


# ---------------------------------------------------------------------------------------------- vocabulary
@pytest.mark.unit
def test_other_vocabulary_is_refused_naming_both(target_dir: Path) -> None:
    from kiln.text.tokenizer import load_tokenizer

    tok = load_tokenizer(str(target_dir))
    check_same_vocabulary(("t", 10, tok), ("d", 10, tok))
    with pytest.raises(DraftRefused, match=r"draft model d has a vocabulary of 12 tokens, the target t 10"):
        check_same_vocabulary(("t", 10, tok), ("d", 12, tok))

    class Other:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "b": 1}

    with pytest.raises(DraftRefused, match=r"draft model d's tokenizer .* differs from the target t's"):
        check_same_vocabulary(("t", 10, tok), ("d", 10, Other()))


# ---------------------------------------------------------------------------------------------- EAGLE heads
def _random(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) * 0.08


def save_head(out: Path, target_dir: Path, eagle3: bool, draft_vocab: int = 512, seed: int = 0) -> str:
    """A random head in the public layout: EAGLE's `fc` + `layers.0.*` (with an embedding SGLang ignores),
    EAGLE-3's `midlayer.*`, `norm`, its own `lm_head` over `draft_vocab` ids and `d2t` / `t2d`."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    config = json.loads((target_dir / "config.json").read_text())
    width, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = width // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    layer = "midlayer" if eagle3 else "layers.0"
    into = 2 * width if eagle3 else width
    tensors = {
        f"{layer}.self_attn.q_proj.weight": _random(q, into),
        f"{layer}.self_attn.k_proj.weight": _random(kv, into),
        f"{layer}.self_attn.v_proj.weight": _random(kv, into),
        f"{layer}.self_attn.o_proj.weight": _random(width, q),
        f"{layer}.mlp.gate_proj.weight": _random(inter, width),
        f"{layer}.mlp.up_proj.weight": _random(inter, width),
        f"{layer}.mlp.down_proj.weight": _random(width, inter),
        f"{layer}.post_attention_layernorm.weight": 1 + _random(width),
    }
    config.update(num_hidden_layers=1)
    if eagle3:
        hot = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[hot] = True
        tensors |= {
            "fc.weight": _random(width, 3 * width),
            f"{layer}.input_layernorm.weight": 1 + _random(width),
            f"{layer}.hidden_norm.weight": 1 + _random(width),
            "norm.weight": 1 + _random(width),
            "lm_head.weight": _random(draft_vocab, width) * 4,
            "d2t": hot - torch.arange(draft_vocab),
            "t2d": t2d,
        }
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
    else:
        tensors |= {"fc.weight": _random(width, 2 * width), "fc.bias": _random(width)}
        tensors["embed_tokens.weight"] = _random(vocab, width)
        config.update(architectures=["LlamaForCausalLMEagle"])
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
def test_a_head_missing_one_part_of_a_merged_weight_is_refused(eagle3, eagle_target, target_dir, tmp_path):
    """A head without its k_proj loaded with that third of qkv_proj left as whatever memory held: refused
    now, naming the tensor, as the target's load refuses it."""
    from safetensors.torch import load_file, save_file

    from kiln.speculative.eagle import load_head

    head = Path(save_head(tmp_path / "head", target_dir, eagle3))
    tensors = load_file(str(head / "model.safetensors"))
    layer = "midlayer" if eagle3 else "layers.0"
    del tensors[f"{layer}.self_attn.k_proj.weight"]
    save_file(tensors, str(head / "model.safetensors"))
    # (an EAGLE-3 head's midlayer is named by its layer in Kiln, layers.0)
    with pytest.raises(
        DraftRefused, match=r"lacks 1 tensors, e.g. \['[a-z.0]+\.self_attn\.k_proj\.weight'\]"
    ):
        load_head(str(head), eagle_target.model, torch.float32, "cpu", 256)


@pytest.fixture(scope="module")
def eagle_target(target_dir: Path) -> ModelRunner:
    """A target runner of its own: attaching a head changes what its forward keeps."""
    return make_runner(target_dir)


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
def test_eagle_head_is_lossless(eagle3, eagle_target, target_dir, plain, tmp_path) -> None:

    path = save_head(tmp_path / "head", target_dir, eagle3)
    sizes = PoolSizes(POOL, RUNNING, CONTEXT, 1)
    drafter = build_eagle_drafter(path, eagle_target, sizes, 4)
    width = 3 * 64 if eagle3 else 64
    proposals: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def recording(inputs):
        chains = propose(inputs)
        proposals.append((inputs[0].token_ids, chains[0]))
        return chains

    drafter.propose = recording
    loop = TargetLoop(eagle_target, drafter)
    assert [loop.generate(str(i), p) for i, p in enumerate(PROMPTS)] == plain
    assert eagle_target.model.last_hidden.shape[-1] == width
    assert all(chain for _, chain in proposals)  # every step drafted: the pairs reached each last token
    assert_idle(eagle_target)
    assert_idle(drafter.runner, held=drafter.mirrored - 1)
    # drafting incrementally (catching up step by step) equals drafting from the whole sequence at once
    seq, chain = proposals[-1]
    loop.drafter = None
    fresh = build_eagle_drafter(path, eagle_target, sizes, 4)
    idx = eagle_target.table.alloc()
    loop._extend(idx, 0, seq[:-1])
    hidden = eagle_target.model.last_hidden
    fresh.accepted("x", seq[1:], hidden)
    slots = eagle_target.table.req_to_token[idx, : len(seq) - 1]
    assert fresh.propose([DraftInput("x", seq, 4, kv_slots=slots)]) == [chain]
    # a head joining after a prefix the target read from its cache, whose head KV it cannot find (no slots
    # handed over), starts after the prefix and drafts still
    fresh.accepted("y", seq[4:], hidden[3:])
    assert len(fresh.propose([DraftInput("y", seq, 4)])[0]) == 4
    assert fresh.sequences["y"].base == 3
    eagle_target.allocator.free(slots.clone())
    eagle_target.table.free(idx)
    fresh.release("x")
    fresh.release("y")
    assert_idle(fresh.runner, held=fresh.mirrored - 1)
    eagle_target.model.capture_hidden = None


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
def test_a_heads_catch_up_as_decode_rows_drafts_as_its_extend(
    eagle3, eagle_target, target_dir, tmp_path
) -> None:
    """Catch-ups run as decode rows (one a token, each attending up to its own column: what a captured catch-up
    runs) give the logits and drafts of the same catch-ups run as one extend: two requests catching up on 5 and 2
    tokens past their first 3, up to column 8. Catch-ups the captured shapes do not hold stay extends: more
    tokens a request, more requests or more KV columns than they take."""
    path = save_head(tmp_path / "head", target_dir, eagle3)
    sizes = PoolSizes(POOL, RUNNING, CONTEXT, 1)
    loop, requests, fed = TargetLoop(eagle_target, None), [], 3
    shapes = {"extend": None, "rows": CatchUpShapes(16, 16, columns=8), "tokens": CatchUpShapes(4, 16),
              "requests": CatchUpShapes(16, 1), "columns": CatchUpShapes(16, 16, columns=7)}  # fmt: skip
    drafters = {name: build_eagle_drafter(path, eagle_target, sizes, 3) for name in shapes}
    for rid, prompt in zip("ab", (PROMPTS[0], PROMPTS[2])):
        seq = prompt + loop.generate(rid, prompt, new_tokens=3)
        idx = eagle_target.table.alloc()
        loop._extend(idx, 0, seq[:-1])
        slots = eagle_target.table.req_to_token[idx, : len(seq) - 1]
        requests.append((rid, seq, idx, slots, eagle_target.model.last_hidden))
    drafts, steps = {}, {}
    for name, drafter in drafters.items():
        for rid, seq, _, slots, hidden in requests:  # the first tokens, caught up on as an extend
            drafter.accepted(rid, seq[1 : fed + 1], hidden[:fed])
            drafter.propose([DraftInput(rid, seq[: fed + 1], 3, kv_slots=slots[:fed])])
        drafter.catch_up_shapes = shapes[name]
        forward, seen = drafter.runner.forward, []

        def recording(fb, forward=forward, seen=seen):
            logits = forward(fb)
            seen.append((fb.mode, int(fb.input_ids.shape[0]), logits))
            return logits

        drafter.runner.forward = recording
        for rid, seq, _, _, hidden in requests:
            drafter.accepted(rid, seq[fed + 1 :], hidden[fed:])
        drafts[name] = drafter.propose(
            [DraftInput(rid, seq, 3, kv_slots=slots) for rid, seq, _, slots, _ in requests]
        )
        steps[name] = seen[0]
        for rid, *_ in requests:
            drafter.release(rid)
        assert_idle(drafter.runner, held=drafter.mirrored - 1)
    lengths = [len(seq) - 1 - fed for _, seq, *_ in requests]
    assert lengths == [5, 2]
    kinds = {name: step[0] for name, step in steps.items()}
    assert kinds == dict.fromkeys(shapes, ForwardMode.EXTEND) | {"rows": ForwardMode.DECODE}
    assert all(step[1] == 7 for step in steps.values())
    # the logits of each request's last token, then the chains drafted from them
    assert steps["rows"][2].shape[0] == 2
    torch.testing.assert_close(steps["rows"][2], steps["extend"][2], rtol=1e-5, atol=1e-5)
    assert drafts["rows"] == drafts["extend"] and all(len(d) == 3 for d in drafts["extend"])
    for _, _, idx, slots, _ in requests:
        eagle_target.allocator.free(slots.clone())
        eagle_target.table.free(idx)
    eagle_target.model.capture_hidden = None


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
def test_eagle_head_keeps_its_kv_for_a_cached_prefix(eagle3, eagle_target, target_dir, tmp_path) -> None:
    """The head's KV sits in the target's slots, stamped with the prefix it was computed for: a request whose
    prompt the target read from its cache (no hidden states for it) drafts exactly as one whose every hidden state
    the head saw; the same slots under another prefix's stamps, or none, make it start after the prefix."""
    path = save_head(tmp_path / "head", target_dir, eagle3)
    drafter = build_eagle_drafter(path, eagle_target, PoolSizes(POOL, RUNNING, CONTEXT, 1), 4)
    table = eagle_target.table.req_to_token
    loop = TargetLoop(eagle_target, None)
    prompt = PROMPTS[0] + [22, 23, 24]
    idx = eagle_target.table.alloc()
    logits = loop._extend(idx, 0, prompt)
    seq = [*prompt, int(logits[-1].argmax())]
    slots = table[idx, : len(seq) - 1]
    # "a" computed the prompt: the head catches up on it, into the target's slots
    drafter.accepted("a", seq[1:], eagle_target.model.last_hidden)
    full = drafter.propose([DraftInput("a", seq, 4, kv_slots=slots)])[0]
    # "b" read the prompt from the cache and computed only its last token: the head's KV is there for it
    last = eagle_target.model.last_hidden[-1:]
    drafter.accepted("b", seq[-1:], last)
    assert drafter.propose([DraftInput("b", seq, 4, kv_slots=slots)])[0] == full
    assert drafter.sequences["b"].base == 0
    # "c" holds other tokens in the same slots (stamps of another prefix): it starts after the prefix
    other = [seq[0] + 1, *seq[1:]]
    drafter.accepted("c", other[-1:], last)
    assert len(drafter.propose([DraftInput("c", other, 4, kv_slots=slots)])[0]) == 4
    assert drafter.sequences["c"].base == len(seq) - 2  # the cached prompt but its last token
    for rid in "abc":
        drafter.release(rid)
    eagle_target.allocator.free(slots.clone())
    eagle_target.table.free(idx)
    assert_idle(eagle_target)
    assert_idle(drafter.runner, held=target_pool_rows(eagle_target) - 1)  # page 0 is never mirrored
    eagle_target.model.capture_hidden = None


def test_eagle3_layers_follow_sglang(eagle_target: ModelRunner, target_dir: Path) -> None:
    from kiln.models.eagle import eagle3_capture_layers

    assert eagle3_capture_layers(None, 32) == (2, 16, 29)
    head = {
        **json.loads((target_dir / "config.json").read_text()),
        "architectures": ["LlamaForCausalLMEagle3"],
    }
    named = model_spec({**head, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}})
    # SGLang takes the output of layer i: the input of i + 1
    assert eagle3_capture_layers(named.aux_hidden_layers, 32) == (2, 16, 29)
    repeated = model_spec({**head, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 0]}})
    with pytest.raises(DraftRefused, match=r"layers \[2, 2, 1\] of the target t, which has 7 layers"):
        attach_target(eagle_target.model, repeated, "t")
    assert eagle_target.model.capture_hidden is None


# ---------------------------------------------------------------------------------------------- through serve
ENGINE_ARGS = dict(max_total_tokens=4096, max_running_requests=8, num_threads=1, disable_cuda_graph=True)
ENGINE_PROMPTS = [*PROMPTS, PROMPTS[0] + [22, 23], [1, *range(300, 340)]]


def engine_outputs(path: Path, **spec) -> tuple[list[list[int]], list[int], int]:
    """Greedy outputs of the prompts, twice (the second time on radix-cache hits); the tokens drafted by the
    end of each round, and the drafts the target accepted."""
    import kiln

    eng = kiln.Engine(model_path=str(path), **ENGINE_ARGS, **spec)
    try:
        params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        spec_step, drafted = eng.scheduler.spec, []
        ids = [o["output_ids"] for o in eng.generate(input_ids=ENGINE_PROMPTS, sampling_params=params)]
        drafted.append(spec_step.drafter.drafted_tokens if spec_step else 0)
        again = eng.generate(input_ids=ENGINE_PROMPTS, sampling_params=params)
        assert [o["output_ids"] for o in again] == ids
        drafted.append(spec_step.drafter.drafted_tokens if spec_step else 0)
        return ids, drafted, spec_step.totals.accepted_drafts if spec_step else 0
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def engine_plain(target_dir: Path) -> list[list[int]]:
    return engine_outputs(target_dir)[0]


def test_engine_standalone_matches_plain(target_dir: Path, engine_plain) -> None:
    """The target as its own draft: every draft is right, so the verify step keeps them (and the output)."""
    ids, drafted, accepted = engine_outputs(
        target_dir, speculative_algorithm="STANDALONE", speculative_draft_model_path=str(target_dir)
    )
    assert ids == engine_plain
    assert accepted >= drafted[-1] // 2 > 0


def test_engine_eagle3_matches_plain(target_dir: Path, engine_plain, tmp_path, monkeypatch) -> None:
    """A random EAGLE-3 head through serve: the prefill hands it the prompt's features, so it drafts; on radix
    hits it finds its own KV of the cached prefix in the target's slots and drafts on from there."""
    from kiln.speculative.head_kv import TargetSlotKV

    joins = []
    join = TargetSlotKV._join_cached_prefix

    def recording(self, seq, inp, prefix):
        joins.append(join(self, seq, inp, prefix))
        return joins[-1]

    monkeypatch.setattr(TargetSlotKV, "_join_cached_prefix", recording)
    path = save_head(tmp_path / "head3", target_dir, eagle3=True)
    ids, drafted, _ = engine_outputs(
        target_dir, speculative_algorithm="EAGLE3", speculative_draft_model_path=path
    )
    assert ids == engine_plain
    assert 0 < drafted[0] < drafted[1]
    assert any(joins)  # the second round's radix hits


def test_engine_refuses_another_vocabulary(target_dir: Path, tmp_path) -> None:
    import kiln
    from kiln.scheduler.resolve import StartupRefused

    config = json.loads((target_dir / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target_dir / name).exists():
            (other / name).write_bytes((target_dir / name).read_bytes())
    (other / "config.json").write_text(json.dumps(config | {"vocab_size": config["vocab_size"] + 64}))
    with pytest.raises(
        StartupRefused, match=rf"draft model {other} has a vocabulary of .* the target {target_dir}"
    ):
        kiln.Engine(
            model_path=str(target_dir),
            **ENGINE_ARGS,
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(other),
        )


# ---------------------------------------------------------------------------------------------- NEXTN
def save_deepseek_with_mtp(out: Path) -> Path:
    """A tiny DeepSeek-V3 whose checkpoint holds a complete MTP layer (numbered num_hidden_layers)."""
    from moe_models import deepseek_hf_model
    from safetensors.torch import save_file

    model, tok = deepseek_hf_model(0, num_hidden_layers=4)  # its last layer becomes the MTP layer
    model.save_pretrained(out)
    tok.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(
        json.dumps(config | {"num_hidden_layers": 3, "num_nextn_predict_layers": 1})
    )
    head = {f"model.layers.3.{n}.weight": 1 + _random(64) for n in ("enorm", "hnorm", "shared_head.norm")}
    head["model.layers.3.eh_proj.weight"] = _random(64, 128)
    save_file(head, str(out / "mtp.safetensors"))
    return out


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> Path:
    return save_deepseek_with_mtp(tmp_path_factory.mktemp("deepseek"))


@pytest.fixture(scope="module")
def deepseek(deepseek_dir: Path) -> tuple[ModelRunner, list[list[int]]]:
    target = make_runner(deepseek_dir)
    return target, [TargetLoop(target, None).generate(str(i), p) for i, p in enumerate(PROMPTS)]


def test_nextn_is_lossless(deepseek) -> None:
    from kiln.speculative.nextn import build_nextn_drafter

    target, expected = deepseek
    proposals: dict[int, list] = {}
    for rows in (0, 4):  # catch-ups as extends, then as decode rows (what a captured catch-up runs)
        drafter = build_nextn_drafter(target, PoolSizes(POOL, RUNNING, CONTEXT, 1), 3)
        drafter.catch_up_shapes = CatchUpShapes(rows, RUNNING) if rows else None
        proposals[rows], modes = record_drafts(drafter), record_modes(drafter.runner)
        assert [TargetLoop(target, drafter, 3).generate(str(i), p) for i, p in enumerate(PROMPTS)] == expected
        assert (ForwardMode.DECODE in modes[::3]) == bool(rows)  # every catch-up: the first forward of 3
        assert drafter.drafted_tokens > 0
        assert_idle(target)
        assert_idle(drafter.runner, held=drafter.mirrored - 1)
    assert proposals[4] == proposals[0]


def test_engine_nextn_matches_plain(deepseek_dir: Path, deepseek) -> None:
    """Through serve: --speculative-algorithm NEXTN needs no draft path, the MTP layer drafts."""
    import kiln

    eng = kiln.Engine(model_path=str(deepseek_dir), **ENGINE_ARGS, speculative_algorithm="NEXTN")
    try:
        params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        outs = eng.generate(input_ids=PROMPTS, sampling_params=params)
        assert [o["output_ids"] for o in outs] == deepseek[1]
        assert eng.scheduler.spec.drafter.drafted_tokens > 0
        assert not eng.scheduler.runner.model.mtp_weights  # the head holds its own copy
    finally:
        eng.shutdown()


def test_without_nextn_the_mtp_layer_is_not_kept(deepseek_dir: Path) -> None:
    """The loader sets a checkpoint's MTP layer aside for NEXTN; a server that does not draft with it lets it go
    once startup has decided, rather than hold a layer's weights in host memory the ledger does not count."""
    import kiln

    eng = kiln.Engine(model_path=str(deepseek_dir), **ENGINE_ARGS)
    try:
        assert not eng.scheduler.runner.model.mtp_weights
        assert eng.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 2})["output_ids"]
    finally:
        eng.shutdown()


def test_the_ledger_counts_the_nextn_heads_kv(deepseek_dir: Path, deepseek) -> None:
    """NEXTN's head mirrors the target's slots on a latent pool of its own, one target layer's KV per token, and
    holds its guesses above them: the ledger counts both (the model has no draft config to read them from)."""
    from kiln.config import ServerArgs
    from kiln.scheduler.resolve import plan_ledger
    from kiln.speculative.nextn import build_nextn_drafter

    base = dict(model_path=str(deepseek_dir), device="cpu", device_memory="16GiB", max_running_requests=4)
    plain = plan_ledger(ServerArgs(**base)).ledger
    nextn = plan_ledger(ServerArgs(**base, speculative_algorithm="NEXTN")).ledger
    head_per_token = nextn.kv_bytes_per_token - plain.kv_bytes_per_token
    target, _ = deepseek
    pool = build_nextn_drafter(target, PoolSizes(POOL, RUNNING, CONTEXT, 1), 3).runner.kv_pool
    assert head_per_token == pool.k_bytes // pool.k[0].shape[0] == plain.kv_bytes_per_token // 3
    assert nextn.line("draft guess slots").bytes == 4 * (3 + 1) * head_per_token  # SGLang's 3 steps, a chain


def test_an_mtp_layer_missing_one_part_of_a_merged_weight_is_refused(deepseek, monkeypatch) -> None:
    """Its MLP without up_proj loaded with that half of gate_up_proj left as whatever memory held: refused now,
    naming the tensor, as the target's load refuses it."""
    from kiln.speculative.nextn import build_nextn_drafter

    target, _ = deepseek
    kept = dict(target.model.mtp_weights)
    gone = next(
        n for n in kept if n.endswith("mlp.up_proj.weight") or n.endswith("shared_experts.up_proj.weight")
    )
    monkeypatch.setattr(target.model, "mtp_weights", {n: t for n, t in kept.items() if n != gone})
    with pytest.raises(DraftRefused, match=r"MTP layer lacks 1 tensors, e.g. \[.*up_proj\.weight'\]"):
        build_nextn_drafter(target, PoolSizes(POOL, RUNNING, CONTEXT, 1), 3)


def test_nextn_needs_an_mtp_layer(target: ModelRunner) -> None:
    from kiln.speculative.nextn import build_nextn_drafter

    with pytest.raises(DraftRefused, match="has none"):
        build_nextn_drafter(target, PoolSizes(POOL, RUNNING, CONTEXT, 1), 3)


# ---------------------------------------------------------------------------------------------- the ledger
def test_the_ledger_counts_the_draft(target_dir: Path, target: ModelRunner) -> None:
    """`kiln plan` and serve count the draft's weights and its KV per token; the loaded draft holds that much."""
    from kiln.config import ServerArgs
    from kiln.scheduler.resolve import plan_ledger
    from kiln.speculative.draft_model import build_standalone_drafter
    from kiln.text.tokenizer import load_tokenizer

    args = ServerArgs(model_path=str(target_dir), max_total_tokens=POOL, device="cpu")
    plain_ledger = plan_ledger(args).ledger
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(target_dir))
    ledger = plan_ledger(ServerArgs(**vars(args) | spec)).ledger
    config = json.loads((target_dir / "config.json").read_text())
    assert ledger.line("draft weights").bytes == model_spec(config).weight_bytes(1, 4)
    assert not plain_ledger.has_line("draft weights")
    draft_cell = model_spec(config).kv_bytes_per_token(1, 4)
    assert ledger.kv_bytes_per_token == plain_ledger.kv_bytes_per_token + draft_cell
    assert f"+ draft {draft_cell} B" in ledger.line("kv bytes per token").inputs
    sizes = PoolSizes(POOL, RUNNING, CONTEXT, 1)
    drafter = build_standalone_drafter(
        str(target_dir), target, load_tokenizer(str(target_dir)), sizes, 3, False
    )
    assert drafter.runner.measured["weights"] == ledger.line("draft weights").bytes
    pool = drafter.runner.kv_pool
    assert pool.num_tokens <= POOL  # never more tokens than the ledger's pool counts the draft's bytes for
    assert (pool.k_bytes + pool.v_bytes) // (pool.num_tokens + pool.page_size) == draft_cell


def test_drafts_read_the_kv_with_the_targets_attention_backend(
    target_dir: Path, engine_plain, tmp_path
) -> None:
    """--attention-backend reaches the draft's runner as well as the target's: a draft model and an EAGLE-3 head
    both attend with the Triton kernels (here in Triton's interpreter), and the output stays the plain one."""
    import kiln
    from kiln.runner.attention.triton_backend import TritonBackend

    head = save_head(tmp_path / "head3", target_dir, eagle3=True)
    for spec in (
        {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(target_dir)},
        {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": head},
    ):
        eng = kiln.Engine(model_path=str(target_dir), attention_backend="triton", **ENGINE_ARGS, **spec)
        try:
            backends = [eng.scheduler.runner.attn_backend, eng.scheduler.spec.drafter.runner.attn_backend]
            assert all(isinstance(b, TritonBackend) for b in backends), backends
            # two prompts, a few verify steps each: the interpreter is slow (greedy: the plain outputs' heads)
            params = {"temperature": 0, "max_new_tokens": INTERPRETED_TOKENS, "ignore_eos": True}
            out = eng.generate(input_ids=ENGINE_PROMPTS[:2], sampling_params=params)
            assert [o["output_ids"] for o in out] == [o[:INTERPRETED_TOKENS] for o in engine_plain[:2]]
            # verification hides a wrong draft, its acceptance does not: the target drafting for itself has most
            # drafts accepted (a near tie may part the two in float)
            if spec["speculative_algorithm"] == "STANDALONE":
                assert eng.scheduler.spec.accept_rate() >= 0.5
        finally:
            eng.shutdown()
