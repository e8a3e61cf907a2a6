"""`kiln plan` on the published configs of Gemma-3-27B-it, GPT-OSS-120B (MXFP4) and Mixtral-8x7B-Instruct
(tests/data/public_configs) on an H100 at SGLang's defaults, against figures worked out by hand from the configs'
fields (docs/families.md shows the arithmetic): parameters, KV bytes a token of the full-attention layers, and the
windowed layers' ring a request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kiln.plan as plan

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).parent / "data" / "public_configs"


def planned(capsys, name: str, *flags: str) -> dict:
    """The plan's JSON; its exit status 0 when it fits, 1 when it does not."""
    argv = ["--model-path", str(CONFIGS / f"{name}.json"), "--device-name", "H100", "--json", *flags]
    rc = plan.main(argv)
    out = json.loads(capsys.readouterr().out)
    assert rc == (0 if out["fits"] else 1)
    return out


def gemma3_27b_params() -> int:
    h, inter, layers, vocab, heads, kv, hd = 5376, 21504, 62, 262208, 32, 16, 128
    attn = h * heads * hd * 2 + h * kv * hd * 2 + 2 * hd  # q, o; k, v; q/k norms
    return (
        vocab * h + layers * (attn + 3 * h * inter + 4 * h) + h
    )  # tied head; four norms a layer; final norm


def gpt_oss_120b_params() -> int:
    h, layers, vocab, heads, kv, hd, experts, inter = 2880, 36, 201088, 64, 8, 64, 128, 2880
    attn = 2 * h * heads * hd + 2 * h * kv * hd + heads * hd + 2 * kv * hd + h + heads  # + biases, sinks
    moe = experts * (3 * h * inter + 2 * inter + h) + experts * h + experts  # experts with biases; router
    return 2 * vocab * h + layers * (attn + moe + 2 * h) + h


def mixtral_8x7b_params() -> int:
    h, layers, vocab, heads, kv, hd, experts, inter = 4096, 32, 32000, 32, 8, 128, 8, 14336
    return (
        2 * vocab * h
        + layers * (2 * h * heads * hd + 2 * h * kv * hd + experts * (3 * h * inter + h) + 2 * h)
        + h
    )


def test_gemma3_27b(capsys) -> None:
    out = planned(capsys, "gemma-3-27b-it")
    assert out["weight_bytes"] == gemma3_27b_params() * 2 and round(gemma3_27b_params() / 1e9, 2) == 27.01
    # 10 of 62 layers full attention (every 6th); 52 windowed over 1024 tokens
    assert out["kv_bytes_per_token"] == 10 * 16 * (128 + 128) * 2 == 81_920
    assert out["state_slot_bytes"] == 52 * 1024 * 16 * (128 + 128) * 2 == 436_207_616
    assert out["fits"]


def test_gpt_oss_120b_dequantized_needs_four_h100s(capsys) -> None:
    one = planned(capsys, "gpt-oss-120b")
    assert one["weight_bytes"] == gpt_oss_120b_params() * 2  # MXFP4 experts dequantized to bfloat16 at load
    assert not one["fits"] and "--tp-size 4" in one["failure"]["fix"]
    four = planned(capsys, "gpt-oss-120b", "--tp-size", "4")
    assert four["fits"] and four["kv_bytes_per_token"] == 18 * 2 * (64 + 64) * 2 == 9_216
    assert four["state_slot_bytes"] == 18 * 128 * 2 * (64 + 64) * 2


def test_mixtral_8x7b_needs_two_h100s(capsys) -> None:
    one = planned(capsys, "mixtral-8x7b-instruct-v0.1")
    assert one["weight_bytes"] == mixtral_8x7b_params() * 2 and round(mixtral_8x7b_params() / 1e9, 2) == 46.7
    assert not one["fits"] and "--tp-size 2" in one["failure"]["fix"]
    two = planned(capsys, "mixtral-8x7b-instruct-v0.1", "--tp-size", "2")
    assert two["fits"] and two["kv_bytes_per_token"] == 32 * 4 * (128 + 128) * 2 and two["state_slots"] == 0
