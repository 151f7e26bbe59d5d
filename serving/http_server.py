"""The gateway's HTTP server: uvicorn's, with a second stop signal that hurries the stop instead
of forcing it (``GatewayServer``), and uvicorn's httptools protocol with a deadline on request
heads. uvicorn times out idle keep-alive connections but not a request whose head never
completes: 500 connections sending a header byte now and then were held open indefinitely.
(Request bodies have their own deadline in the handler, ``serve.body_timeout_s``.)

The same protocol bounds a request head's size (``serve.max_header_bytes``: 431, where 20 MB
of headers were taken), answers bad framing in the gateway's JSON error form (uvicorn's is
plain text), and serves a request that asks to switch protocols (``Connection: Upgrade``,
``Upgrade: h2c``) as the HTTP/1.1 request it also is: the parser stops at the upgrade, and
uvicorn handed the application an empty body."""

from __future__ import annotations

import asyncio
import json
from types import FrameType
from typing import Callable

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}


class GatewayServer(uvicorn.Server):
    """``uvicorn.Server`` whose second stop signal calls ``on_hurry`` instead of forcing an exit.

    The first SIGINT or SIGTERM is uvicorn's: the server stops accepting, the gateway drains
    (``serve.drain_s``), the lifespan stops the engines. uvicorn takes a second Ctrl-C as "force
    quit": it skipped the lifespan's shutdown (the engines were left to their reapers) and raised
    the signal twice once the loop ended, so the tasks still answering were cancelled as the loop
    closed, each printing a traceback, and then ``KeyboardInterrupt``'s own. Here a second signal
    (either kind, and any after it) calls ``on_hurry`` (the gateway ends its requests and kills
    its engines at once) and the same orderly stop goes on, now in seconds. Only the first
    signal is raised again at the end, as uvicorn does (SIGTERM: the process ends by it;
    SIGINT: ``KeyboardInterrupt`` out of ``run``, which ``serve`` takes as the normal end)."""

    def __init__(self, config: uvicorn.Config, on_hurry: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_hurry = on_hurry

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            super().handle_exit(sig, frame)
            return
        self.on_hurry()


class HeadDeadlineProtocol(HttpToolsProtocol):
    """Closes a connection whose request head has not fully arrived ``head_timeout_s`` after
    the connection opened or the request's first byte came."""

    head_timeout_s: float = 10.0
    max_head_bytes: int = 64 * 1024
    _head_timer: asyncio.TimerHandle | None = None
    #: Bytes received while a request head is incomplete (reset when a head completes).
    _head_bytes = 0
    _in_head = True
    #: Body bytes still to come of a request whose upgrade is ignored (None: none such).
    _upgrade_body_left: int | None = None
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._head_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_head = False
        self._head_bytes = 0
        if self.parser.should_upgrade() and not self._should_upgrade():
            # Not a WebSocket (which uvicorn handles): ignore the upgrade, as RFC 9110 7.8 lets a
            # server, and serve the request; its body is the bytes after the head.
            names = {k for k, _ in self.headers}
            if b"transfer-encoding" in names:
                self._refuse(400, "upgrade_not_supported", "a protocol upgrade (Upgrade header) with a chunked "
                             "body is not supported; send the request without Connection: Upgrade")
                return
            length = next((v for k, v in self.headers if k == b"content-length"), b"0")
            self._upgrade_body_left = int(length) if length.isdigit() else 0
        super().on_headers_complete()
        if self._upgrade_body_left is not None:
            self.cycle.keep_alive = False  # the parser is past the upgrade: no next request here

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused or self._upgrade_body_left:
            return  # an ignored upgrade's body is still to come (``_take_upgrade_body``)
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        """uvicorn's, plus the head's size bound, the JSON 400 and ignored upgrades."""
        if self._refused:
            return
        if self._upgrade_body_left is not None:
            self._take_upgrade_body(data)
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.logger.warning("invalid HTTP request received: %s", exc)
            self._refuse(400, "bad_request", f"malformed HTTP/1.1 request: {exc}")
            return
        except httptools.HttpParserUpgrade as exc:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            elif self._upgrade_body_left is not None:
                self._take_upgrade_body(data[exc.args[0]:] if exc.args else b"")
            else:
                self._unsupported_upgrade_warning()
            return
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse(431, "header_too_large", f"the request head (request line and headers) has more than "
                             f"serve.max_header_bytes={self.max_head_bytes} bytes")

    def _take_upgrade_body(self, data: bytes) -> None:
        """Body bytes of a request whose upgrade is ignored, up to its Content-Length; anything
        after it is dropped (the connection closes after the answer)."""
        left = self._upgrade_body_left or 0
        part = data[:left]
        if part:
            super().on_body(part)
        left -= len(part)
        self._upgrade_body_left = left
        if left == 0 and self.cycle is not None and self.cycle.more_body:
            self._upgrade_body_left = 0
            self._refused = True  # nothing more is read on this connection
            self.cycle.more_body = False
            self.cycle.message_event.set()

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer ``status`` in the gateway's JSON error form and close the connection. While an
        earlier (pipelined) request's answer is still being sent nothing is written: bytes in
        the middle of that answer would corrupt it; the connection is only closed."""
        self._refused = True
        self._disarm()
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy and not self.transport.is_closing():
            body = json.dumps({"error": {"message": message, "type": "GatewayError", "param": None, "code": status,
                                         "reason": reason}}).encode()
            head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])]
            for name, value in self.server_state.default_headers:
                head.append(name + b": " + value + b"\r\n")
            head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                        % len(body))
            self.transport.write(b"".join(head) + body)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request head did not arrive within %.1f s",
                             self.head_timeout_s)
            self.transport.close()


def with_head_timeout(seconds: float, max_head_bytes: int = 64 * 1024) -> type[HeadDeadlineProtocol]:
    """The protocol class for ``uvicorn.run(http=...)`` with the given head deadline and size."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,),
                {"head_timeout_s": float(seconds), "max_head_bytes": int(max_head_bytes)})
