"""Fault: the managed ``vllm serve`` is killed mid-load. In-flight requests fail fast with
502/503, new ones queue (managed: a restart is coming) or get 503 with Retry-After, and once
the gateway has restarted the upstream traffic flows again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import httpx
import pytest
from gateway_helpers import AUTH, RunningGateway, one_request, running_gateway, wait_ready

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(900)]

REQUEST_TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def gw(request: pytest.FixtureRequest) -> RunningGateway:
    with running_gateway(f"serve.request_timeout_s={REQUEST_TIMEOUT_S}", "serve.health_interval_s=0.25", request=request) as g:
        yield g


def test_upstream_killed_mid_load(gw: RunningGateway) -> None:
    """Open-loop load (20 requests/s, a third streamed); the engine is killed once two streams
    are under way, whatever the machine's speed. Requests in flight at the kill fail at once
    (502, or an SSE error event), never by waiting for their timeout; those sent after the
    gateway noticed queue for the restart (200) or get 503 with Retry-After."""
    [pid] = gw.upstream_pids()
    # Long outputs, so streams are still running at the kill however fast the engine is.
    body = {"prompt": "fault test", "max_tokens": 1500, "ignore_eos": True}
    rate = 20.0
    after_down = 20  # requests sent once the gateway has noticed the death

    async def scenario() -> tuple[list, float, float | None]:
        t_kill = 0.0
        t_down: float | None = None
        streaming = 0  # streams whose first chunk came and that have not ended

        def first_chunk() -> None:
            nonlocal streaming, t_kill
            streaming += 1
            if streaming >= 2 and not t_kill:  # two streams mid-generation: kill now
                os.killpg(pid, signal.SIGKILL)
                t_kill = time.monotonic()

        def stream_ended(task: asyncio.Task) -> None:
            nonlocal streaming
            if not task.cancelled() and task.result().t_first is not None:
                streaming -= 1

        async def watch_down(admin: httpx.AsyncClient) -> None:
            """When the gateway first reports the upstream down (condition, polled)."""
            nonlocal t_down
            while True:
                lane = next(iter((await admin.get(f"{gw.url}/admin/status", headers=AUTH, timeout=30)
                                  ).json()["control"]["lanes"].values()))
                if t_kill and (not lane["healthy"] or lane["restarting"]):
                    t_down = time.monotonic()
                    return
                await asyncio.sleep(0.02)

        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=400)) as c, httpx.AsyncClient() as admin:
            watcher = asyncio.create_task(watch_down(admin))
            tasks: list[asyncio.Task] = []
            t0 = time.monotonic()
            sent_after_down = 0
            for i in range(2000):
                if t_kill and (sent_after_down >= after_down or watcher.done() and watcher.exception()):
                    break
                await asyncio.sleep(max(t0 + i / rate - time.monotonic(), 0))
                stream = i % 3 == 0
                task = asyncio.create_task(one_request(c, gw.url, body, stream=stream, timeout_s=120,
                                                       on_first_chunk=first_chunk if stream else None))
                if stream:
                    task.add_done_callback(stream_ended)
                tasks.append(task)
                if t_down is not None:
                    sent_after_down += 1
            outcomes = list(await asyncio.gather(*tasks))
            if not watcher.done():
                watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            return outcomes, t_kill, t_down

    outcomes, t_kill, t_down = asyncio.run(scenario())
    assert t_kill, "no two streams were under way at once"
    assert t_down is not None, "the gateway never reported the killed upstream down"
    by = Counter(o.status for o in outcomes)
    assert set(by) <= {200, 502, 503}, by  # nothing hung, no transport errors, no 500s
    for o in outcomes:
        if o.status in (502, 503):
            assert o.reason in {"upstream_error", "upstream_down", "timeout"}, o
            assert o.retry_after is not None
        if o.status == 502:  # it lost its upstream mid-request: it was sent before the gateway knew
            assert o.reason == "upstream_error" and o.t_start < t_down, o
    # Streams under way at the kill failed at once: the gateway's upstream_error event, never
    # the request timeout's (or they had just ended normally).
    in_flight = [o for o in outcomes if o.t_first is not None and o.t_first <= t_kill < o.t_end]
    assert in_flight, "expected streams in flight at the kill"
    for o in in_flight:
        assert o.status == 200 and '"reason": "timeout"' not in o.body, o
        assert '"reason": "upstream_error"' in o.body or o.body.rstrip().endswith("data: [DONE]"), o
    failed = [o for o in in_flight if '"reason": "upstream_error"' in o.body] + [o for o in outcomes if o.status == 502]
    assert failed, "no request in flight at the kill saw it"
    # Requests sent after the gateway noticed: queued (200 once back, or 503 timeout) or 503
    # upstream_down, each within the request timeout (+ slack for a busy machine).
    after = [o for o in outcomes if o.t_start > t_down]
    assert len(after) >= after_down
    for o in after:
        assert o.status in (200, 503), o
        assert o.t_end - o.t_start < REQUEST_TIMEOUT_S + 10.0, o
    # The gateway restarts the upstream (within its own serve.startup_timeout_s, 300 s); traffic
    # flows again.
    wait_ready(gw.url, 420)
    ok = [httpx.post(f"{gw.url}/v1/completions", json={"prompt": "back?", "max_tokens": 3}, timeout=60).status_code
          for _ in range(5)]
    assert ok == [200] * 5
    assert gw.metric("batchpilot:upstream_restarts_total", cause="crash") >= 1
    assert gw.upstream_pids() != [pid]
    deadline = time.monotonic() + 60  # every slot handed back (the last releases may trail the answers)
    while True:
        lane = next(iter(gw.status()["control"]["lanes"].values()))
        if (lane["in_flight"] == 0 and sum(lane["queue_depths"]) == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert lane["in_flight"] == 0 and sum(lane["queue_depths"]) == 0, lane
    print(f"fault: {dict(by)}, {len(in_flight)} streams in flight at the kill, down noticed after "
          f"{t_down - t_kill:.2f} s, {len(after)} requests after")


def test_kv_dtype_switch_restarts_managed_upstream_drained(gw: RunningGateway) -> None:
    """An operator KV dtype switch (the path a policy's switch takes too): the managed upstream
    restarts with the new dtype while requests queue (or time out with 503 + Retry-After);
    afterwards it serves with 8-bit KV."""
    from batchpilot.platform.vllm_cpu import cpu_kv8_unavailable_reason

    wait_ready(gw.url, 420)
    why = cpu_kv8_unavailable_reason()
    # An operator override: the shield alone would refuse it (an idle engine gains nothing).
    r = httpx.post(f"{gw.url}/admin/kv_dtype", json={"dtype": "fp8", "force": True}, headers=AUTH, timeout=30)
    if why is not None:  # this CPU cannot: the switch is refused with the reason, nothing restarts
        assert r.status_code == 400 and "AVX-512 or AMX" in r.json()["error"]["message"], r.text
        assert gw.metric("batchpilot:upstream_restarts_total", cause="admin") == 0
        return
    assert r.status_code == 200 and r.json()["upstreams"] == {"vllm0": "restarting"}, r.text
    assert gw.metric("batchpilot:admin_overrides_total", kind="kv_dtype") == 1

    async def during() -> list:
        async with httpx.AsyncClient() as c:
            return list(await asyncio.gather(*(
                one_request(c, gw.url, {"prompt": "during", "max_tokens": 2}, timeout_s=120) for _ in range(5))))

    for o in asyncio.run(during()):
        assert o.status == 200 or (o.status == 503 and o.reason == "timeout" and o.retry_after), o
    deadline = time.monotonic() + 420  # the restart may take the gateway's startup_timeout_s (300 s)
    while time.monotonic() < deadline:
        lane = next(iter(gw.status()["control"]["lanes"].values()))
        if lane["knobs_in_force"]["kv_dtype"] == "fp8" and lane["healthy"] and not lane["restarting"]:
            break
        time.sleep(1)
    assert lane["knobs_in_force"]["kv_dtype"] == "fp8", lane
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "8-bit now", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
    assert gw.metric("batchpilot:knob_kv_8bit") == 1
    assert gw.metric("batchpilot:upstream_restarts_total", cause="admin") == 1
