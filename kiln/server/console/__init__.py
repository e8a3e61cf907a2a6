"""The built-in console: one page at `/` and `/ui` (index.html, console.js, console.css, all shipped here, nothing
from a CDN) that reads /status, /metrics and the info routes and streams /v1/chat/completions. The page holds no
data, so it is served without the API key; the data routes it calls keep theirs (app.GateMiddleware)."""

from __future__ import annotations

import json
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

PAGE_PATHS = ("/", "/ui")
ASSETS = {"console.js": "text/javascript", "console.css": "text/css"}
ASSET_PATHS = tuple(f"/console/{name}" for name in ASSETS)
CONSOLE_PATHS = frozenset((*PAGE_PATHS, *ASSET_PATHS))
# where index.html takes what the page must know before its first request: asking for the key up front spares
# a 401 (which the browser logs as an error), and a server without /metrics is not polled for it
_CONFIG_MARK = "{}<!--kiln-config-->"


def _read(name: str) -> str:
    return files(__name__).joinpath(name).read_text(encoding="utf-8")


def page_html(api_key_required: bool, metrics: bool) -> str:
    config = json.dumps({"auth": api_key_required, "metrics": metrics})
    return _read("index.html").replace(_CONFIG_MARK, config)


def add_console_routes(app: FastAPI, api_key_required: bool, metrics: bool) -> None:
    html = page_html(api_key_required, metrics)
    # read once: the files do not change under a running server
    assets = {name: _read(name) for name in ASSETS}

    async def page():
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    for path in PAGE_PATHS:
        app.add_api_route(path, page, methods=["GET"], include_in_schema=False)

    def asset_route(name: str):
        async def asset():
            return Response(assets[name], media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

        return asset

    for name in ASSETS:
        app.add_api_route(f"/console/{name}", asset_route(name), methods=["GET"], include_in_schema=False)
