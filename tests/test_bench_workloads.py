"""Benchmark workloads: exact token lengths, seeding, shared prefixes, multi-turn growth, JSONL."""

from __future__ import annotations

import json
import random
import re

import pytest

from kiln.bench import workloads as w

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    """A small byte-level BPE trained on the workload's own prose: words split into several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    trainer = trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator([w.prose(rng, 50) for _ in range(100)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_random_prompts_have_exact_token_lengths(tok):
    convs = w.random_workload(tok, 40, input_len=120, output_len=30, range_ratio=0.5, seed=7)
    assert len(convs) == 40
    in_lens = [c.turns[0].prompt_len for c in convs]
    for c in convs:
        (turn,) = c.turns
        assert len(_ids(tok, turn.prompt)) == turn.prompt_len
        assert 60 <= turn.prompt_len <= 120 and 15 <= turn.output_len <= 30
    assert len(set(in_lens)) > 10  # really spread over the range


def test_random_prompts_are_english_prose(tok):
    (conv,) = w.random_workload(tok, 1, input_len=300, output_len=8, range_ratio=1.0, seed=1)
    words = re.findall(r"[A-Za-z]+", conv.turns[0].prompt)[:-1]  # the last word may be cut
    known = set(w._WORDS)
    assert len(words) > 50 and all(x.lower() in known for x in words)
    assert conv.turns[0].prompt.count(".") >= 3


def test_range_ratio_follows_sglang(tok):
    fixed = w.random_workload(tok, 8, input_len=50, output_len=20, range_ratio=1.0, seed=0)
    assert {(c.turns[0].prompt_len, c.turns[0].output_len) for c in fixed} == {(50, 20)}
    assert all(1 <= n <= 10 for n in w.sample_lens(random.Random(0), 200, 10, 0.0))
    assert min(w.sample_lens(random.Random(0), 200, 10, 0.0)) == 1


def test_seeding_is_deterministic(tok):
    def prompts(seed):
        return [c.turns[0].prompt for c in w.random_workload(tok, 5, 80, 10, 0.0, seed)]

    assert prompts(3) == prompts(3)
    assert prompts(3) != prompts(4)
    a = w.shared_prefix_workload(tok, 2, 3, 60, 10, 5, seed=9)
    b = w.shared_prefix_workload(tok, 2, 3, 60, 10, 5, seed=9)
    assert [c.turns[0].prompt for c in a] == [c.turns[0].prompt for c in b]


def test_shared_prefix_groups_share_prefix_tokens(tok):
    sys_len, q_len = 200, 24
    convs = w.shared_prefix_workload(tok, 3, 4, sys_len, q_len, output_len=16, seed=0)
    assert len(convs) == 12
    ids = [_ids(tok, c.turns[0].prompt) for c in convs]
    for c, i in zip(convs, ids, strict=True):
        assert len(i) == c.turns[0].prompt_len == sys_len + q_len
        assert c.turns[0].output_len == 16
    groups = [ids[g * 4 : (g + 1) * 4] for g in range(3)]
    for group in groups:
        assert all(i[:sys_len] == group[0][:sys_len] for i in group)
        assert len({tuple(i[sys_len:]) for i in group}) == 4  # distinct questions
    assert len({tuple(g[0][:sys_len]) for g in groups}) == 3  # groups differ


def test_multi_turn_each_turn_resends_the_conversation(tok):
    convs = w.multi_turn_workload(tok, 2, num_turns=3, input_len=20, output_len=8, range_ratio=1.0, seed=0)
    assert [len(c.turns) for c in convs] == [3, 3]
    turns = convs[0].turns
    assert all(len(_ids(tok, t.prompt)) == t.prompt_len == 20 for t in turns)
    history, prev, lens = [], "", []
    for i, t in enumerate(turns):
        text = w.render_text(history, t.prompt)
        assert text.startswith(prev) and t.prompt in text
        lens.append(len(_ids(tok, text)))
        history.append((t.prompt, f"answer {i}"))
        prev = text + f" answer {i}\n"
    assert lens[0] < lens[1] < lens[2] and lens[2] > 3 * 20
    msgs = w.render_messages(history[:2], turns[2].prompt)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[1]["content"] == "answer 0" and msgs[-1]["content"] == turns[2].prompt


def test_jsonl_workload(tok, tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "The cat sat on the mat.", "output_len": 7},
        {"prompt": "Hello world", "output_len": 3},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    convs = w.jsonl_workload(tok, str(path))
    assert [(c.turns[0].prompt, c.turns[0].output_len) for c in convs] == [
        (r["prompt"], r["output_len"]) for r in rows
    ]
    assert convs[0].turns[0].prompt_len == len(_ids(tok, rows[0]["prompt"]))
    assert len(w.jsonl_workload(tok, str(path), num_prompts=1)) == 1
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="p.jsonl:1"):
        w.jsonl_workload(tok, str(path))


def test_fit_to_tokens(tok):
    text = w.prose(random.Random(5), 100)
    for n in (1, 7, 33):
        assert len(_ids(tok, w.fit_to_tokens(tok, text, n))) == n
    with pytest.raises(ValueError, match="fewer"):
        w.fit_to_tokens(tok, "cat", 50)


def test_default_model_tokenizer():
    """The shipped GGUF's tokenizer: exact lengths and shared prefixes hold there too (~8 s to load)."""
    tok = w.load_tokenizer(None)
    for c in w.random_workload(tok, 10, 200, 16, 0.0, seed=1):
        assert len(_ids(tok, c.turns[0].prompt)) == c.turns[0].prompt_len
    convs = w.shared_prefix_workload(tok, 2, 3, 300, 16, 8, seed=0)
    ids = [_ids(tok, c.turns[0].prompt) for c in convs]
    assert all(len(i) == 316 for i in ids)
    assert ids[0][:300] == ids[2][:300] and ids[3][:300] == ids[5][:300] and ids[0][:300] != ids[3][:300]
