"""`kiln plan` and `kiln serve` are one path from the flags to the ledger: the same flags, the same ledger, and
every fix the plan offers is one serve accepts and that fits."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

import kiln.plan as plan
from kiln.config import ServerArgs
from kiln.core.dtypes import kv_cache_dtype_name, resolve_dtype_name
from kiln.core.sharding import kv_heads_per_rank
from kiln.loader.default_model import default_model_path
from kiln.loader.model_config import read_model_spec
from kiln.memory.fix_search import flags_argv, offered_fixes, serve_accepts
from kiln.memory.ledger import compute_core, compute_ledger
from kiln.memory.ledger_types import LedgerInputs
from kiln.models.shapes import checkpoint_dtype, half_dtype
from kiln.models.spec import ModelSpec
from kiln.scheduler.launch import build_engine
from kiln.scheduler.resolve import StartupRefused, plan_ledger, resolve, target_platform

pytestmark = pytest.mark.engine

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 512, "tie_word_embeddings": True,
}  # fmt: skip


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln serve")
    ServerArgs.add_cli_args(parser)
    return parser


def serve_args(argv: list[str]) -> ServerArgs:
    """What `kiln serve` makes of these words (ServerArgs' checks included), the default model filled in."""
    return ServerArgs.from_cli(serve_parser().parse_args(argv)).with_defaults()


def plan_json(capsys, argv: list[str]) -> tuple[int, dict]:
    rc = plan.main(argv + ["--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


# ---------------------------------------------------------------- every offered fix is one serve takes


FAILING = {
    "kv_allocation, --mem-fraction-static too low": [
        "--device", "cuda", "--device-memory", "80GiB", "--mem-fraction-static", "0.18"],
    "kv_allocation, --max-total-tokens": ["--device", "cuda", "--device-memory", "24GiB", "--max-total-tokens", "200000"],
    "kv_allocation, --max-running-requests": [
        "--device", "cuda", "--device-memory", "24GiB", "--context-length", "8192", "--max-running-requests", "64"],
    "kv_allocation, --context-length": ["--device", "cuda", "--device-memory", "24GiB", "--context-length", "131072"],
    "first_full_prefill": [
        "--device", "cuda", "--device-memory", "80GiB", "--mem-fraction-static", "0.93", "--context-length", "8192"],
    "graph_capture": [
        "--device", "cuda", "--device-memory", "80GiB", "--mem-fraction-static", "0.95", "--context-length", "8192"],
    "cpu, --mem-fraction-static too high": [
        "--device", "cpu", "--device-memory", "24GiB", "--dtype", "bfloat16", "--mem-fraction-static", "0.99"],
    "cpu float32 weights": ["--device", "cpu", "--device-memory", "31GiB"],
    "host_memory": [
        "--device", "cuda", "--device-memory", "80GiB", "--enable-hierarchical-cache", "--hicache-size", "600",
        "--host-memory", "256GiB"],
}  # fmt: skip


@pytest.mark.parametrize("flags", FAILING.values(), ids=FAILING.keys())
@pytest.mark.unit
def test_every_offered_fix_is_accepted_by_serve_and_fits(capsys, model_dir, flags):
    argv = ["--model-path", model_dir(LLAMA_31_8B)] + flags
    args = serve_args(argv)
    inputs = LedgerInputs.from_args(args, read_model_spec(args.model_path))
    ledger = compute_core(inputs)
    assert not ledger.fits
    fixes = offered_fixes(inputs, ledger, compute_core)
    assert fixes, ledger.failure
    for fix in fixes:
        assert serve_accepts(fix.flags)
        fixed = serve_args(argv + flags_argv(fix.flags))  # the later flag wins, as on a command line
        resolve(fixed, target_platform(fixed, serving=False)).check_fits()  # the whole resolve path runs it
        assert compute_ledger(LedgerInputs.from_args(fixed, inputs.model)).fits, fix.text
    rc, data = plan_json(capsys, argv)
    assert rc == 1 and data["failure"]["fix_flags"] == fixes[0].flags
    assert data["failure"]["fix"] == "use " + ", or ".join(fix.text for fix in fixes)


@pytest.mark.unit
def test_serve_accepts_only_what_serve_runs():
    assert serve_accepts({"--mem-fraction-static": "0.8"}) and serve_accepts({"--disable-cuda-graph": ""})
    assert serve_accepts({"--kv-cache-dtype": "fp8_e4m3"})
    assert not serve_accepts({"--kv-cache-dtype": "nvfp4"})  # SGLang's, not a Kiln KV dtype
    assert serve_accepts({"--tp-size": "2"})
    assert not serve_accepts({"--tp-size": "0"})
    assert not serve_accepts({"--mem-fraction-static": "1"})
    assert not serve_accepts({"--no-such-flag": ""})


# ---------------------------------------------------------------- plan's ledger is serve's


@pytest.fixture
def gguf_dir(tmp_path: Path) -> str:
    """A directory holding the default model's .gguf (and no config.json)."""
    try:
        source = default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model is not installed")
    directory = tmp_path / "gguf"
    directory.mkdir()
    (directory / Path(source).name).symlink_to(source)
    return str(directory)


def same_ledger(capsys, argv: list[str]) -> dict:
    """Plan's --json ledger, checked against the one serve computes before loading; returns it."""
    rc, planned = plan_json(capsys, argv)
    verdict = planned.pop("verdict")
    planned.pop("platform")
    assert planned.pop("is_embedding") is serve_args(argv).is_embedding  # the plan's, beside the ledger
    # the plan's own too: what each startup phase should take (tests/test_startup_prediction.py checks the figures)
    prediction = planned.pop("startup_prediction")
    assert prediction["total"] > 0 and "loading_weights" in prediction
    served = plan_ledger(serve_args(argv)).ledger
    assert planned == json.loads(json.dumps(served.to_dict()))
    assert rc == (0 if served.fits else 1) and verdict == ("fits" if served.fits else "does_not_fit")
    return planned


@pytest.mark.unit
def test_plan_and_serve_ledgers_agree(capsys, model_dir):
    tiny, llama = model_dir(TINY, "tiny"), model_dir(LLAMA_31_8B, "llama")
    for argv in (
        ["--model-path", tiny, "--device", "cpu", "--device-memory", "4GiB"],
        ["--model-path", tiny, "--device", "cpu", "--device-memory", "8GiB", "--tp-size", "2", "--page-size", "16"],
        ["--model", tiny, "--device", "cpu", "--device-memory", "4GiB", "--cuda-graph-max-bs", "8"],
        ["--model-path", llama, "--device", "cuda", "--device-memory", "80GiB", "--context-length", "8192"],
        ["--model-path", llama, "--device", "cuda", "--device-memory", "12GiB"],  # does not fit
        ["--model-path", llama, "--device", "cuda", "--device-memory", "80GiB", "--enable-hierarchical-cache",
         "--host-memory", "512GiB"],
    ):  # fmt: skip
        same_ledger(capsys, argv)


@pytest.mark.unit
def test_plan_and_serve_agree_on_a_gguf_directory(capsys, gguf_dir):
    for cpu_gemm in ("auto", "f32"):
        argv = [
            "--model-path",
            gguf_dir,
            "--device",
            "cpu",
            "--device-memory",
            "24GiB",
            "--cpu-gemm",
            cpu_gemm,
        ]
        data = same_ledger(capsys, argv)
        assert data["context_len"] == 8192 and data["fits"]


@pytest.mark.unit
def test_plan_and_serve_agree_on_a_float32_checkpoint_on_cuda(capsys, model_dir):
    path = model_dir(dict(LLAMA_31_8B, torch_dtype="float32"))
    argv = ["--model-path", path, "--device", "cuda", "--device-memory", "80GiB"]
    data = same_ledger(capsys, argv)
    assert plan_ledger(serve_args(argv)).inputs.dtype == "float16"  # SGLang's choice for float32 checkpoints
    kv_line = next(line for line in data["lines"] if line["name"] == "kv bytes per token")
    assert kv_line["inputs"].endswith("x 2 B (float16)")


@pytest.mark.unit
def test_tensor_parallel_size_alias(capsys, model_dir):
    path = model_dir(TINY)
    common = ["--model-path", path, "--device", "cpu", "--device-memory", "8GiB"]
    alias, name = (
        plan_json(capsys, common + [flag, "2"]) for flag in ("--tensor-parallel-size", "--tp-size")
    )
    # the startup prediction scales with the host's load sampled at each call: the ledgers are what must agree
    alias[1].pop("startup_prediction"), name[1].pop("startup_prediction")
    assert alias == name
    assert serve_args(common + ["--tensor-parallel-size", "2"]).tp_size == 2


def test_serve_refuses_more_ranks_before_reading_the_model():
    with pytest.raises(StartupRefused, match="--tp-size 2"):
        build_engine(ServerArgs(model_path="/nonexistent", tp_size=2))


def test_serve_refuses_a_config_json_that_plan_takes(capsys, model_dir):
    """A config.json alone is a plan's input; serve says so before any startup work, not at the weight load."""
    config = str(Path(model_dir(TINY)) / "config.json")
    assert plan.main(["--model-path", config, "--device", "cpu"]) == 0
    with pytest.raises(StartupRefused, match="is a config.json, which `kiln plan` plans from"):
        build_engine(ServerArgs(model_path=config))


def test_serve_refuses_an_unusable_storage_dir_before_loading_weights(tmp_path, model_dir):
    """Both refusals come before any weight loads (they came after it, as a bare OS error or not at all)."""
    (tmp_path / "a_file").write_text("x")
    args = dict(model_path=model_dir(TINY), enable_hierarchical_cache=True, hicache_storage_backend="file")
    with pytest.raises(StartupRefused, match="--hicache-storage-dir .* cannot hold the storage tier's files"):
        build_engine(ServerArgs(**args, hicache_storage_dir=str(tmp_path / "a_file" / "kv")))
    with pytest.raises(ValueError, match="the host tier holds no page of KV"):
        build_engine(ServerArgs(**args, hicache_storage_dir=str(tmp_path / "kv"), hicache_size=1e-9))


# ---------------------------------------------------------------- one rule each


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.2"])
@pytest.mark.unit
def test_mem_fraction_static_one_rule(capsys, model_dir, value):
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        ServerArgs(mem_fraction_static=float(value))
    inputs = LedgerInputs(
        model=ModelSpec.from_config(TINY), device_memory_bytes=2**30, available_memory_bytes=2**30
    )
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        compute_ledger(replace(inputs, mem_fraction_static=float(value)))
    argv = ["--model-path", model_dir(TINY), "--device", "cpu", "--mem-fraction-static", value]
    assert plan.main(argv) == 2 and "--mem-fraction-static" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag", ["--max-running-requests", "--max-total-tokens", "--context-length", "--max-prefill-tokens"]
)
def test_count_flags_one_rule(capsys, model_dir, flag):
    """A count of 0 is refused by ServerArgs, so `kiln serve` refuses it at once as plan does (serve refused
    --max-running-requests 0 only after starting its engine)."""
    argv = ["--model-path", model_dir(TINY), "--device", "cpu", flag, "0"]
    with pytest.raises(ValueError, match=f"{flag} must be >= 1"):
        serve_args(argv)
    assert plan.main(argv) == 2 and f"{flag} must be >= 1" in capsys.readouterr().err


@pytest.mark.unit
def test_serve_refuses_a_context_past_the_model_before_any_process(model_dir, monkeypatch):
    from kiln.server import launch

    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    too_long = serve_args(["--model-path", model_dir(TINY), "--context-length", "100000"])
    assert "use --context-length 512 or less" in launch._front_refusal(too_long)
    assert launch._front_refusal(replace(too_long, context_length=512)) is None


@pytest.mark.unit
def test_plan_says_when_the_pool_caps_requests_below_the_context(capsys, model_dir):
    assert plan.main(["--model-path", model_dir(TINY), "--device", "cpu", "--max-total-tokens", "100"]) == 0
    assert "no request can be longer than 100 tokens" in capsys.readouterr().out
    assert plan.main(["--model-path", model_dir(TINY), "--device", "cpu", "--max-total-tokens", "4096"]) == 0
    assert "no request can be longer" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "config, device, requested, expected",
    [
        ({"torch_dtype": "bfloat16"}, "cuda", "auto", "bfloat16"),
        ({"torch_dtype": "float16"}, "cuda", "auto", "float16"),
        ({"torch_dtype": "float32"}, "cuda", "auto", "float16"),
        ({}, "cuda", "auto", "float16"),
        ({"torch_dtype": "float32", "model_type": "gemma2"}, "cuda", "auto", "bfloat16"),
        ({"text_config": {"torch_dtype": "bfloat16"}, "torch_dtype": "float32"}, "cuda", "auto", "bfloat16"),
        ({"torch_dtype": "bfloat16"}, "cpu", "auto", "float32"),
        ({"torch_dtype": "float32"}, "cuda", "bfloat16", "bfloat16"),
        ({}, "cpu", "half", "float16"),
    ],
)
@pytest.mark.unit
def test_one_dtype_resolver(config, device, requested, expected):
    assert resolve_dtype_name(checkpoint_dtype(config), half_dtype(config), device, requested) == expected


@pytest.mark.unit
def test_kv_cache_dtype_auto_is_the_dtype():
    assert kv_cache_dtype_name("auto", "float16") == "float16"
    assert kv_cache_dtype_name(None, "float32") == "float32"
    assert kv_cache_dtype_name("bfloat16", "float32") == "bfloat16"
    with pytest.raises(ValueError):
        resolve_dtype_name(None, "float16", "cpu", "float7")


@pytest.mark.parametrize(
    "kv_heads, tp, expected", [(8, 1, 8), (8, 2, 4), (8, 8, 1), (8, 16, 1), (2, 4, 1), (3, 1, 3), (6, 4, 2)]
)
@pytest.mark.unit
def test_kv_heads_per_rank_rounds_up(kv_heads, tp, expected):
    assert kv_heads_per_rank(kv_heads, tp) == expected
