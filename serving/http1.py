"""A lean HTTP/1.1 client for the gateway's hot path (proxying completions to vLLM).

Why not httpx here: on two shared cores httpx/httpcore/h11 cost about a millisecond of CPU per
request, half the gateway's whole latency budget. This client is asyncio streams plus the
``httptools`` parser uvicorn already uses, with a pool of keep-alive connections to one
upstream. It does only what the proxy needs: one request per connection at a time, bodies
with Content-Length or chunked, streaming reads, and abort (closing the connection, which
vLLM notices and turns into a request abort). Health, metrics and admin calls keep httpx.

The rules that keep one client's answer from reaching another (each has a test in
``tests/test_http1.py``): interim ``1xx`` responses are skipped, never taken for the answer;
hop-by-hop headers (``expect``, ``connection``, ``te``, ``upgrade`` ...) are never forwarded;
a connection goes back to the pool only after its response was read to the end, with nothing
after it, and only if it is still clean (no unread bytes) when it is taken again.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import AsyncIterator

import httptools


class Http1Error(ConnectionError):
    """The upstream connection failed; ``connect`` says whether it failed before any request
    bytes could have reached the server (safe to call the upstream down)."""

    def __init__(self, message: str, *, connect: bool) -> None:
        super().__init__(message)
        self.connect = connect


#: Hop-by-hop request headers (RFC 9110 7.6.1) and ones this client sets itself; never sent on.
#: ``expect: 100-continue`` in particular: the body goes out with the head, so the interim
#: answer it asks for is useless, and a client that took it for the answer leaked the real one.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade",
                        "expect", "host", "content-length"})


def forwardable(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``headers`` (lower-case names) without hop-by-hop ones, including any the request's
    ``connection`` header names."""
    named = {t.strip().lower() for k, v in headers if k == "connection" for t in v.split(",")}
    return [(k, v) for k, v in headers if k not in HOP_BY_HOP and k not in named]


class _Parse:
    """httptools callbacks, collecting one final response (interim 1xx ones are dropped)."""

    __slots__ = ("headers", "headers_done", "body", "done", "keep_alive", "parser", "status", "trailing")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.body: deque[bytes] = deque()
        self.done = False
        self.keep_alive = False
        self.status = 0
        #: Bytes after the end of the response: the connection is not clean, never reuse it.
        self.trailing = False
        self.parser: httptools.HttpResponseParser | None = None

    def on_message_begin(self) -> None:
        if self.done:
            self.trailing = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.done:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.done or self.parser is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.headers.clear()  # an interim answer (100 Continue, 103 Early Hints): skip it
            return
        self.status = status
        self.headers_done = True
        # Asked here: once feed_data has returned a complete message the parser has reset and
        # says False, which turned every pooled upstream call into a new connection.
        self.keep_alive = self.parser.should_keep_alive() and status != 101
        self.parser = None  # needed only for those questions; no parse <-> parser cycle after it

    def on_body(self, body: bytes) -> None:
        if not self.done:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.headers_done:
            self.done = True


class Http1Response:
    """Status and headers are read; the body is read with ``read`` or ``aiter``."""

    __slots__ = ("status", "headers", "_pool", "_reader", "_writer", "_parse", "_parser", "_closed")

    def __init__(self, pool: "Http1Pool", reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 parse: _Parse, parser: httptools.HttpResponseParser) -> None:
        self._pool, self._reader, self._writer, self._parse, self._parser = pool, reader, writer, parse, parser
        self.status = parse.status
        self.headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in parse.headers]
        self._closed = False

    async def aiter(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive (chunked framing removed)."""
        p = self._parse
        while True:
            while p.body:
                yield p.body.popleft()
            if p.done:
                break
            data = await self._reader.read(65536)
            if not data:
                self.aclose()
                raise Http1Error("upstream closed the connection mid-response", connect=False)
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserError as exc:
                self.aclose()
                raise Http1Error(f"bad HTTP from upstream: {exc}", connect=False) from None
        self._finish()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.aiter()])

    def _finish(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool._busy.discard(self._writer)
        if self._parse.keep_alive and not self._parse.trailing:
            self._pool._release(self._reader, self._writer)
        else:
            self._writer.close()

    def aclose(self) -> None:
        """Drop the connection unless the body was read to the end (then it is pooled)."""
        if self._closed:
            return
        self._closed = True
        self._pool._busy.discard(self._writer)
        self._writer.close()


class Http1Pool:
    """Keep-alive connections to one ``host:port``.

    A request is never resent: once its bytes may have reached the server, a failure is the
    caller's to report (vLLM may have started generating). Stale connections are weeded out
    before use instead: one idle longer than ``keepalive_expiry_s`` (under the 5 s after which
    vLLM's server closes idle connections) or one the server has already closed is dropped.
    """

    def __init__(self, host: str, port: int, max_idle: int = 512, keepalive_expiry_s: float = 4.0) -> None:
        self.host, self.port, self.max_idle = host, port, max_idle
        self.keepalive_expiry_s = keepalive_expiry_s
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []
        #: Connections with a request on them (taken, not yet released or closed).
        self._busy: set[asyncio.StreamWriter] = set()
        #: Those of them still waiting for the response head (``abort_waiting_head``).
        self._heads: set[asyncio.StreamWriter] = set()
        self._host_header = f"{host}:{port}".encode()

    def _release(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._idle) < self.max_idle and not writer.is_closing():
            self._idle.append((reader, writer, time.monotonic()))
        else:
            writer.close()

    def _reusable(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The most recently used idle connection that is still open, dropping stale ones."""
        now = time.monotonic()
        while self._idle:
            reader, writer, since = self._idle.pop()
            if (now - since < self.keepalive_expiry_s and not writer.is_closing() and not reader.at_eof()
                    and not _has_unread(reader)):
                return reader, writer
            writer.close()
        return None

    def close(self) -> None:
        for _, w, _ in self._idle:
            w.close()
        self._idle.clear()

    def abort_busy(self) -> int:
        """Close every connection with a request on it (the gateway's stop, once its grace is
        over): each waiting call fails with ``Http1Error`` and vLLM aborts what it generated.
        Returns how many were closed."""
        busy, self._busy = self._busy, set()
        for w in busy:
            w.close()
        return len(busy)

    def abort_waiting_head(self) -> int:
        """Close every connection whose request has no response head yet (an engine that stopped
        answering): each waiting call fails with ``Http1Error``, its client has had nothing yet,
        and vLLM aborts the request when it sees the close. Streams under way are left alone."""
        heads, self._heads = self._heads, set()
        for w in heads:
            w.close()
        return len(heads)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        except OSError as exc:
            raise Http1Error(f"cannot connect to {self.host}:{self.port}: {exc}", connect=True) from None

    async def request(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> Http1Response:
        """Send one request, return once the final response head is in. ``headers`` have
        lower-case names; hop-by-hop ones are dropped here."""
        head = [f"{method} {path} HTTP/1.1\r\n".encode(), b"host: ", self._host_header, b"\r\n",
                b"content-length: ", str(len(body)).encode(), b"\r\n"]
        for k, v in forwardable(headers):
            head.append(f"{k}: {v}\r\n".encode("latin-1"))
        head.append(b"\r\n")
        payload = b"".join(head) + body
        reader, writer = self._reusable() or await self._connect()
        self._busy.add(writer)
        self._heads.add(writer)
        try:
            writer.write(payload)
            parse = _Parse()
            parser = httptools.HttpResponseParser(parse)
            parse.parser = parser
            while not parse.headers_done:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionResetError("connection closed before the response head")
                parser.feed_data(data)
            self._heads.discard(writer)
            return Http1Response(self, reader, writer, parse, parser)
        except httptools.HttpParserUpgrade:
            self._busy.discard(writer)
            self._heads.discard(writer)
            writer.close()
            raise Http1Error(f"upstream {self.host}:{self.port} switched protocols (101); not supported",
                             connect=False) from None
        except (OSError, httptools.HttpParserError) as exc:
            self._busy.discard(writer)
            self._heads.discard(writer)
            writer.close()
            raise Http1Error(f"upstream {self.host}:{self.port} failed: {exc!r}", connect=False) from None
        except BaseException:
            self._busy.discard(writer)
            self._heads.discard(writer)
            writer.close()
            raise


def _has_unread(reader: asyncio.StreamReader) -> bool:
    """Bytes the server sent while nobody asked (a stray or duplicated response): such a
    connection would hand them to the next request as its answer. StreamReader has no public
    way to ask; ``_buffer`` is its read buffer (absent: assume clean, ``at_eof`` still holds)."""
    return bool(getattr(reader, "_buffer", b""))
