"""The gateway's hot-path HTTP/1.1 client against fake upstreams that misbehave on purpose.

Each test is a way one client's answer could reach another through a pooled connection, or a
request could be answered with something that is not its own final response: interim ``1xx``
answers, chunked bodies, an upstream that closes early, a connection left half read, bytes the
server sends unasked, and hop-by-hop request headers."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import pytest

from batchpilot.serving.http1 import Http1Error, Http1Pool, forwardable

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes, int], Awaitable[bool]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    n = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    return head, await reader.readexactly(n)


class FakeUpstream:
    """An asyncio server answering each request with ``respond(reader, writer, body, i)``
    (``i`` counts requests over all connections); it stops serving a connection when that
    returns False. Records the request heads and counts connections."""

    def __init__(self, respond: Handler) -> None:
        self.respond = respond
        self.heads: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Http1Pool:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.pool = Http1Pool("127.0.0.1", self.server.sockets[0].getsockname()[1])
        return self.pool

    async def __aexit__(self, *exc: object) -> None:
        self.pool.close()
        assert self.server is not None
        self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head, body = await _read_request(reader)
                self.heads.append(head)
                if not await self.respond(reader, writer, body, len(self.heads) - 1):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def _echo(_r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes, _i: int) -> bool:
    w.write(_ok(body))
    await w.drain()
    return True


async def _call(pool: Http1Pool, body: bytes, headers: list[tuple[str, str]] | None = None) -> tuple[int, bytes]:
    r = await pool.request("POST", "/v1/completions", headers or [], body)
    return r.status, await r.read()


@pytest.mark.parametrize("interim", [b"HTTP/1.1 100 Continue\r\n\r\n",
                                     b"HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n",
                                     b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n"])
@pytest.mark.parametrize("split", [False, True])
async def test_interim_1xx_is_skipped_and_the_next_caller_gets_its_own_answer(interim: bytes, split: bool) -> None:
    """The leak of issue 12: vLLM answered ``Expect: 100-continue`` with ``100 Continue``; the
    client took it for the answer and left the real one on the pooled connection, where the
    next request read it. Interim answers arrive in the same read as the final one, or apart."""

    async def respond(_r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes, _i: int) -> bool:
        w.write(interim)
        if split:
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(_ok(b"answer to " + body))
        await w.drain()
        return True

    async with FakeUpstream(respond) as pool:
        assert await _call(pool, b"alice") == (200, b"answer to alice")
        assert await _call(pool, b"bob") == (200, b"answer to bob")


async def test_hop_by_hop_headers_are_not_forwarded() -> None:
    up = FakeUpstream(_echo)
    async with up as pool:
        await _call(pool, b"x", [("expect", "100-continue"), ("te", "trailers"), ("upgrade", "h2c"),
                                 ("connection", "upgrade, x-secret-hop"), ("x-secret-hop", "1"),
                                 ("keep-alive", "timeout=5"), ("transfer-encoding", "chunked"),
                                 ("content-type", "application/json"), ("x-request-id", "r1")])
    head = up.heads[0].lower()
    for name in (b"expect", b"te:", b"upgrade", b"connection", b"x-secret-hop", b"keep-alive", b"transfer-encoding"):
        assert name not in head, name
    assert b"content-type: application/json" in head and b"x-request-id: r1" in head
    assert head.count(b"content-length") == 1 and head.count(b"host:") == 1


def test_forwardable_drops_what_connection_names() -> None:
    hs = [("connection", "close, X-Foo"), ("x-foo", "1"), ("x-bar", "2"), ("expect", "100-continue")]
    assert forwardable(hs) == [("x-bar", "2")]


async def test_chunked_body_is_read_whole_and_the_connection_reused() -> None:
    async def respond(_r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes, _i: int) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (b"data: " + body, b" more", b"\n\n"):
            w.write(b"%x\r\n%s\r\n" % (len(part), part))
            await w.drain()
            await asyncio.sleep(0.005)
        w.write(b"0\r\n\r\n")
        await w.drain()
        return True

    up = FakeUpstream(respond)
    async with up as pool:
        r = await pool.request("POST", "/v1/completions", [], b"one")
        chunks = [c async for c in r.aiter()]
        assert b"".join(chunks) == b"data: one more\n\n" and len(chunks) >= 2
        assert await _call(pool, b"two") == (200, b"data: two more\n\n")
    assert up.connections == 1


async def test_early_close_is_an_error_and_the_connection_is_not_reused() -> None:
    async def respond(_r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes, i: int) -> bool:
        if i == 0:  # promises 100 bytes, sends 5, hangs up
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nhello")
            await w.drain()
            return False
        w.write(_ok(body))
        await w.drain()
        return True

    up = FakeUpstream(respond)
    async with up as pool:
        r = await pool.request("POST", "/v1/completions", [], b"a")
        with pytest.raises(Http1Error, match="mid-response"):
            await r.read()
        assert await _call(pool, b"b") == (200, b"b")
    assert up.connections == 2


async def test_a_partly_read_response_never_returns_to_the_pool() -> None:
    """A caller that stops reading (client gone mid-stream) closes the connection; the rest of
    that answer can never reach the next caller."""
    release = asyncio.Event()

    async def respond(_r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes, _i: int) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await release.wait()
        w.write(b"c\r\nsecret-of-" + body[:1] + b"\r\n0\r\n\r\n")
        await w.drain()
        return True

    up = FakeUpstream(respond)
    async with up as pool:
        r = await pool.request("POST", "/v1/completions", [], b"A")
        it = r.aiter()
        assert await it.__anext__() == b"first"
        r.aclose()
        release.set()
        up.respond = _echo
        assert await _call(pool, b"next") == (200, b"next")
    assert up.connections == 2


async def test_bytes_after_the_response_spoil_the_connection() -> None:
    """A server that sends more than one response (a stray duplicate) must not have the extra
    one read as the next request's answer: whether it came in the same read or later."""

    late_sent = asyncio.Event()

    async def respond(_r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes, i: int) -> bool:
        if i == 0:
            w.write(_ok(b"first") + _ok(b"stray"))
        elif i == 1:
            w.write(_ok(b"second"))
            await w.drain()
            await asyncio.sleep(0.02)
            w.write(_ok(b"stray-late"))
            await w.drain()
            late_sent.set()
        else:
            w.write(_ok(body))
        await w.drain()
        return True

    up = FakeUpstream(respond)
    async with up as pool:
        assert await _call(pool, b"a") == (200, b"first")
        assert await _call(pool, b"b") == (200, b"second")
        # The late stray answer is sent (a condition: on a busy machine the server's timer may
        # come due only with this test's own), then reaches the idle connection: the loop reads
        # the socket before it runs the callback of a timer that expired meanwhile.
        await asyncio.wait_for(late_sent.wait(), 30)
        await asyncio.sleep(0.1)
        assert await _call(pool, b"c") == (200, b"c")
    assert up.connections == 3


async def test_switching_protocols_is_refused() -> None:
    async def respond(_r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes, _i: int) -> bool:
        w.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n")
        await w.drain()
        return False

    async with FakeUpstream(respond) as pool:
        with pytest.raises(Http1Error, match="101"):
            await _call(pool, b"x")
