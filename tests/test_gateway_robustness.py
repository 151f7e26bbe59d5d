"""Issue 12's hardening, checked in process (no vLLM): the real app and ``Gateway`` in front of an
upstream that is never called, driven through ASGI. A large body's per-item work runs off the
event loop and an over-long prompt list is refused before its items are looked at; a client
that leaves while queued is counted as 499; every ``/admin/*`` route (read from the app, so new
ones are covered) refuses a missing or wrong token; the managed engines' log is private. The
last test runs ``scripts/serve.py`` for real (a fake upstream, no vLLM) and looks for the admin
token in Hydra's config dump and the process's command line."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from gateway_helpers import FakeVLLM, stop_process

from batchpilot.schemas.control import ControlLoopConfig
from batchpilot.schemas.serve import ServeConfig
from batchpilot.serving import request_body
from batchpilot.serving.errors import BadRequest
from batchpilot.serving.gateway import AppSettings, Gateway, build_app
from batchpilot.serving.request_body import BodyInspector
from batchpilot.serving.upstream import EngineInfo, _open_log, free_port

TOKEN = "in-process-admin-token"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _settings(control: dict[str, Any] | None = None, **serve: Any) -> AppSettings:
    cfg = {"upstreams": ["http://127.0.0.1:9"], "tokenizer": "chars", **serve}
    return AppSettings(serve=ServeConfig.from_cfg(cfg), control=ControlLoopConfig.from_cfg(control or {}))


@contextlib.contextmanager
def _app(monkeypatch: pytest.MonkeyPatch, token: str | None = TOKEN, **serve: Any) -> Iterator[tuple[Any, Gateway]]:
    """The real app with a real ``Gateway`` (its lifespan not run: nothing starts), its one
    upstream marked healthy. Requests that reach the upstream would fail; none should."""
    if token is None:
        monkeypatch.delenv("BATCHPILOT_ADMIN_TOKEN", raising=False)
    else:
        monkeypatch.setenv("BATCHPILOT_ADMIN_TOKEN", token)
    settings = _settings(**serve)
    app = build_app(settings)
    gw = Gateway(settings)
    app.state.gateway = gw
    up = gw.lanes[0].upstream
    up.healthy = True
    up.info = EngineInfo(model="tiny", max_model_len=2048)
    try:
        yield app, gw
    finally:
        up.pool.close()


def _count(gw: Gateway, route: str, status: int) -> float:
    return gw.metrics.requests.labels(route, str(status))._value.get()


# --- a large body's work is done off the event loop --------------------------------------------
def _inspect(raw: bytes, chat: bool = False) -> Any:
    return request_body.inspect_body(raw, chat, 256, 2048)


@pytest.mark.anyio
async def test_without_workers_a_large_bodys_work_runs_in_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``serve.body_workers=0`` parse, validation, sequence count and the prompt's texts
    and characters all run in a worker thread for a body over the threshold, with the cyclic GC
    paused, and on the loop below it."""
    seen: dict[str, tuple[int, bool]] = {}
    for name in ("json_object", "_validate", "num_sequences", "prompt_text"):
        real = getattr(request_body, name)

        def spy(*args: Any, _real: Any = real, _name: str = name) -> Any:
            seen[_name] = (threading.get_ident(), gc.isenabled())
            return _real(*args)

        monkeypatch.setattr(request_body, name, spy)
    loop_thread = threading.get_ident()
    inspector = BodyInspector(256, workers=0)
    inspector.start()  # no pool with no workers
    big = json.dumps({"prompt": ["x" * 2000] * 200 + ["y"], "max_tokens": 2, "junk": [[]] * 1000}).encode()
    assert len(big) > request_body.OFF_LOOP_BYTES
    parsed = await inspector.inspect(big, False, 2048)
    assert parsed.seqs == 201 and parsed.text.max_chars == 2000 and parsed.text.total_chars == 400_001
    assert set(parsed.body) == {"prompt", "max_tokens"}  # what the gateway reads; the rest was freed there
    assert set(seen) == {"json_object", "_validate", "num_sequences", "prompt_text"}
    assert {t for t, _ in seen.values()} & {loop_thread} == set(), seen
    assert not any(enabled for _, enabled in seen.values()) and gc.isenabled()
    seen.clear()
    small = await inspector.inspect(b'{"prompt": "hi"}', False, 2048)
    assert small.seqs == 1 and set(seen.values()) == {(loop_thread, True)}


async def _max_loop_gap(work: Any) -> tuple[Any, float]:
    """Await ``work`` while a ticker measures the longest the event loop stood still."""
    gaps = [0.0]
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    try:
        out = await work
    except Exception as exc:  # noqa: BLE001  (the caller checks what came back)
        out = exc
    finally:
        done.set()
        await ticker
    return out, max(gaps)


@pytest.mark.anyio
async def test_a_large_body_is_parsed_in_a_worker_process_and_the_loop_runs_on() -> None:
    """600,000 chat messages (7 MiB) are parsed in the worker process: the loop keeps running
    while the thread inspection, the reference measured beside it, holds it for the whole
    parse (the C parser keeps the GIL). The refusal, and a valid large body, come back from the
    worker exactly as a thread makes them."""
    chat = json.dumps({"messages": [{"role": "u"}] * 600_000}, separators=(",", ":")).encode()
    valid = json.dumps({"prompt": ["x" * 2000] * 200, "max_tokens": 2, "junk": [[]] * 1000}).encode()
    inspector = BodyInspector(256, workers=1)
    inspector.start()
    threaded = BodyInspector(256, workers=0)
    try:
        assert (await inspector.inspect(valid, False, 2048)) == (await threaded.inspect(valid, False, 2048))
        ref, ref_gap = await _max_loop_gap(threaded.inspect(chat, True, 2048))
        # The best of three: a busy machine may deschedule the loop once, not for the parse each time.
        out, gap = min([await _max_loop_gap(inspector.inspect(chat, True, 2048)) for _ in range(3)],
                       key=lambda r: r[1])
    finally:
        inspector.close()
    for err in (ref, out):
        assert isinstance(err, BadRequest) and err.reason == "prompt_too_long" and "600000 messages" in err.message
    assert out.message == ref.message and out.status == ref.status == 400
    assert gap < ref_gap / 3, f"the loop stood still {gap:.3f} s (in a thread: {ref_gap:.3f} s)"


@pytest.mark.anyio
async def test_a_dead_body_worker_loses_no_request() -> None:
    """The worker process killed (SIGTERM ends it even where the parent handles SIGTERM): the
    next large body is inspected in a thread, and the pool is started again for the one after,
    its worker forked without the gateway's open connections."""
    import multiprocessing
    import signal

    others = set(multiprocessing.active_children())  # other tests' children in this process
    inspector = BodyInspector(256, workers=1)
    before = signal.signal(signal.SIGTERM, lambda *_: None)  # as uvicorn does: a fork copies it
    try:
        inspector.start()
    finally:
        signal.signal(signal.SIGTERM, before)
    big = json.dumps({"prompt": ["x" * 2000] * 200, "max_tokens": 2}).encode()
    client, server_side = socket.socketpair()  # a client's connection, open when the pool restarts
    try:
        assert (await inspector.inspect(big, False, 2048)).seqs == 200
        workers = set(multiprocessing.active_children()) - others
        assert workers
        for w in workers:
            os.kill(w.pid, signal.SIGTERM)  # the default action: not the handlers a fork copied
        for w in workers:
            w.join(30)
        assert (await inspector.inspect(big, False, 2048)).seqs == 200
        assert (await inspector.inspect(big, False, 2048)).seqs == 200  # the new pool
        assert set(multiprocessing.active_children()) - others - workers, "no new worker"
        # The new worker holds no copy of the connection: closed here, the client sees it end.
        server_side.close()
        client.settimeout(10)
        assert client.recv(1) == b""
    finally:
        inspector.close()
        client.close()
        server_side.close()


def test_the_gc_pause_nests_across_threads() -> None:
    assert gc.isenabled()
    with request_body._gc_paused():
        with request_body._gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # another parse still runs
    assert gc.isenabled()
    gc.disable()  # someone else's choice is kept
    try:
        with request_body._gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_over_long_prompt_list_is_refused_before_its_items_are_read() -> None:
    """1.6 million prompts (7.6 MiB, under the body cap) held the loop ~0.5 s in per-item checks
    before being refused as too many sequences: the list's length alone decides now. The last
    item is not a valid prompt: had the items been checked, the reason would be invalid_field.
    The same for token ids and chat messages (each at least one token) over max_model_len."""
    many = json.dumps({"prompt": ["a"] * 1_600_000 + [{}]}).encode()
    assert len(many) < 8 << 20
    for raw, chat, reason, says in [
        (many, False, "too_many_sequences", "1600001 prompts"),
        (json.dumps({"prompt": [1] * 3000 + [{}]}).encode(), False, "prompt_too_long", "3001 token ids"),
        (json.dumps({"messages": [{"role": "user"}] * 3000 + [7]}).encode(), True, "prompt_too_long", "3001 messages"),
    ]:
        with pytest.raises(BadRequest) as exc:
            _inspect(raw, chat)
        assert exc.value.reason == reason and says in exc.value.message
    # Within the limits the items are checked, and n/best_of multiply the prompts.
    with pytest.raises(BadRequest, match="'prompt' must be"):
        _inspect(json.dumps({"prompt": ["a", {}]}).encode())
    with pytest.raises(BadRequest, match="'messages' must be"):
        _inspect(json.dumps({"messages": [{"role": "user"}, 7]}).encode(), True)
    with pytest.raises(BadRequest) as exc:
        _inspect(json.dumps({"prompt": ["a"] * 100, "n": 3}).encode())
    assert exc.value.reason == "too_many_sequences"
    assert _inspect(json.dumps({"prompt": [1] * 2048}).encode()).text.token_ids == 2048


def test_the_body_is_read_as_leniently_as_vllm_reads_it() -> None:
    """Clients found refused by the gateway and served by vLLM (pydantic's lax mode): unset
    fields written as null, 8.0 or "8" for 8, "true" for true, a batch of token-id prompts,
    and max_tokens 0 to score a prompt (echo). Values vLLM also refuses stay refused."""
    kept = _inspect(json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": None,
                                "n": None, "stop": None, "temperature": None}).encode(), True).body
    assert kept == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    kept = _inspect(b'{"prompt": "x", "max_tokens": 8.0, "n": "2", "stream": "true", "best_of": 2}').body
    assert (kept["max_tokens"], kept["n"], kept["stream"], kept["best_of"]) == (8, 2, True, 2)
    batch = _inspect(json.dumps({"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4}).encode())
    assert batch.seqs == 2 and batch.text.token_ids == 3  # two sequences; the longest prompt counts
    assert _inspect(b'{"prompt": "Hello", "max_tokens": 0, "echo": true, "logprobs": 1}').body["max_tokens"] == 0
    for raw, says in [
        (b'{"prompt": "Hello", "max_tokens": 0}', "'max_tokens' must be at least 1"),
        (b'{"prompt": "x", "max_tokens": 8.5}', "'max_tokens' must be an integer"),
        (b'{"prompt": "x", "stream": "maybe"}', "'stream' must be true or false"),
        (b'{"prompt": [[1, 2], []]}', "a batch of token ids must be a list of non-empty lists"),
        (b'{"prompt": [[1, 2], "a"]}', "a batch of token ids"),
    ]:
        with pytest.raises(BadRequest, match=says):
            _inspect(raw)
    with pytest.raises(BadRequest) as exc:
        _inspect(json.dumps({"prompt": [[1]] * 300}).encode())
    assert exc.value.reason == "too_many_sequences"
    with pytest.raises(BadRequest) as exc:
        _inspect(json.dumps({"prompt": [[1], [2] * 3000]}).encode())
    assert exc.value.reason == "prompt_too_long" and exc.value.param is None


@pytest.mark.anyio
async def test_a_stream_that_keeps_sending_outlives_the_request_timeout() -> None:
    """A long generation streamed past ``request_timeout_s`` is relayed to its end (vLLM lets
    it run); a stream that stops sending for that long is ended with a timeout event."""
    from types import SimpleNamespace

    from batchpilot.serving.gateway import _relay

    def fake(chunks: list[bytes], pause_s: float, stall_after: int | None = None) -> Any:
        async def aiter() -> Any:
            for i, c in enumerate(chunks):
                await asyncio.sleep(30.0 if i == stall_after else pause_s)
                yield c
        return SimpleNamespace(aiter=aiter, aclose=lambda: None)

    ended: list[bool] = []
    timer = SimpleNamespace(chunk=lambda c: None, finish=lambda ok: ended.append(ok))
    timeouts: list[str] = []
    lane = SimpleNamespace(name="up0", check_stream_error=lambda c: None,
                           metrics=SimpleNamespace(rejected=SimpleNamespace(
                               labels=lambda r: SimpleNamespace(inc=lambda: timeouts.append(r)))))
    chunks = [f"data: {i}\n\n".encode() for i in range(40)] + [b"data: [DONE]\n\n"]
    t0 = time.monotonic()
    got = [c async for c in _relay(fake(chunks, 0.02), timer, lane, t0 + 0.2, idle_s=2.0)]
    assert got == chunks and timeouts == [] and ended == [True]
    assert time.monotonic() - t0 > 0.2  # it ran past the first deadline
    got = [c async for c in _relay(fake(chunks, 0.0, stall_after=3), timer, lane, time.monotonic() + 0.1,
                                   idle_s=0.3)]
    assert got[:3] == chunks[:3] and b'"reason": "timeout"' in got[3] and timeouts == ["timeout"]
    assert ended == [True, False]


@pytest.mark.parametrize("raw", [b'{"prompt": "x", "echo": true}', b' \r\n\t{"prompt": [1, 2]}',
                                 '{"prompt": "caf\u00e9 \u2603"}'.encode()])
def test_the_model_is_spliced_into_the_clients_bytes(raw: bytes) -> None:
    parsed = _inspect(raw)
    out = request_body.with_model(parsed, 'ti"ny')
    assert json.loads(out) == {**json.loads(raw), "model": 'ti"ny'}
    assert out.endswith(raw[raw.index(b"{") + 1:])  # the client's bytes after the brace, untouched


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-8-sig"])
def test_a_body_in_another_unicode_encoding_goes_upstream_as_utf8(encoding: str) -> None:
    raw = ' {"prompt": "caf\u00e9", "echo": true}'.encode(encoding)
    parsed = _inspect(raw)
    assert parsed.raw == ' {"prompt": "caf\u00e9", "echo": true}'.encode()
    assert json.loads(request_body.with_model(parsed, "tiny")) == {"prompt": "caf\u00e9", "echo": True, "model": "tiny"}


@pytest.mark.anyio
async def test_a_large_prompt_reaches_tokenize_encoded_off_the_loop() -> None:
    """Upstream counting: a large body's ``/tokenize`` request is encoded in a worker thread
    (the upstream gets bytes), a small one is handed over as a dict."""
    from batchpilot.serving.tokens import PromptCounter, prompt_text

    counter = PromptCounter("upstream", None)
    got: list[Any] = []

    async def tokenize(req: dict[str, Any] | bytes) -> int:
        got.append(req)
        return 7

    body = {"prompt": "hello", "model": "tiny"}
    text = prompt_text(body, False)
    assert await counter.count(body, False, tokenize, 2048, text=text, off_loop=True) == 7
    assert await counter.count(body, False, tokenize, 2048, text=text) == 7
    assert json.loads(got[0]) == {"model": "tiny", "prompt": "hello"} and got[1] == {"model": "tiny", "prompt": "hello"}


# --- 499: a client that leaves while queued is counted -------------------------------------------
@pytest.mark.anyio
async def test_a_client_gone_while_queued_is_counted_as_499(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the whole app (the counting middleware, the proxy, a real lane): the only slot is
    taken, a request queues, its client disconnects; the request leaves the queue and
    ``batchpilot:requests_total{route="/v1/completions",status="499"}`` goes up by one."""
    from batchpilot.core.engine import Request as EngineRequest

    with _app(monkeypatch, control={"initial_batch_cap": 1}) as (app, gw):
        lane = gw.lanes[0]
        holder = EngineRequest("holder", time.monotonic(), 10, 10, 1)
        await lane.acquire(holder, time.monotonic() + 60)  # the one slot: the next request queues
        gone = asyncio.Event()
        raw = json.dumps({"prompt": "queued", "max_tokens": 2}).encode()
        sent_body = False
        messages: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            messages.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", str(len(raw)).encode())],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "app": app}
        before = _count(gw, "/v1/completions", 499)
        task = asyncio.create_task(app(scope, receive, send))
        while lane.admission.num_waiting == 0:  # queued behind the held slot
            assert not task.done(), messages
            await asyncio.sleep(0.001)
        gone.set()
        await task
        assert _count(gw, "/v1/completions", 499) == before + 1
        assert lane.admission.num_waiting == 0 and lane.admission.is_in_flight("holder")
        assert gw.metrics.rejected.labels("cancelled")._value.get() == 1
        lane.release("holder")
        assert lane.admission.num_in_flight == 0



@pytest.mark.anyio
async def test_admin_decisions_lists_the_loops_records_and_refuses_a_bad_since(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchpilot.serving.control_loop import ControlLoop

    with _app(monkeypatch) as (app, gw):
        gw.control = ControlLoop(gw)
        gw.control.history.append({"tick": 1, "batch_cap": 64})
        gw.control.num_ticks = 1
        auth = {"authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            r = await c.get("/admin/decisions", headers=auth)
            assert r.status_code == 200 and r.json() == {"ticks": 1, "decisions": [{"tick": 1, "batch_cap": 64}]}
            assert (await c.get("/admin/decisions?since=1", headers=auth)).json()["decisions"] == []
            for bad in ("-1", "x", "1.5", "9" * 40, "%C2%B2"):
                r = await c.get(f"/admin/decisions?since={bad}", headers=auth)
                assert r.status_code == 400 and "since" in r.text, (bad, r.text)

# --- every admin route needs the token ------------------------------------------------------------
def _admin_routes(app: Any) -> list[tuple[str, str]]:
    out = [(m, r.path) for r in app.routes if getattr(r, "path", "").startswith("/admin")
           for m in sorted(getattr(r, "methods", None) or ())]
    # The enumeration finds what the API documents (and anything added since).
    assert {p for _, p in out} >= {"/admin/status", "/admin/policy/reload", "/admin/mode", "/admin/freeze",
                                   "/admin/kv_dtype", "/admin/reset", "/admin/quality/reset"}, out
    return out


BAD_AUTH = [None, "", "Bearer", "Bearer ", "Bearer nope", f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer x{TOKEN}",
            f"Bearer {TOKEN[:-1]}", f"Token {TOKEN}", f"Bearer  {TOKEN}"]


@pytest.mark.anyio
async def test_every_admin_route_refuses_a_missing_or_wrong_token(monkeypatch: pytest.MonkeyPatch) -> None:
    with _app(monkeypatch) as (app, gw):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            for method, path in _admin_routes(app):
                for auth in BAD_AUTH:
                    headers = {"content-type": "application/json"}
                    if auth is not None:
                        headers["authorization"] = auth
                    # A body that would change state (or be refused as malformed) if it got in.
                    for body in (b'{"frozen": true, "force": true, "mode": "static", "dtype": "fp8"}', b"\xff{"):
                        r = await c.request(method, path, content=body if method == "POST" else None, headers=headers)
                        assert r.status_code == 401, (method, path, auth, r.text)
                        assert r.json()["error"]["reason"] == "unauthorized"
        assert gw.control is None and gw.metrics.requests.labels("/admin/status", "401")._value.get() > 0


@pytest.mark.anyio
async def test_without_a_token_every_admin_route_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    with _app(monkeypatch, token=None) as (app, _):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            for method, path in _admin_routes(app):
                for auth in ("Bearer ", "Bearer None", "Bearer null", None):
                    r = await c.request(method, path, headers={"authorization": auth} if auth is not None else {})
                    assert r.status_code == 403 and r.json()["error"]["reason"] == "admin_disabled", (method, path)


# --- paths the gateway does not serve -----------------------------------------------------------
#: vLLM endpoints a client written for `vllm serve` might call: other generation APIs (they would
#: pass admission and the shield by) and engine control (anyone could put the engine to sleep).
NOT_FORWARDED = [("POST", "/v1/responses"), ("POST", "/v1/messages"), ("POST", "/inference/v1/generate"),
                 ("POST", "/v1/embeddings"), ("POST", "/sleep"), ("POST", "/pause"),
                 ("POST", "/reset_prefix_cache"), ("GET", "/server_info"), ("GET", "/nope"),
                 ("GET", "/admin/nope")]


@pytest.mark.anyio
async def test_paths_it_does_not_serve_are_refused_in_its_own_error_form_and_never_forwarded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each answers 404 ``unknown_endpoint`` naming what the gateway serves (the upstream, at a
    port nothing listens on, would have made a forwarded call a 503); a wrong method is 405
    with ``Allow``; a long path is not echoed whole; each refusal is counted."""
    with _app(monkeypatch) as (app, gw):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            for method, path in NOT_FORWARDED:
                r = await c.request(method, path, json={"input": "x", "model": "tiny"})
                assert r.status_code == 404, (method, path, r.text)
                err = r.json()["error"]
                assert err["reason"] == "unknown_endpoint" and err["code"] == 404
                assert path in err["message"] and "/v1/chat/completions" in err["message"]
            r = await c.get("/v1/completions")
            assert r.status_code == 405 and r.json()["error"]["reason"] == "method_not_allowed"
            assert r.headers["allow"] == "POST"
            r = await c.get("/" + "a" * 5000)
            assert r.status_code == 404 and len(r.json()["error"]["message"]) < 600
        assert gw.metrics.rejected.labels("unknown_endpoint")._value.get() == len(NOT_FORWARDED) + 1
        assert gw.metrics.requests.labels("other", "404")._value.get() == len(NOT_FORWARDED) + 1


@pytest.mark.anyio
async def test_health_answers_as_vllm_does_while_the_gateway_can_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """``/health`` is 200 with an empty body (as from `vllm serve`) only once the gateway is up
    and an upstream admits; 503 before, and while every upstream is down."""
    with _app(monkeypatch) as (app, gw):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            assert (await c.get("/health")).status_code == 503  # the lifespan has not finished
            gw.ready = True
            r = await c.get("/health")
            assert r.status_code == 200 and r.content == b""
            for probe in (c.get("/ping"), c.post("/ping")):  # vLLM's SageMaker-style probe
                r = await probe
                assert r.status_code == 200 and r.content == b""
            gw.lanes[0].upstream.healthy = False
            assert (await c.get("/health")).status_code == 503
            assert (await c.get("/ping")).status_code == 503


# --- the managed engine's log ------------------------------------------------------------------------
def test_the_engine_log_is_opened_without_following_links_and_private(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("someone else's file\n")
    link = tmp_path / "vllm-8001.log"
    link.symlink_to(target)
    with pytest.raises(OSError) as exc:
        _open_log(link)
    assert exc.value.errno == errno.ELOOP
    assert target.read_text() == "someone else's file\n"
    dangling = tmp_path / "vllm-8002.log"
    dangling.symlink_to(tmp_path / "not-yet")
    with pytest.raises(OSError):
        _open_log(dangling)
    assert not (tmp_path / "not-yet").exists()
    old = os.umask(0)  # the mode is the opener's, not the umask's
    try:
        fd = _open_log(tmp_path / "vllm-8003.log")
    finally:
        os.umask(old)
    try:
        os.write(fd, b"first\n")
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        assert os.get_inheritable(fd) is False
    finally:
        os.close(fd)
    fd = _open_log(tmp_path / "vllm-8003.log")  # a restart appends
    os.write(fd, b"second\n")
    os.close(fd)
    assert (tmp_path / "vllm-8003.log").read_text() == "first\nsecond\n"


def test_the_default_engine_log_folder_is_the_runs_or_one_per_user(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``serve.log_dir``: ``engines/`` in the Hydra run's folder (``scripts/serve.py``; its
    own test is in test_gateway_lifecycle), else one folder per user in the temporary folder,
    reused by every gateway (a fresh ``mkdtemp`` folder per start piled up in /tmp by the
    hundred). Private (0700), and refused when it is a link, not a folder or another user's: its
    name is predictable. A leftover log of an earlier gateway on the same port is removed (its
    error lines would be taken for the new engine's). A configured folder is created private."""
    from batchpilot.serving.gateway import default_engine_log_dir

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    model = tmp_path / "model"
    model.mkdir()
    base = {"managed": True, "model": str(model), "tokenizer": "chars"}

    def build(**cfg: Any) -> Gateway:
        gw = Gateway(AppSettings(serve=ServeConfig.from_cfg({**base, **cfg})))
        for ln in gw.lanes:
            ln.upstream.pool.close()
        return gw

    shared = tmp / f"batchpilot-engines-{os.getuid()}"
    for _ in range(3):
        gw = build()
        assert gw.log_dir == shared and gw.lanes[0].upstream.managed.log_path.parent == shared
    assert os.listdir(tmp) == [shared.name]  # one folder, however many starts
    st = shared.stat()
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    old = shared / "vllm-18000.log"
    old.write_text("OSError: an earlier engine's failure\n")
    gw = build(managed_port_base=18000)
    assert gw.lanes[0].upstream.managed.log_path == old and not old.exists()

    run = tmp_path / "outputs" / "run"  # Hydra's run folder
    assert default_engine_log_dir(run) == run / "engines"
    assert stat.S_IMODE((run / "engines").stat().st_mode) == 0o700
    (run / "engines").chmod(0o755)  # ours but open: closed again
    assert default_engine_log_dir(run) == run / "engines"
    assert stat.S_IMODE((run / "engines").stat().st_mode) == 0o700

    shutil.rmtree(shared)
    shared.symlink_to(tmp_path / "elsewhere")  # prepared by someone else
    with pytest.raises(ValueError, match=r"default, .*batchpilot-engines-\d+, is a link: remove it or set serve.log_dir"):
        build()
    shared.unlink()
    shared.write_text("")
    with pytest.raises(ValueError, match="is not a folder"):
        default_engine_log_dir(None)
    uid = os.getuid()
    (tmp / f"batchpilot-engines-{uid + 1}").mkdir(mode=0o700)  # made by this test: uid's, not uid+1's
    with monkeypatch.context() as m:
        m.setattr(os, "getuid", lambda: uid + 1)
        with pytest.raises(ValueError, match=rf"is a folder of another user's \(uid {uid}\)"):
            default_engine_log_dir(None)

    configured = tmp_path / "logs" / "engines"
    gw = build(log_dir=str(configured))
    assert gw.log_dir == configured and stat.S_IMODE(configured.stat().st_mode) == 0o700


# --- the admin token stays out of the config dump and the command line -------------------------------
def test_an_admin_token_in_the_config_is_refused() -> None:
    from batchpilot.config import load_config

    with pytest.raises(ValueError, match="BATCHPILOT_ADMIN_TOKEN"):
        AppSettings.from_cfg(load_config(["serve.managed=true", "+serve.admin_token=secret"], config_name="serve_app"))


def test_the_upstream_api_key_comes_from_the_environment_or_a_file_never_the_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$VLLM_API_KEY`` wins over ``serve.upstream_api_key_file``; the key in the config is
    refused; each upstream's client and the proxy's headers carry it; a managed engine gets it
    in its environment, not on its command line."""
    from batchpilot.config import load_config

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ValueError, match="VLLM_API_KEY"):
        AppSettings.from_cfg(load_config(["serve.managed=true", "+serve.upstream_api_key=k"], config_name="serve_app"))
    assert ServeConfig.from_cfg({"upstreams": ["http://127.0.0.1:9"]}).upstream_api_key is None
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    cfg = {"upstreams": ["http://127.0.0.1:9"], "upstream_api_key_file": str(key_file), "tokenizer": "chars"}
    assert ServeConfig.from_cfg(cfg).upstream_api_key == "from-file"
    assert "from-file" not in repr(ServeConfig.from_cfg(cfg))
    with pytest.raises(ValueError, match="upstream_api_key_file"):
        ServeConfig.from_cfg({**cfg, "upstream_api_key_file": str(tmp_path / "missing")})
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    gw = Gateway(AppSettings(serve=ServeConfig.from_cfg(cfg)))
    up = gw.lanes[0].upstream
    try:
        assert up.auth_headers == [("authorization", "Bearer from-env")]
        assert up.client.headers["authorization"] == "Bearer from-env"
    finally:
        up.pool.close()
    managed = Gateway(AppSettings(serve=ServeConfig.from_cfg(
        {"managed": True, "model": str(tmp_path), "tokenizer": "chars", "log_dir": str(tmp_path / "logs")})))
    up = managed.lanes[0].upstream
    try:
        assert up.auth_headers == [("authorization", "Bearer from-env")]
        assert not any("from-env" in a for a in up.managed.command())
    finally:
        up.pool.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["env", "file"])
def test_a_serve_runs_config_dump_and_command_line_hold_no_token(tmp_path: Path, source: str) -> None:
    """``scripts/serve.py`` composed and run as an operator would (Hydra's output folder with its
    ``.hydra`` dump on), in front of a fake upstream (no vLLM). The token, given by
    ``$BATCHPILOT_ADMIN_TOKEN`` or ``serve.admin_token_file``, guards the admin API of the
    running gateway, and appears in no file of the run folder and not on its command line."""
    from batchpilot.config import REPO_ROOT

    token = f"tok-{os.urandom(12).hex()}"
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if k not in ("BATCHPILOT_ADMIN_TOKEN", "BATCHPILOT_TRUSTED_KEYS")}
    port = free_port()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), f"serve.upstreams=[http://127.0.0.1:{server.server_port}]",
           f"serve.port={port}", "serve.startup_timeout_s=60", f"hydra.run.dir={run_dir}"]
    if source == "env":
        env["BATCHPILOT_ADMIN_TOKEN"] = token
    else:
        secret = tmp_path / "admin-token"
        secret.write_text(token + "\n")
        secret.chmod(0o600)
        cmd.append(f"serve.admin_token_file={secret}")
    out = (tmp_path / "gateway.out").open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "gateway.out").read_text()
            assert time.monotonic() < deadline, "the gateway did not become ready"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        # The token was read and guards the API: it is the gateway's, from env or file.
        assert httpx.get(f"{url}/admin/status", timeout=10).status_code == 401
        assert httpx.get(f"{url}/admin/status", headers={"authorization": f"Bearer {token}"}, timeout=10).status_code == 200
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"serve.upstreams" in cmdline and token.encode() not in cmdline
        dump = run_dir / ".hydra" / "config.yaml"
        assert "upstreams" in dump.read_text()  # the dump is there, and it is the run's config
        for f in run_dir.rglob("*"):
            if f.is_file():
                assert token not in f.read_text(errors="replace"), f
    finally:
        stop_process(proc)
        out.close()
        server.shutdown()
        server.server_close()
    assert token not in (tmp_path / "gateway.out").read_text(errors="replace")


def test_a_stop_while_waiting_for_the_upstreams_ends_the_gateway_at_once(tmp_path: Path) -> None:
    """uvicorn takes SIGTERM/SIGINT during start-up but acts on them only after it: a gateway
    whose upstream never came up ignored both for ``serve.startup_timeout_s`` (300 s)."""
    import signal as sig

    from batchpilot.config import REPO_ROOT

    log = tmp_path / "serve.log"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), f"serve.upstreams=[{dead}]",
                                 f"serve.port={free_port()}", f"hydra.run.dir={tmp_path}"],
                                cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "Waiting for application startup" not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()[-2000:]
        proc.send_signal(sig.SIGTERM)
        proc.wait(timeout=60)  # the start-up timeout is 300 s
        text = log.read_text()
        assert "asked to stop while starting" in text
        assert "Traceback" not in text and "startup failed" not in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
