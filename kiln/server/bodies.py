"""Request bodies read defensively, in one place: a size limit enforced while reading, a time limit, strict
UTF-8, and nesting checked without recursion before the JSON decoder runs. Every refusal is a client error
(400 / 408 / 413) raised before any work is done."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import Request

from kiln.sampling_params import InvalidParam
from kiln.server.responses import BodyReadTimeout, BodyTooLarge

# Nesting of arrays and objects a body may have: far beyond any OpenAI or native body, far below what would
# exhaust the interpreter's stack in the (recursive) JSON decoder.
MAX_JSON_DEPTH = 64


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, read at most `limit` bytes far (a declared Content-Length beyond it is refused unread) and
    within `timeout` seconds, so neither a huge nor a trickling body holds memory or a handler."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise BodyTooLarge(int(declared) if len(declared) <= 18 else 10**18, limit, declared=True)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(size, limit, declared=False)
                chunks.append(chunk)
    except TimeoutError:
        raise BodyReadTimeout(size, timeout) from None
    return b"".join(chunks)


def decode_json(raw: bytes) -> Any:
    """JSON from the body's bytes: strict UTF-8 (a leading BOM is tolerated), nesting checked before the
    decoder runs, and every decoder error a 400 naming `body`."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InvalidParam(
            "body",
            f"the body is not valid UTF-8: byte 0x{raw[e.start]:02x} at position {e.start} ({e.reason})",
        ) from None
    if json_depth_exceeds(text, MAX_JSON_DEPTH):
        raise InvalidParam("body", f"the body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError, or a number too long to convert
        raise InvalidParam("body", f"malformed JSON body: {e}") from None


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth_exceeds(text: str, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit`, from the brackets outside strings: a loop, not a
    recursion, so no body can exhaust the stack (a malformed one is left for the decoder to refuse)."""
    depth = 0
    for bracket in _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False
