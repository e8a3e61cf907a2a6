"""Hostile clients at the HTTP layer: bodies that are not UTF-8, nested without end, larger than the limit or
sent slowly, prompts far beyond the context, batches that can never be admitted, hundreds of connections held
open, raw random bytes on every route. Each is refused with a 4xx in the OpenAI error shape (or cut), the server
keeps serving with its latency, no KV slot or table row leaks, and the log holds no traceback."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time

import httpx
import pytest
from conftest import ServerProcess, assert_pool_at_baseline
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kiln.config import ServerArgs
from kiln.sampling_params import InvalidParam
from kiln.server.bodies import MAX_JSON_DEPTH, decode_json, json_depth_exceeds

pytestmark = pytest.mark.server

CMPL, CHAT, GEN, ABORT = "/v1/completions", "/v1/chat/completions", "/generate", "/abort_request"
BODY_ROUTES = [CMPL, CHAT, GEN, ABORT]
READ_TIMEOUT = 10  # --request-read-timeout of the server below
BODY_LIMIT = 2_000_000  # --max-request-bytes of the server below
MAX_CONNECTIONS = 600
IN_FLIGHT = 8  # --max-running-requests 4 + --max-queued-requests 4


# ---------------------------------------------------------------------------------------------- no server
@pytest.mark.unit
def test_depth_is_counted_outside_strings_without_recursion():
    assert json_depth_exceeds("[" * 100_000 + "]" * 100_000, MAX_JSON_DEPTH)
    assert not json_depth_exceeds(json.dumps({"a": "[[[[[[[[[[" * 100, "b": [[1], {"c": "]]"}]}), 3)
    assert not json_depth_exceeds('{"a": "\\"[[[[[[\\\\"}', 1)  # escaped quotes do not end the string
    assert json_depth_exceeds("[[[[]]]]", 3) and not json_depth_exceeds("[[[]]]", 3)


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
        (b"[" * 100_000, "deeper than"),
        (b'{"a": ' * 10_000 + b"1" + b"}" * 10_000, "deeper than"),
        (b'{"n": 1' + b"0" * 5000 + b"}", "malformed"),
        (b'{"prompt": ', "malformed"),
    ],
)
@pytest.mark.unit
def test_bad_bodies_are_refused_naming_the_body(raw, needle):
    with pytest.raises(InvalidParam) as refused:
        decode_json(raw)
    assert refused.value.param == "body" and needle in str(refused.value)


@pytest.mark.unit
def test_body_limit_default_follows_the_context_length():
    assert ServerArgs().request_byte_limit(8192) == 4 << 20
    assert ServerArgs().request_byte_limit(1 << 20) == 128 << 20
    assert ServerArgs(max_request_bytes=1000).request_byte_limit(1 << 20) == 1000


@pytest.mark.unit
def test_token_byte_bound_only_where_the_tokenizer_guarantees_it(default_model):
    from tokenizers import normalizers

    from kiln.text.tokenizer import load_tokenizer, longest_token_bytes

    tokenizer = load_tokenizer(default_model)
    bound = longest_token_bytes(tokenizer)
    vocab = tokenizer.get_vocab()
    assert bound is not None and bound >= max(len(tokenizer.decode([i]).encode()) for i in vocab.values())
    text = " " * 20_000 + "x"
    assert len(tokenizer.encode(text)) >= len(text.encode()) / bound
    tokenizer.backend_tokenizer.normalizer = normalizers.NFKC()  # may shrink the text: no bound
    assert longest_token_bytes(tokenizer) is None
    assert longest_token_bytes(object()) is None


# ---------------------------------------------------------------------------------------------- a server
@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    srv = ServerProcess(
        ["--max-total-tokens", "8192", "--chunked-prefill-size", "512", "--max-running-requests", "4"]
        + ["--max-queued-requests", "4", "--request-read-timeout", str(READ_TIMEOUT)]
        + ["--max-request-bytes", str(BODY_LIMIT), "--max-connections", str(MAX_CONNECTIONS)],
        tmp_path_factory.mktemp("hostile") / "serve.log",
    )
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()


def post_raw(url: str, path: str, body: bytes, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=timeout)


def check_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text[:500]
    err = resp.json()["error"]
    assert err["message"] and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def serves(url: str) -> float:
    """One real request; its latency in seconds."""
    t0 = time.time()
    r = httpx.post(url + CMPL, json={"prompt": "Hi", "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return time.time() - t0


BAD_BODIES = {
    "invalid-utf8": b'{"messages": [{"role": "user", "content": "\xff\xfe"}], "prompt": "\xff", "text": "\xc3"}',
    "nested-arrays": b"[" * 100_000 + b"]" * 100_000,
    "nested-objects": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    "long-integer": b'{"max_tokens": ' + b"9" * 10_000 + b"}",
    "malformed": b'{"text": "Hi",,}',
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
@pytest.mark.parametrize("path", BODY_ROUTES)
def test_bad_body_is_400_naming_the_body(hostile, path, case):
    check_error(post_raw(hostile.url, path, BAD_BODIES[case]), 400, "body")


def test_declared_body_beyond_the_limit_is_413_unread(hostile):
    with socket.create_connection(("127.0.0.1", hostile.port), timeout=30) as sock:
        head = f"POST {GEN} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {50 * BODY_LIMIT}\r\n\r\n".encode())
        status, headers, body = read_response(sock)
    assert status == 413 and headers.get("connection") == "close", (status, headers)
    err = json.loads(body)["error"]
    assert err["param"] == "body" and err["code"] == "request_too_large" and str(BODY_LIMIT) in err["message"]


def test_chunked_body_beyond_the_limit_is_413_when_it_crosses(hostile):
    """No Content-Length: the limit is enforced while reading, at the chunk that crosses it."""
    with socket.create_connection(("127.0.0.1", hostile.port), timeout=30) as sock:
        head = f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
        sent, chunk = 0, b"[" + b"1," * 32767
        while sent <= BODY_LIMIT:
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            sent += len(chunk)
        status, headers, body = read_response(sock)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large", (status, body[:300])


def test_prompt_far_beyond_the_context_is_refused_from_its_bytes(hostile):
    huge = "a" * 1_000_000
    bodies = {
        CMPL: ({"prompt": huge}, "prompt"),
        GEN: ({"text": huge}, "text"),
        CHAT: ({"messages": [{"role": "user", "content": huge}]}, "messages"),
    }
    for path, (body, param) in bodies.items():
        err = check_error(httpx.post(hostile.url + path, json=body, timeout=60), 400, param)
        assert "at least" in err["message"] and " bytes of text" in err["message"], err
    serves(hostile.url)


def test_long_text_that_fits_is_never_refused_by_the_bound(hostile):
    """More bytes than the context has tokens, but few tokens (runs of spaces): served."""
    text = " " * 100_000 + "Hi"
    r = httpx.post(hostile.url + CMPL, json={"prompt": text, "max_tokens": 1}, timeout=300)
    assert r.status_code == 200, r.text[:500]
    assert 100_000 / 81 <= r.json()["usage"]["prompt_tokens"] < 8192


def test_batch_that_can_never_be_admitted_is_400_with_both_numbers(hostile):
    texts = [f"Text {i}" for i in range(300)]
    r = httpx.post(hostile.url + GEN, json={"text": texts}, timeout=60)
    err = check_error(r, 400, "text")
    assert "300" in err["message"] and str(IN_FLIGHT) in err["message"] and "Retry-After" not in r.headers
    r = httpx.post(hostile.url + CMPL, json={"prompt": "Hi", "n": IN_FLIGHT + 1}, timeout=60)
    assert str(IN_FLIGHT + 1) in check_error(r, 400, "n")["message"]
    r = httpx.post(hostile.url + CMPL, json={"prompt": [[1, 2]] * (IN_FLIGHT + 1)}, timeout=60)
    check_error(r, 400, "prompt")
    body = {"input_ids": [1, 2], "sampling_params": {"n": IN_FLIGHT + 1, "max_new_tokens": 1}}
    check_error(httpx.post(hostile.url + GEN, json=body, timeout=60), 400, "sampling_params.n")


# ---------------------------------------------------------------------------------------------- connections
def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length, read off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"the connection closed before a response: {data!r}"
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        more = sock.recv(65536)
        if not more:
            break
        body += more
    return int(lines[0].split()[1]), headers, body


def closed_by_server(sock: socket.socket, received: dict[socket.socket, bytes] | None = None) -> bytes | None:
    """What the server sent before it closed the socket (b'' for nothing); None while it is still open. Bytes
    that arrive before the close are kept in `received` across calls: a response can come one poll before the
    close does."""
    received = {} if received is None else received
    sock.setblocking(False)
    try:
        while True:
            more = sock.recv(65536)
            if not more:
                return received.pop(sock, b"")
            received[sock] = received.get(sock, b"") + more
    except BlockingIOError:
        return None
    except ConnectionResetError:
        return received.pop(sock, b"")


class Holders:
    """Connections that hold the server without completing a request: silent ones, ones that trickle their
    headers a byte a second, ones that send their headers and a little of their body."""

    def __init__(self, port: int, count: int):
        self.socks: dict[str, list[socket.socket]] = {"silent": [], "headers": [], "body": []}
        self.opened: list[socket.socket] = []  # in the order they opened
        kinds = list(self.socks)
        for i in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            kind = kinds[i % 3]
            if kind == "headers":
                sock.sendall(f"POST {GEN} HTTP/1.1\r\nHo".encode())
            elif kind == "body":
                sock.sendall(f"POST {GEN} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{{".encode())
            self.socks[kind].append(sock)
            self.opened.append(sock)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _trickle(self) -> None:
        while not self.stop.wait(1.0):
            for sock in self.socks["headers"]:
                try:
                    sock.send(b"s")
                except OSError:
                    pass

    def all(self) -> list[socket.socket]:
        return list(self.opened)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for sock in self.all():
            sock.close()


def held_latency(url: str, port: int) -> tuple[Holders, float, float]:
    """Opens 500 holders and measures real requests beside them: (holders, when they opened, median latency).
    A try counts only if its requests finished before the first holder could be cut and within a few times the
    baseline measured just before it: on a 2-core host shared with another test worker a burst of load can void
    one, so up to three are made. Starved requests wait for the cut (READ_TIMEOUT) in every try."""
    tries = []
    for _ in range(3):
        baseline = statistics.median(serves(url) for _ in range(5))
        opened = time.time()
        holders = Holders(port, 500)
        held = statistics.median(serves(url) for _ in range(5))
        took = time.time() - opened
        if took < READ_TIMEOUT and held <= min(4 * baseline + 2.0, READ_TIMEOUT / 2):
            return holders, opened, held
        holders.close()
        tries.append({"baseline": round(baseline, 3), "held": round(held, 3), "took": round(took, 1)})
        time.sleep(READ_TIMEOUT)  # the closed holders' slots free on the server's side
    pytest.fail(f"real requests starved beside 500 held connections in every try: {tries}")


def test_500_held_connections_do_not_starve_real_requests_and_are_cut(hostile):
    url = hostile.url
    serves(url)
    holders, opened, _ = held_latency(url, hostile.port)
    try:
        # generous past the cut: a 2-core host shared with another test worker has stalled this process for
        # 20 s, and a late cut is still a cut (a missing one never comes)
        deadline = opened + READ_TIMEOUT + 60
        left = holders.all()
        outcomes: dict[socket.socket, bytes] = {}
        received: dict[socket.socket, bytes] = {}
        while left and time.time() < deadline:
            time.sleep(0.5)
            for sock in list(left):
                got = closed_by_server(sock, received)
                if got is not None:
                    outcomes[sock] = got
                    left.remove(sock)
        assert not left, f"{len(left)} of 500 held connections still open {time.time() - opened:.0f} s on"
        assert time.time() - opened >= READ_TIMEOUT - 1, "cut before --request-read-timeout"
        for sock in holders.socks["body"]:  # a body that never completes is answered 408, then closed
            assert outcomes[sock].startswith(b"HTTP/1.1 408"), outcomes[sock][:200]
    finally:
        holders.close()
    serves(url)


def test_connections_beyond_the_limit_close_the_longest_idle(hostile):
    url = hostile.url
    holders = Holders(hostile.port, MAX_CONNECTIONS + 50)
    try:
        time.sleep(1.0)
        closed = [s for s in holders.all() if closed_by_server(s) is not None]
        assert len(closed) >= 50, len(closed)
        first = set(holders.all()[:100])
        assert sum(s in first for s in closed) >= 40, len(closed)  # the oldest idle ones went first
        for _ in range(3):
            serves(url)  # a new client still gets in: an idle one makes room
    finally:
        holders.close()


# ---------------------------------------------------------------------------------------------- raw-byte fuzz
def valid_bodies() -> st.SearchStrategy[bytes]:
    bodies = [
        {"prompt": "Hi", "max_tokens": 1},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        {"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
        {"rid": "x"},
    ]
    return st.sampled_from([json.dumps(b).encode() for b in bodies])


@st.composite
def mutated(draw) -> bytes:
    """A valid body with bytes replaced, inserted or cut, or wrapped in deep nesting."""
    body = bytearray(draw(valid_bodies()))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(body)))
        op = draw(st.sampled_from(["replace", "insert", "cut", "nest"]))
        if op == "replace" and at < len(body):
            body[at] = draw(st.integers(0, 255))
        elif op == "insert":
            body[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "cut":
            del body[at:]
        else:
            depth = draw(st.integers(MAX_JSON_DEPTH - 2, 5000))
            body = bytearray(b"[" * depth + bytes(body) + b"]" * depth)
    return bytes(body)


@pytest.fixture(scope="module")
def routes(hostile) -> list[tuple[str, str]]:
    spec = httpx.get(hostile.url + "/openapi.json", timeout=30).json()
    found = [(method.upper(), path) for path, ops in spec["paths"].items() for method in ops]
    assert {("POST", p) for p in BODY_ROUTES} <= set(found)
    return [(m, p.replace("{name}", "x")) for m, p in found]


@settings(
    max_examples=150,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a dead server fails every later example
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
)
@given(data=st.data(), body=st.one_of(st.binary(max_size=512), mutated()))
def test_raw_bytes_on_every_route_never_5xx(hostile, routes, data, body):
    method, path = data.draw(st.sampled_from(routes))
    r = httpx.request(
        method, hostile.url + path, content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code < 500, f"{method} {path} {body[:200]!r} -> {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        assert r.json()["error"]["message"], r.text


def test_after_all_still_serving_at_baseline_and_no_traceback(hostile):
    serves(hostile.url)
    assert_pool_at_baseline(hostile.url)
    log = hostile.log_text()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-5000:]
