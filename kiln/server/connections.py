"""The HTTP/1.1 connections uvicorn runs for Kiln: slow, silent and held-open clients are cut, so they cannot
starve real requests."""

from __future__ import annotations

import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from kiln.config import ServerArgs


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the two guards it lacks. A request's headers must arrive within
    `read_timeout` of the connection opening (or of its previous response): uvicorn arms no timer until a first
    response, and a trickle of bytes re-arms its keep-alive one, so silent or slow clients would hold sockets
    for ever. And at most `max_connections` stay open: the one idle longest (no request in progress) is closed
    to make room, so held-open sockets cannot lock real clients out (uvicorn's limit_concurrency would answer
    every request 503 instead)."""

    read_timeout: float = 30.0
    max_connections: int = 1024

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_timer.cancel()
        super().connection_lost(exc)

    def idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self.idle_since = time.monotonic()
        self._header_timer = self.loop.call_later(self.read_timeout, self._cut_if_no_request, self.cycle)

    def _cut_if_no_request(self, cycle_when_armed) -> None:
        if self.idle() and self.cycle is cycle_when_armed and not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> None:
        """Closes the longest-idle connection (this one if no other is idle); one already closing is gone
        (it leaves `connections` only when its close completes)."""
        open_ = [c for c in self.connections if not c.transport.is_closing()]
        if len(open_) <= self.max_connections:
            return
        idle = [c for c in open_ if c is not self and isinstance(c, GuardedH11Protocol) and c.idle()]
        min(idle, key=lambda c: c.idle_since, default=self).transport.close()


def guarded_protocol(args: ServerArgs) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn runs (its `http=`), with this server's limits."""
    limits = {"read_timeout": args.request_read_timeout, "max_connections": args.max_connections}
    return type("KilnH11Protocol", (GuardedH11Protocol,), limits)
