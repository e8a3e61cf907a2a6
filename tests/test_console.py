"""The built-in console (kiln/server/console/): served at / and /ui without the key, off with --disable-console,
and driven in headless Chromium against one `kiln serve --api-key`: it asks for the key, then shows the model,
`ready`, the startup timeline, the ledger's figures and the load, streams a chat reply, and no request leaves
the server and nothing is logged as an error.

The browser is Debian's `chromium` (`apt-get install chromium`, as .ci/run does), driven by the Python package
playwright (no `playwright install`); without it the browser tests skip. KILN_CONSOLE_SCREENSHOT=docs/console.png
also saves the page as it ends (the README's screenshot)."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from conftest import served
from fastapi.testclient import TestClient

from kiln.config import ServerArgs
from kiln.core.units import human
from kiln.server.app import ServerState, create_app
from kiln.server.startup import StartupState

pytestmark = pytest.mark.server

KEY = "console-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = shutil.which("chromium") or next((p for p in ("/usr/bin/chromium",) if os.path.exists(p)), None)
# A closed network refuses Chromium's background connections (updates, sync, QUIC probes): they are turned off
# so that the browser itself makes no request either
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium to drive the console in: install Debian's chromium package (apt-get install chromium)",
)


def app_client(**args) -> TestClient:
    return TestClient(create_app(ServerState(ServerArgs(**args), StartupState())))


# ---------------------------------------------------------------------------------------------- without a server
@pytest.mark.unit
def test_the_page_and_its_assets_are_served_without_the_key_and_the_data_routes_keep_it():
    http = app_client(api_key=KEY)
    for path in ("/", "/ui"):
        r = http.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
        assert '{"auth": true, "metrics": true}' in r.text  # the page asks for the key before its first call
    assert http.get("/console/console.js").headers["content-type"].startswith("text/javascript")
    assert http.get("/console/console.css").headers["content-type"].startswith("text/css")
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers=AUTH).status_code == 200
    assert "/" not in http.get("/openapi.json", headers=AUTH).json()["paths"]  # no API route


@pytest.mark.unit
def test_every_asset_the_page_names_is_kilns_own():
    page = app_client(disable_metrics=True).get("/").text
    assert '{"auth": false, "metrics": false}' in page
    for ref in re.findall(r'(?:src|href)="([^"]*)"', page):
        assert ref.startswith(("console/", "data:")), ref
    js = app_client().get("/console/console.js").text
    assert not re.search(r"https?://", js)  # every fetch is relative: Kiln's own routes


@pytest.mark.unit
def test_disable_console_leaves_its_paths_unserved():
    http = app_client(disable_console=True, api_key=KEY)
    for path in ("/", "/ui", "/console/console.js"):
        r = http.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    assert app_client().get("/ui").status_code == 200


# ---------------------------------------------------------------------------------------------- in a browser
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if CHROMIUM is None:  # no server started for tests that will skip
        pytest.skip("no Chromium")
    log = tmp_path_factory.mktemp("console") / "serve.log"
    flags = ["--max-total-tokens", "4096", "--max-running-requests", "8", "--api-key", KEY]
    flags += ["--served-model-name", "SmolLM2-135M-Instruct"]  # a name, not a path, in the screenshot
    yield from served(flags, log, ready_timeout=None, headers=AUTH)  # the console fixture watches it start


class Console:
    """One page over the module's server, opened while it starts, with what it requested and every error it
    logged."""

    def __init__(self, page, url: str):
        self.page, self.url = page, url
        self.requests: list[str] = []
        self.errors: list[str] = []
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(str(e)))


@pytest.fixture(scope="module")
def console(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            view = Console(browser.new_page(viewport={"width": 1280, "height": 1000}), server.url)
            wait_for_http(server)
            view.page.goto(f"{server.url}/")
            # the phase badge and the timeline's live row, each time the page changes them
            view.page.evaluate(
                """() => {
                window.phases = [];
                window.liveRows = 0;
                new MutationObserver(() => {
                    const phase = document.getElementById('phase').textContent;
                    if (window.phases.at(-1) !== phase) window.phases.push(phase);
                    window.liveRows += document.querySelectorAll('#timeline tr.current').length;
                }).observe(document.body, {childList: true, subtree: true, characterData: true});
            }"""
            )
            view.page.locator("#key-panel").wait_for(state="visible", timeout=10_000)
            view.page.fill("#key-input", KEY)
            view.page.click("#key-send")
            server.wait_ready(300)
            view.page.locator("#settings dd").first.wait_for(timeout=15_000)
            yield view
        finally:
            browser.close()


def wait_for_http(server, timeout: float = 120.0) -> None:
    """Until the starting server answers /status (its HTTP comes up before the engine)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited:\n{server.log_text()[-3000:]}")
        try:
            httpx.get(f"{server.url}/status", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(f"kiln serve did not answer in {timeout} s")


@needs_chromium
def test_the_page_follows_the_startup_live(console):
    phases = console.page.evaluate("window.phases")
    starting = [p for p in phases if p not in ("connecting", "ready")]
    assert starting and phases[-1] == "ready", phases  # a phase of the startup, then ready
    assert console.page.evaluate("window.liveRows") > 0  # the running phase's row, growing


@needs_chromium
def test_predicted_seconds_and_the_eta_are_shown_where_status_gives_them(console, server):
    """A starting server's /status with predictions (canned: this server's may have none), in a second tab."""
    status = {
        "phase": "loading_weights", "progress": {}, "error": None, "elapsed": 9.0, "ledger": None,
        "timings": {"launching": 4.0, "building_kernels": 1.0},
        "predicted_s": {"launching": 5.0, "building_kernels": 0.5, "loading_weights": 6.0, "warming_up": 2.0,
                        "total": 13.5},
        "eta_s": 4.5,
    }  # fmt: skip
    page = console.page.context.browser.new_page()
    try:
        page.route("**/status", lambda route: route.fulfill(json=status))
        page.goto(f"{server.url}/ui")
        page.locator('#timeline tr[data-phase="warming_up"]').wait_for(timeout=10_000)
        rows = {
            p: page.text_content(f'#timeline tr[data-phase="{p}"]')
            for p in status["predicted_s"]
            if p != "total"
        }
        assert "4.0 s" in rows["launching"] and "5.0 s" in rows["launching"], rows
        assert "4.0 s" in rows["loading_weights"] and "6.0 s" in rows["loading_weights"], (
            rows
        )  # live: 9 - 5 s
        assert "2.0 s" in rows["warming_up"], rows  # predicted, not reached yet
        assert page.text_content("#phase") == "loading_weights"
        assert page.text_content("#eta") == "ready in ~4.5 s"
        assert "predicted 13.5 s" in page.text_content("#startup-total")
    finally:
        page.close()


@needs_chromium
def test_after_the_key_the_page_shows_the_model_and_ready(console, server):
    model = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    page = console.page
    assert page.locator("#key-panel").is_hidden()
    assert page.text_content("#model") == model
    assert page.text_content("#phase") == "ready"
    settings = page.text_content("#settings")
    info = httpx.get(f"{server.url}/get_server_info", headers=AUTH).json()
    assert str(info["context_len"]) in settings and str(info["max_running_requests"]) in settings


@needs_chromium
def test_the_timeline_shows_each_phase_and_the_ledger_its_figures(console, server):
    status = httpx.get(f"{server.url}/status").json()
    page = console.page
    for phase, actual in status["timings"].items():
        # the row's cells: name, bar, actual, predicted; JavaScript's toFixed rounds halves up and Python's format
        # to even (0.25 is "0.3" on the page, "0.2" here), so the figures are compared as numbers
        cells = page.locator(f'#timeline tr[data-phase="{phase}"] td').all_text_contents()
        assert shown_seconds(cells[2]) == pytest.approx(actual, abs=0.051), (phase, cells)
        predicted = (status.get("predicted_s") or {}).get(phase)  # where /status predicts it
        if predicted is not None:
            assert shown_seconds(cells[3]) == pytest.approx(predicted, abs=0.051), (phase, cells)
    lines = status["ledger"]["lines"]
    device = lines[1 : [x["name"] for x in lines].index("headroom") + 1]
    for line in device:
        if line["name"] != "kv bytes per token":
            shown = page.text_content(f'#ledger-lines li[data-line="{line["name"]}"]')
            assert shown == f"{line['name']} {human(line['bytes'])}"
    assert human(lines[0]["bytes"]) in page.text_content("#ledger-total")
    assert page.locator("#ledger-bar > div").count() >= 3  # weights, the KV pool, headroom at least


def shown_seconds(text: str) -> float:
    """The seconds a timeline cell shows ("12.3 s")."""
    assert text.endswith(" s"), text
    return float(text.removesuffix(" s"))


@needs_chromium
def test_a_chat_message_streams_its_reply_into_the_page(console):
    page = console.page
    # every text the reply shows, as the page changes it: a streamed reply grows in several steps
    page.evaluate(
        """() => {
        window.seen = [];
        new MutationObserver(() => {
            const reply = [...document.querySelectorAll('#chat-log .assistant')].pop();
            if (reply && reply.textContent && window.seen.at(-1) !== reply.textContent) window.seen.push(reply.textContent);
        }).observe(document.getElementById('chat-log'), {childList: true, subtree: true, characterData: true});
    }"""
    )
    page.fill("#chat-max-tokens", "24")
    page.fill("#chat-input", "Write one sentence about the sea.")
    page.click("#chat-send")
    reply = page.locator("#chat-log .assistant").last
    page.wait_for_function(
        "() => document.querySelector('#chat-log .assistant:last-child').dataset.state !== 'streaming'",
        timeout=60_000,
    )
    assert reply.get_attribute("data-state") == "done", reply.text_content()
    seen = page.evaluate("window.seen")
    assert len(seen) >= 2 and int(reply.get_attribute("data-chunks")) >= 2, seen
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:])), seen
    assert seen[-1] == reply.text_content() and reply.text_content().strip()


@needs_chromium
def test_the_load_panel_reads_the_metrics(console):
    page = console.page
    # two polls make a rate: the generation tokens/s is a counter's difference
    page.wait_for_function(
        "() => /tokens\\/s/.test(document.getElementById('load').textContent)", timeout=10_000
    )
    load = page.text_content("#load")
    for label in ("running requests", "queued requests", "KV usage", "prefix hit rate"):
        assert label in load
    assert "spec acceptance" not in load  # no speculation: the series is absent, so is the line


@needs_chromium
def test_no_request_left_the_server_and_nothing_was_logged_as_an_error(console, server):
    assert console.requests and all(
        url.startswith(f"{server.url}/") or url.startswith("data:") for url in console.requests
    ), console.requests
    assert not console.errors, console.errors
    if shot := os.environ.get("KILN_CONSOLE_SCREENSHOT"):
        Path(shot).parent.mkdir(parents=True, exist_ok=True)
        console.page.screenshot(path=shot, full_page=True)
