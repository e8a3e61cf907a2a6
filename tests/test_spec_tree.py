"""Tree verification (--speculative-eagle-topk > 1): greedy output identical to plain decoding whatever tree a
drafter proposes (random trees, the right continuation on a later branch, always-wrong trees, chains), with
stop ids and strings, max_new_tokens cut mid-path, penalties, logprobs, n > 1, and the KV pool intact after; the
accepted path's KV moved where plain decoding writes it (a follow-up turn hits it in the radix cache); the
target-only tree rule keeps the target distribution; NGRAM trees; a chain builds today's verify batch; the flags
resolve as SGLang's."""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

import numpy as np
import pytest
import test_speculative
import torch

import kiln
from kiln.config import ServerArgs
from kiln.memory.req_to_token import ReqToTokenPool
from kiln.runner.sampler import SamplingRow, target_probs
from kiln.sampling_params import SamplingParams
from kiln.scheduler.spec_step import SpecDecoder, build_verify
from kiln.speculative.base import DraftInput, DraftTree
from kiln.speculative.ngram import NgramDrafter, TreeShape, bfs_tree
from kiln.speculative.settings import TREE_ALGORITHMS, resolve
from kiln.speculative.verify import Tree, verify_tree_sampled

pytestmark = pytest.mark.engine

NUM_DRAFT = 9
PROMPTS = [
    list(range(300, 340)) * 3,
    [7, 8, 9, 10, 11, 12] * 12 + [13, 14],
    list(range(1000, 1064)) + list(range(1000, 1030)),
]
GREEDY = {"max_new_tokens": 20, "temperature": 0.0}


# ---------------------------------------------------------------------------------------------- drafters
def _add(tokens: list[int], parents: list[int], parent: int, token: int) -> int:
    tokens.append(token)
    parents.append(parent)
    return len(tokens) - 1


def _free_token(rng: random.Random, vocab: int, taken: set[int]) -> int:
    while True:
        token = rng.randrange(vocab)
        if token not in taken:
            return token


def random_tree(rng: random.Random, vocab: int, size: int, right: list[int]) -> DraftTree:
    """A random tree holding the path `right`, each of its tokens after one or two wrong siblings, then random
    nodes (distinct tokens among siblings, never `right`'s token beside it)."""
    tokens: list[int] = []
    parents: list[int] = []
    parent = -1
    for token in right:
        for _ in range(rng.randint(1, 2)):
            siblings = {tokens[i] for i, p in enumerate(parents) if p == parent}
            _add(tokens, parents, parent, _free_token(rng, vocab, siblings | {token}))
        parent = _add(tokens, parents, parent, token)
    while len(tokens) < size:
        parent = rng.randrange(-1, len(tokens))
        siblings = {tokens[i] for i, p in enumerate(parents) if p == parent}
        _add(tokens, parents, parent, _free_token(rng, vocab, siblings))
    return DraftTree(tuple(tokens), tuple(parents))


class ScriptedTreeDrafter:
    """Proposes trees built around plain decoding's continuation (known from a reference run): `kind` "hidden"
    holds the right path on later branches, "random" a random one, "wrong" none, "chain" is the right chain."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], kind: str, vocab: int, seed: int = 0):
        self.references, self.kind, self.vocab = references, kind, vocab
        self.rng = random.Random(seed)

    def _continuation(self, item: DraftInput) -> list[int]:
        for prompt, ref in self.references.items():
            if tuple(item.token_ids[: len(prompt)]) == prompt:
                done = len(item.token_ids) - len(prompt)
                return ref[done:]
        return []

    def propose(self, inputs: list[DraftInput]) -> list[list[int] | DraftTree]:
        out: list[list[int] | DraftTree] = []
        for item in inputs:
            right = self._continuation(item)
            if self.kind == "chain":
                out.append(right[: item.num_draft])
                continue
            depth = {"hidden": 4, "random": self.rng.randint(0, 2), "wrong": 0}[self.kind]
            # a tree larger than the step's room: the verify step cuts it
            out.append(random_tree(self.rng, self.vocab, NUM_DRAFT + 3, right[:depth]))
        return out

    def accepted(self, rid, tokens, hidden) -> None:
        pass

    def release(self, rid) -> None:
        pass


# ---------------------------------------------------------------------------------------------- end to end
engine = test_speculative.engine  # the fixture: a tiny llama engine


def _run(engine, prompts, params: dict, drafter, logprobs_out: list | None = None):
    """test_speculative's scheduler loop with this module's draft budget."""
    return test_speculative._run(
        engine, prompts, params, drafter, num_draft=NUM_DRAFT, logprobs_out=logprobs_out
    )


@pytest.fixture(scope="module")
def reference(engine):
    ids, _, _ = _run(engine, PROMPTS, GREEDY, None)
    return ids


def _scripted(engine, reference, kind: str, seed: int = 0) -> ScriptedTreeDrafter:
    vocab = engine.parts.model_config.vocab_size
    return ScriptedTreeDrafter({tuple(p): r for p, r in zip(PROMPTS, reference)}, kind, vocab, seed)


@pytest.mark.parametrize("kind", ["hidden", "random", "wrong", "chain"])
def test_tree_greedy_identical(engine, reference, kind):
    ids, outs, spec = _run(engine, PROMPTS, GREEDY, _scripted(engine, reference, kind))
    assert ids == reference
    if kind in ("hidden", "chain"):
        assert spec.accept_length() > 2.0
        assert sum(o.spec_accepted_drafts for o in outs) == spec.totals.accepted_drafts
    if kind == "wrong":
        assert spec.totals.accepted_drafts == 0


def test_trees_cut_at_stops_max_tokens_and_processed_rows(engine, reference):
    stop_id = reference[0][9]
    stop_text = engine.tokenizer.decode(reference[1][5:7])
    for params in (
        {"max_new_tokens": 7, "temperature": 0.0},
        {"max_new_tokens": 20, "temperature": 0.0, "stop_token_ids": [stop_id]},
        {"max_new_tokens": 20, "temperature": 0.0, "stop": [stop_text]},
        {"max_new_tokens": 20, "temperature": 0.0, "min_new_tokens": 12, "stop_token_ids": [stop_id]},
        {"max_new_tokens": 12, "temperature": 0.0, "frequency_penalty": 0.7, "logprobs": True},
    ):
        plain_logprobs: list = []
        tree_logprobs: list = []
        plain, plain_outs, _ = _run(engine, PROMPTS[:2], params, None, plain_logprobs)
        # paths run past the stops and max_new_tokens: the full greedy continuation where it is the same
        drafter = _scripted(engine, plain if "frequency_penalty" in params else reference, "hidden", seed=3)
        ids, outs, spec = _run(engine, PROMPTS[:2], params, drafter, tree_logprobs)
        assert ids == plain, params
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in plain_outs]
        assert spec.totals.accepted_drafts > 0
        if params.get("logprobs"):
            assert tree_logprobs == plain_logprobs and all(len(x) == 12 for x in plain_logprobs)


def test_n_samples_and_moved_kv_in_the_radix_cache(engine, reference):
    sched = engine.scheduler
    sched.spec = SpecDecoder(_scripted(engine, reference, "hidden", seed=5), NUM_DRAFT, NUM_DRAFT + 1)
    try:
        samples = engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "n": 2})
    finally:
        sched.spec = None
    assert [s["output_ids"] for s in samples] == [reference[0]] * 2
    # a follow-up turn reads the first turn's KV from the radix cache: after a tree run it holds the moved
    # nodes' KV, which must be the bits plain decoding wrote
    follow_ups = [p + r + [5, 6] for p, r in zip(PROMPTS, reference)]
    after = {}
    for label, drafter in (("plain", None), ("tree", _scripted(engine, reference, "hidden", seed=7))):
        sched.kv.flush()
        _run(engine, PROMPTS, GREEDY, drafter)
        after[label], outs, _ = _run(engine, follow_ups, {"max_new_tokens": 6, "temperature": 0.0}, None)
        assert all(o.cached_tokens > len(p) for o, p in zip(outs, PROMPTS))
    assert after["tree"] == after["plain"]


def test_trees_on_a_paged_pool(tiny_llama, engine, reference):
    paged = kiln.Engine(
        model_path=tiny_llama, device="cpu", disable_cuda_graph=True, max_total_tokens=2048, page_size=4
    )
    ids, _, spec = _run(paged, PROMPTS[:2], GREEDY, _scripted(engine, reference, "hidden", seed=11))
    assert ids == reference[:2] and spec.totals.accepted_drafts > 0  # _run checked the pool's integrity


def test_ngram_trees_identical_to_plain(engine, reference):
    drafter = NgramDrafter(max_breadth=4, max_nodes=NUM_DRAFT)
    ids, _, spec = _run(engine, PROMPTS, GREEDY, drafter)
    assert ids == reference
    assert spec.accept_length() > 1.0


def test_sampled_trees_run_and_are_seeded(engine, reference):
    params = {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 5}
    first, _, _ = _run(engine, PROMPTS[:1], params, _scripted(engine, reference, "random", seed=1))
    again, _, _ = _run(engine, PROMPTS[:1], params, _scripted(engine, reference, "random", seed=1))
    assert first == again and len(first[0]) == 8


# ---------------------------------------------------------------------------------------------- verify rule
def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert int(counts[~keep].sum()) == 0, "drew a token of zero probability"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.unit
def test_target_only_tree_rule_keeps_the_target_distribution():
    vocab, trials = 6, 3000
    torch.manual_seed(0)
    logits = torch.randn(6, vocab) * 1.5
    params = SamplingParams(temperature=0.9, top_k=5).normalize()
    generator = torch.Generator().manual_seed(1)
    rows = [SamplingRow(params, generator, [1, 2], []) for _ in range(6)]
    target = target_probs(logits, rows)
    likely = target[0].argsort(descending=True).tolist()
    # three siblings under the root, the likeliest second; the first sibling (node 0) has children 2 and 0;
    # a token the target never picks at a row of node 0 (top_k) is a child too
    children = target[1].argsort(descending=True).tolist()
    tree = DraftTree((likely[1], likely[0], likely[4], children[1], children[5]), (-1, -1, -1, 0, 0))
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)  # the token after node 0's, drawn at node 0's row
    accepted = 0
    for _ in range(trials):
        verdict = verify_tree_sampled(Tree(logits, rows, tree))
        first[verdict.tokens[0]] += 1
        if verdict.tokens[0] == likely[1]:
            second[verdict.tokens[1]] += 1
        accepted += verdict.accepted
    assert accepted > 0 and second.sum() > 100
    # 5 degrees of freedom at most; 20.5 is the 0.999 quantile
    assert _chi_square(first, target[0]) < 20.5
    assert _chi_square(second, target[1]) < 20.5


# ---------------------------------------------------------------------------------------------- verify batch
def _requests(table: ReqToTokenPool, lengths: list[int]) -> list[SimpleNamespace]:
    reqs = []
    for i, n in enumerate(lengths):
        idx = table.alloc()
        table.req_to_token[idx, : n + NUM_DRAFT + 1] = torch.arange(n + NUM_DRAFT + 1) + 1000 * (i + 1)
        reqs.append(SimpleNamespace(kv_len=n, last_token=7 + i, table_idx=idx))
    return reqs


@pytest.mark.unit
def test_a_chain_builds_todays_verify_batch():
    table = ReqToTokenPool(4, 64)
    reqs = _requests(table, [5, 9, 3])
    drafts = [[11, 12, 13], [], [14]]
    fb = build_verify(reqs, [DraftTree.chain(d) for d in drafts], table)
    # today's batch: row j of a request attends to its first kv_len + j + 1 columns, at position kv_len + j
    owners, lengths = [], []
    for r, draft in zip(reqs, drafts):
        owners += [r.table_idx] * (len(draft) + 1)
        lengths += list(range(r.kv_len + 1, r.kv_len + len(draft) + 2))
    rows, seq_lens = torch.tensor(owners), torch.tensor(lengths)
    kv_table, mask = table.decode_table(rows, seq_lens)
    assert torch.equal(fb.kv_table, kv_table) and torch.equal(fb.kv_mask, mask)
    assert torch.equal(fb.positions, seq_lens - 1)
    assert torch.equal(fb.out_cache_loc, table.req_to_token[rows, seq_lens - 1])
    assert fb.input_ids.tolist() == [7, 11, 12, 13, 8, 9, 14]


@pytest.mark.unit
def test_a_tree_row_attends_to_its_path():
    table = ReqToTokenPool(2, 64)
    (r,) = _requests(table, [4])
    tree = DraftTree((20, 21, 22, 23), (-1, -1, 1, 1))  # node 2 and 3 under node 1
    fb = build_verify([r], [tree], table)
    slot = lambda col: 1000 + col  # noqa: E731
    prefix = [slot(c) for c in range(5)]  # kv_len + 1 columns: the prefix and the root
    expected = [
        prefix,
        prefix + [slot(5)],
        prefix + [slot(6)],
        prefix + [slot(6), slot(7)],
        prefix + [slot(6), slot(8)],
    ]
    width = max(len(e) for e in expected)
    for row, want in enumerate(expected):
        assert fb.kv_table[row, : len(want)].tolist() == want
        assert fb.kv_mask[row, 0, 0].tolist() == [c < len(want) for c in range(width)]
    assert fb.positions.tolist() == [4, 5, 5, 6, 6]
    assert fb.out_cache_loc.tolist() == [slot(c) for c in range(4, 9)]


# ---------------------------------------------------------------------------------------------- trees, NGRAM
@pytest.mark.unit
def test_tree_cut_and_follow():
    tree = DraftTree((1, 2, 3, 4, 5, 6), (-1, -1, 0, 2, 1, 4))
    assert tree.cut(6, 6) is tree
    assert tree.cut(6, 2) == DraftTree((1, 2, 3, 5), (-1, -1, 0, 1))
    assert tree.cut(3, 9) == DraftTree((1, 2, 3), (-1, -1, 0))
    assert tree.cut(0, 3) == DraftTree((), ())
    assert DraftTree.chain([4, 5, 6]).cut(2, 9) == DraftTree.chain([4, 5])
    assert tree.follow([2, 5, 6, 9]) == [1, 4, 5]
    assert tree.follow([1, 3, 7]) == [0, 2]
    assert DraftTree.of([8, 9]) == DraftTree.chain([8, 9]) and DraftTree.of(tree) is tree


@pytest.mark.unit
def test_ngram_bfs_tree_follows_several_matches():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 7, 1, 2, 3])
    tree = bfs_tree(tokens, TreeShape(1, 4, 8, 5), 1, 12)
    # "1 2 3" was followed by 9 and, more recently, by 4: both branch from the root, the recent one first
    assert tree.children(-1)[:2] == [0, 1] and tree.tokens[:2] == (4, 9)
    assert tree.tokens[tree.children(0)[0]] == 5 and len(tree) == 8
    assert all(p < i for i, p in enumerate(tree.parents))
    assert max(tree.depth(i) for i in range(len(tree))) <= 5
    # breadth 1 is today's chain
    item = DraftInput("a", tokens.tolist(), 4)
    assert NgramDrafter().propose([item]) == [[4, 5, 1, 2]]


# ---------------------------------------------------------------------------------------------- flags
def _args(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli(parser.parse_args(list(argv)))


def _resolve(architecture: str, *argv: str):
    s = resolve(_args(*argv), architecture)
    return s.num_steps, s.topk, s.num_draft_tokens


@pytest.mark.unit
def test_flags_resolve_trees_with_sglang_defaults():
    assert _resolve("x", "--speculative-algorithm", "NGRAM") == (1, 10, 12)  # SGLang's BFS breadth 10
    assert _resolve("x", "--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "1") == (11, 1, 12)
    assert _resolve("x", "--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "10") == (1, 10, 12)
    assert _resolve(
        "x",
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-eagle-topk",
        "4",
        "--speculative-num-draft-tokens",
        "9",
    ) == (2, 4, 9)
    eagle = _resolve("LlamaForCausalLM", "--speculative-algorithm", "EAGLE", "--speculative-draft-model", "d")
    assert eagle == ((5, 4, 8) if "EAGLE" in TREE_ALGORITHMS else (5, 1, 6))
    assert _resolve("DeepseekV3ForCausalLM", "--speculative-algorithm", "NEXTN") == (3, 1, 4)
    standalone = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model", "d")
    assert _resolve("LlamaForCausalLM", *standalone) == (3, 1, 4)


@pytest.mark.unit
def test_flags_refused_naming_the_range():
    with pytest.raises(ValueError, match="--speculative-eagle-topk 0 must be >= 1"):
        resolve(_args("--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "0"), "x")
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens 1 must be >= 2"):
        resolve(
            _args(
                "--speculative-algorithm",
                "NGRAM",
                "--speculative-eagle-topk",
                "3",
                "--speculative-num-draft-tokens",
                "1",
            ),
            "x",
        )
    draft = ("--speculative-draft-model", "d")
    too_many = (
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "2",
        "--speculative-num-draft-tokens",
        "8",
    )
    for algorithm in ("STANDALONE", "EAGLE", "EAGLE3", "NEXTN"):
        argv = ("--speculative-algorithm", algorithm, *draft, *too_many)
        if algorithm in TREE_ALGORITHMS:
            with pytest.raises(
                ValueError, match=r"--speculative-num-draft-tokens 8 .* valid range is 2\.\.7"
            ):
                resolve(_args(*argv), "x")
        else:
            with pytest.raises(ValueError, match=f"--speculative-eagle-topk 2: Kiln's {algorithm} drafter"):
                resolve(_args(*argv), "x")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.unit
def test_copy_slots_moves_every_layer_bit_for_bit(dtype):
    from kiln.memory.kv_pool import KVPool, LatentKVPool

    for pool in (KVPool(16, 1, 2, 2, 4, dtype), LatentKVPool(16, 1, 2, 6, dtype)):
        for rows in pool.k + pool.v:
            rows.copy_(torch.randn(rows.shape).to(dtype))
        before = [rows.clone() for rows in pool.k + pool.v]
        src, dst = torch.tensor([7, 9]), torch.tensor([5, 6])
        pool.copy_slots(src, dst)
        for old, new in zip(before, pool.k + pool.v):
            as_bytes = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731
            assert torch.equal(as_bytes(new[dst]), as_bytes(old[src]))
            keep = [i for i in range(new.shape[0]) if i not in (5, 6)]
            assert torch.equal(as_bytes(new[keep]), as_bytes(old[keep]))
