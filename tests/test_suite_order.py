"""The suite's own order (tests/layers.py): files by their heaviest layer, slow first and unit last, each file's
tests together and in their order, so that `make test`'s workers start the longest files first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from layers import heaviest_files_first

pytestmark = pytest.mark.unit


def item(nodeid: str, layer: str):
    return SimpleNamespace(nodeid=nodeid, iter_markers=lambda: iter([getattr(pytest.mark, layer).mark]))


def test_files_go_heaviest_layer_first_each_kept_whole_and_in_order():
    items = [
        item("tests/a.py::t1", "unit"),
        item("tests/a.py::t2", "engine"),  # a's heaviest test makes it an engine file
        item("tests/b.py::t", "server"),
        item("tests/c.py::t1", "unit"),
        item("tests/d.py::t", "slow"),
        item("tests/c.py::t2", "unit"),
        item("tests/e.py::t", "engine"),
    ]
    heaviest_files_first(items)
    assert [i.nodeid for i in items] == [
        "tests/d.py::t",
        "tests/b.py::t",
        "tests/a.py::t1",
        "tests/a.py::t2",
        "tests/e.py::t",  # same layer as a: collection order kept
        "tests/c.py::t1",
        "tests/c.py::t2",
    ]
