"""Gateway pieces that need no vLLM: config validation, prompt counting, the quality guard's
rate and threshold, token agreement, the canary's promote/rollback verdict, the hot-path HTTP
client's connection pool, core groups, and a client that leaves at every stage of its request
(queued, while its prompt is counted, during the upstream call or its body's read, between the
handler's return and the response's start): its slot is freed each time."""

from __future__ import annotations

import asyncio
import os
import time
from typing import AsyncIterator

import pytest

from batchpilot.schemas.serve import QualityGuardConfig, ServeConfig
from batchpilot.serving.prom import GatewayMetrics
from batchpilot.serving.quality_guard import QualityGuard, token_agreement


def test_serve_config_validates_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="no upstream"):
        ServeConfig.from_cfg({})
    with pytest.raises(ValueError, match="exclusive"):
        ServeConfig.from_cfg({"managed": True, "upstreams": ["http://127.0.0.1:1"]})
    with pytest.raises(ValueError, match="Key 'prot' not in 'ServeConfig'"):
        ServeConfig.from_cfg({"managed": True, "prot": 1})
    with pytest.raises(ValueError, match="serve.control.mode"):
        ServeConfig.from_cfg({"managed": True, "control": {"mode": "ppo"}})
    with pytest.raises(ValueError, match="must start with http"):
        ServeConfig.from_cfg({"upstreams": ["127.0.0.1:8000"]})
    cfg = ServeConfig.from_cfg({"upstreams": ["http://127.0.0.1:8000/"], "admission": {"max_queue_len": 7}})
    assert cfg.upstreams == ["http://127.0.0.1:8000"] and cfg.admission.max_queue_len == 7
    assert cfg.host == "127.0.0.1"  # localhost unless configured otherwise


def test_shipped_serve_config_loads() -> None:
    from batchpilot.config import load_config
    from batchpilot.serving.gateway import AppSettings

    s = AppSettings.from_cfg(load_config(["serve.managed=true"], config_name="serve_app"))
    assert s.serve.managed and s.shield["breaker_shrink"] == 0.8 and s.policy["kind"] == "pid"


def test_token_agreement() -> None:
    assert token_agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_agreement([1, 2, 3], [1, 9, 3]) == pytest.approx(2 / 3)
    assert token_agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert token_agreement([], []) == 1.0


def test_quality_guard_blocks_8bit_above_threshold() -> None:
    g = QualityGuard(QualityGuardConfig(threshold=0.05, min_samples=20, window=100), GatewayMetrics())
    for _ in range(19):
        g.record(0.5)  # all differ, but too few samples to act on
    assert not g.blocks_8bit
    g.record(1.0)
    assert g.blocks_8bit and g.diff_rate == pytest.approx(19 / 20)
    g.reset()
    for i in range(100):
        g.record(0.9 if i % 25 == 24 else 1.0)  # 4 % differ: under the 5 % threshold
    assert not g.blocks_8bit and g.diff_rate == pytest.approx(0.04)


@pytest.mark.anyio
async def test_prompt_counter_local_and_chars(tiny_model_path) -> None:
    from batchpilot.serving.tokens import PromptCounter

    async def no_upstream(_: dict) -> int:
        raise AssertionError("local counting must not call the upstream")

    local = PromptCounter("auto", str(tiny_model_path))
    assert local.mode == "local"
    n = len(local.tokenizer.encode("hello world", add_special_tokens=False).ids)
    assert await local.count({"prompt": "hello world"}, False, no_upstream) == n + 1  # + BOS
    longest = len(local.tokenizer.encode("abcd efgh", add_special_tokens=False).ids) + 1
    assert await local.count({"prompt": ["a", "abcd efgh"]}, False, no_upstream) == longest
    assert await local.count({"prompt": [1, 2, 3]}, False, no_upstream) == 3
    chat = await local.count({"messages": [{"role": "user", "content": "hi"}]}, True, no_upstream)
    assert chat >= 3
    chars = PromptCounter("chars", None)
    assert await chars.count({"prompt": "x" * 40}, False, no_upstream) == 12


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _read_request(reader: asyncio.StreamReader) -> None:
    """Read one HTTP request (head and Content-Length body) in a fake upstream."""
    head = await reader.readuntil(b"\r\n\r\n")
    n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    await reader.readexactly(n)


@pytest.mark.anyio
@pytest.mark.parametrize("close", [False, True])
async def test_http1_pool_keeps_connections_alive(close: bool) -> None:
    """Sequential upstream calls reuse one keep-alive connection (each whole response arrives
    in one read here, the case that used to reset the parser's keep-alive answer); a server
    that says ``connection: close`` gets a new connection per call."""
    from batchpilot.serving.http1 import Http1Pool

    connections = 0
    extra = b"connection: close\r\n" if close else b""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while True:
                await _read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra
                             + b"content-length: 2\r\n\r\n{}")
                await writer.drain()
                if close:
                    break
        except asyncio.IncompleteReadError:  # the pool closed the connection
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Http1Pool("127.0.0.1", port)
    try:
        for _ in range(5):
            r = await pool.request("POST", "/v1/completions", [("content-type", "application/json")], b"{}")
            assert r.status == 200 and await r.read() == b"{}"
        assert connections == (5 if close else 1)
    finally:
        pool.close()
        server.close()


def test_cpu_core_groups_are_disjoint_and_cover_the_cores() -> None:
    from batchpilot.serving.upstream import cpu_core_groups

    cores = sorted(os.sched_getaffinity(0))
    assert cpu_core_groups(1) == [",".join(map(str, cores))]
    for n in range(1, len(cores) + 1):
        groups = [set(map(int, g.split(","))) for g in cpu_core_groups(n)]
        assert len(groups) == n and all(groups)
        assert all(a.isdisjoint(b) for i, a in enumerate(groups) for b in groups[i + 1:])
        assert set().union(*groups) <= set(cores)
    more = cpu_core_groups(len(cores) + 1)  # more engines than cores: shared round-robin
    assert len(more) == len(cores) + 1 and more[-1] == more[0]


@pytest.mark.anyio
async def test_http1_pool_drops_stale_connections_and_never_resends() -> None:
    """A connection the server closed while idle, or one idle past keepalive_expiry_s, is not
    reused; a request whose connection dies before the answer fails (no second copy is sent:
    vLLM may already be generating it)."""
    from batchpilot.serving.http1 import Http1Error, Http1Pool

    connections, requests = 0, 0
    mode = {"after": "keep"}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections, requests
        connections += 1
        try:
            while True:
                await _read_request(reader)
                requests += 1
                if mode["after"] == "die":  # the upstream dies mid-request
                    break
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
                if mode["after"] == "close_idle":  # e.g. the server's keep-alive timeout
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    pool = Http1Pool("127.0.0.1", server.sockets[0].getsockname()[1], keepalive_expiry_s=0.2)

    async def call() -> bytes:
        r = await pool.request("POST", "/v1/completions", [], b"{}")
        return await r.read()

    try:
        mode["after"] = "close_idle"
        assert await call() == b"{}"
        await asyncio.sleep(0.05)  # the server's FIN arrives while the connection is idle
        assert await call() == b"{}" and connections == 2
        mode["after"] = "keep"
        await asyncio.sleep(0.05)  # (the second connection was closed after its answer too)
        assert await call() == b"{}"
        assert await call() == b"{}" and connections == 3  # reused
        await asyncio.sleep(0.3)  # idle past keepalive_expiry_s
        assert await call() == b"{}" and connections == 4
        mode["after"] = "die"
        before = requests
        with pytest.raises(Http1Error) as err:
            await call()  # on the pooled connection
        assert not err.value.connect and requests == before + 1 and connections == 4
    finally:
        pool.close()
        server.close()


@pytest.mark.anyio
async def test_client_gone_as_its_slot_is_granted_is_not_served() -> None:
    """A queued request whose client leaves in the same loop turn as its slot is granted (the
    request ahead finishes) must not go on to the upstream: the slot is handed back and the
    request counts as "cancelled". (``asyncio.wait_for`` on Python 3.11 swallowed that
    cancellation, and the gone client was served in full.)"""
    from batchpilot.core.admission import AdmissionConfig
    from batchpilot.core.engine import Request
    from batchpilot.core.knobs import Knobs
    from batchpilot.core.telemetry import SLO, Telemetry
    from batchpilot.serving.lanes import Lane
    from batchpilot.serving.upstream import Upstream

    metrics = GatewayMetrics()
    lane = Lane.build(0, Upstream("http://127.0.0.1:9"), AdmissionConfig(), Knobs(batch_cap=1),
                      Telemetry(SLO()), metrics, retry_after_s=1)
    lane.upstream.healthy = True
    deadline = time.monotonic() + 30
    await lane.acquire(Request("first", time.monotonic(), 4, 4), deadline)
    second = asyncio.create_task(lane.acquire(Request("second", time.monotonic(), 4, 4), deadline))
    await asyncio.sleep(0)  # "second" is queued behind the single slot
    assert lane.admission.num_waiting == 1
    lane.release("first")  # grants the slot to "second" ...
    second.cancel()  # ... as its client goes away
    with pytest.raises(asyncio.CancelledError):
        await second
    assert lane.admission.num_in_flight == 0 and lane.admission.num_waiting == 0
    assert metrics.rejected.labels("cancelled")._value.get() == 1
    await lane.upstream.aclose()


def test_capabilities_come_from_the_upstream_not_the_gateways_host() -> None:
    """An unmanaged upstream runs elsewhere: what the gateway's CPU can do says nothing about
    it. Its KV dtypes are the one it runs plus what its operator declares; its KV budget and
    block size are what its /metrics said."""
    from batchpilot.core.admission import AdmissionConfig
    from batchpilot.core.knobs import Knobs
    from batchpilot.core.telemetry import SLO, Telemetry
    from batchpilot.platform.vllm_cpu import cpu_kv8_unavailable_reason
    from batchpilot.serving.control_loop import upstream_engine_model
    from batchpilot.serving.lanes import Lane
    from batchpilot.serving.upstream import EngineInfo, Upstream

    lane = Lane.build(0, Upstream("http://10.0.0.9:8000"), AdmissionConfig(), Knobs(batch_cap=8), Telemetry(SLO()),
                      GatewayMetrics(), 1)
    lane.upstream.info = EngineInfo(model="m", max_model_len=4096, num_kv_blocks=777, block_size=32, kv_dtype="auto")
    mem, caps = upstream_engine_model(lane, 128, managed=False)
    assert caps.can_run("auto") and not caps.can_run("fp8") and "serve.upstream_kv_dtypes" in caps.why_not("fp8")
    assert mem.num_kv_blocks_total == 777 and caps.block_size == 32 and caps.max_model_len == 4096
    _, declared = upstream_engine_model(lane, 128, managed=False, declared_kv_dtypes=["fp8"])
    assert declared.can_run("fp8")
    _, managed = upstream_engine_model(lane, 128, managed=True)
    assert managed.can_run("fp8") == (cpu_kv8_unavailable_reason() is None)


def test_the_engines_token_budget_is_the_one_given_or_vllms_cpu_default() -> None:
    """Admission's prefill backlog counts in the engine's token budget, which vLLM does not
    publish: it is what the gateway starts its engines with, what their operator declares, or
    the flag in the engines' arguments; only without any of them vLLM's CPU server default."""
    from batchpilot.core.admission import AdmissionConfig
    from batchpilot.core.knobs import Knobs
    from batchpilot.core.telemetry import SLO, Telemetry
    from batchpilot.serving.control_loop import token_budget, upstream_engine_model
    from batchpilot.serving.lanes import Lane
    from batchpilot.serving.upstream import EngineInfo, ManagedVLLM, Upstream

    up = ["http://10.0.0.9:8000"]
    assert token_budget(ServeConfig.from_cfg({"upstreams": up})) is None
    assert token_budget(ServeConfig.from_cfg({"upstreams": up, "max_num_batched_tokens": 8192})) == 8192
    for args in (["--max-num-batched-tokens", "4096"], ["--enforce-eager", "--max-num-batched-tokens=4096"]):
        assert token_budget(ServeConfig.from_cfg({"managed": True, "extra_vllm_args": args})) == 4096
    with pytest.raises(ValueError, match="serve.max_num_batched_tokens=64 must be >= serve.max_num_seqs=256"):
        ServeConfig.from_cfg({"upstreams": up, "max_num_batched_tokens": 64})

    lane = Lane.build(0, Upstream(up[0]), AdmissionConfig(), Knobs(batch_cap=8), Telemetry(SLO()), GatewayMetrics(), 1)
    lane.upstream.info = EngineInfo(model="m", max_model_len=4096, num_kv_blocks=777, block_size=32, kv_dtype="auto")
    assert upstream_engine_model(lane, 128, managed=False)[1].max_num_batched_tokens == 4096  # max_model_len
    assert upstream_engine_model(lane, 128, managed=False, max_num_batched_tokens=8192)[1].max_num_batched_tokens == 8192

    def flag(engine: ManagedVLLM) -> list[str]:
        cmd = engine.command()
        return cmd[cmd.index("--max-num-batched-tokens"):][:2] if "--max-num-batched-tokens" in cmd else []

    kw = dict(model="m", served_model_name="m", max_model_len=64, max_num_seqs=4, port=1)
    assert flag(ManagedVLLM(**kw)) == []  # vLLM's own default
    assert flag(ManagedVLLM(**kw, max_num_batched_tokens=512)) == ["--max-num-batched-tokens", "512"]


@pytest.mark.anyio
async def test_quality_replays_take_an_admission_slot() -> None:
    """A replay's upstream copy used to bypass admission (the batch could pass the cap); it now
    holds a slot while it runs, at the lowest priority, and is skipped when none is free."""
    from batchpilot.core.admission import AdmissionConfig
    from batchpilot.core.engine import Request
    from batchpilot.core.knobs import Knobs
    from batchpilot.core.telemetry import SLO, Telemetry
    from batchpilot.serving.lanes import Lane
    from batchpilot.serving.quality_guard import Sample
    from batchpilot.serving.upstream import Upstream

    metrics = GatewayMetrics()
    lane = Lane.build(0, Upstream("http://127.0.0.1:9"), AdmissionConfig(max_queue_len=1), Knobs(batch_cap=1),
                      Telemetry(SLO()), metrics, retry_after_s=1)
    lane.upstream.healthy = True
    guard = QualityGuard(QualityGuardConfig(reference_url="http://127.0.0.1:9"), metrics)
    seen = []

    async def compare(a, b, path, body) -> float:  # the two servers' answers agree
        seen.append(lane.admission.num_in_flight)
        return 1.0

    guard.compare = compare  # type: ignore[method-assign]
    sample = Sample(lane, {"prompt": "x"}, "/v1/completions", prompt_len=3)
    await guard._replay(sample)
    assert seen == [1] and lane.admission.num_in_flight == 0 and guard.num_samples == 1
    await lane.acquire(Request("client", time.monotonic(), 3, 3, priority=1), time.monotonic() + 5)
    waiting = asyncio.create_task(lane.acquire(Request("queued", time.monotonic(), 3, 3, priority=1),
                                               time.monotonic() + 5))
    await asyncio.sleep(0)
    await guard._replay(sample)  # the slot is a client's, the queue full with another: skipped
    assert seen == [1] and metrics.quality_samples.labels("skipped")._value.get() == 1
    lane.release("client")
    await waiting
    lane.release("queued")
    await guard.aclose()
    await lane.upstream.aclose()


@pytest.mark.anyio
async def test_a_stream_whose_client_left_before_its_first_byte_frees_its_slot() -> None:
    """Starlette cancels a streamed answer whose client is gone before it starts, without
    ever starting the body's generator (whose clean-up freed the slot): SlotStream frees it."""
    from batchpilot.serving.gateway import SlotStream

    started, closed = [], []

    async def body() -> AsyncIterator[bytes]:
        started.append(True)
        yield b"data: 1\n\n"

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(10)  # the client is gone: nothing arrives

    stream = SlotStream(body(), lambda: closed.append(True), status_code=200)
    await stream({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    assert closed == [True] and not started


def test_server_timing_header_parse() -> None:
    from batchpilot.serving.bench import server_timing

    assert server_timing("upstream;dur=12.5", "upstream") == 12.5
    assert server_timing('db;desc="x", upstream ; dur=3', "upstream") == 3.0
    with pytest.raises(ValueError, match="no 'upstream' duration"):
        server_timing("upstream;desc=slow", "upstream")


def test_every_managed_vllm_process_asks_for_amx_first() -> None:
    """On AMX CPUs vLLM's attention runs tile instructions without asking Linux first: a fresh
    engine whose first batch was one short prompt died with SIGILL (HTTP 500). The managed
    command goes through the launcher, which asks at import; vLLM's spawned engine processes
    import their parent's main module (the launcher) first, so each of them asks too. The live
    check is test_gateway_fault's first requests to a restarted engine."""
    import subprocess
    import sys

    from batchpilot.platform.vllm_cpu import cpu_simd_flags
    from batchpilot.serving.upstream import ManagedVLLM

    cmd = ManagedVLLM(model="m", served_model_name="m", max_model_len=64, max_num_seqs=4, port=1).command()
    assert cmd[1:3] == ["-m", "batchpilot.serving.vllm_launch"], cmd
    has_amx = "amx_tile" in cpu_simd_flags()

    def permitted(*imports: str) -> str:
        code = "".join(f"import {m}; " for m in imports)
        code += "from batchpilot.platform.vllm_cpu import amx_permitted; print(amx_permitted())"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()

    assert permitted() == "False"  # a new process starts without it (nor is it kept over exec)
    assert permitted("batchpilot.serving.vllm_launch") == str(has_amx)


# --- a client that leaves at every stage of a request frees its slot ----------------------------
class _FakeStreamAnswer:
    """What ``Http1Pool.request`` returns: status and headers read, the body still to come."""

    def __init__(self, body: list[bytes], stall: asyncio.Event | None = None) -> None:
        self.status = 200
        self.headers = [("content-type", "text/event-stream" if len(body) > 1 else "application/json")]
        self._body, self._stall = body, stall
        self.closed = False

    async def aiter(self) -> AsyncIterator[bytes]:
        for chunk in self._body:
            if self._stall is not None:
                await self._stall.wait()
            yield chunk

    async def read(self) -> bytes:
        return b"".join([c async for c in self.aiter()])

    def aclose(self) -> None:
        self.closed = True


class _FakePool:
    """The upstream's hot-path client: ``request`` waits for ``answer`` (an upstream call in
    progress), then returns ``response``."""

    def __init__(self, response: _FakeStreamAnswer | None = None) -> None:
        self.response = response
        self.sent = asyncio.Event()
        self.answer = asyncio.Event()
        self.cancelled = False
        if response is not None:
            self.answer.set()

    async def request(self, method: str, path: str, headers: list, body: bytes) -> _FakeStreamAnswer:
        self.sent.set()
        try:
            await self.answer.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        assert self.response is not None
        return self.response

    def close(self) -> None:
        pass


def _proxy_setup(body: dict, pool: _FakePool):
    """A gateway with one (fake) upstream whose ``/tokenize`` counts every prompt 3 tokens, and
    what ``_proxy`` needs of a Starlette request: the body, then ``http.disconnect`` once
    ``left`` is set (the client goes away)."""
    import json
    from types import SimpleNamespace

    from starlette.requests import Request as StarletteRequest

    from batchpilot.serving.gateway import AppSettings, Gateway
    from batchpilot.serving.upstream import EngineInfo

    gw = Gateway(AppSettings(serve=ServeConfig.from_cfg({"upstreams": ["http://127.0.0.1:9"]})))
    lane = gw.lanes[0]
    lane.upstream.healthy = True
    lane.upstream.info = EngineInfo(model="m", max_model_len=2048)
    lane.upstream.pool = pool

    async def tokenize(body) -> int:
        return 3

    lane.upstream.tokenize = tokenize
    raw = json.dumps(body).encode()
    left = asyncio.Event()
    sent_body = [False]

    async def receive() -> dict:
        if not sent_body[0]:
            sent_body[0] = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "app": SimpleNamespace(state=SimpleNamespace(gateway=gw)), "client": ("127.0.0.1", 1)}
    return gw, lane, StarletteRequest(scope, receive), left


async def _until(cond, what: str) -> None:
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


@pytest.mark.anyio
async def test_a_client_leaving_while_its_prompt_is_counted_never_keeps_a_slot() -> None:
    """The client leaves while the upstream's ``/tokenize`` counts its prompt (no slot yet, no
    disconnect watcher yet): the watcher that starts after counting sees it gone, the request
    is cancelled wherever it is (here: in its upstream call) and its slot is freed."""
    from batchpilot.serving.errors import ClientGone
    from batchpilot.serving.gateway import _proxy

    pool = _FakePool()  # the upstream call never answers: only the client's leaving ends it
    gw, lane, request, left = _proxy_setup({"prompt": "hello world", "max_tokens": 4}, pool)
    counting, counted = asyncio.Event(), asyncio.Event()

    async def tokenize(body) -> int:
        counting.set()
        await counted.wait()
        return 3

    lane.upstream.tokenize = tokenize
    handler = asyncio.create_task(_proxy(request, "/v1/completions", False))
    await asyncio.wait_for(counting.wait(), 5)
    assert lane.admission.num_in_flight == 0 and lane.admission.num_waiting == 0
    left.set()  # the client goes away mid-count
    counted.set()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(handler, 5)
    assert lane.admission.num_in_flight == 0 and lane.admission.num_waiting == 0
    lane.admission.check_counts()
    await lane.upstream.client.aclose()


@pytest.mark.anyio
async def test_a_client_leaving_during_a_non_stream_upstream_call_frees_its_slot() -> None:
    """The client leaves while the upstream generates its (non-stream) answer: the upstream
    call is cancelled (vLLM aborts the request when its connection closes) and the slot freed."""
    from batchpilot.serving.errors import ClientGone
    from batchpilot.serving.gateway import _proxy

    pool = _FakePool()
    gw, lane, request, left = _proxy_setup({"prompt": "hello world", "max_tokens": 4}, pool)

    handler = asyncio.create_task(_proxy(request, "/v1/completions", False))
    await asyncio.wait_for(pool.sent.wait(), 5)
    assert lane.admission.num_in_flight == 1  # admitted, waiting for the upstream's answer
    left.set()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(handler, 5)
    assert pool.cancelled and lane.admission.num_in_flight == 0
    assert gw.metrics.rejected.labels("cancelled")._value.get() == 0  # it was admitted: not a queue leaver
    lane.admission.check_counts()
    await lane.upstream.client.aclose()


@pytest.mark.anyio
async def test_a_client_leaving_while_a_non_stream_body_is_read_frees_its_slot() -> None:
    """The upstream answered (status, headers) and its body is still coming when the client
    leaves: the upstream response is closed and the slot freed."""
    from batchpilot.serving.errors import ClientGone
    from batchpilot.serving.gateway import _proxy

    stall = asyncio.Event()
    answer = _FakeStreamAnswer([b'{"choices": []}'], stall=stall)
    pool = _FakePool(answer)
    gw, lane, request, left = _proxy_setup({"prompt": "hello world", "max_tokens": 4}, pool)

    handler = asyncio.create_task(_proxy(request, "/v1/completions", False))
    await asyncio.wait_for(pool.sent.wait(), 5)
    await asyncio.sleep(0.01)  # the body read is under way (stalled)
    assert lane.admission.num_in_flight == 1
    left.set()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(handler, 5)
    assert answer.closed and lane.admission.num_in_flight == 0
    await lane.upstream.client.aclose()


@pytest.mark.anyio
async def test_a_client_leaving_between_the_handler_and_the_response_frees_its_slot() -> None:
    """A non-stream answer frees its slot before the handler returns; a stream's slot is held by
    the response the handler returns, and a client gone before that response starts frees it
    (and the upstream's stream is closed, so vLLM aborts it)."""
    from batchpilot.serving.gateway import _proxy

    # Non-stream: freed when the answer is read, before the handler returns.
    pool = _FakePool(_FakeStreamAnswer([b'{"choices": [{"text": "hi"}]}']))
    gw, lane, request, left = _proxy_setup({"prompt": "hello world", "max_tokens": 4}, pool)

    resp = await _proxy(request, "/v1/completions", False)
    assert resp.status_code == 200 and lane.admission.num_in_flight == 0
    await lane.upstream.client.aclose()

    # Stream: the handler returns with the slot held; the client is gone when the response starts.
    answer = _FakeStreamAnswer([b"data: 1\n\n", b"data: [DONE]\n\n"])
    pool = _FakePool(answer)
    gw, lane, request, left = _proxy_setup({"prompt": "hello world", "max_tokens": 4, "stream": True}, pool)
    resp = await _proxy(request, "/v1/completions", False)
    assert lane.admission.num_in_flight == 1 and not answer.closed

    async def gone() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(10)  # nothing reaches a client that left

    await asyncio.wait_for(resp({"type": "http", "asgi": {"spec_version": "2.3"}}, gone, send), 5)
    assert lane.admission.num_in_flight == 0 and answer.closed
    lane.admission.check_counts()
    await lane.upstream.client.aclose()


@pytest.mark.anyio
async def test_a_streams_first_token_lets_a_held_request_in() -> None:
    """The lane hands a slot to a request held for the prefill backlog as soon as a streamed
    request in flight reports its first token, not when it finishes."""
    from batchpilot.core.admission import AdmissionConfig
    from batchpilot.core.engine import Request
    from batchpilot.core.knobs import Knobs
    from batchpilot.core.telemetry import SLO, Telemetry
    from batchpilot.serving.lanes import Lane
    from batchpilot.serving.upstream import Upstream

    lane = Lane.build(0, Upstream("http://127.0.0.1:9"), AdmissionConfig(), Knobs(batch_cap=8),
                      Telemetry(SLO()), GatewayMetrics(), retry_after_s=1)
    lane.upstream.healthy = True
    lane.admission.use_token_budget(1000)
    deadline = time.monotonic() + 30
    await lane.acquire(Request("a", time.monotonic(), 600, 4), deadline)
    await lane.acquire(Request("b", time.monotonic(), 600, 4), deadline)  # 600 < 1000: in
    third = asyncio.create_task(lane.acquire(Request("c", time.monotonic(), 600, 4), deadline))
    await asyncio.sleep(0)
    assert lane.admission.num_waiting == 1 and lane.admission.num_in_flight == 2  # 1200: held
    lane.on_first_token("a")
    await asyncio.wait_for(third, 5)
    assert lane.admission.num_in_flight == 3 and lane.admission.prefill_tokens_in_flight == 1200
    await lane.upstream.aclose()


@pytest.mark.anyio
async def test_a_lane_times_its_first_tokens_for_the_late_margin() -> None:
    """With ``first_token_margin`` the lane times each streamed request from admission to its
    first token on the gateway's clock (the env does on the engine's): the margin admission
    counts requests late by."""
    from batchpilot.core.admission import AdmissionConfig
    from batchpilot.core.engine import Request
    from batchpilot.core.knobs import Knobs
    from batchpilot.core.telemetry import SLO, Telemetry
    from batchpilot.serving.lanes import Lane
    from batchpilot.serving.upstream import Upstream

    lane = Lane.build(0, Upstream("http://127.0.0.1:9"), AdmissionConfig(first_token_margin=True, first_token_margin_rate=1.0),
                      Knobs(batch_cap=8), Telemetry(SLO(ttft_ms=1000.0)), GatewayMetrics(), retry_after_s=1)
    lane.upstream.healthy = True
    arrived = time.monotonic() - 5.0  # it waited before this lane took it
    await lane.acquire(Request("a", arrived, 600, 4), arrived + 30)
    t_first = time.monotonic() + 0.25  # the gateway's time of the stream's first chunk
    lane.on_first_token("a", t_first)
    assert 0.25 <= lane.admission.first_token_s < 5.25  # from its admission, not its arrival
    assert lane.admission.late_margin_s == pytest.approx(lane.admission.first_token_s)
    await lane.upstream.aclose()
