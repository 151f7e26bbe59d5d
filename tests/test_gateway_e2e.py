"""End to end through the gateway to a real ``vllm serve`` (tiny model, loopback): completions
and chat, streaming and not; bad input; disconnects; admin API and policy fallback."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from gateway_helpers import AUTH, TRUSTED, RunningGateway, running_gateway

from batchpilot.serving.bench import server_timing

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def gw(request: pytest.FixtureRequest) -> RunningGateway:
    with running_gateway("control.interval_s=0.5", "serve.control.policy_dir=/nonexistent/policy", request=request) as g:
        yield g


def _sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_ready_and_health(gw: RunningGateway) -> None:
    assert httpx.get(f"{gw.url}/healthz", timeout=30).status_code == 200
    r = httpx.get(f"{gw.url}/readyz", timeout=30)
    assert r.status_code == 200 and r.json()["ready"] is True
    r = httpx.get(f"{gw.url}/health", timeout=30)  # vLLM's own probe route, as vLLM answers it
    assert r.status_code == 200 and r.content == b""


def test_vllms_read_only_endpoints_answer_through_the_gateway_as_vllm_does(gw: RunningGateway) -> None:
    """/tokenize, /detokenize and /version reach vLLM and come back unchanged, its errors too;
    engine control and other generation APIs do not reach it (404 from the gateway)."""
    vllm = next(iter(gw.status()["upstreams"].values()))["url"]
    for method, path, body in [("POST", "/tokenize", {"prompt": "hello batchpilot world"}),
                               ("POST", "/detokenize", {"tokens": [5, 6, 7, 8]}),
                               ("POST", "/tokenize", {"prompt": 12}),  # vLLM's own 4xx
                               ("GET", "/version", None)]:
        direct = httpx.request(method, f"{vllm}{path}", json=body, timeout=60)
        through = httpx.request(method, f"{gw.url}{path}", json=body, timeout=60)
        assert through.status_code == direct.status_code and through.json() == direct.json(), (path, through.text)
    assert httpx.post(f"{gw.url}/tokenize", json={"prompt": "hi"}, timeout=60).json()["count"] >= 1
    r = httpx.post(f"{gw.url}/reset_prefix_cache", timeout=60)
    assert r.status_code == 404 and r.json()["error"]["reason"] == "unknown_endpoint"


def test_completion_non_streaming(gw: RunningGateway) -> None:
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "hello world", "max_tokens": 5}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens"] > 0
    assert body["choices"][0]["finish_reason"] == "length"
    # The split a benchmark reads per request: time waiting for vLLM, time in the gateway.
    upstream_ms = server_timing(r.headers["server-timing"], "upstream")
    assert 0 < upstream_ms and 0 <= float(r.headers["x-gateway-overhead-ms"]) < upstream_ms + 1e3


def test_completion_streaming_passes_sse_through(gw: RunningGateway) -> None:
    body = {"prompt": "hello world", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = _sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_both_ways(gw: RunningGateway) -> None:
    msgs = [{"role": "user", "content": "hi there"}]
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    assert r.json()["usage"]["completion_tokens"] == 3
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions",
                      json={"messages": msgs, "max_tokens": 3, "stream": True}, timeout=60) as s:
        events = _sse_events(s.read().decode())
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"


def test_the_openai_sdk_works_through_the_gateway(gw: RunningGateway) -> None:
    """OpenAI's own Python client (installed with vLLM), as an application would use it:
    models, completions, a streamed chat, and the gateway's errors raised as the SDK's typed
    exceptions with the gateway's reason in the body."""
    import openai

    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="any-client-key", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="hello world", max_tokens=5)
    assert done.usage is not None and done.usage.completion_tokens == 5 and done.choices[0].text
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    assert chunks and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x", max_tokens=10**6)
    assert bad.value.status_code == 400 and bad.value.body["reason"] == "max_tokens_too_large"
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=model, input="hi")
    assert missing.value.body["reason"] == "unknown_endpoint"


def test_upstream_errors_pass_through(gw: RunningGateway) -> None:
    # The gateway does not check sampling parameters: vLLM's own 400 comes back unchanged.
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": -3}, timeout=60)
    assert r.status_code == 400
    assert "temperature" in r.text


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"{not json", "invalid_json"),
        (b"[1, 2]", "invalid_body"),
        (json.dumps({"max_tokens": 3}).encode(), "missing_field"),
        (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), "invalid_field"),
        (json.dumps({"prompt": "x", "max_tokens": "ten"}).encode(), "invalid_field"),
        (json.dumps({"prompt": "x", "max_tokens": 10**9}).encode(), "max_tokens_too_large"),
        (json.dumps({"prompt": "ab " * 3000, "max_tokens": 2}).encode(), "prompt_too_long"),
        (json.dumps({"prompt": {"a": 1}}).encode(), "invalid_field"),
        (json.dumps({"prompt": "x", "n": 0}).encode(), "invalid_field"),
        (json.dumps({"prompt": ["a", "b"], "n": 200}).encode(), "too_many_sequences"),  # 400 > max_num_seqs
    ],
)
def test_bad_input_gets_clear_4xx(gw: RunningGateway, raw: bytes, reason: str) -> None:
    r = httpx.post(f"{gw.url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500
    err = r.json()["error"]
    assert err["reason"] == reason and err["message"]


def test_bad_chat_and_priority_header(gw: RunningGateway) -> None:
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"messages": "hi"}, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   headers={"x-priority": "high"}, timeout=30)
    assert r.status_code == 400 and "x-priority" in r.json()["error"]["message"]


def test_gateway_keeps_serving_after_bad_input(gw: RunningGateway) -> None:
    for _ in range(3):
        httpx.post(f"{gw.url}/v1/completions", content=b"\xff\xfe", timeout=30)
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "still there?", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_admin_requires_token(gw: RunningGateway) -> None:
    assert httpx.get(f"{gw.url}/admin/status", timeout=30).status_code == 401
    assert httpx.get(f"{gw.url}/admin/status", headers={"authorization": "Bearer nope"}, timeout=30).status_code == 401
    assert httpx.get(f"{gw.url}/admin/status", headers=AUTH, timeout=30).status_code == 200


def test_missing_policy_falls_back_to_pid_and_says_so(gw: RunningGateway) -> None:
    r = httpx.post(f"{gw.url}/admin/mode", json={"mode": "policy"}, headers=AUTH, timeout=30)
    assert r.status_code == 200
    out = r.json()
    assert out["acting"] == "pid" and "load_failed" in out["fallback_reason"]
    assert gw.metric("batchpilot:policy_fallbacks_total", reason="load_failed") >= 1
    assert gw.status()["control"]["fallback_reason"]
    assert httpx.post(f"{gw.url}/admin/mode", json={"mode": "bogus"}, headers=AUTH, timeout=30).status_code == 400
    httpx.post(f"{gw.url}/admin/mode", json={"mode": "pid"}, headers=AUTH, timeout=30)


def test_disconnects_free_slots(gw: RunningGateway) -> None:
    """Clients that go away while queued leave the queue, and ones that go away mid-request
    free their slot: afterwards nothing is queued or in flight, and every request is counted
    once as finished, cancelled (queued) or client_gone (in flight)."""
    r = httpx.post(f"{gw.url}/admin/freeze", json={"frozen": True, "knobs": {"batch_cap": 1}, "force": True}, headers=AUTH,
                   timeout=30)
    assert r.status_code == 200

    def counts() -> tuple[float, float, float]:
        return (gw.metric("batchpilot:requests_total", route="/v1/completions", status="200"),
                gw.metric("batchpilot:requests_rejected_total", reason="cancelled"),
                gw.metric("batchpilot:requests_rejected_total", reason="client_gone"))

    before = counts()
    n_queued = 5

    async def lane_state(c: httpx.AsyncClient) -> dict:
        st = (await c.get(f"{gw.url}/admin/status", headers=AUTH)).json()
        return next(iter(st["control"]["lanes"].values()))

    async def scenario() -> int:
        async with httpx.AsyncClient(timeout=60) as c:
            long = {"prompt": "go on", "max_tokens": 1900, "stream": True, "ignore_eos": True}
            async with c.stream("POST", f"{gw.url}/v1/completions", json=long) as s:
                it = s.aiter_raw()
                await it.__anext__()  # the stream holds the only slot
                # Long enough that some are still queued when their clients leave, even if the
                # stream has ended by then.
                small = {"prompt": "q", "max_tokens": 1500, "ignore_eos": True}
                tasks = [asyncio.create_task(c.post(f"{gw.url}/v1/completions", json=small)) for _ in range(n_queued)]
                seen = 0
                deadline = time.monotonic() + 60  # a condition, not a speed: ends as soon as one queues
                while not seen and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                    seen = max(seen, sum((await lane_state(c))["queue_depths"]))
                for t in tasks:  # every client goes away
                    t.cancel()
            # leaving the stream context closed the streaming client's connection too
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                lane = await lane_state(c)
                if lane["in_flight"] == 0 and sum(lane["queue_depths"]) == 0:
                    break
                await asyncio.sleep(0.2)
            assert lane["in_flight"] == 0 and sum(lane["queue_depths"]) == 0, lane
            return seen

    try:
        seen = asyncio.run(scenario())
        # Each request is counted as its handler ends, which may trail the slot's release: wait
        # until every one is (condition, polled), then a moment more for a double count to show.
        deadline = time.monotonic() + 60
        while sum(a - b for a, b in zip(counts(), before)) < 1 + n_queued and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        after = counts()
        delta = [a - b for a, b in zip(after, before)]
        assert seen >= 1  # some requests were really queued when their clients left
        assert delta[1] >= 1  # ... and left the queue as "cancelled"
        # the stream (200 at its start) + the 5 small ones, each counted once
        assert sum(delta) == 1 + n_queued, delta
    finally:
        httpx.post(f"{gw.url}/admin/freeze", json={"frozen": False, "knobs": {"batch_cap": 64}, "force": True}, headers=AUTH,
                   timeout=30)
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_metrics_exported(gw: RunningGateway) -> None:
    text = httpx.get(f"{gw.url}/metrics", timeout=30).text
    for name in ("batchpilot:queue_depth", "batchpilot:knob_batch_cap", "batchpilot:breaker_level",
                 "batchpilot:ttft_seconds_bucket", "batchpilot:e2e_latency_seconds_bucket",
                 "batchpilot:admission_wait_seconds_bucket",
                 "batchpilot:output_diff_rate", "batchpilot:upstream_kv_cache_usage"):
        assert name in text, name
    assert gw.metric("batchpilot:requests_total", route="/v1/completions", status="200") >= 3
    # each request let through records its wait in the admission queue (every bucket summed)
    assert gw.metric("batchpilot:admission_wait_seconds_count") >= 3
    assert gw.metric("batchpilot:admission_wait_seconds_sum") >= 0


def test_quality_guard_replay_agrees_on_identical_servers(gw: RunningGateway) -> None:
    """The guard's comparison on a real server: greedy replays of one prompt on the same
    16-bit engine agree token for token (so a diff on 8-bit vs 16-bit is the KV dtype's)."""
    from batchpilot.schemas.serve import QualityGuardConfig
    from batchpilot.serving.prom import GatewayMetrics
    from batchpilot.serving.quality_guard import QualityGuard

    [up] = gw.status()["upstreams"].values()

    async def run() -> float:
        guard = QualityGuard(QualityGuardConfig(reference_url=up["url"]), GatewayMetrics())
        async with httpx.AsyncClient(base_url=up["url"]) as c:
            body = {"model": "tiny-llama", "prompt": "compare me", "max_tokens": 16, "temperature": 0.0,
                    "return_token_ids": True}
            try:
                return await guard.compare(c, guard._ref, "/v1/completions", body)
            finally:
                await guard.aclose()

    assert asyncio.run(run()) == 1.0


def test_policy_modes_with_the_shipped_policy(gw: RunningGateway) -> None:
    """Load the exported policy through the admin API; it acts in ``policy`` mode, only
    advises in ``shadow`` mode, and a canary of it starts evaluating."""
    from batchpilot.config import REPO_ROOT

    path = REPO_ROOT / "policies" / "pretrained"
    if not (path / "manifest.json").is_file():
        pytest.skip("no shipped policy in policies/pretrained")
    post = lambda url, body: httpx.post(f"{gw.url}{url}", json=body, headers=AUTH, timeout=30)  # noqa: E731
    try:
        r = post("/admin/policy/reload", {"path": str(path), "canary_share": 0})
        assert r.status_code == 200 and r.json()["ok"], r.text
        assert post("/admin/mode", {"mode": "policy"}).json()["acting"] == "policy"
        for _ in range(3):
            httpx.post(f"{gw.url}/v1/completions", json={"prompt": "tick", "max_tokens": 2}, timeout=60)
        gw.wait_ticks(3)  # two whole control ticks in policy mode (counted, not slept)
        st = gw.status()["control"]
        assert st["fallback_reason"] is None and next(iter(st["lanes"].values()))["acting"] == "policy", st
        assert post("/admin/mode", {"mode": "shadow"}).json()["acting"] == "pid"
        gw.wait_ticks(3)
        assert gw.metric("batchpilot:shadow_batch_agreement") >= 0.0
        assert next(iter(gw.status()["control"]["lanes"].values()))["acting"] == "pid"
        post("/admin/mode", {"mode": "policy"})
        r = post("/admin/policy/reload", {"path": str(path), "canary_share": 0.5})
        assert r.json()["canary"] is True
        assert gw.status()["control"]["canary"]["state"] == "evaluating"
        assert gw.metric("batchpilot:canary_state") == 1
    finally:
        post("/admin/mode", {"mode": "pid"})


def test_ttft_in_metrics_matches_what_clients_measure(gw: RunningGateway) -> None:
    """Production TTFT used to read 0 (only the env recorded first tokens): the gateway's TTFT
    percentiles (``/metrics`` and the control snapshot) must match what streaming clients
    measure, within 10 %. 40 streams at once into a batch cap of 2, so TTFT holds real queueing
    (what the controller steers on) and the loopback hops (~1-2 ms each way, which the client's
    clock holds and the gateway's cannot) stay small beside it."""
    from batchpilot.core.telemetry import _p50_p99

    r = httpx.post(f"{gw.url}/admin/freeze", json={"frozen": True, "knobs": {"batch_cap": 2}, "force": True}, headers=AUTH,
                   timeout=30)
    assert r.status_code == 200
    time.sleep(10.5)  # the telemetry window (10 s) holds only the requests below

    host, port = gw.url.removeprefix("http://").split(":")
    headers = {"x-priority": "0", **TRUSTED}  # core priority: queued, never shed

    async def one(i: int, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> float:
        # A minimal client on an open connection: the clock starts as the request is written and
        # stops at the first SSE event, so no client library's own scheduling is in it (httpx
        # with 40 streams on a busy 2-core machine added ~300 ms at p99 that the gateway cannot see).
        reader, writer = conn
        body = json.dumps({"prompt": f"time to first token {i}", "max_tokens": 24, "ignore_eos": True,
                           "stream": True}).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        req = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\nconnection: close\r\n{head}\r\n").encode() + body
        t0 = time.monotonic()
        writer.write(req)
        await writer.drain()
        seen = b""
        while b"data: " not in seen.partition(b"\r\n\r\n")[2]:
            chunk = await reader.read(65536)
            assert chunk, f"connection closed before the first token: {seen[:300]!r}"
            seen += chunk
        took = (time.monotonic() - t0) * 1e3
        assert seen.startswith(b"HTTP/1.1 200"), seen[:300]
        while await reader.read(65536):
            pass
        writer.close()
        return took

    async def run() -> list[float]:
        # Connections first: a TCP connect is in a client's clock, not in the gateway's.
        conns = [await asyncio.open_connection(host, int(port)) for _ in range(40)]
        return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(conns))))

    try:
        measured = asyncio.run(run())
        # Two control ticks after the last stream take the snapshot (counted, not slept: a
        # busy machine delays ticks).
        ticks = gw.status()["control"]["ticks"]
        deadline = time.monotonic() + 60.0
        while gw.status()["control"]["ticks"] < ticks + 2:
            assert time.monotonic() < deadline, "the control loop stopped ticking"
            time.sleep(0.1)
        lane = next(iter(gw.status()["control"]["lanes"].values()))
        gauge = gw.metric("batchpilot:ttft_p99_ms")
    finally:
        httpx.post(f"{gw.url}/admin/freeze", json={"frozen": False, "knobs": {"batch_cap": 64}, "force": True}, headers=AUTH,
                   timeout=30)
    p50, p99 = _p50_p99(measured)
    print(f"TTFT client p50 {p50:.1f} p99 {p99:.1f} ms; gateway gauge p99 {gauge:.1f}, snapshot p99 "
          f"{lane['ttft_p99_ms']:.1f} ms")
    assert p99 > 50.0, measured  # queueing really is in it
    for name, got, want in (("gauge p99", gauge, p99), ("snapshot p99", lane["ttft_p99_ms"], p99)):
        assert got > 0 and abs(got - want) <= 0.10 * want, (name, got, want, p50)


def test_a_streamed_prompt_leaves_the_prefill_backlog_at_its_first_token(gw: RunningGateway) -> None:
    """Admission holds requests while streamed prompts without a first token fill the engine's
    token budget; the stream's first chunk takes its prompt out of that backlog while it runs on."""

    def lane() -> dict:
        st = httpx.get(f"{gw.url}/admin/status", headers=AUTH, timeout=30).json()
        return next(iter(st["control"]["lanes"].values()))

    assert lane()["prefill_hold_tokens"] == 2048  # vLLM's CPU server budget (max_num_batched_tokens)
    assert lane()["late_margin_s"] == 0.0 and lane()["first_token_s"] is None  # first_token_margin: off by default
    body = {"prompt": "go on " * 100, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped iterator closes the response
        while not next(lines).startswith("data: "):  # the first token
            pass
        st = lane()
        assert st["in_flight"] == 1 and st["prefill_backlog_tokens"] == 0, st
    deadline = time.monotonic() + 60
    while (st := lane())["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert st["in_flight"] == 0 and st["prefill_backlog_tokens"] == 0, st
