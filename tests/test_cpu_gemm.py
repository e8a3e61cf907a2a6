"""Prepacked CPU weights: the same products as F.linear, every linear and the lm head packed at load, the tied
embedding left readable, and the packed head copy counted where the ledger says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.layers import cpu_gemm
from kiln.loader.weights import load_model
from kiln.models.config import ModelConfig

pytestmark = pytest.mark.skipif(
    cpu_gemm.prepack(torch.zeros(8, 8)) is None, reason="no oneDNN prepacking here"
)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    w, b, x = torch.randn(96, 40), torch.randn(96), torch.randn(rows, 40)
    packed = cpu_gemm.prepack(w)
    assert packed is not None and packed.is_mkldnn
    torch.testing.assert_close(
        cpu_gemm.linear(x, packed, b, packed=True), F.linear(x, w, b), rtol=1e-5, atol=1e-5
    )


def test_only_float32_on_cpu_is_packed():
    assert cpu_gemm.prepack(torch.zeros(8, 8, dtype=torch.bfloat16)) is None
    assert cpu_gemm.prepack(torch.zeros(8, 8, device="meta")) is None


@pytest.mark.parametrize("prepack", [True, False])
@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen3"])  # untied and tied lm head
def test_model_weights_packed_at_load(request, kind, prepack):
    cfg = ModelConfig.load(request.getfixturevalue(kind))
    model = load_model(cfg, torch.float32, "cpu", 128, prepack=prepack)
    layer = model.model.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(m.weight.is_mkldnn == prepack for m in linears)
    assert not model.model.embed_tokens.weight.is_mkldnn  # the embedding always gathers plain rows
    head = model.lm_head
    assert head.tied == cfg.tie_word_embeddings
    if head.tied:  # a second, packed copy of the shared matrix
        assert (head.packed_weight is not None) == prepack and head.weight is model.model.embed_tokens.weight
    else:  # swapped in place
        assert head.packed_weight is None and head.weight.is_mkldnn == prepack
    if prepack:
        assert model.prepacked_weights == 4 * cfg.num_layers + 1
        packed_head = head.packed_weight if head.tied else head.weight
        assert packed_head.nbytes == cfg.vocab_size * cfg.hidden_size * 4


def test_packed_linear_under_torch_compile():
    """A compiled step keeps the packed matmul as one op (inductor would otherwise lower it to an `mm` that
    cannot read oneDNN's layout and fail at run time)."""
    torch.manual_seed(0)
    w, x = torch.randn(48, 32), torch.randn(5, 32)
    packed = cpu_gemm.prepack(w)

    def step(x, weight):
        return torch.relu(cpu_gemm.linear(x * 2.0, weight, None, packed=True))

    got = torch.compile(step, dynamic=False, backend="aot_eager")(x, packed)
    torch.testing.assert_close(got, torch.relu(F.linear(x * 2.0, w)), rtol=1e-5, atol=1e-5)
