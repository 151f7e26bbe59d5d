"""The gateway's HTTP server: uvicorn's, with a second stop signal that hurries the stop instead
of forcing it (``GatewayServer``), and uvicorn's httptools protocol with a deadline on request
heads. uvicorn times out idle keep-alive connections but not a request whose head never
completes: 500 connections sending a header byte now and then were held open indefinitely.
(Request bodies have their own deadline in the handler, ``serve.body_timeout_s``.)"""

from __future__ import annotations

import asyncio
from types import FrameType
from typing import Callable

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


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
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

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


def with_head_timeout(seconds: float) -> type[HeadDeadlineProtocol]:
    """The protocol class for ``uvicorn.run(http=...)`` with the given head deadline."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout_s": float(seconds)})
