"""The supervisor's health decisions without vLLM: a busy upstream that answers /health slowly
is not restarted on one failed probe; one that stays silent for ``health_failures`` probes over
``health_grace_s`` is; a process that exited is restarted at once; only one restart runs; and
stopping the gateway cancels a restart under way and waits for it."""

from __future__ import annotations

import asyncio

import pytest

from batchpilot.core.admission import AdmissionConfig
from batchpilot.core.knobs import Knobs
from batchpilot.core.telemetry import SLO, Telemetry
from batchpilot.schemas.serve import ServeConfig
from batchpilot.serving.lanes import Lane
from batchpilot.serving.prom import GatewayMetrics
from batchpilot.serving.supervisor import Supervisor

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeProcess:
    def __init__(self) -> None:
        self.exited = False
        self.proc = None

    def alive(self) -> bool:
        return not self.exited

    def stopped(self) -> bool:  # SIGSTOPped (ManagedVLLM.stopped): never here
        return False


class FakeUpstream:
    """An upstream whose probe answers what the test says, and whose restart is recorded."""

    stalled = False  # Upstream's flags the supervisor reads and sets
    planned_restart = False

    def __init__(self) -> None:
        self.name = "vllm0"
        self.url = "http://fake"
        self.healthy = True
        self.restarting = False
        self.managed = FakeProcess()
        self.answer: str | None = None
        self.restarts = 0
        self.restart_gate = asyncio.Event()
        self.restart_gate.set()
        self.num_restarts = 0
        self.info = None
        self.stopped = False

    async def probe(self, timeout_s: float) -> str | None:
        if self.managed.exited:
            return "the vllm serve process exited (code -9)"
        return self.answer

    async def restart(self, timeout_s: float, kv_dtype: str | None = None) -> float:
        self.restarts += 1
        await self.restart_gate.wait()
        self.managed.exited = False
        self.healthy = True
        return 0.0

    async def stop(self) -> None:
        self.stopped = True

    async def aclose(self) -> None:
        pass


def _supervisor(**cfg: object) -> tuple[Supervisor, FakeUpstream, Lane]:
    serve = ServeConfig.from_cfg({"managed": True, "health_failures": 3, "health_grace_s": 0.2,
                                  "warmup": {"prompts": []}, **cfg})
    up = FakeUpstream()
    metrics = GatewayMetrics()
    lane = Lane.build(0, up, AdmissionConfig(), Knobs(batch_cap=4), Telemetry(SLO()), metrics, 1)  # type: ignore[arg-type]
    return Supervisor(serve, [lane], metrics), up, lane


async def _settle(sup: Supervisor) -> None:
    while sup._tasks:
        await asyncio.sleep(0.01)


async def test_one_slow_probe_does_not_restart_a_busy_upstream() -> None:
    sup, up, lane = _supervisor()
    up.answer = "/health did not answer within 5 s"
    await sup.probe(lane)
    await sup.probe(lane)  # two in a row: still under health_failures=3
    await _settle(sup)
    assert up.restarts == 0 and up.healthy
    up.answer = None  # it answers again: the count starts over
    await sup.probe(lane)
    up.answer = "/health answered 503"
    for _ in range(2):
        await sup.probe(lane)
    await _settle(sup)
    assert up.restarts == 0 and up.healthy


async def test_failures_must_also_span_the_grace_period() -> None:
    sup, up, lane = _supervisor(health_grace_s=3600.0)
    up.answer = "/health did not answer within 5 s"
    for _ in range(10):  # many quick failures, but within the grace period
        await sup.probe(lane)
    await _settle(sup)
    assert up.restarts == 0 and up.healthy


async def test_a_silent_upstream_is_restarted_after_the_grace_period() -> None:
    sup, up, lane = _supervisor()
    up.answer = "/health did not answer within 5 s"
    for _ in range(3):
        await sup.probe(lane)
    assert up.healthy  # three failures, but not yet over 0.2 s
    await asyncio.sleep(0.25)
    await sup.probe(lane)
    assert not up.healthy
    await _settle(sup)
    assert up.restarts == 1 and up.healthy
    assert sup.metrics.upstream_restarts.labels("vllm0", "unresponsive")._value.get() == 1


async def test_an_exited_process_is_restarted_at_once_and_only_once() -> None:
    sup, up, lane = _supervisor()
    up.managed.exited = True
    up.restart_gate.clear()  # the restart takes a while
    await sup.probe(lane)
    assert not up.healthy
    await asyncio.sleep(0.01)
    assert up.restarting
    assert await sup.restart(lane, cause="quality") is False  # one already under way
    up.restart_gate.set()
    await _settle(sup)
    assert up.restarts == 1 and up.healthy and not up.restarting
    assert sup.metrics.upstream_restarts.labels("vllm0", "crash")._value.get() == 1


async def test_stop_cancels_a_restart_under_way_and_stops_the_upstream() -> None:
    sup, up, lane = _supervisor()
    up.managed.exited = True
    up.restart_gate.clear()  # stuck mid-restart when the gateway stops
    await sup.probe(lane)
    await asyncio.sleep(0.01)
    assert up.restarting and sup._tasks
    await sup.stop_all()
    assert not sup._tasks and up.stopped and not up.restarting
    assert await sup.restart(lane, cause="crash") is False  # nothing starts after stop


def test_traffic_counts_as_a_health_check() -> None:
    """``Upstream.answered_within``: a recent answer below 500 from a healthy upstream whose
    process still runs makes a /health call redundant; any of the three missing, it does not."""
    from batchpilot.serving.upstream import Upstream

    up = Upstream("http://127.0.0.1:9")
    up.healthy = True
    assert not up.answered_within(0.5, now=100.0)  # nothing answered yet
    up.last_answer = 99.8
    assert up.answered_within(0.5, now=100.0)
    assert not up.answered_within(0.5, now=100.4)  # too long ago
    up.healthy = False
    assert not up.answered_within(0.5, now=100.0)
    up.healthy = True
    up.managed = FakeProcess()  # type: ignore[assignment]
    up.managed.exited = True
    assert not up.answered_within(0.5, now=100.0)


async def test_the_health_loop_probes_only_when_traffic_stops() -> None:
    sup, up, lane = _supervisor(health_interval_s=0.001)
    probes, asked = [], []
    answering = True

    async def probe(timeout_s: float) -> str | None:
        probes.append(timeout_s)
        return None

    def answered_within(seconds: float) -> bool:
        asked.append(seconds)
        return answering

    up.probe = probe  # type: ignore[method-assign]
    up.answered_within = answered_within  # type: ignore[attr-defined]
    task = asyncio.create_task(sup._health_loop())
    try:
        while len(asked) < 20:
            await asyncio.sleep(0.001)
        assert probes == []  # answers kept coming: no /health call
        answering = False
        while len(probes) < 3:
            await asyncio.sleep(0.001)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_scrape_asks_vllm_only_for_the_samples_it_reads() -> None:
    """Against vLLM's own /metrics route (its FastAPI app, in process): the gateway's scrape
    names the samples it reads, so buckets and every other metric stay out of the answer."""
    import httpx
    import prometheus_client
    from fastapi import FastAPI
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    from batchpilot.metrics import parse_vllm_metrics
    from batchpilot.serving.upstream import Upstream

    registry = get_prometheus_registry()
    running = prometheus_client.Gauge("vllm:num_requests_running", "running", ["engine"], registry=registry)
    ttft = prometheus_client.Histogram("vllm:time_to_first_token_seconds", "ttft", ["engine"], registry=registry)
    try:
        running.labels("0").set(7)
        ttft.labels("0").observe(0.25)
        app = FastAPI()
        attach_router(app)
        up = Upstream("http://vllm")
        await up.client.aclose()
        up.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vllm")
        text = await up.metrics_text()
        full = (await up.client.get("/metrics")).text
        await up.aclose()
    finally:
        registry.unregister(running)
        registry.unregister(ttft)
    assert "vllm:num_requests_running" in full and "_bucket" in full and "python_gc" in full
    assert "_bucket" not in text and "python_gc" not in text and len(text) < len(full) / 4
    got = parse_vllm_metrics(text)
    assert got["num_running"] == 7 and got["ttft_seconds_count"] == 1 and got["ttft_seconds_sum"] == 0.25


async def test_a_server_without_the_restricted_route_gets_the_plain_scrape() -> None:
    """A /metrics that is a plain route (``/metrics/`` redirects): the scrape falls back to it
    once and stays there."""
    import httpx
    from fastapi import FastAPI, Response

    from batchpilot.serving.upstream import Upstream

    app, calls = FastAPI(), []

    @app.get("/metrics")
    def metrics() -> Response:
        calls.append(1)
        return Response("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3.0\n")

    up = Upstream("http://other")
    await up.client.aclose()
    up.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://other")
    try:
        for _ in range(2):
            assert "vllm:num_requests_running 3.0" in await up.metrics_text()
    finally:
        await up.aclose()
    assert len(calls) == 2 and up._restricted_scrape is False
