"""--cpu-gemm (alias --cpu-matmul) is validated where it is read: argparse refuses an unknown value, set_cpu_gemm
(what a model load calls) and gguf_blocks_expected (what the memory ledger asks) name the valid values, and `kiln` is
refused on a CPU that cannot run Kiln's kernel instead of silently falling back to oneDNN's layout. Each mode keeps
its own GGUF types in their blocks: auto and kiln every type the integer kernels take, exact Q4_1 and Q8_0."""

from __future__ import annotations

import argparse

import pytest
import torch

from kiln.config import ServerArgs
from kiln.layers import cpu_gemm
from kiln.platform import CPU_GEMM_MODES, gguf_block_types, gguf_blocks_expected, integer_compute

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def default_mode():
    """The mode is module-wide: every test here leaves the default behind."""
    yield
    cpu_gemm.set_cpu_gemm("auto")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)


AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _without_avx2(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without AVX2: torch reports its baseline, and the kernel (cached per process) is not there."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr(cpu_gemm, "blocked_kernel", lambda: None)


def test_the_parser_takes_every_mode_and_defaults_to_auto():
    assert _parse([]).cpu_gemm == "auto"
    assert set(CPU_GEMM_MODES) == {"auto", "exact", "kiln", "f32", "onednn"}
    for mode in CPU_GEMM_MODES:
        assert _parse(["--cpu-gemm", mode]).cpu_gemm == mode
        assert _parse(["--cpu-matmul", mode]).cpu_gemm == mode


def test_quantization_takes_int8_and_sglang_values_leave_the_default():
    assert _parse([]).quantization is None
    assert ServerArgs.from_cli(_parse(["--quantization", "int8"])).quantization == "int8"
    args = ServerArgs.from_cli(_parse(["--quantization", "awq"]))  # SGLang's: accepted, reported, not done
    assert args.quantization is None and ("--quantization", "awq") in args.foreign_flags
    with pytest.raises(ValueError, match="--quantization 'int4': Kiln quantizes at load to int8"):
        cpu_gemm.set_cpu_gemm("auto", "int4")


def test_the_parser_rejects_an_unknown_mode(capsys):
    with pytest.raises(SystemExit):
        _parse(["--cpu-gemm", "kiln-f32"])  # the old environment variable's spelling
    err = capsys.readouterr().err
    assert "--cpu-gemm" in err and "invalid choice: 'kiln-f32'" in err


@pytest.mark.parametrize("ask", [cpu_gemm.set_cpu_gemm, gguf_blocks_expected])
def test_an_unknown_mode_is_refused_naming_the_valid_ones(ask):
    with pytest.raises(
        ValueError, match="--cpu-gemm 'onedn': expected one of auto, exact, kiln, f32, onednn"
    ):
        ask("onedn")
    assert cpu_gemm.cpu_gemm_mode() == "auto"  # a refused mode changes nothing


@pytest.mark.parametrize("ask", [cpu_gemm.set_cpu_gemm, gguf_blocks_expected])
def test_kiln_is_refused_on_a_cpu_without_avx2(monkeypatch, ask):
    _without_avx2(monkeypatch)
    with pytest.raises(ValueError, match="--cpu-gemm kiln: .*AVX2.* this CPU's capability is DEFAULT"):
        ask("kiln")


def test_auto_falls_back_to_onednn_on_a_cpu_without_avx2(monkeypatch):
    _without_avx2(monkeypatch)
    cpu_gemm.set_cpu_gemm("auto")
    assert not gguf_blocks_expected("auto")
    assert cpu_gemm.packed_layout_name() == "oneDNN's"
    packed = cpu_gemm.prepack(torch.randn(32, 64))
    assert packed is None or packed.is_mkldnn


def test_gguf_blocks_follow_the_mode():
    assert gguf_blocks_expected("auto") == AVX2 and gguf_blocks_expected("exact") == AVX2
    if AVX2:  # else "kiln" is refused (tested above)
        assert gguf_blocks_expected("kiln")
        assert (
            gguf_block_types("auto") == gguf_block_types("kiln") == ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
        )
        assert gguf_block_types("exact") == ("Q4_1", "Q8_0")
    assert not gguf_blocks_expected("f32") and not gguf_blocks_expected("onednn")
    assert [m for m in CPU_GEMM_MODES if integer_compute(m)] == ["auto", "kiln"]


def test_the_mode_decides_each_load_in_turn():
    """Loads with different modes one after another in one process: each packs as its own mode says (the
    extension stays built across them)."""
    weight = torch.randn(32, 64)
    cpu_gemm.set_cpu_gemm("onednn")
    onednn = cpu_gemm.prepack(weight)
    assert onednn is None or onednn.is_mkldnn
    assert cpu_gemm.packed_layout_name() == "oneDNN's" and cpu_gemm.kiln_kernel() is None
    cpu_gemm.set_cpu_gemm("auto")
    assert cpu_gemm.cpu_gemm_mode() == "auto"
    if AVX2:
        assert cpu_gemm.prepack(weight).dim() == 3  # Kiln's blocks again
