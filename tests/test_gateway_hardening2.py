"""The gateway's second hardening round (issue 56), against a real ``vllm serve``: every route
has the generation routes' limits (a huge /tokenize prompt never reaches vLLM), unknown body
fields are bounded, request heads are bounded (431), bad framing is a JSON 400, an ``h2c``
upgrade keeps its body, admin routes check every body, no gateway secret is in the engine's
environment, a stopped engine is failed fast (503 + Retry-After, /readyz at once), and a
failed control loop fails open when asked to."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest
from gateway_helpers import AUTH, TOKEN, TRUSTED_KEY, RunningGateway, running_gateway, wait_until

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def gw(request: pytest.FixtureRequest) -> RunningGateway:
    # body_timeout_s: well above what the large bodies below take to arrive on a busy machine.
    with running_gateway("serve.header_timeout_s=5", "serve.body_timeout_s=20", request=request) as g:
        yield g


def _addr(gw: RunningGateway) -> tuple[str, int]:
    host, port = gw.url.removeprefix("http://").split(":")
    return host, int(port)


def _engine_url(gw: RunningGateway) -> str:
    return next(iter(gw.status()["upstreams"].values()))["url"]


def _vllm_requests(gw: RunningGateway, handler: str) -> float:
    """Requests vLLM's own API server counted on ``handler`` (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{_engine_url(gw)}/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "http_requests_total" and s.labels.get("handler") == handler)


def _raw_exchange(gw: RunningGateway, data: bytes, timeout_s: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` on a fresh connection; the first response (Content-Length framed)."""
    with socket.create_connection(_addr(gw)) as s:
        s.settimeout(timeout_s)
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway answered and closed before taking everything
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed before a response head: {buf[:200]!r}")
            buf += chunk
        head, rest = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        n = int(headers.get("content-length", "0"))
        while len(rest) < n:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return int(lines[0].split()[1]), headers, rest[:n]


def _reason(body: bytes) -> str:
    return json.loads(body)["error"]["reason"]


def test_a_huge_tokenize_prompt_is_refused_without_reaching_vllm(gw: RunningGateway) -> None:
    """Issue 56 finding 1: 7.5 MB sent to /tokenize was forwarded, held vLLM's API server for
    10 s and stalled every completion beside it. Now it is refused as /v1/completions refuses
    it, and vLLM never sees it; a normal /tokenize still answers as vLLM does."""
    before = _vllm_requests(gw, "/tokenize")
    r = httpx.post(f"{gw.url}/tokenize", json={"prompt": "lorem ipsum " * 625_000}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["reason"] == "prompt_too_long", r.text[:300]
    r = httpx.post(f"{gw.url}/detokenize", json={"tokens": [5] * 5000}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["reason"] == "prompt_too_long", r.text[:300]
    r = httpx.post(f"{gw.url}/tokenize", json={"prompt": "hello", "junk": [[]] * 200_000}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["reason"] == "too_many_json_values", r.text[:300]
    assert _vllm_requests(gw, "/tokenize") == before  # none of them reached vLLM
    r = httpx.post(f"{gw.url}/tokenize", json={"prompt": "hello world"}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] >= 2
    assert _vllm_requests(gw, "/tokenize") == before + 1


def test_unknown_fields_are_bounded_and_huge_ones_never_forwarded(gw: RunningGateway) -> None:
    """Finding 2: 2.7 M empty arrays (8.1 MB) in an unknown field were parsed and forwarded.
    Now they are refused by a count before the parse; a large unknown field is refused after
    it; a small one (``metadata``, ``user``: vLLM ignores them) still passes."""
    before = _vllm_requests(gw, "/v1/completions")
    raw = b'{"prompt": "hi", "max_tokens": 2, "junk": [' + b",".join([b"[]"] * 2_700_000) + b"]}"
    assert len(raw) < 8 * 1024 * 1024
    r = httpx.post(f"{gw.url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["reason"] == "too_many_json_values", r.text[:300]
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "junk": "x" * 200_000},
                   timeout=120)
    assert r.status_code == 400 and r.json()["error"]["reason"] == "unknown_field_too_large", r.text[:300]
    assert r.json()["error"]["param"] == "junk"
    assert _vllm_requests(gw, "/v1/completions") == before
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "user": "u1",
                                                     "metadata": {"team": "a"}}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_huge_request_head_is_a_json_431(gw: RunningGateway) -> None:
    """Finding 3: 20 MB of headers were accepted. Past serve.max_header_bytes (64 KiB) the
    answer is 431 in the gateway's JSON form; a head under it is served."""
    headers = b"".join(b"x-filler-%d: %s\r\n" % (i, b"a" * 1000) for i in range(200))  # ~200 KB
    req = (b"GET /healthz HTTP/1.1\r\nhost: gw\r\n" + headers + b"\r\n")
    status, h, body = _raw_exchange(gw, req)
    assert status == 431 and h["content-type"] == "application/json" and _reason(body) == "header_too_large"
    small = b"".join(b"x-filler-%d: %s\r\n" % (i, b"a" * 1000) for i in range(20))  # ~20 KB
    status, _, _ = _raw_exchange(gw, b"GET /healthz HTTP/1.1\r\nhost: gw\r\n" + small + b"\r\n")
    assert status == 200


@pytest.mark.parametrize("raw", [
    b"GET /healthz HTTP/1.1\r\nhost: gw\r\ncontent-length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    b"NOT A REQUEST\r\n\r\n",
], ids=["bad-length", "length-and-chunked", "garbage"])
def test_bad_framing_is_a_json_400(gw: RunningGateway, raw: bytes) -> None:
    """Finding 5: bad framing got uvicorn's plain-text 400; the docs say never plain text."""
    status, h, body = _raw_exchange(gw, raw)
    assert status == 400 and h["content-type"] == "application/json", body
    assert _reason(body) == "bad_request" and h["connection"] == "close"


def test_an_h2c_upgrade_request_keeps_its_body(gw: RunningGateway) -> None:
    """Finding 5: ``Connection: Upgrade`` + ``Upgrade: h2c`` dropped the body (the parser stops
    at an upgrade). The upgrade is ignored and the request served as HTTP/1.1, body included."""
    body = json.dumps({"prompt": "h2c marker 7731", "max_tokens": 2, "echo": True}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\nconnection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
           b"http2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n" % len(body)) + body
    status, _, answer = _raw_exchange(gw, req)
    assert status == 200, answer
    assert "h2c marker 7731" in json.loads(answer)["choices"][0]["text"]


@pytest.mark.parametrize("raw", [b'{"x": Infinity}', b'{"x": NaN}', b"\xff\xfe{}", b'{"x": 1}'],
                         ids=["infinity", "nan", "not-utf8", "unknown-key"])
def test_admin_quality_reset_checks_its_body(gw: RunningGateway, raw: bytes) -> None:
    """Finding 5: ``POST /admin/quality/reset`` took ``{"x": Infinity}`` and non-UTF-8 bodies;
    every admin route checks its body before anything changes."""
    r = httpx.post(f"{gw.url}/admin/quality/reset", content=raw, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert httpx.post(f"{gw.url}/admin/quality/reset", headers=AUTH, timeout=30).status_code == 200
    assert httpx.post(f"{gw.url}/admin/quality/reset", json={}, headers=AUTH, timeout=30).status_code == 200


def _group(pid: int) -> list[int]:
    """``pid`` and every process below it (through /proc's children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for tid in os.listdir(f"/proc/{p}/task"):
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(x) for x in f.read().split())
            except OSError:
                pass
    return out


def test_no_gateway_secret_in_the_engines_environment(gw: RunningGateway) -> None:
    """Finding 5: the admin token was in the managed ``vllm serve``'s /proc/<pid>/environ."""
    pids = _group(gw.upstream_pids()[0])
    assert len(pids) >= 2  # the reaper and vllm serve at least
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
        assert TOKEN.encode() not in env and TRUSTED_KEY.encode() not in env, pid
        assert b"BATCHPILOT_ADMIN_TOKEN" not in env


async def _completions(url: str, n: int, timeout_s: float) -> list[tuple[int, str | None, str | None, float]]:
    async with httpx.AsyncClient() as client:
        async def one() -> tuple[int, str | None, str | None, float]:
            t0 = time.monotonic()
            try:
                r = await client.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                      timeout=timeout_s)
            except httpx.TimeoutException:
                return -1, None, None, time.monotonic() - t0
            reason = r.json()["error"]["reason"] if r.status_code != 200 else None
            return r.status_code, reason, r.headers.get("retry-after"), time.monotonic() - t0

        return list(await asyncio.gather(*(one() for _ in range(n))))


def test_a_stopped_engine_is_failed_fast(gw: RunningGateway) -> None:
    """Finding 4: with the engine SIGSTOPped, completions queued and were answered after
    19-55 s. Now /readyz says so within a moment, and requests sent meanwhile (some before the
    gateway noticed, queued) get 503 ``upstream_down`` with Retry-After, within
    serve.fail_fast_s (1 s) of the gateway noticing, not the 60 s request timeout; once the
    engine continues, it serves again."""
    pid = gw.upstream_pids()[0]
    os.killpg(pid, signal.SIGSTOP)
    try:
        out = asyncio.run(_completions(gw.url, 4, timeout_s=30))
        wait_until(lambda: httpx.get(f"{gw.url}/readyz", timeout=10).status_code == 503, 10, "/readyz 503")
        assert httpx.get(f"{gw.url}/readyz", timeout=10).json()["upstreams"]["vllm0"]["stalled"] is True
        out += asyncio.run(_completions(gw.url, 2, timeout_s=30))
    finally:
        os.killpg(pid, signal.SIGCONT)
    assert all(s == 503 and reason == "upstream_down" and ra for s, reason, ra, _ in out), out
    # Generous for a busy machine, far under the 60 s request timeout the requests waited before.
    assert max(t for *_, t in out) < 15, out
    wait_until(lambda: httpx.get(f"{gw.url}/readyz", timeout=10).status_code == 200, 60, "/readyz 200 again")
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert gw.status()["upstreams"]["vllm0"]["restarts"] == 0  # stalled, not restarted


def test_a_failed_control_loop_fails_open_when_asked(request: pytest.FixtureRequest) -> None:
    """serve.control.fail_open: a control loop that completes no decision (here: its interval is
    longer than the test) for fail_open_after_s stops gating admission; requests go straight to
    the live engine, past the batch cap of 1 it left, so several streams run at once."""
    with running_gateway("serve.control.fail_open=true", "serve.control.fail_open_after_s=2",
                         "control.interval_s=100000", "control.initial_batch_cap=1",
                         request=request) as g:
        wait_until(lambda: g.status()["fail_open"] is True, 60, "the gateway to fail open")

        async def overlap() -> int:
            running, most = 0, 0
            body = {"prompt": "count", "max_tokens": 48, "ignore_eos": True, "stream": True}
            async with httpx.AsyncClient() as client:
                async def one() -> int:
                    nonlocal running, most
                    async with client.stream("POST", f"{g.url}/v1/completions", json=body, timeout=120) as r:
                        first = True
                        async for _ in r.aiter_bytes():
                            if first:
                                running, first = running + 1, False
                                most = max(most, running)
                        running -= 1
                        return r.status_code

                statuses = await asyncio.gather(*(one() for _ in range(4)))
            assert statuses == [200] * 4
            return most

        assert asyncio.run(overlap()) >= 2


def test_a_short_soak_crosses_no_answers_and_fails_fast(tmp_path) -> None:
    """``scripts/soak.py`` shortened: mixed traffic with each fault once (engine SIGSTOP, SIGKILL
    and its restart, huge bodies, slow clients). No answer reaches the wrong client, the gateway
    answers every request (no client timeout, no 500), every load refusal carries Retry-After,
    and requests sent while the engine is stopped are answered (503) long before the 60 s
    request timeout."""
    from batchpilot.serving.soak import SoakConfig, soak

    cfg = SoakConfig(duration_s=100, fault_every_s=15, min_faults=4, sigstop_s=8, burst_s=8, clients=4,
                     log_dir=str(tmp_path / "soak"))
    out = soak(cfg)
    print(json.dumps(out))
    assert [f["kind"] for f in out["faults"]][:4] == ["sigstop", "sigkill", "huge_body", "slow_client"], out
    assert out["sent"] > 50 and out["crossed"] == 0, out
    # No 500, no client timeout (-1), no reset (-2); 502 or a stream ended by an error event
    # ("200+error"): requests in flight when the engine was killed.
    assert set(out["by_status"]) <= {"200", "200+error", "502", "503", "429"}, out
    assert out["refusals_without_retry_after"] == 0, out
    stop = out["faults"][0]
    assert stop["statuses"].get("503", 0) > 0 and stop["p99_s"] < 30, stop
    for f in out["faults"][2:4]:
        assert f["statuses"].get("200", 0) > 0, f  # huge bodies and slow clients stall nobody


class _HungUpstream:
    """An unmanaged upstream whose /health never answers until ``answer`` is set (a hang that
    /proc cannot show: a deadlocked server, another host)."""

    name, url, managed, info, num_restarts = "vllm0", "http://hung", None, None, 0
    healthy, restarting, stalled, planned_restart = True, False, False, False
    last_answer = -float("inf")

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        from batchpilot.serving.http1 import Http1Pool

        self.pool = Http1Pool("127.0.0.1", 9)

    async def probe(self, timeout_s: float) -> str | None:
        try:
            async with asyncio.timeout(timeout_s):
                await self.answer.wait()
        except TimeoutError:
            return f"/health did not answer within {timeout_s:g} s"
        return None

    def answered_within(self, seconds: float, now: float | None = None) -> bool:
        return False


def test_an_unresponsive_upstream_stops_admitting_and_its_queue_is_refused() -> None:
    """An upstream whose /health goes unanswered past serve.unresponsive_s stops admitting
    (without a restart: it is not managed here), and a request queued on it gets 503
    ``upstream_down`` with Retry-After once it has been down serve.fail_fast_s, not after the
    request timeout; when it answers again it admits again."""
    from batchpilot.core.admission import AdmissionConfig
    from batchpilot.core.engine import Request as EngineRequest
    from batchpilot.core.knobs import Knobs
    from batchpilot.core.telemetry import SLO, Telemetry
    from batchpilot.schemas.serve import ServeConfig
    from batchpilot.serving.errors import Refused
    from batchpilot.serving.lanes import Lane
    from batchpilot.serving.prom import GatewayMetrics
    from batchpilot.serving.supervisor import Supervisor

    async def scenario() -> None:
        cfg = ServeConfig.from_cfg({"upstreams": ["http://hung"], "health_timeout_s": 0.3, "unresponsive_s": 0.5,
                                    "fail_fast_s": 0.3, "request_timeout_s": 60, "health_interval_s": 0.1})
        up, metrics = _HungUpstream(), GatewayMetrics()
        lane = Lane.build(0, up, AdmissionConfig(), Knobs(batch_cap=1), Telemetry(SLO()), metrics, 1)  # type: ignore[arg-type]
        sup = Supervisor(cfg, [lane], metrics)
        await lane.acquire(EngineRequest("held", time.monotonic(), 8, 8, 1), time.monotonic() + 60)  # the one slot
        queued = asyncio.ensure_future(lane.acquire(EngineRequest("q", time.monotonic(), 8, 8, 1),
                                                    time.monotonic() + 60))

        async def health() -> None:
            while True:
                await sup.probe(lane)
                await asyncio.sleep(0.05)

        async def watch() -> None:
            while True:
                sup.check_lanes(time.monotonic())
                await asyncio.sleep(0.05)

        tasks = [asyncio.ensure_future(health()), asyncio.ensure_future(watch())]
        try:
            t0 = time.monotonic()
            with pytest.raises(Refused) as err:
                await asyncio.wait_for(queued, 30)
            assert err.value.reason == "upstream_down" and err.value.status == 503 and err.value.retry_after
            assert up.stalled and not lane.available and time.monotonic() - t0 < 30
            up.answer.set()  # it answers again
            deadline = time.monotonic() + 30
            while not lane.available:
                assert time.monotonic() < deadline, "the lane never admitted again"
                await asyncio.sleep(0.05)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())
