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
from batchpilot.serving.lanes import Lane
from batchpilot.serving.prom import GatewayMetrics
from batchpilot.serving.settings import ServeConfig
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


class FakeUpstream:
    """An upstream whose probe answers what the test says, and whose restart is recorded."""

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
