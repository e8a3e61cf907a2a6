"""Tensor parallelism over processes: `kiln serve --tp-size N` gives the tokens one rank gives (greedy, batched,
chunked prefill, radix hits, n > 1, aborts), on the default model and on random Llama (decoding speculatively with
NGRAM trees) and Qwen3 models (the Qwen3
one with fewer KV heads than ranks, so each rank holds a replica of the one KV head), a Qwen3-MoE with whole experts
per rank (--ep-size 2) and a DeepSeek-V3 (latent attention, grouped routing); each rank allocates what
`kiln plan` predicts; a rank that crashes or stalls ends the server naming it; two `kiln serve` processes form
one group as node 0 and node 1 (tests/test_tp_faults.py has the failures, the nodes and SIGTERM).

The ranks' all-reduce adds the partial sums in another order than one rank's matmul, so a logit may differ in
its last bits; these models' greedy tokens have clear winners and come out identical, which is what is asserted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from moe_models import build_tiny_deepseek, build_tiny_moe

from tests.conftest import TINY, ServerProcess, build_tiny_model

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fib(n):"]
LONG_PROMPT = " ".join(f"item {i}," for i in range(40))  # several chunks of --chunked-prefill-size 16
# exact: tp 2 must give tp 1's tokens, which float32 arithmetic keeps; with activations rounded to int8 (the GGUF
# default, auto) the all-reduce's last-bit differences can move a value across a rounding step
COMMON = ["--device", "cpu", "--max-total-tokens", "4096", "--chunked-prefill-size", "16"]
COMMON += ["--cpu-gemm", "exact"]
GREEDY = {"max_new_tokens": 10, "temperature": 0}
SAMPLED = {"max_new_tokens": 8, "temperature": 0.8, "seed": 7, "n": 2}


def build_kv1_qwen3(out_dir: Path) -> str:
    """A tiny Qwen3 with one KV head: at tp 2 each rank holds a replica of it."""
    saved = dict(TINY["qwen3"])
    TINY["qwen3"].update(num_key_value_heads=1)
    try:
        return str(build_tiny_model("qwen3", out_dir, seed=1))
    finally:
        TINY["qwen3"].clear()
        TINY["qwen3"].update(saved)


def generate(url: str, text, params: dict, timeout: float = 120) -> dict | list:
    r = httpx.post(f"{url}/generate", json={"text": text, "sampling_params": params}, timeout=timeout)
    r.raise_for_status()
    return r.json()


def ids(result) -> list:
    return [ids(x) for x in result] if isinstance(result, list) else result["output_ids"]


def reference(model: str, **engine_args) -> dict[str, object]:
    """What one rank gives (the in-process engine with the same flags)."""
    import kiln

    eng = kiln.Engine(
        model_path=model,
        device="cpu",
        max_total_tokens=4096,
        chunked_prefill_size=16,
        cpu_gemm="exact",
        **engine_args,
    )
    try:
        return {
            "alone": ids(eng.generate(PROMPTS[0], GREEDY)),
            "batched": ids(eng.generate(PROMPTS, GREEDY)),
            "long": ids(eng.generate(LONG_PROMPT, GREEDY)),
            "sampled": ids(eng.generate(PROMPTS[1], SAMPLED)),
        }
    finally:
        eng.shutdown()


# the random Llama's cluster decodes speculatively: NGRAM trees (breadth 4) verified on every rank alike, the
# kept tokens rank 0's, sampled draws included (its one-rank reference speculates the same way)
TREES = {"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 4}


class Cluster:
    def __init__(
        self, model: str, tp: int, log_dir: Path, flags: tuple[str, ...] = (), spec: dict | None = None
    ):
        self.expected = reference(model, **(spec or {}))
        spec_flags = [f"--{k.replace('_', '-')}={v}" for k, v in (spec or {}).items()]
        self.tp, self.flags, self.spec = tp, ["--tp-size", str(tp), *flags, *spec_flags], spec
        self.srv = ServerProcess(["--model-path", model, *self.flags, *COMMON], log_dir / "serve.log")
        self.srv.wait_ready()


# the MoE models: Qwen3-MoE with whole experts per rank (--ep-size 2), DeepSeek-V3 (MLA heads and a slice of
# every expert per rank, its grouped router and shared expert on both)
@pytest.fixture(scope="module", params=["default", "llama", "qwen3_kv1", "qwen3_moe_ep2", "deepseek_v3"])
def cluster(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"tp-{request.param}")
    flags: tuple[str, ...] = ()
    spec = None
    if request.param == "default":  # 9 attention heads, 3 KV heads: tp 3 is its smallest split
        model, tp = request.getfixturevalue("default_model"), 3
    elif request.param == "llama":
        model, tp, spec = request.getfixturevalue("tiny_llama"), 2, TREES
    elif request.param == "qwen3_moe_ep2":
        model, tp, flags = str(build_tiny_moe(d / "model")), 2, ("--ep-size", "2")
    elif request.param == "deepseek_v3":
        model, tp = str(build_tiny_deepseek(d / "model")), 2
    else:  # with the host and storage tiers: the ranks agree on what their own files hold
        model, tp = build_kv1_qwen3(d / "model"), 2
        tiers = ("--enable-hierarchical-cache", "--hicache-size", "0.01", "--hicache-storage-backend", "file")
        flags = (*tiers, "--hicache-storage-dir", str(d / "kv"))
    c = Cluster(model, tp, d, flags, spec)
    yield c
    c.srv.stop()


def test_tp_gives_one_ranks_tokens(cluster):
    url, want = cluster.srv.url, cluster.expected
    assert ids(generate(url, PROMPTS[0], GREEDY)) == want["alone"]
    assert ids(generate(url, PROMPTS, GREEDY)) == want["batched"]
    assert ids(generate(url, LONG_PROMPT, GREEDY)) == want["long"]  # chunked prefill
    again = generate(url, LONG_PROMPT, GREEDY)  # radix hit
    assert again["meta_info"]["cached_tokens"] > 0 and ids(again) == want["long"]
    assert ids(generate(url, PROMPTS[1], SAMPLED)) == want["sampled"]  # n > 1, seeded: rank 0's draws
    if cluster.spec:  # the trees were verified: drafts were kept
        assert again["meta_info"]["spec_verify_ct"] > 0
        assert again["meta_info"]["spec_accept_length"] > 1.0


def test_abort_keeps_the_ranks_in_step(cluster):
    """A request aborted mid-decode ends on every rank alike: the next request still gives one rank's tokens."""
    url = cluster.srv.url
    body = {"text": PROMPTS[2], "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    chunks = []
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunks.append(json.loads(line[5:]))
            if len(chunks) == 1:
                httpx.post(f"{url}/abort_request", json={"abort_all": True}, timeout=10).raise_for_status()
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert chunks[-1]["meta_info"]["completion_tokens"] < 3000
    assert ids(generate(url, PROMPTS[0], GREEDY)) == cluster.expected["alone"]


def test_every_rank_reports_its_memory(cluster):
    url = cluster.srv.url
    info = httpx.get(f"{url}/get_server_info", timeout=10).json()
    assert info["tp_size"] == cluster.tp and len(info["memory_check_per_rank"]) == cluster.tp
    status = httpx.get(f"{url}/status", timeout=10).json()
    assert len(status["memory_check_per_rank"]) == cluster.tp
    log = cluster.srv.log_text()
    assert f"TP{cluster.tp - 1}] Load weight end" in log and "Init torch distributed: backend gloo" in log
    for rank in range(cluster.tp):
        assert f"Memory check rank {rank} " in log


def test_plan_matches_each_rank(cluster, capsys):
    """`kiln plan --tp-size N` predicts what each rank allocates, within 5%."""
    import kiln.plan as plan

    info = httpx.get(f"{cluster.srv.url}/get_server_info", timeout=10).json()
    model = info["server_args"]["model_path"]
    rc = plan.main(["--model-path", model, *cluster.flags, *COMMON, "--json"])
    planned = {line["name"]: line["bytes"] for line in json.loads(capsys.readouterr().out)["lines"]}
    assert rc == 0
    for check in info["memory_check_per_rank"]:
        measured = {row["name"]: row["measured"] for row in check}
        for ledger_name, name in (("weights", "weights"), ("kv pool", "kv_pool")):
            assert abs(measured[name] - planned[ledger_name]) <= 0.05 * planned[ledger_name], (name, check)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
