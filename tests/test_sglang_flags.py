"""An SGLang launch line starts Kiln (issue 23, point 1): every flag of SGLang's launch_server parses, those Kiln
implements into ServerArgs (vLLM's spellings and SGLang's readable counts too), the others accepted with one line
saying what Kiln does instead; a Hugging Face model id resolves through a local hub cache, offline; the docs
table is the one the parser generates. One `kiln serve` start, from such a line, serves a completion."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess

import kiln.cli as cli
import kiln.config_compat as config_compat
import kiln.plan as plan
from kiln.config import ServerArgs, sglang_flags_markdown
from kiln.config_compat import FOREIGN_FLAGS, SGLANG_NATIVE_FLAGS, Shape, human_readable_int
from kiln.loader.model_config import load_model_config

pytestmark = pytest.mark.server

DOCS = Path(__file__).resolve().parent.parent / "docs" / "sglang_flags.md"
MODEL_ID = "kiln-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

# twenty common flags of an SGLang launch line
LAUNCH_LINE = (
    "--model-path X --host 127.0.0.1 --port 31234 --tp-size 1 --trust-remote-code --enable-metrics --dtype half "
    "--context-length 2k --mem-fraction-static 0.8 --max-running-requests 8 --chunked-prefill-size 512 "
    "--attention-backend fa3 --sampling-backend pytorch --disable-overlap-schedule --log-requests-level 1 "
    "--revision main --load-format auto --enable-torch-compile --cuda-graph-max-bs 8 --schedule-policy lpm "
    "--served-model-name default"
).split()


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> ServerArgs:
    return ServerArgs.from_cli(parser.parse_args(argv))


@pytest.mark.unit
def test_enable_torch_compile_compiles_the_cpu_decode_steps_up_to_its_max_bs(parser):
    """SGLang's --enable-torch-compile selects the CPU's compiled decode steps (sizes up to --torch-compile-max-bs,
    SGLang's default 32), for the engine (the resolve path) and for the startup prediction alike; a capture flag
    of Kiln's still decides, and on CUDA Kiln captures CUDA graphs whichever is given."""
    from kiln.server.startup_prediction import capture_shapes

    on, off = parse(parser, ["--enable-torch-compile"]), parse(parser, [])
    assert on.with_torch_compile("cpu").cuda_graph_max_bs == 32
    assert on.with_torch_compile("cuda") == on and off.with_torch_compile("cpu") == off
    four = parse(parser, ["--enable-torch-compile", "--torch-compile-max-bs", "4"])
    assert capture_shapes(four, "cpu") == ("decode/1", "decode/2", "decode/4")
    assert capture_shapes(parse(parser, ["--torch-compile-max-bs", "4"]), "cpu") == ()  # without the switch
    for kiln_says in (["--cuda-graph-max-bs", "8"], ["--cuda-graph-bs", "2"], ["--disable-cuda-graph"]):
        args = parse(parser, ["--enable-torch-compile", *kiln_says])
        assert args.with_torch_compile("cpu") == args, kiln_says
    with pytest.raises(ValueError, match="--torch-compile-max-bs 0 must be >= 1"):
        parse(parser, ["--torch-compile-max-bs", "0"])


def test_a_launch_line_of_twenty_sglang_flags(parser):
    args = parse(parser, LAUNCH_LINE)
    assert ServerArgs.from_cli(cli.build_parser().parse_args(["serve", *LAUNCH_LINE])) == args
    assert (args.model_path, args.host, args.port, args.tp_size) == ("X", "127.0.0.1", 31234, 1)
    assert (args.dtype, args.context_length, args.mem_fraction_static) == ("float16", 2000, 0.8)
    assert (args.max_running_requests, args.chunked_prefill_size, args.cuda_graph_max_bs) == (8, 512, 8)
    assert (args.revision, args.schedule_policy, args.served_model_name) == ("main", "lpm", "default")
    assert args.foreign_flags == (
        ("--trust-remote-code",),
        ("--enable-metrics",),
        ("--sampling-backend", "pytorch"),
        (
            "--attention-backend",
            "fa3",
        ),  # a value of a flag Kiln implements: after the flags it has no field for
    )
    assert args.attention_backend is None  # Kiln chooses
    assert args.load_format == "auto"  # a flag Kiln implements
    assert args.disable_overlap_schedule
    messages = config_compat.foreign_flag_messages(args.foreign_flags)
    assert len(messages) == 4
    assert args.log_requests_level == 1  # SGLang's flag, Kiln's own
    warned = [line.split(":")[0] for level, line in messages if level == logging.WARNING]
    noted = [line.split(":")[0] for level, line in messages if level == logging.INFO]
    # where Kiln already does what the flag asks (metrics served, PyTorch sampling), the line is
    # information, not a warning
    assert warned == [
        "SGLang flag --trust-remote-code",
        "SGLang flag --attention-backend fa3",
    ]
    assert args.enable_torch_compile and args.cuda_graph_max_bs == 8  # Kiln's flag; the explicit size decides
    assert noted == [
        "SGLang flag --enable-metrics",
        "SGLang flag --sampling-backend pytorch",
    ]
    assert "Kiln runs no code from the model repository" in messages[0][1]


def _foreign_argv(flag: config_compat.ForeignFlag) -> list[str]:
    return {
        Shape.SWITCH: [flag.flag],
        Shape.TOGGLE: [flag.flag],
        Shape.VALUE: [flag.flag, "1"],
        Shape.VALUES: [flag.flag, "1", "2"],
        Shape.ANY_VALUES: [flag.flag],
        Shape.OPTIONAL_VALUE: [flag.flag],
    }[flag.shape]


@pytest.mark.parametrize("flag", FOREIGN_FLAGS, ids=lambda f: f.flag)
@pytest.mark.unit
def test_every_sglang_flag_kiln_does_not_implement_parses_and_is_reported(parser, flag):
    args = parse(parser, _foreign_argv(flag))
    assert args == ServerArgs(foreign_flags=args.foreign_flags)  # no field of Kiln's changed
    assert len(args.foreign_flags) == 1 and args.foreign_flags[0][0] == flag.flag
    [(_, line)] = config_compat.foreign_flag_messages(args.foreign_flags)
    assert line.endswith(flag.instead)
    for alias in flag.aliases:
        assert parse(parser, [alias, *_foreign_argv(flag)[1:]]).foreign_flags == args.foreign_flags


@pytest.mark.unit
def test_every_sglang_flag_kiln_implements_is_a_flag_of_its_own(parser):
    native = {
        option: action
        for action in parser._actions
        if not action.dest.startswith(config_compat.DEST_PREFIX)
        for option in action.option_strings
    }
    assert set(SGLANG_NATIVE_FLAGS) <= set(native)
    foreign = {spelling for f in FOREIGN_FLAGS for spelling in (f.flag, *f.aliases)}
    assert not foreign & set(native), (
        "flags Kiln implements now: move them to config_compat.SGLANG_NATIVE_FLAGS"
    )
    assert len(foreign) + len(SGLANG_NATIVE_FLAGS) == len(foreign | set(SGLANG_NATIVE_FLAGS))


@pytest.mark.unit
def test_a_toggle_turned_off_and_list_values_are_kept_as_given(parser):
    args = parse(parser, ["--no-enable-tf32-matmul", "--gc-threshold", "10", "20", "--custom-weight-loader"])
    assert args.foreign_flags == (
        ("--no-enable-tf32-matmul",),
        ("--gc-threshold", "10", "20"),
        ("--custom-weight-loader",),
    )


@pytest.mark.unit
def test_vllm_spellings_and_sglang_aliases(parser):
    args = parse(
        parser,
        "--max-model-len 32k --max-num-seqs 16 --tensor-parallel-size 2 --ep 2 --enable-hicache "
        "--cuda-graph-max-bs-decode 4 --cuda-graph-bs-decode 1 2 4 --disable-prefill-cuda-graph".split(),
    )
    assert (args.context_length, args.max_running_requests, args.tp_size, args.ep_size) == (32000, 16, 2, 2)
    assert args.enable_hierarchical_cache and args.disable_prefill_graph
    assert (args.cuda_graph_max_bs, args.cuda_graph_bs) == (4, (1, 2, 4))
    assert args.foreign_flags == ()


@pytest.mark.parametrize(
    ("text", "count"),
    [("2048", 2048), ("32k", 32000), ("25.6k", 25600), ("1M", 10**6), ("1m", 10**6), ("4Ki", 4096),
     ("32K", 32768), ("1Mi", 2**20), ("-1", -1), ("2G", 2 * 10**9)],
)  # fmt: skip
@pytest.mark.unit
def test_token_counts_read_as_sglang_does(text, count):
    assert human_readable_int(text) == count


@pytest.mark.parametrize("text", ["32 k", "1.5Ki", "0.0001k", "k", "thirty"])
@pytest.mark.unit
def test_a_count_that_is_not_one_is_refused(parser, text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--max-total-tokens", text])


@pytest.mark.unit
def test_readable_counts_on_every_token_flag(parser):
    args = parse(parser, "--max-total-tokens 1M --max-prefill-tokens 16Ki --chunked-prefill-size -1".split())
    assert (args.max_total_tokens, args.max_prefill_tokens, args.chunked_prefill_size) == (10**6, 16384, -1)


def test_other_spellings_of_values(parser):
    assert parse(parser, ["--dtype", "float", "--kv-cache-dtype", "bf16"]).dtype == "float32"
    assert parse(parser, ["--kv-cache-dtype", "bf16"]).kv_cache_dtype == "bfloat16"
    assert ServerArgs(dtype="half").dtype == "float16"  # built in code, as kiln.Engine(**kwargs) does
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--dtype", "float8"])


@pytest.mark.unit
def test_sglang_values_kiln_does_not_take_keep_the_default_and_are_reported(parser):
    args = parse(parser, ["--schedule-policy", "priority", "--enable-metrics"])
    assert args.schedule_policy == "fcfs"
    assert args.foreign_flags == (("--enable-metrics",), ("--schedule-policy", "priority"))
    [_, (level, line)] = config_compat.foreign_flag_messages(args.foreign_flags)
    assert (level, line) == (
        logging.WARNING,
        "SGLang flag --schedule-policy priority: Kiln schedules fcfs or lpm only: it schedules fcfs",
    )
    # a KV dtype Kiln cannot store (FP4) would change the memory plan: refused rather than served in another
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--kv-cache-dtype", "nvfp4"])


@pytest.mark.unit
def test_docs_table_is_the_generated_one():
    assert DOCS.read_text() == sglang_flags_markdown(), (
        "docs/sglang_flags.md is stale: python -m kiln.config --sglang-flags-markdown > docs/sglang_flags.md"
    )


# ------------------------------------------------------------------------------ Hugging Face model ids


@pytest.fixture(scope="module")
def hub_cache(tiny_llama, tmp_path_factory) -> Path:
    """A hub cache as huggingface_hub lays it out, holding the tiny Llama as MODEL_ID at COMMIT (refs/main)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / ("models--" + MODEL_ID.replace("/", "--"))
    shutil.copytree(tiny_llama, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch) -> Path:
    """huggingface_hub pointed at the cache (it reads HF_HUB_CACHE once, at import)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub_cache


@pytest.mark.unit
def test_a_model_id_resolves_through_the_hub_cache(offline_hub):
    snapshot = offline_hub / ("models--" + MODEL_ID.replace("/", "--")) / "snapshots" / COMMIT
    assert load_model_config(MODEL_ID).model_path == str(snapshot)
    assert load_model_config(MODEL_ID, revision=COMMIT).model_path == str(snapshot)
    args = ServerArgs(model_path=MODEL_ID, revision="main").with_defaults()
    assert (args.model_path, args.served_model_name) == (str(snapshot), MODEL_ID)


@pytest.mark.unit
def test_a_model_id_missing_from_the_cache_is_refused_by_name(offline_hub):
    with pytest.raises(ValueError, match=f"kiln-test/absent.*{offline_hub}.*HF_HUB_OFFLINE=1"):
        load_model_config("kiln-test/absent")
    with pytest.raises(ValueError, match=f"{MODEL_ID}@v2.*{offline_hub}"):
        ServerArgs(model_path=MODEL_ID, revision="v2").with_defaults()


@pytest.mark.unit
def test_kiln_plan_plans_a_model_id_and_reports_sglang_flags(offline_hub, capsys):
    argv = ["--model-path", MODEL_ID, "--device", "cpu", "--max-total-tokens", "4k"]
    code = plan.main([*argv, "--enable-metrics", "--trust-remote-code", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["fits"] is True
    instead = {f.flag: f.instead for f in FOREIGN_FLAGS}
    assert err.splitlines() == [
        "kiln plan: note: SGLang flag --enable-metrics: " + instead["--enable-metrics"],
        "kiln plan: warning: SGLang flag --trust-remote-code: " + instead["--trust-remote-code"],
    ]
    assert plan.main(argv) == 0
    assert f"Kiln memory plan for {MODEL_ID}: cpu" in capsys.readouterr().out


# ------------------------------------------------------------------------------ one real start


@pytest.fixture(scope="module")
def sglang_server(hub_cache, tmp_path_factory):
    """`kiln serve` from an SGLang launch line naming a model id, offline against the test's hub cache."""
    log = tmp_path_factory.mktemp("sglang-serve") / "serve.log"
    line = (
        f"--model-path {MODEL_ID} --revision main --host 127.0.0.1 --tp-size 1 --trust-remote-code "
        "--enable-metrics --dtype float --context-length 2k --max-total-tokens 4k --max-running-requests 8 "
        "--chunked-prefill-size 512 --attention-backend fa3 --sampling-backend pytorch "
        "--disable-overlap-schedule --log-requests-level 1 --load-format auto --enable-torch-compile "
        "--torch-compile-max-bs 1 --schedule-policy lpm --served-model-name default --skip-server-warmup"
    ).split()
    server = ServerProcess(line, log, env={"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_kiln_serves_an_sglang_launch_line(sglang_server):
    response = httpx.post(
        f"{sglang_server.url}/v1/completions",
        json={"model": "default", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    log = sglang_server.log_text()
    for flag in [
        "--trust-remote-code",
        "--enable-metrics",
        "--attention-backend fa3",
    ]:
        assert log.count(f"SGLang flag {flag}:") == 1, log[-3000:]
    # --enable-torch-compile is Kiln's: the CPU's decode step compiled, up to --torch-compile-max-bs
    assert "SGLang flag --enable-torch-compile" not in log and "Compiled decode bs=1 " in log, log[-3000:]
    assert httpx.get(f"{sglang_server.url}/metrics", timeout=10).status_code == 200
