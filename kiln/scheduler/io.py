"""Messages between the front (HTTP / in-process API) and the scheduler. One set serves both; each is a
tagged dataclass that pickles over ZMQ."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.sampling_params import SamplingParams


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    stream: bool = False
    deadline: float | None = None  # time.time() after which the request is aborted


@dataclass
class AbortReq:
    rid: str | None = None  # None with abort_all
    abort_all: bool = False
    message: str = "aborted by the client"


@dataclass
class ControlReq:
    """flush_cache | server_info | check_integrity; answered with a ControlOut of the same id."""

    kind: str
    cid: int = 0


@dataclass
class ControlOut:
    cid: int
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None


@dataclass
class ReqOutput:
    """What happened to one request in one step: new tokens and text, and the end when it ended."""

    rid: str
    new_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    num_retractions: int = 0
    queue_time: float | None = None  # seconds from arrival to first admission, on the first output only
    error: str | None = None  # set for requests that failed inside the engine (a 500 for that request alone)


@dataclass
class BatchOut:
    outputs: list[ReqOutput]
    stats: dict[str, Any] = field(default_factory=dict)  # the scheduler's gauges and counters at this step
