"""The pooled routes' shared part (PoolingServing: prompts checked and run as prefill-only requests with a PoolSpec,
kiln.scheduler.pooling) and the embedding routes of an --is-embedding server: OpenAI's POST /v1/embeddings and
SGLang's native POST /encode (its EmbeddingReqInput: `text` or `input_ids`, an {embedding, meta_info} body per
input). /v1/score and /v1/rerank, a generation server's, are in kiln.server.scoring."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from kiln.sampling_params import InvalidParam, SamplingParams
from kiln.scheduler.io import PoolSpec, ReqOutput, ServerInfo, embedding_spec
from kiln.scheduler.scheduler import DEADLINE_MESSAGE
from kiln.scheduler.validate import validate_request
from kiln.server.openai_api import EngineRequestError, OpenAIServing, until_done
from kiln.server.responses import QueueFull

MAX_INPUTS = 2048  # inputs (texts, token lists, score items, documents) a request may carry
NOT_EMBEDDING = (
    "This model does not appear to be an embedding model by default. Please add `--is-embedding` when launching "
    "the server or try another model."  # SGLang's words
)
SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


class PooledAborted(Exception):
    """A pooled request ended without its result (there is no finish_reason to carry an abort in OpenAI's shapes):
    408 past --request-timeout, 503 otherwise (/abort_request, a shutdown)."""

    def __init__(self, message: str):
        super().__init__(f"the request was aborted: {message}")
        self.status = 408 if message == DEADLINE_MESSAGE else 503


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingRequest(_Strict):
    """OpenAI's /v1/embeddings body."""

    input: Any = Field(description=SHAPES)
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's fields that change nothing


class EncodeRequest(_Strict):
    """SGLang's /encode body (EmbeddingReqInput's text-only fields)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    dimensions: int | None = None


class PoolingServing:
    """Prompts run as prefill-only requests that return a pooled vector, over the server's OpenAIServing (its
    tokenizer, limits, engine client and queue); `info`: the engine's pooling (None on a generation server)."""

    def __init__(self, serving: OpenAIServing, info: ServerInfo):
        self.serving, self.pooling, self.hidden_size = serving, info.pooling, info.hidden_size

    def require_embedding(self) -> PoolSpec:
        if self.pooling is None:
            raise InvalidParam("model", NOT_EMBEDDING)
        return self.pooling

    def require_generation(self, route: str) -> None:
        if self.pooling is not None:
            raise InvalidParam(
                "model",
                f"{route} scores with a generation model's next-token logits, and this server runs an embedding "
                "model (--is-embedding): use /v1/embeddings or /encode",
            )

    def prompts(self, value: Any, field: str) -> list[list[int]]:
        """Token ids of each input of `value`, given as SHAPES."""
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise InvalidParam(field, f"{field} must be {SHAPES}")
        if not value:
            raise InvalidParam(field, f"{field} is empty: send at least one input")
        self.check_count(len(value), field)
        if all(isinstance(v, str) for v in value):
            for i, text in enumerate(value):
                if not text.strip():  # SGLang refuses these too: nothing to embed
                    raise InvalidParam(field, f"{field}[{i}] is empty or whitespace only")
            return [self.serving.encode(text, field) for text in value]
        if all(_is_id(v) for v in value):
            return [list(value)]
        if all(isinstance(v, list) and all(_is_id(t) for t in v) for v in value):
            return [list(v) for v in value]
        raise InvalidParam(field, f"{field} must be {SHAPES} (one kind throughout)")

    @staticmethod
    def check_count(count: int, field: str) -> None:
        if count > MAX_INPUTS:
            raise InvalidParam(field, f"{field} has {count} inputs: send at most {MAX_INPUTS} in one request")

    async def run(
        self, prompts: list[list[int]], pool: PoolSpec, field: str, raw: Request
    ) -> list[ReqOutput]:
        """Each prompt's output, its `embedding` set, once all ended; a prompt the limits refuse is a 400 naming
        `field` and its index."""
        params = SamplingParams(max_new_tokens=0)
        for i, ids in enumerate(prompts):
            try:
                validate_request(ids, params, self.serving.limits)
            except InvalidParam as e:
                raise InvalidParam(field, f"{field}[{i}]: {e}") from None
        serving = self.serving
        serving.refuse_never_admitted(len(prompts), len(prompts), (field, field))
        active = serving.client.num_active
        if serving.max_in_flight is not None and active + len(prompts) > serving.max_in_flight:
            raise QueueFull(active, serving.max_in_flight)
        deadline = serving.request_deadline()
        client = serving.client
        results = await until_done(
            (client.collect(ids, params, None, deadline, pool=pool) for ids in prompts), raw
        )
        outs = [r.output for r in results]
        for out in outs:
            if out.error:
                raise EngineRequestError(out.error)
            if out.embedding is None:  # aborted: a deadline, /abort_request, a shutdown
                raise PooledAborted((out.finish_reason or {}).get("message", "aborted"))
        return outs

    async def embeddings(self, req: EmbeddingRequest, raw: Request) -> dict:
        self.serving.check_model(req.model)
        pool = embedding_spec(self.require_embedding(), req.dimensions, self.hidden_size)
        outs = await self.run(self.prompts(req.input, "input"), pool, "input", raw)
        tokens = sum(out.prompt_tokens for out in outs)
        data = [
            {"object": "embedding", "embedding": _encoded(out.embedding, req.encoding_format), "index": i}
            for i, out in enumerate(outs)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": self.serving.model_name, "usage": usage}

    async def encode(self, req: EncodeRequest, raw: Request) -> dict | list[dict]:
        """SGLang's /encode: one {embedding, meta_info} body, a list of them for a list of inputs."""
        if (req.text is None) == (req.input_ids is None):
            raise InvalidParam("text", "give exactly one of text or input_ids")
        pool = embedding_spec(self.require_embedding(), req.dimensions, self.hidden_size)
        field, value = ("text", req.text) if req.text is not None else ("input_ids", req.input_ids)
        single = isinstance(value, str) or bool(value) and _is_id(value[0])
        start = time.time()
        outs = await self.run(self.prompts(value, field), pool, field, raw)
        bodies = [{"embedding": out.embedding, "meta_info": _meta(out, start)} for out in outs]
        return bodies[0] if single else bodies


def _meta(out: ReqOutput, start: float) -> dict:
    """SGLang's meta_info of an embedding: no completion or cached tokens."""
    return {
        "id": out.rid or uuid.uuid4().hex,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "e2e_latency": time.time() - start,
    }


def _encoded(vector: list[float] | None, encoding_format: str) -> list[float] | str:
    """OpenAI's base64: the float32 values' little-endian bytes."""
    assert vector is not None
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
