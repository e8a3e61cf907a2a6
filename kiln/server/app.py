"""The FastAPI application: OpenAI-compatible and native routes, probes, control endpoints, error shapes."""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import asdict, dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from kiln.config import ServerArgs
from kiln.sampling_params import InvalidParam
from kiln.server.engine_client import EngineClient
from kiln.server.openai_api import EngineRequestError, OpenAIServing
from kiln.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, error_body
from kiln.server.responses import ModelNotFound, QueueFull
from kiln.server.startup import StartupState

logger = logging.getLogger("kiln")
OPEN_PATHS = {"/live", "/ready", "/health", "/health_generate", "/status", "/metrics"}
GENERATION_PATHS = {"/v1/completions", "/v1/chat/completions", "/generate"}


@dataclass
class ServerState:
    args: ServerArgs
    startup: StartupState
    client: EngineClient | None = None
    serving: OpenAIServing | None = None
    info: dict | None = None
    model_name: str = ""
    shutting_down: bool = False
    stalled: str | None = None  # why the engine is considered stuck, if it is
    metrics: object | None = None


def _err(
    status: int, message: str, param: str | None = None, type_: str = "invalid_request_error", code=None
):
    return JSONResponse(error_body(message, param, type_, code), status_code=status)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Kiln")
    app.state.kiln = state

    app.add_middleware(GateMiddleware, state=state)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", []) if x not in ("body",)]
        if first.get("type") == "json_invalid":
            return _err(400, f"malformed JSON body: {first.get('msg', '')}", None)
        param = ".".join(loc) or None
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

    def serving() -> OpenAIServing:
        if state.serving is None:
            raise _NotReady()

        return state.serving

    class _NotReady(Exception):
        pass

    @app.exception_handler(_NotReady)
    async def on_not_ready(request: Request, exc: _NotReady):
        return _err(503, f"the engine is not up yet (phase: {state.startup.phase})", None, "unavailable")

    async def _body(request: Request, model):
        raw = await request.body()
        try:
            data = json.loads(raw) if raw else {}
        except json.JSONDecodeError as e:
            raise InvalidParam("body", f"malformed JSON body: {e}") from None
        if not isinstance(data, dict):
            raise InvalidParam("body", "the body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None

    # ---------------------------------------------------------------- probes
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

    for path in ("/health", "/ready", "/health_generate"):
        app.add_api_route(path, _readiness, methods=["GET"])

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return _err(404, "metrics are disabled (--disable-metrics)", None, "not_found")
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status():
        return state.startup.to_dict()

    # ---------------------------------------------------------------- OpenAI
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != state.model_name:
            raise ModelNotFound(name, state.model_name)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving().completions(await _body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serving().chat(await _body(request, ChatCompletionRequest), request)

    @app.post("/generate")
    async def generate(request: Request):
        return await serving().generate(await _body(request, GenerateRequest), request)

    # ---------------------------------------------------------------- control
    async def flush_cache():
        out = await serving().client.control("flush_cache")
        if out.ok:
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)

    app.add_api_route("/flush_cache", flush_cache, methods=["POST"], operation_id="flush_cache_post")
    app.add_api_route("/flush_cache", flush_cache, methods=["GET"], operation_id="flush_cache_get")

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        out = await serving().client.control("server_info")
        return {"server_args": asdict(state.args), **out.data, "startup": state.startup.to_dict()}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return {
            "model_path": state.args.model_path,
            "tokenizer_path": state.args.tokenizer_path or state.args.model_path,
            "is_generation": True,
        }

    @app.post("/abort_request")
    async def abort_request(request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except json.JSONDecodeError as e:
            raise InvalidParam("body", f"malformed JSON body: {e}") from None
        if not isinstance(body, dict) or ("rid" not in body and not body.get("abort_all")):
            raise InvalidParam("rid", "give rid or abort_all: true")
        serving().client.abort(body.get("rid"), bool(body.get("abort_all")))
        return {"success": True}

    return app


class GateMiddleware:
    """Plain ASGI (so client disconnects still reach the handlers): 503 for generation while shutting down,
    401 without the API key (probes and /metrics stay open)."""

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
    info = state.info or {}
    return {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "kiln",
        "root": state.model_name,
        "max_model_len": info.get("context_len"),
    }
