"""The saved verdicts of compiled CPU shapes: a warm start reads back what the first start measured, only for the
same host, threads, torch, kernels and model layout, and an unreadable file counts as empty."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.runner.graph_payoff import FILE_NAME, PayoffStore

pytestmark = pytest.mark.unit


def _model(width: int = 4) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 2))


def test_a_verdict_comes_back_for_the_same_model_and_shape(tmp_path):
    PayoffStore(str(tmp_path), _model()).put("decode", 8, 40.0, 50.0)
    again = PayoffStore(str(tmp_path), _model())
    assert again.get("decode", 8) == (40.0, 50.0)
    assert again.get("decode", 16) is None and again.get("prefill", 8) is None


def test_another_model_layout_or_thread_count_measures_again(tmp_path, monkeypatch):
    PayoffStore(str(tmp_path), _model()).put("decode", 8, 40.0, 50.0)
    assert PayoffStore(str(tmp_path), _model(width=8)).get("decode", 8) is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert PayoffStore(str(tmp_path), _model()).get("decode", 8) is None


def test_an_unreadable_or_foreign_file_is_empty(tmp_path):
    (tmp_path / FILE_NAME).write_text("{not json")
    store = PayoffStore(str(tmp_path), _model())
    assert store.get("decode", 8) is None
    store.put("decode", 8, 1.0, 2.0)  # and is replaced by a good one
    assert PayoffStore(str(tmp_path), _model()).get("decode", 8) == (1.0, 2.0)
    key = next(iter(json.loads((tmp_path / FILE_NAME).read_text())))
    (tmp_path / FILE_NAME).write_text(json.dumps({key: {"graph_ms": "x", "eager_ms": 2.0}}))
    assert PayoffStore(str(tmp_path), _model()).get("decode", 8) is None


def test_without_a_cache_directory_nothing_is_written(tmp_path):
    store = PayoffStore(None, _model())
    store.put("decode", 1, 1.0, 2.0)
    assert store.get("decode", 1) == (1.0, 2.0)  # this start's own record
    assert not list(tmp_path.iterdir())
