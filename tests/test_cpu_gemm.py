"""Prepacked CPU weights, in Kiln's blocked layout and in oneDNN's: the same products as F.linear, every linear
and the lm head packed at load, the tied embedding left readable, and the packed head copy counted where the
ledger says."""

from __future__ import annotations

import fcntl
import functools
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from kiln.layers import cpu_gemm
from kiln.layers.extension_loader import extension_directory
from kiln.loader.model_config import load_model_config
from kiln.loader.weights import load_model

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(cpu_gemm.prepack(torch.zeros(16, 8)) is None, reason="no CPU prepacking here"),
]
AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.fixture(params=["kiln", "onednn"])
def layout(request):
    """Which packed layout prepack() picks, by --cpu-gemm: Kiln's blocked one (where the CPU has AVX2) or
    oneDNN's. The mode is module-wide, so it goes back to the default after the test."""
    if request.param == "kiln" and cpu_gemm.blocked_kernel() is None:
        pytest.skip("Kiln's CPU kernel needs AVX2 and FMA")
    cpu_gemm.set_cpu_gemm(request.param)
    yield request.param
    cpu_gemm.set_cpu_gemm("auto")


def is_packed(w: torch.Tensor) -> bool:
    return w.is_mkldnn or w.dim() == 3


@pytest.mark.unit
def test_kernel_builds_where_the_cpu_has_avx2():
    assert (cpu_gemm.blocked_kernel() is not None) == AVX2
    assert cpu_gemm.packed_layout_name() == ("Kiln's blocked" if AVX2 else "oneDNN's")


LOAD_KERNEL = (
    "import logging; logging.basicConfig(level=logging.INFO)\n"
    "from kiln.layers.cpu_gemm import blocked_kernel\n"
    "assert blocked_kernel() is not None"
)


@pytest.mark.skipif(not AVX2, reason="Kiln's CPU kernel needs AVX2 and FMA")
@pytest.mark.unit
def test_a_build_lock_left_by_a_killed_build_is_removed():
    """torch's `lock` file in the kernel's build directory, as a process killed mid-build leaves it: the next start
    removes it and loads the kernel instead of waiting on it forever. A second start while one holds Kiln's own
    lock waits for it, and says so."""
    cpu_gemm.blocked_kernel()  # built: the starts below only load it
    directory = extension_directory("kiln_blocked_gemm", cpu_gemm._SOURCES)
    stale = os.path.join(directory, "lock")
    open(stale, "w").close()
    try:
        with open(os.path.join(directory, "kiln.flock"), "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # another Kiln process building
            start = subprocess.Popen([sys.executable, "-c", LOAD_KERNEL], stderr=subprocess.PIPE, text=True)
            said: list[str] = []
            reader = threading.Thread(target=lambda: said.extend(start.stderr), daemon=True)
            reader.start()
            deadline = time.monotonic() + 120
            while not any("Waiting for another Kiln process" in line for line in said):
                assert start.poll() is None and time.monotonic() < deadline, "".join(said)
                time.sleep(0.05)
            assert start.poll() is None, "".join(said)  # waits for the holder, not on torch's lock
            assert os.path.exists(stale)
        start.wait(120)
        reader.join(10)
        err = "".join(said)
        assert start.returncode == 0, err
        assert "Waiting for another Kiln process" in err and "killed before it finished" in err
        assert not os.path.exists(stale)
    finally:
        if "start" in locals() and start.poll() is None:
            start.kill()
        if os.path.exists(stale):
            os.remove(stale)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 64, 300])
@pytest.mark.unit
def test_packed_linear_matches_f_linear(layout, rows):
    """Every row remainder of the kernel's 4-row tiles, an input width that is not a multiple of a vector, and a
    bias; a 3-D input keeps its leading dims."""
    torch.manual_seed(rows)
    w, b, x = torch.randn(96, 40), torch.randn(96), torch.randn(rows, 40)
    packed = cpu_gemm.prepack(w)
    assert packed is not None and (packed.dim() == 3 if layout == "kiln" else packed.is_mkldnn)
    torch.testing.assert_close(
        cpu_gemm.linear(x, packed, b, packed=True), F.linear(x, w, b), rtol=1e-5, atol=1e-5
    )
    x3 = x.view(1, rows, 40)
    torch.testing.assert_close(cpu_gemm.linear(x3, packed, None, packed=True), F.linear(x3, w))


@pytest.mark.unit
def test_output_width_off_the_block_uses_onednn(layout):
    """Kiln's layout needs the output features in blocks of 16; other weights take oneDNN's."""
    w, x = torch.randn(100, 24), torch.randn(3, 24)
    packed = cpu_gemm.prepack(w)
    assert packed.is_mkldnn
    torch.testing.assert_close(cpu_gemm.linear(x, packed, None, packed=True), F.linear(x, w))


@pytest.mark.unit
def test_only_float32_on_cpu_is_packed():
    assert cpu_gemm.prepack(torch.zeros(8, 8, dtype=torch.bfloat16)) is None
    assert cpu_gemm.prepack(torch.zeros(8, 8, device="meta")) is None


@pytest.mark.parametrize("prepack", [True, False])
@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen3"])  # untied and tied lm head
def test_model_weights_packed_at_load(request, kind, prepack, layout):
    cfg = load_model_config(request.getfixturevalue(kind))
    loaded = load_model(cfg, torch.float32, "cpu", 128, prepack=prepack)
    model = loaded.model
    layer = model.model.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(is_packed(m.weight) == prepack for m in linears)
    assert not is_packed(model.model.embed_tokens.weight)  # the embedding always gathers plain rows
    head = model.lm_head
    assert head.tied == cfg.tie_word_embeddings
    if head.tied:  # a second, packed copy of the shared matrix
        assert (head.packed_weight is not None) == prepack and head.weight is model.model.embed_tokens.weight
    else:  # swapped in place
        assert head.packed_weight is None and is_packed(head.weight) == prepack
    if prepack:
        assert loaded.prepacked_weights == 4 * cfg.num_layers + 1
        packed_head = head.packed_weight if head.tied else head.weight
        assert packed_head.nbytes == cfg.vocab_size * cfg.hidden_size * 4


def test_prepacking_reports_progress_to_the_startup_watchdog(tiny_llama, monkeypatch):
    """Packing a large model's weights takes tens of seconds after the last tensor is read: it reports its
    count as loading does, or --watchdog-timeout would stop a healthy startup in that silence."""
    from kiln.loader import weights

    every_layer = functools.partial(weights._reporting, every=0.0)
    monkeypatch.setattr(
        weights, "_reporting", lambda items, cb, what="tensors_loaded": every_layer(items, cb, what)
    )
    seen: list[dict] = []
    loaded = load_model(load_model_config(tiny_llama), torch.float32, "cpu", 128, seen.append, prepack=True)
    packed = [r["weights_prepacked"] for r in seen if "weights_prepacked" in r]
    assert packed and packed == sorted(packed) and packed[-1] >= loaded.prepacked_weights // 4


@pytest.mark.unit
def test_packed_linear_under_torch_compile(layout):
    """A compiled step keeps the packed matmul as one op (inductor would otherwise lower it to an `mm` that
    cannot read the packed layout and fail at run time)."""
    torch.manual_seed(0)
    w, x = torch.randn(48, 32), torch.randn(5, 32)
    packed = cpu_gemm.prepack(w)

    def step(x, weight):
        return torch.relu(cpu_gemm.linear(x * 2.0, weight, None, packed=True))

    got = torch.compile(step, dynamic=False, backend="aot_eager")(x, packed)
    torch.testing.assert_close(got, torch.relu(F.linear(x * 2.0, w)), rtol=1e-5, atol=1e-5)
