"""The FastAPI application: OpenAI-compatible and native routes, probes, control endpoints, error shapes."""

from __future__ import annotations

import logging
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kiln.config import ServerArgs
from kiln.sampling_params import InvalidParam
from kiln.scheduler.io import EngineState, SchedulerStats, ServerInfo
from kiln.server.bodies import decode_json, read_body
from kiln.server.console import CONSOLE_PATHS, add_console_routes
from kiln.server.embeddings import EmbeddingRequest, EncodeRequest, PooledAborted, PoolingServing
from kiln.server.engine_client import EngineClient
from kiln.server.lora_routes import (
    LoadLoraAdapterRequest,
    LoraNames,
    UnloadLoraAdapterRequest,
    add_lora_routes,
)
from kiln.server.openai_api import EngineRequestError, OpenAIServing
from kiln.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    error_body,
)
from kiln.server.responses import BodyReadTimeout, BodyTooLarge, ModelNotFound, QueueFull
from kiln.server.scoring import RerankRequest, ScoringRequest, rerank, score
from kiln.server.sglang_fields import refuse_unsupported
from kiln.server.sglang_routes import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    health_generate,
    model_info,
    sglang_server_info,
    tokenize,
)
from kiln.server.startup import StartupState

if TYPE_CHECKING:
    from kiln.server.metrics import Metrics

logger = logging.getLogger("kiln")
# the console's page and assets hold no data: the routes they call keep the key
OPEN_PATHS = {"/live", "/ready", "/health", "/health_generate", "/status", "/metrics", *CONSOLE_PATHS}
GENERATION_PATHS = {
    "/v1/completions",
    "/v1/chat/completions",
    "/generate",
    "/v1/embeddings",
    "/encode",
    "/v1/score",
    "/v1/rerank",
}
# The body each POST route reads (itself, through json_object), declared in /openapi.json for clients and fuzzers.
BODY_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/generate": GenerateRequest,
    "/abort_request": AbortRequest,
    "/v1/tokenize": TokenizeRequest,
    "/tokenize": TokenizeRequest,
    "/v1/detokenize": DetokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/encode": EncodeRequest,
    "/v1/score": ScoringRequest,
    "/v1/rerank": RerankRequest,
    "/load_lora_adapter": LoadLoraAdapterRequest,
    "/unload_lora_adapter": UnloadLoraAdapterRequest,
}


@dataclass
class ServerState:
    args: ServerArgs
    startup: StartupState
    client: EngineClient | None = None
    serving: OpenAIServing | None = None
    # /v1/embeddings, /encode, /v1/score, /v1/rerank (kiln.server.embeddings, kiln.server.scoring)
    pooling: PoolingServing | None = None
    info: ServerInfo | None = None
    model_name: str = ""
    shutting_down: bool = False
    stalled: str | None = None  # why the engine is considered stuck, if it is
    metrics: Metrics | None = None
    # the model's sampling defaults under --sampling-defaults model (read once at startup; /model_info says them)
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    lora: LoraNames = field(default_factory=lambda: LoraNames(False))  # the LoRA adapters loaded, by name


def _err(
    status: int, message: str, param: str | None = None, type_: str = "invalid_request_error", code=None
):
    return JSONResponse(error_body(message, param, type_, code), status_code=status)


def _closing(response: JSONResponse) -> JSONResponse:
    """The answer to a request whose body was left unread: the connection closes after it."""
    response.headers["Connection"] = "close"
    return response


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Kiln")
    app.state.kiln = state
    app.add_middleware(GateMiddleware, state=state)
    _add_error_handlers(app, state)
    _add_probes(app, state)
    _add_openai_routes(app, state)
    _add_control_routes(app, state)
    add_lora_routes(app, state.lora, _parse_body, lambda: _serving(state).client)
    if not state.args.disable_console:
        add_console_routes(
            app, api_key_required=bool(state.args.api_key), metrics=not state.args.disable_metrics
        )
    app.openapi = lambda: _openapi_with_bodies(app)  # type: ignore[method-assign]
    return app


def _openapi_with_bodies(app: FastAPI) -> dict:
    """FastAPI's spec plus the request bodies: the routes read their bodies themselves (json_object), so
    FastAPI cannot see them; declared here, from the same pydantic models, clients and fuzzers see every field
    and its bounds."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        refs, defs = models_json_schema(
            [(model, "validation") for model in BODY_MODELS.values()],
            ref_template="#/components/schemas/{model}",
        )
        spec.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        for path, model in BODY_MODELS.items():
            spec["paths"][path]["post"]["requestBody"] = {
                "required": path != "/abort_request",
                "content": {"application/json": {"schema": refs[(model, "validation")]}},
            }
        app.openapi_schema = spec
    return app.openapi_schema


class EngineNotReady(Exception):
    """A route that needs the engine was called before startup finished."""


def _serving(state: ServerState) -> OpenAIServing:
    if state.serving is None:
        raise EngineNotReady()
    return state.serving


def _generating(state: ServerState) -> OpenAIServing:
    """The generation routes' serving; an embedding server refuses them (400), as SGLang does."""
    serving = _serving(state)
    if state.info is not None and state.info.pooling is not None:
        raise InvalidParam(
            "model", "this server runs an embedding model (--is-embedding): it generates nothing, use "
            "/v1/embeddings or /encode",
        )  # fmt: skip
    return serving


def _pooling(state: ServerState) -> PoolingServing:
    if state.pooling is None:
        raise EngineNotReady()
    return state.pooling


# ---------------------------------------------------------------------------------------------- request bodies
async def json_object(request: Request, not_object: InvalidParam) -> dict:
    """The request body as a JSON object, the one way every route reads its body: an empty body is {}; a body
    too large (413), too slow (408), not UTF-8, nested too deep or malformed (400 naming `body`) is refused
    before any work; a body that is valid JSON but no object is refused with `not_object` (each route names its
    own remedy)."""
    state: ServerState = request.app.state.kiln
    context_len = state.info.context_len if state.info is not None else 0
    raw = await read_body(
        request, state.args.request_byte_limit(context_len), state.args.request_read_timeout
    )
    data = decode_json(raw) if raw else {}
    if not isinstance(data, dict):
        raise not_object
    return data


async def _parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    data = await json_object(request, InvalidParam("body", "the body must be a JSON object"))
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    state: ServerState = request.app.state.kiln
    refuse_unsupported(body, served=frozenset({"lora_path"}) if state.lora.enabled else frozenset())
    return body


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", []) if x not in ("body",)]
        if first.get("type") == "json_invalid":
            return _err(400, f"malformed JSON body: {first.get('msg', '')}", None)
        param = ".".join(loc) or None
        if first.get("type") == "extra_forbidden":  # pydantic's "Extra inputs are not permitted" says not why
            message = f"{param} is not supported by Kiln (refused rather than silently ignored)"
            return _err(400, message, param)
        return _err(
            400,
            f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid"),
            param,
        )

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException):
        """The router's own refusals (no such path, method not allowed) in the same error shape."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        resp = _err(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None, code=code)
        resp.headers.update(exc.headers or {})
        return resp

    @app.exception_handler(InvalidParam)
    async def on_invalid(request: Request, exc: InvalidParam):
        return _err(400, str(exc), exc.param)

    @app.exception_handler(QueueFull)
    async def on_queue_full(request: Request, exc: QueueFull):
        if state.metrics is not None:
            state.metrics.rejected.inc()
        resp = _err(429, str(exc), None, "rate_limit_error", "queue_full")
        resp.headers["Retry-After"] = str(exc.retry_after)
        return resp

    @app.exception_handler(BodyTooLarge)
    async def on_too_large(request: Request, exc: BodyTooLarge):
        # the rest of the body is never read: the connection cannot carry another request
        return _closing(_err(413, str(exc), "body", code="request_too_large"))

    @app.exception_handler(BodyReadTimeout)
    async def on_read_timeout(request: Request, exc: BodyReadTimeout):
        return _closing(_err(408, str(exc), "body", code="request_timeout"))

    @app.exception_handler(ClientDisconnect)
    async def on_disconnect(request: Request, exc: ClientDisconnect):
        """The client left while sending its body: nobody reads this answer, and it is no server error."""
        return Response(status_code=400)

    @app.exception_handler(ModelNotFound)
    async def on_model(request: Request, exc: ModelNotFound):
        return _err(404, str(exc), "model", "invalid_request_error", "model_not_found")

    @app.exception_handler(EngineRequestError)
    async def on_engine_error(request: Request, exc: EngineRequestError):
        eid = uuid.uuid4().hex[:12]
        logger.error(f"request failed in the engine (error id {eid}): {exc}")
        return _err(
            500, f"internal error while processing the request (error id {eid})", None, "internal_error"
        )

    @app.exception_handler(PooledAborted)
    async def on_pooled_aborted(request: Request, exc: PooledAborted):
        code = "request_timeout" if exc.status == 408 else "aborted"
        return _err(
            exc.status, str(exc), None, "unavailable" if exc.status == 503 else "invalid_request_error", code
        )

    @app.exception_handler(EngineNotReady)
    async def on_not_ready(request: Request, exc: EngineNotReady):
        return _err(503, f"the engine is not up yet (phase: {state.startup.phase})", None, "unavailable")


def _add_probes(app: FastAPI, state: ServerState) -> None:
    @app.get("/live")
    async def live():
        return {"status": "alive"}

    def _readiness():
        if state.startup.ready and not state.shutting_down and not state.stalled:
            return PlainTextResponse("", status_code=200)
        phase = "shutting_down" if state.shutting_down else state.startup.phase
        return JSONResponse(
            {"ready": False, "phase": phase, "error": state.startup.error, "stalled": state.stalled},
            status_code=503,
        )

    for path in ("/health", "/ready"):
        app.add_api_route(path, _readiness, methods=["GET"])

    @app.get("/health_generate")
    async def health_generate_route():
        """SGLang's: 200 once a one-token generation (or any other output) comes back, 503 otherwise."""
        not_ready = _readiness()
        if not_ready.status_code != 200:
            return not_ready
        pool = state.info.pooling if state.info is not None else None
        if await health_generate(_serving(state).client, pool=pool):
            return PlainTextResponse("", status_code=200)
        return JSONResponse({"ready": True, "healthy": False, "error": "no token came back"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return _err(404, "metrics are disabled (--disable-metrics)", None, "not_found")
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status():
        body = state.startup.to_dict()
        if state.shutting_down and not state.startup.failed:  # draining, or stopped during startup
            body["phase"] = "shutting_down"
        if state.info is not None and state.info.memory_check_per_rank is not None:
            body["memory_check_per_rank"] = state.info.memory_check_per_rank
        return body


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state), *state.lora.cards(state.model_name)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != state.model_name:
            raise ModelNotFound(name, state.model_name)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generating(state).completions(await _parse_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generating(state).chat(await _parse_body(request, ChatCompletionRequest), request)

    @app.post("/generate")
    async def generate(request: Request):
        return await _generating(state).generate(await _parse_body(request, GenerateRequest), request)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await _pooling(state).embeddings(await _parse_body(request, EmbeddingRequest), request)

    @app.post("/encode")
    async def encode(request: Request):
        return await _pooling(state).encode(await _parse_body(request, EncodeRequest), request)

    @app.post("/v1/score")
    async def score_route(request: Request):
        return await score(_pooling(state), await _parse_body(request, ScoringRequest), request)

    @app.post("/v1/rerank")
    async def rerank_route(request: Request):
        return await rerank(_pooling(state), await _parse_body(request, RerankRequest), request)

    async def tokenize_route(request: Request):
        return tokenize(_serving(state), await _parse_body(request, TokenizeRequest))

    async def detokenize_route(request: Request):
        return detokenize(_serving(state), await _parse_body(request, DetokenizeRequest))

    for prefix, suffix in (("/v1", "_v1"), ("", "")):  # SGLang serves both paths
        app.add_api_route(
            f"{prefix}/tokenize", tokenize_route, methods=["POST"], operation_id=f"tokenize{suffix}"
        )
        app.add_api_route(
            f"{prefix}/detokenize", detokenize_route, methods=["POST"], operation_id=f"detokenize{suffix}"
        )


def _add_control_routes(app: FastAPI, state: ServerState) -> None:
    async def flush_cache():
        out = await _serving(state).client.control("flush_cache")
        if out.ok:
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)

    app.add_api_route("/flush_cache", flush_cache, methods=["POST"], operation_id="flush_cache_post")
    app.add_api_route("/flush_cache", flush_cache, methods=["GET"], operation_id="flush_cache_get")

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        engine = await _serving(state).client.engine_state()
        return {
            # SGLang's layout first (its flat arguments, scheduler figures, version); Kiln's fields over it
            **sglang_server_info(state.args, engine),
            # SGLang's top-level fields, which SGLang's router reads when it registers a worker
            "model_path": state.args.model_path,
            "served_model_name": state.model_name,
            "tp_size": state.args.tp_size,
            "dp_size": state.args.dp_size,
            "server_args": asdict(state.args),
            **server_info_json(engine),
            "startup": state.startup.to_dict(),
            "lora_adapters": state.lora.paths if state.lora.enabled else None,
        }

    @app.get("/get_load")
    async def get_load():
        """SGLang's load report (one entry per dp rank: a Kiln server is one), which SGLang's router polls for
        its power_of_two policy. num_tokens counts the pool tokens in use, the prefix cache's included."""
        stats = _serving(state).client.engine_stats
        return [
            {
                "dp_rank": 0,
                "num_reqs": stats.num_running_reqs + stats.num_waiting_reqs,
                "num_waiting_reqs": stats.num_waiting_reqs,
                "num_tokens": stats.used_tokens,
            }
        ]

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info_route():
        embedding = state.info is not None and state.info.pooling is not None
        return model_info(state.args, state.model_name, state.sampling_defaults, not embedding)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        give_rid = InvalidParam("rid", "give rid or abort_all: true")
        try:
            body = AbortRequest.model_validate(await json_object(request, give_rid))
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        if body.rid is None and not body.abort_all:
            raise give_rid
        _serving(state).client.abort(body.rid, body.abort_all)
        return {"success": True}


def server_info_json(engine: EngineState) -> dict:
    """The engine's part of /get_server_info: the startup info's fields, then the live figures."""
    stats = engine.stats
    return {
        **asdict(engine.info),
        "num_running_reqs": stats.num_running_reqs,
        "num_waiting_reqs": stats.num_waiting_reqs,
        "token_usage": stats.token_usage,
        "integrity": engine.integrity,
        "stats": stats.counters(),
        "cache_tokens": stats.cache_tokens,
        **_hierarchical_cache(stats),
    }


def _hierarchical_cache(stats: SchedulerStats) -> dict:
    """The tiers' sizes and use, when --enable-hierarchical-cache is on."""
    if not stats.host_tier_tokens:
        return {}
    names = [f.name for f in fields(stats) if f.name.startswith(("host_", "storage_"))]
    return {"hierarchical_cache": {name: getattr(stats, name) for name in names}}


class GateMiddleware:
    """Plain ASGI (so client disconnects still reach the handlers): 503 for generation while shutting down,
    401 without the API key (probes, /metrics and the console's page stay open)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope.get("path", "")
            refusal = None
            if self.state.shutting_down and path in GENERATION_PATHS:
                refusal = _err(503, "the server is shutting down", None, "unavailable")
            key = self.state.args.api_key
            if refusal is None and key and path not in OPEN_PATHS:
                headers = dict(scope.get("headers") or [])
                if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {key}":
                    refusal = _err(
                        401,
                        "missing or wrong API key (send 'Authorization: Bearer <key>')",
                        None,
                        "authentication_error",
                        "invalid_api_key",
                    )
            if refusal is not None:
                return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "kiln",
        "root": state.model_name,
        "max_model_len": state.info.context_len if state.info is not None else None,
    }
