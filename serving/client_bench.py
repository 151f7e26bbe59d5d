"""``bench_http_client(cfg)``: the hot-path HTTP client (``http1.Http1Pool``) against aiohttp's,
side by side in one run, on the call the proxy makes (POST a completion body, read the answer,
keep the connection). The upstream is a fixed-answer asyncio server in a thread of its own, so
what differs between the two is the client's own cost per call. Rounds alternate the clients
(ABAB...) so drift on a shared machine hits both alike; the figure people compare is the
difference of the medians, with a bootstrap interval over rounds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Awaitable, Callable

import numpy as np

from batchpilot.schemas.bench import ClientBenchConfig  # declared there (schema/client_bench)

_BODY = b'{"model":"tiny","prompt":"The quick brown fox jumps over the lazy dog.","max_tokens":1}'
_ANSWER = (b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"tiny","choices":[{"index":0,'
           b'"text":" the","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":11,'
           b'"total_tokens":12,"completion_tokens":1}}')


class _FixedUpstream:
    """A keep-alive HTTP/1.1 server answering every request with one fixed JSON body, on its
    own event loop in a thread (it must not share the clients' loop)."""

    def __init__(self) -> None:
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "_FixedUpstream":
        self._thread.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(_ANSWER)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    h = await reader.readuntil(b"\r\n\r\n")
                    n = next(int(x.split(b":")[1]) for x in h.split(b"\r\n") if x.lower().startswith(b"content-length"))
                    await reader.readexactly(n)
                    writer.write(head + _ANSWER)
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        loop.run_forever()
        server.close()
        pending = asyncio.all_tasks(loop)  # the connection handlers: end them before the loop
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


async def _timed(call: Callable[[], Awaitable[bytes]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        body = await call()
        out.append(time.perf_counter() - t0)
        assert body == _ANSWER
    return out


async def _run(cfg: ClientBenchConfig, port: int) -> dict[str, list[float]]:
    import aiohttp

    from batchpilot.serving.http1 import Http1Pool

    pool = Http1Pool("127.0.0.1", port)
    headers = [("content-type", "application/json")]

    async def via_http1() -> bytes:
        r = await pool.request("POST", "/v1/completions", headers, _BODY)
        return await r.read()

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    session = aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector,
                                    auto_decompress=False, skip_auto_headers=("user-agent", "accept-encoding"))

    async def via_aiohttp() -> bytes:
        async with session.post("/v1/completions", data=_BODY, headers={"content-type": "application/json"}) as r:
            return await r.read()

    clients = {"http1": via_http1, "aiohttp": via_aiohttp}
    try:
        for call in clients.values():
            await _timed(call, cfg.warmup_calls)
        rounds: dict[str, list[float]] = {k: [] for k in clients}
        samples: dict[str, list[float]] = {k: [] for k in clients}
        for i in range(cfg.rounds):
            order = list(clients) if i % 2 == 0 else list(reversed(clients))
            for name in order:
                t = await _timed(clients[name], cfg.calls_per_round)
                samples[name] += t
                rounds[name].append(float(np.median(t)))
    finally:
        pool.close()
        await session.close()
    return {**{f"{k}_rounds": v for k, v in rounds.items()}, **samples}


def bench_http_client(node: Any) -> dict[str, Any]:
    """Per-call latency of each client (p50/p99, µs) and aiohttp's extra p50 cost over http1."""
    cfg = ClientBenchConfig.from_cfg(node)
    with _FixedUpstream() as up:
        res = asyncio.run(_run(cfg, up.port))
    a, h = np.array(res["aiohttp_rounds"]), np.array(res["http1_rounds"])
    diff = a - h  # per round, same conditions
    rng = np.random.default_rng(0)
    boot = [float(np.median(rng.choice(diff, diff.size))) for _ in range(2000)]
    us = lambda x: round(float(x) * 1e6, 1)  # noqa: E731
    return {
        "target": "http_client",
        "calls_per_client": len(res["http1"]),
        "http1_p50_us": us(np.percentile(res["http1"], 50)),
        "http1_p99_us": us(np.percentile(res["http1"], 99)),
        "aiohttp_p50_us": us(np.percentile(res["aiohttp"], 50)),
        "aiohttp_p99_us": us(np.percentile(res["aiohttp"], 99)),
        "aiohttp_extra_p50_us": us(np.median(diff)),
        "aiohttp_extra_p50_ci95_us": [us(np.percentile(boot, 2.5)), us(np.percentile(boot, 97.5))],
        "aiohttp_over_http1_p50_ratio": round(float(np.median(a / h)), 2),
    }
