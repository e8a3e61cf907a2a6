"""Draft models proposing trees (--speculative-eagle-topk above 1), as SGLang's EAGLE worker builds them: the
selection rule on hand-made scores against a port of SGLang's own; a tiny random Llama draft, EAGLE / EAGLE-3
heads and a NEXTN MTP layer whose every branch must draft what the model computes on that branch's own path (a
plain forward of the draft, or a chain forced along the path), with no draft KV slot left behind; then trees
verified by the scheduler's speculative step, greedy output identical to plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_draft_models
import torch
from conftest import build_tiny_model
from model_equality import one_torch_thread  # noqa: F401 (the fixture: one torch thread here)
from test_draft_models import CONTEXT, POOL, PROMPTS, RUNNING, make_runner, save_head

from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.runner.model_runner import ModelRunner, PoolSizes
from kiln.sampling_params import SamplingParams
from kiln.scheduler.io import GenerateReq
from kiln.scheduler.spec_step import SpecDecoder
from kiln.speculative.base import DraftInput, DraftTree
from kiln.speculative.draft_model import StandaloneDrafter, _Branches, _CatchUp, select_tree
from kiln.speculative.eagle import EagleDrafter, build_eagle_drafter
from kiln.speculative.head_kv import target_pool_rows

pytestmark = pytest.mark.engine

TOPK, STEPS = 3, 3
deepseek_dir = test_draft_models.deepseek_dir  # the fixture: a tiny DeepSeek-V3 with its MTP layer
TOLERANCE = 1e-4  # log-probability: a branch's rows are decode rows, the reference's an extend


# ---------------------------------------------------------------------------------------------- selection
def sglang_tree(probs: list[torch.Tensor], tokens: list[torch.Tensor], topk: int, num_draft_tokens: int):
    """SGLang's select_top_k_tokens, organize_draft_results and build_tree_kernel's parent rule for one request
    (`probs[0]`, `tokens[0]`: the root's top k; `probs[i]`, `tokens[i]`: [topk, topk], each live branch's)."""
    scores = probs[0].view(1, topk)
    score_list, token_list = [scores.unsqueeze(1)], [tokens[0].view(1, topk)]
    parents_list = [torch.arange(-1, topk).view(1, -1)]
    for i in range(1, len(probs)):
        expand = scores.unsqueeze(2) * probs[i].view(1, topk, topk)
        scores, index = torch.topk(expand.flatten(1), topk, dim=-1)
        score_list.append(expand)
        token_list.append(tokens[i].view(1, -1))
        parents_list.append(index + (topk * topk * (i - 1) + topk))
    flat = torch.cat(score_list, dim=1).flatten(1)
    chosen = torch.sort(torch.topk(flat, num_draft_tokens - 1, dim=-1).indices).values[0].tolist()
    parent_list = torch.cat(parents_list[:-1], dim=1)[0] if len(parents_list) > 1 else torch.empty(0)
    parents = [-1 if flat // topk == 0 else chosen.index(int(parent_list[flat // topk])) for flat in chosen]
    return DraftTree(tuple(torch.cat(token_list, dim=1)[0, chosen].tolist()), tuple(parents))


def grow(probs: list[torch.Tensor], tokens: list[torch.Tensor], num_nodes: int | None) -> DraftTree:
    """Kiln's tree from the same draft distributions (the paths' KV slots play no part here)."""
    topk = probs[0].numel()
    branches = _Branches.first(_CatchUp("r", [1], 0, len(probs)), probs[0], tokens[0], 0, torch.device("cpu"))
    for i in range(1, len(probs)):
        branches.expand(probs[i], tokens[i], torch.zeros(topk, i, dtype=torch.int64), 0)
    return branches.tree(num_nodes)


def likeliest(count: int, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` draft distributions' top `count`: probabilities, best first, and distinct token ids."""
    probs = torch.softmax(torch.randn(rows, 50, generator=generator) * 2, dim=-1).topk(count, dim=-1).values
    tokens = torch.stack([torch.randperm(50, generator=generator)[:count] for _ in range(rows)])
    return probs.squeeze(0), tokens.squeeze(0)


@pytest.mark.parametrize(
    "steps, topk, num_draft_tokens", [(3, 2, 6), (5, 4, 8), (4, 3, 12), (1, 3, 3), (2, 4, 21)]
)
@pytest.mark.unit
def test_selection_follows_sglang(steps: int, topk: int, num_draft_tokens: int) -> None:
    generator = torch.Generator().manual_seed(steps * 10 + topk)
    for _ in range(5):
        drawn = [likeliest(topk, 1, generator)] + [likeliest(topk, topk, generator) for _ in range(steps - 1)]
        probs, tokens = [p for p, _ in drawn], [t for _, t in drawn]
        tree = grow(probs, tokens, num_draft_tokens - 1)
        assert tree == sglang_tree(probs, tokens, topk, num_draft_tokens)
        assert len(tree) == num_draft_tokens - 1
        assert all(parent < node for node, parent in enumerate(tree.parents))
        assert max(tree.depth(n) for n in range(len(tree))) <= steps


@pytest.mark.unit
def test_selection_keeps_ancestors_on_ties() -> None:
    """Children as likely as their parent (probability 1) and equal branches: the tree still holds every chosen
    node's parent, and a parent comes before its children."""
    half, certain = torch.tensor([0.5, 0.5]), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    tokens = [torch.tensor([5, 6]), torch.tensor([[7, 8], [9, 10]]), torch.tensor([[11, 12], [13, 14]])]
    for count in range(1, 9):
        tree = grow([half, certain, certain], tokens, count)
        assert len(tree) == count
        assert all(parent < node for node, parent in enumerate(tree.parents))
    assert grow([half, certain, certain], tokens, 4) == DraftTree((5, 6, 7, 9), (-1, -1, 0, 1))
    # select_tree alone: a later candidate tied with an earlier one loses, so no orphan is picked
    tree = select_tree(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 1]), 2)
    assert tree == DraftTree((1, 2), (-1, 0))


# ---------------------------------------------------------------------------------------------- a draft model
@pytest.fixture(scope="module")
def draft(tiny_llama: str) -> ModelRunner:
    return make_runner(tiny_llama)


def plain_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """The model's distribution after `tokens` by one plain extend on a table row of its own (freed after)."""
    idx, table = runner.table.alloc(), runner.table.req_to_token
    slots = runner.allocator.alloc(len(tokens))
    table[idx, : len(tokens)] = slots
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.arange(len(tokens)),
        out_cache_loc=slots,
        logits_index=torch.tensor([len(tokens) - 1]),
        extend_lens=[len(tokens)],
        prefix_lens=[0],
        seq_slots=[table[idx, : len(tokens)]],
    )
    logits = runner.forward(fb)[0].float()
    runner.allocator.free(slots)
    table[idx] = 0
    runner.table.free(idx)
    return logits


def assert_likeliest(tokens: list[int], logits: torch.Tensor) -> None:
    """`tokens` are the distribution's likeliest, best first (up to rounding between two near-equal ones)."""
    logp = torch.log_softmax(logits, dim=-1)
    assert len(set(tokens)) == len(tokens)
    assert all(float(logp[t]) >= float(logp.topk(len(tokens)).values[-1]) - TOLERANCE for t in tokens)
    assert all(float(logp[a]) >= float(logp[b]) - TOLERANCE for a, b in zip(tokens, tokens[1:]))


def check_branches(tree: DraftTree, reference) -> int:
    """Every node's children (the root's too) are the likeliest tokens of `reference(path tokens)`; the number of
    nodes that have children."""
    expanded = 0
    for node in range(-1, len(tree)):
        children = tree.children(node)
        if not children:
            continue
        path = [tree.tokens[n] for n in tree.path(node)] if node >= 0 else []
        assert_likeliest([tree.tokens[c] for c in children], reference(path))
        expanded += 1
    return expanded


def assert_idle(runner: ModelRunner, held: int = 0) -> None:
    """Every slot and table row free, but `held`: the slots a head's pool mirrors of the target's (head_kv.py)."""
    assert runner.allocator.available_size() == runner.allocator.size - held
    assert runner.table.available_size() == runner.table.size


def test_standalone_tree_branches_follow_their_own_paths(draft: ModelRunner) -> None:
    """A batch of three: two full trees (every candidate kept: each expanded branch's children are visible) and
    one with room for one level. Each branch's children are the draft's likeliest after that branch's path."""
    drafter = StandaloneDrafter(draft, STEPS, TOPK)
    inputs = [
        DraftInput("a", PROMPTS[0], STEPS),
        DraftInput("b", PROMPTS[1], 1),
        DraftInput("c", PROMPTS[2], 9),
    ]
    trees = drafter.propose(inputs)
    assert all(isinstance(t, DraftTree) for t in trees)
    assert [len(t) for t in trees] == [
        TOPK + (STEPS - 1) * TOPK * TOPK,
        TOPK,
        TOPK + (STEPS - 1) * TOPK * TOPK,
    ]
    # the guesses' KV is gone: the draft holds the tokens the target kept, nothing more
    assert draft.allocator.size - draft.allocator.available_size() == sum(len(i.token_ids) for i in inputs)
    for inp, tree in zip(inputs, trees):
        root = [tree.tokens[c] for c in tree.children(-1)]
        assert root == plain_logits(draft, inp.token_ids).topk(TOPK).indices.tolist()
        expanded = check_branches(tree, lambda path, inp=inp: plain_logits(draft, inp.token_ids + path))
        assert expanded == (1 + (STEPS - 1) * TOPK if inp.num_draft >= STEPS else 1)
    for inp in inputs:
        drafter.release(inp.rid)
    assert_idle(draft)


def test_standalone_tree_is_the_best_scored_subtree(draft: ModelRunner) -> None:
    """With SGLang's node budget (num_draft_tokens - 1) the tree is a subtree of the full one, the size asked."""
    whole = StandaloneDrafter(draft, STEPS, TOPK)
    full = whole.propose([DraftInput("a", PROMPTS[0], STEPS)])[0]
    whole.release("a")
    drafter = StandaloneDrafter(draft, STEPS, TOPK, num_nodes=7)
    small = drafter.propose([DraftInput("a", PROMPTS[0], STEPS)])[0]
    assert len(small) == 7
    full_paths = {tuple(full.tokens[n] for n in full.path(node)) for node in range(len(full))}
    assert all(tuple(small.tokens[n] for n in small.path(node)) in full_paths for node in range(len(small)))
    # a catch-up on tokens the target kept since, then a tree again
    grown = drafter.propose([DraftInput("a", PROMPTS[0] + [small.tokens[0], 22], STEPS)])[0]
    root = [grown.tokens[c] for c in grown.children(-1)]
    assert root == plain_logits(draft, PROMPTS[0] + [small.tokens[0], 22]).topk(TOPK).indices.tolist()
    drafter.release("a")
    assert_idle(draft)


def test_a_short_pool_gives_a_smaller_tree(draft: ModelRunner) -> None:
    """The pool runs dry at the second step: the tree keeps what the first gave, and every guess slot returns."""
    drafter = StandaloneDrafter(draft, STEPS, TOPK)
    calls: list[int] = []

    def alloc(n: int) -> torch.Tensor | None:
        calls.append(n)
        return draft.allocator.alloc(n) if len(calls) < 3 else None  # the catch-up, the first step

    drafter._alloc = alloc
    tree = drafter.propose([DraftInput("a", PROMPTS[0], STEPS)])[0]
    assert len(tree) == TOPK + TOPK * TOPK and max(tree.depth(n) for n in range(len(tree))) == 2
    assert draft.allocator.size - draft.allocator.available_size() == len(PROMPTS[0])
    drafter.release("a")
    assert_idle(draft)


@pytest.mark.unit
def test_branch_rows_and_pool() -> None:
    """A branch row: its request's first columns then its own path's slots; the pool holds every branch."""
    from kiln.memory.req_to_token import ReqToTokenPool
    from kiln.speculative.draft_model import draft_pool_sizes

    pool = ReqToTokenPool(2, 8)
    pool.req_to_token[0, :3] = torch.tensor([5, 6, 7])
    pool.req_to_token[1, :1] = torch.tensor([9])
    table, mask = pool.branch_table(
        torch.tensor([0, 0, 1]), torch.tensor([3, 3, 1]), torch.tensor([[20], [21], [22]])
    )
    assert table.tolist() == [[5, 6, 7, 20], [5, 6, 7, 21], [9, 22, 0, 0]]
    assert mask.view(3, 4).tolist() == [[True] * 4, [True] * 4, [True, True, False, False]]
    assert draft_pool_sizes(PoolSizes(10**6, 4, 100, 1), 3, 4) == PoolSizes(4 * (100 + 4 * 3), 4, 103, 1)
    assert draft_pool_sizes(PoolSizes(10**6, 4, 100, 1), 3) == PoolSizes(4 * 103, 4, 103, 1)


def test_topk_one_drafts_todays_chains(draft: ModelRunner) -> None:
    inputs = [DraftInput("a", PROMPTS[0], 4), DraftInput("b", PROMPTS[2], 2)]
    today = StandaloneDrafter(draft, 4)
    chains = today.propose(inputs)
    assert all(isinstance(c, list) for c in chains) and [len(c) for c in chains] == [4, 2]
    drafter = StandaloneDrafter(draft, 4, 1, num_nodes=8)
    assert drafter.propose(inputs) == chains
    for inp in inputs:
        today.release(inp.rid)
        drafter.release(inp.rid)
    assert_idle(draft)
    # the chain's first token is the root's likeliest, as the tree's first child is
    assert chains[0][0] == int(plain_logits(draft, PROMPTS[0]).argmax())


# ---------------------------------------------------------------------------------------------- an EAGLE head
class ForcedChain(EagleDrafter):
    """A topk-1 EAGLE chain made to walk `path`, recording the head's distribution at each step: what a tree
    branch along that path must compute (its features are the head's own hidden state of its parent's row)."""

    def __init__(self, runner: ModelRunner, path: list[int]):
        super().__init__(runner, len(path) + 1)
        self.path, self.seen = path, []

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        # over the target's vocabulary (an EAGLE-3 head's own ids mapped; the ids it cannot propose impossible)
        seen = torch.full((self.runner.model_config.vocab_size,), -torch.inf)
        seen[self._to_target_ids(torch.arange(logits.shape[-1]))] = logits[0].float()
        self.seen.append(seen)
        step = len(self.seen) - 1
        return [self.path[step] if step < len(self.path) else 0]


@pytest.fixture(scope="module")
def eagle_target(tmp_path_factory) -> tuple[ModelRunner, Path]:
    """A 7-layer tiny Llama: EAGLE-3's default layers (2, 3, 4) are distinct there."""
    from conftest import TINY
    from model_equality import random_model
    from transformers import LlamaConfig, LlamaForCausalLM

    model, tok = random_model(LlamaConfig, LlamaForCausalLM, 0, **dict(TINY["llama"], num_hidden_layers=7))
    out = tmp_path_factory.mktemp("target")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return make_runner(out), out


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
def test_eagle_tree_branches_read_their_own_features(eagle3: bool, eagle_target, tmp_path) -> None:
    target, target_dir = eagle_target
    path = save_head(tmp_path / "head", target_dir, eagle3)
    check_head_tree(
        target, build_eagle_drafter(path, target, PoolSizes(POOL, RUNNING, CONTEXT, 1), STEPS, TOPK)
    )


@pytest.mark.unit
def test_nextn_tree_branches_read_their_own_features(deepseek_dir: Path) -> None:
    """The MTP layer as a head: latent attention over each branch's own table row."""
    from kiln.speculative.nextn import build_nextn_drafter

    target = make_runner(deepseek_dir)
    chain = build_nextn_drafter(target, PoolSizes(POOL, RUNNING, CONTEXT, 1), STEPS)
    check_head_tree(target, EagleDrafter(chain.runner, STEPS, TOPK))


def check_head_tree(target: ModelRunner, drafter: EagleDrafter) -> None:
    """A head's tree after the target's prefill of a prompt: every branch's children are the head's likeliest
    after that branch's path, as a chain forced along the path computes them; nothing left in either pool."""
    seq = PROMPTS[0] + [22]
    idx = target.table.alloc()
    slots = target.allocator.alloc(len(seq) - 1)
    target.table.req_to_token[idx, : len(seq) - 1] = slots
    target.forward(
        ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(seq[:-1]),
            positions=torch.arange(len(seq) - 1),
            out_cache_loc=slots,
            logits_index=None,
            extend_lens=[len(seq) - 1],
            prefix_lens=[0],
            seq_slots=[target.table.req_to_token[idx, : len(seq) - 1]],
        )
    )
    hidden = target.model.last_hidden  # the pairs (token p + 1, the target's hidden state at p)
    drafter.accepted("x", seq[1:], hidden)
    tree = drafter.propose([DraftInput("x", seq, STEPS)])[0]
    assert len(tree) == TOPK + (STEPS - 1) * TOPK * TOPK

    def reference(walk: list[int]) -> torch.Tensor:
        chain = ForcedChain(drafter.runner, walk)
        chain.accepted("ref", seq[1:], hidden)
        chain.propose([DraftInput("ref", seq, len(walk) + 1)])
        chain.release("ref")
        return chain.seen[len(walk)]

    assert check_branches(tree, reference) == 1 + (STEPS - 1) * TOPK
    drafter.release("x")
    assert_idle(drafter.runner, held=target_pool_rows(target) - 1)
    target.allocator.free(slots)
    target.table.free(idx)
    target.model.capture_hidden = None


# ---------------------------------------------------------------------------------------------- end to end
ENGINE_PROMPTS = [[1, 450, 3681, 310, 3444, 338], [1, *range(300, 340)], [1, 22, 22, 22, 22, 22, 22, 22]]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0}


@pytest.fixture(scope="module")
def engine(tiny_llama: str):
    import kiln

    eng = kiln.Engine(model_path=tiny_llama, device="cpu", disable_cuda_graph=True, max_total_tokens=4096)
    yield eng
    eng.shutdown()


def run_engine(engine, drafter, num_nodes: int) -> tuple[list[list[int]], SpecDecoder | None]:
    """Greedy outputs of ENGINE_PROMPTS through the engine's scheduler, verifying `drafter`'s trees (None: plain
    decoding); the KV pool's integrity checked after."""
    sched = engine.scheduler
    sched.spec = SpecDecoder(drafter, num_nodes, num_nodes + 1) if drafter is not None else None
    rids = [f"e{i}-{id(drafter)}" for i in range(len(ENGINE_PROMPTS))]
    for rid, prompt in zip(rids, ENGINE_PROMPTS):
        sched.add_request(GenerateReq(rid, list(prompt), SamplingParams(**GREEDY).normalize()))
    ids: dict[str, list[int]] = {rid: [] for rid in rids}
    while sched.has_work:
        for out in sched.step():
            ids[out.rid].extend(out.new_ids)
    report = sched.check_integrity()
    assert report["ok"], report
    spec, sched.spec = sched.spec, None
    return [ids[rid] for rid in rids], spec


@pytest.fixture(scope="module")
def engine_plain(engine) -> list[list[int]]:
    return run_engine(engine, None, 0)[0]


@pytest.mark.parametrize("draft_kind, topk, steps, nodes", [("random", 2, 3, 5), ("same", 4, 4, 8)])
def test_engine_standalone_trees_match_plain(
    engine, engine_plain, tiny_llama, tmp_path, draft_kind, topk, steps, nodes
):
    """A random draft (mostly wrong) and the target's own weights as the draft (mostly right)."""
    path = tiny_llama if draft_kind == "same" else build_tiny_model("llama", tmp_path / "draft", seed=2)
    drafter = StandaloneDrafter(make_runner(path), steps, topk, nodes)
    ids, spec = run_engine(engine, drafter, nodes)
    assert ids == engine_plain
    assert drafter.drafted_tokens > 0
    if draft_kind == "same":
        assert spec.accept_length() > 2.0
    assert_idle(drafter.runner)


def test_engine_eagle_trees_match_plain(engine, engine_plain, tiny_llama, tmp_path) -> None:
    target = engine.scheduler.runner
    path = save_head(tmp_path / "head", Path(tiny_llama), eagle3=False)
    drafter = build_eagle_drafter(path, target, PoolSizes(POOL, RUNNING * 2, CONTEXT, 1), 3, 3, 6)
    try:
        ids, spec = run_engine(engine, drafter, 6)
    finally:
        target.model.capture_hidden = None
    assert ids == engine_plain
    # the head drafted (nearly) every step: its pairs reached each request's last token
    assert drafter.drafted_tokens > 3 * spec.totals.verify_ct > 0
    assert_idle(drafter.runner, held=target_pool_rows(target) - 1)
