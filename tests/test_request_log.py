"""--log-requests-level, SGLang's levels: 0 the requests' metadata, 1 and the sampling parameters they changed, 2
and their prompt and output text cut at 2048 characters, 3 and the texts whole."""

from __future__ import annotations

import logging

import pytest

from kiln.sampling_params import SamplingParams
from kiln.scheduler.io import ReqOutput
from kiln.server.engine_client import RequestLog

pytestmark = pytest.mark.unit

PROMPT = "p" * 3000  # one character a token below: longer than the cut


def lines(level: int, caplog) -> tuple[str, str]:
    log = RequestLog(lambda ids: "".join(chr(i) for i in ids), level)
    with caplog.at_level(logging.INFO, logger="kiln"):
        caplog.clear()
        log.receive("r1", [ord(c) for c in PROMPT], SamplingParams(temperature=0.5))
        for delta, done in (("a" * 2000, False), ("b" * 2000, True)):
            out = ReqOutput("r1", [1], delta, done, {"type": "stop"} if done else None, 3000, 2, 0)
            log.output(out, start=0.0)
    receive, finish = (r.getMessage() for r in caplog.records)
    return receive, finish


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_each_level_logs_what_sglangs_does(level: int, caplog) -> None:
    receive, finish = lines(level, caplog)
    assert receive.startswith("Receive: rid=r1, prompt_tokens=3000")
    assert "finish_reason=stop" in finish and "completion_tokens=2" in finish
    assert ("sampling_params={'temperature': 0.5}" in receive) == (level >= 1)
    assert ("text=" in receive) == ("text=" in finish) == (level >= 2)
    if level == 2:  # cut at 2048 characters, marked
        assert f"text='{'p' * 2048}...'" in receive and f"text='{'a' * 2000}{'b' * 48}...'" in finish
    if level == 3:
        assert f"text='{PROMPT}'" in receive and f"text='{'a' * 2000}{'b' * 2000}'" in finish
