"""One resolve path (kiln/scheduler/resolve.py): `kiln plan` refuses exactly what `kiln serve` refuses, in the same
words, over flag combinations that each stop in another check; and the platform is an input, so a plan can
describe a GPU it does not run on while serve runs only on the device it finds.

Serve runs for real as the CLI runs it (`kiln serve ...`: parser, ServerArgs, the front's refusal), with its engine
built in this process (the engine process's `build_engine`) up to the weight load: reaching `loading_weights`
means serve accepted the configuration. A GPU configuration is run on a machine that reports that GPU
(`kiln.platform.machine_platform`), given to plan and serve alike."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import pytest
from hybrid_models import TINY_HYBRID
from test_ledger import QWEN3_30B_A3B, TINY

import kiln.cli as cli
import kiln.distributed as distributed
import kiln.platform as kiln_platform
import kiln.scheduler.launch as engine_launch
import kiln.server.launch as server_launch
from kiln.core.devices import DEVICES, device_spec, same_device
from kiln.platform import Platform
from kiln.scheduler.resolve import StartupRefused

pytestmark = pytest.mark.engine

LLAMA = {**TINY, "architectures": ["LlamaForCausalLM"]}
HYBRID = {
    **TINY_HYBRID,
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 256,
}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
MOE_FP8 = {**QWEN3_30B_A3B, "quantization_config": FP8}
EAGLE3_OTHER_VOCAB = {
    **LLAMA, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "vocab_size": 512,
    "draft_vocab_size": 512,
}  # fmt: skip
A100 = Platform("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), triton=True)
H200 = Platform("cuda", "NVIDIA H200", (9, 0), triton=True)
CPU_NO_TRITON = Platform("cpu", "cpu", triton=False)
GPU_MEMORY = ["--device-memory", "80GiB"]


@dataclass(frozen=True)
class Case:
    model: str  # a key of MODELS
    flags: tuple[str, ...]
    refused: bool  # what both must say
    machine: Platform | None = None  # None: this machine as it is


MODELS = {"llama": LLAMA, "hybrid": HYBRID, "moe_fp8": MOE_FP8, "eagle3": EAGLE3_OTHER_VOCAB}

CASES = {
    "defaults": Case("llama", (), False),
    "ngram speculation": Case("llama", ("--speculative-algorithm", "NGRAM"), False),
    "spec without a draft": Case("llama", ("--speculative-algorithm", "EAGLE"), True),
    "nextn without an mtp layer": Case("llama", ("--speculative-algorithm", "NEXTN"), True),
    "eagle3 head of another vocabulary": Case(
        "llama", ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "{eagle3}"), True
    ),
    "ngram topk 0": Case(
        "llama", ("--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "0"), True
    ),
    "tp that does not divide heads": Case("llama", ("--tp-size", "3"), True),
    "tp that divides heads": Case("llama", ("--tp-size", "2"), False),
    "context past the model": Case("llama", ("--context-length", "100000"), True),
    "memory that does not fit": Case("llama", ("--device-memory", "1MiB"), True),
    "mem fraction out of range": Case("llama", ("--mem-fraction-static", "1.5"), True),
    "storage tier without the host tier": Case("llama", ("--hicache-storage-backend", "file"), True),
    "lora adapter that is not there": Case("llama", ("--enable-lora", "--lora-paths", "a=b"), True),
    "lora slots without an adapter yet": Case("llama", ("--enable-lora", "--max-lora-rank", "8"), False),
    "lora without a rank": Case("llama", ("--enable-lora",), True),
    "lora with tp 2": Case("llama", ("--enable-lora", "--max-lora-rank", "8", "--tp-size", "2"), False),
    "lora on a hybrid": Case("hybrid", ("--enable-lora", "--max-lora-rank", "8"), True),
    "hicache with a hybrid": Case("hybrid", ("--enable-hierarchical-cache",), True),
    "speculation with a hybrid": Case("hybrid", ("--speculative-algorithm", "NGRAM"), True),
    "tp with a hybrid": Case("hybrid", ("--tp-size", "2"), True),
    "mamba interval off the page": Case("hybrid", ("--mamba-track-interval", "3", "--page-size", "2"), True),
    "a hybrid as it is": Case("hybrid", (), False),
    "triton where it is not installed": Case("llama", ("--attention-backend", "triton"), True, CPU_NO_TRITON),
    "triton fp8_e4m3 on sm_80": Case(
        "llama", ("--attention-backend", "triton", "--kv-cache-dtype", "fp8_e4m3", *GPU_MEMORY), True, A100
    ),
    "triton fp8_e5m2 on sm_80": Case(
        "llama", ("--attention-backend", "triton", "--kv-cache-dtype", "fp8_e5m2", *GPU_MEMORY), False, A100
    ),
    "triton fp8_e4m3 on sm_90": Case(
        "llama", ("--attention-backend", "triton", "--kv-cache-dtype", "fp8_e4m3", *GPU_MEMORY), False, H200
    ),
    "fp8 blocks cut by tp 8 on an H200": Case(
        "moe_fp8", ("--tp-size", "8", "--device-name", "H200", "--device-memory", "141GiB"), True, H200
    ),
    "fp8 blocks whole at tp 2 on an H200": Case(
        "moe_fp8", ("--tp-size", "2", "--device-name", "H200", "--device-memory", "141GiB"), False, H200
    ),
    "fp8 dequantized on an A100 at tp 8": Case(
        "moe_fp8", ("--tp-size", "8", "--device-name", "A100", *GPU_MEMORY), False, A100
    ),
    "a cpu that names a gpu": Case("llama", ("--device", "cpu", "--device-name", "H100"), True),
    "a capability that is not X.Y": Case("llama", ("--compute-capability", "9"), True),
}


class WouldLoad(Exception):
    """Serve's engine reached its weight load: every decision before it accepted the configuration."""


class EngineUpToTheLoad:
    """In place of serve's Launcher: the engine process's build_engine, run here up to the weight load, as rank 0
    of a group of --tp-size ranks (the ranks agree on memory by a MIN over what each probed: one rank here)."""

    refusal: str | None = None

    def __init__(self, args):
        self.args = args

    def run(self) -> int:
        def phase(name: str, info: dict) -> None:
            if name == "loading_weights":
                raise WouldLoad

        try:
            build_engine_as_rank_0(self.args, phase)
        except WouldLoad:
            return 0
        except StartupRefused as e:
            EngineUpToTheLoad.refusal = str(e)
            return 1
        raise AssertionError("build_engine returned without loading weights")


def build_engine_as_rank_0(args, phase) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distributed, "tp_size", lambda: args.tp_size)
        engine_launch.build_engine(args, phase)


class Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, what the command said of a refusal: its error line or the verdict)."""
    said, root = Said(), logging.getLogger()
    handlers, level = root.handlers[:], root.level  # serve configures the root logger, as its process's own
    logging.getLogger("kiln").addHandler(said)
    EngineUpToTheLoad.refusal = None
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse, and the CLI's own refusals of ServerArgs' checks
        code = int(e.code or 0)
    finally:
        logging.getLogger("kiln").removeHandler(said)
        root.handlers[:], root.level = handlers, level
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if ": error: " in line]
    failed = [line.removeprefix("Kiln failed: ") for line in said.lines if line.startswith("Kiln failed: ")]
    text = (
        EngineUpToTheLoad.refusal or (failed and failed[0]) or (errors and errors[0].split(": error: ", 1)[1])
    )
    return code, text or out


@pytest.fixture
def models(model_dir) -> dict[str, str]:
    return {name: model_dir(config, name) for name, config in MODELS.items()}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_plan_refuses_exactly_what_serve_refuses(case, models, capsys, monkeypatch):
    monkeypatch.setenv("KILN_FP8_WEIGHTS", "auto")
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.setattr(server_launch, "Launcher", EngineUpToTheLoad)
    if case.machine is not None:
        machine = case.machine
        monkeypatch.setattr(kiln_platform, "machine_platform", lambda device="auto": machine)
    flags = [flag.format(**models) for flag in case.flags]
    argv = ["--model-path", models[case.model], *flags]
    plan_code, plan_said = run_cli(["plan", *argv], capsys)
    serve_code, serve_said = run_cli(["serve", *argv], capsys)
    assert (plan_code != 0, serve_code != 0) == (case.refused, case.refused), (plan_said, serve_said)
    if not case.refused:
        return
    if plan_code == 1:  # the ledger does not fit: plan prints it, serve refuses with its failure and fix
        _, out = run_cli(["plan", *argv, "--json"], capsys)
        failure = json.loads(out)["failure"]
        assert failure["message"] in serve_said and failure["fix"] in serve_said, (failure, serve_said)
    else:
        assert plan_said == serve_said


def test_a_plan_describes_a_gpu_that_serve_here_refuses(models, capsys):
    """No GPU here: plan for an H200 from the table, at its memory and capability; serve refuses to run on a
    device this machine does not have, naming the flag."""
    argv = ["--model-path", models["moe_fp8"], "--device-name", "H200", "--tp-size", "2", "--json"]
    code, out = run_cli(["plan", *argv], capsys)
    data = json.loads(out)
    assert code == 0 and data["platform"] == {
        "device": "cuda", "name": "H200", "compute_capability": "9.0", "this_machine": False, "assumed": [],
    }  # fmt: skip
    available = next(line for line in data["lines"] if line["name"] == "available")
    assert available["bytes"] == device_spec("H200").memory_bytes
    code, said = run_cli(["serve", *argv[:-1]], capsys)
    assert code == 1 and said.startswith("--device cuda: this machine has no usable CUDA GPU")


def test_a_plan_for_an_unnamed_gpu_says_what_it_assumed(models, capsys):
    argv = ["plan", "--model-path", models["moe_fp8"], "--device", "cuda", "--device-memory", "141GiB"]
    code, _ = run_cli([*argv, "--tp-size", "8"], capsys)
    assert code == 2  # FP8 kept on the assumed sm_90: tp 8 cuts its blocks, as an H200 would
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "kiln plan: note: assumed compute capability 9.0" in err and "--device-name" in err
    assert run_cli([*argv, "--compute-capability", "8.0", "--tp-size", "8"], capsys)[0] == 0  # dequantized


def test_serve_refuses_a_gpu_it_does_not_find(models, capsys, monkeypatch):
    monkeypatch.setattr(kiln_platform, "machine_platform", lambda device="auto": H200)
    argv = ["serve", "--model-path", models["llama"], *GPU_MEMORY]
    code, said = run_cli([*argv, "--device-name", "A100"], capsys)
    assert code == 1 and said.startswith("--device-name A100 describes another GPU than this machine's")
    code, said = run_cli([*argv, "--compute-capability", "8.0"], capsys)
    assert code == 1 and "--compute-capability 8.0 is not this machine's (9.0)" in said
    monkeypatch.setattr(server_launch, "Launcher", EngineUpToTheLoad)
    assert run_cli([*argv, "--device-name", "H200", "--compute-capability", "9.0"], capsys)[0] == 0


@pytest.mark.unit
def test_the_device_table_names_each_gpu_once():
    assert same_device("H100", "NVIDIA H100 80GB HBM3") and not same_device("H20", "NVIDIA H200")
    assert same_device("rtx-4090", "NVIDIA GeForce RTX 4090") and same_device("a100", "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="--device-name V100: not a GPU Kiln knows .*--compute-capability"):
        device_spec("V100")
    for spec in DEVICES:
        assert device_spec(spec.name) is spec and 8 << 30 < spec.memory_bytes < 256 << 30
        assert spec.capability >= (8, 0) and same_device(spec.name, f"NVIDIA {spec.name}")
