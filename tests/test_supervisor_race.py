"""Restarts asked for twice while another lane's restart holds the lock: one restart, not two.

``Supervisor.restart`` used to check ``upstream.restarting`` before taking the lock; that flag is
only set once the lock is held, so two calls for a lane whose restart waits behind another
lane's (the health loop and the quality path, say) both passed the check and queued two
restarts. Now the lane is claimed (``_pending``) before any await. This test fails on the old
code (two restarts of lane 1) and passes on the new (one)."""

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


class Engine:
    """A managed process that never dies."""

    proc = None

    def alive(self) -> bool:
        return True

    def stopped(self) -> bool:
        return False


class SlowUpstream:
    """An upstream whose restart waits for ``gate`` and counts itself."""

    stalled = False  # Upstream's flags the supervisor reads and sets
    planned_restart = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.url = f"http://{name}"
        self.healthy = True
        self.restarting = False
        self.managed = Engine()
        self.info = None
        self.num_restarts = 0
        self.gate = asyncio.Event()

    async def restart(self, timeout_s: float, kv_dtype: str | None = None) -> float:
        self.num_restarts += 1
        await self.gate.wait()
        return 0.0


async def test_two_restarts_of_a_lane_queued_behind_another_lanes_restart_run_once() -> None:
    serve = ServeConfig.from_cfg({"managed": True, "warmup": {"prompts": []}})
    metrics = GatewayMetrics()
    ups = [SlowUpstream("vllm0"), SlowUpstream("vllm1")]
    lanes = [Lane.build(i, up, AdmissionConfig(), Knobs(batch_cap=4), Telemetry(SLO()), metrics, 1)  # type: ignore[arg-type]
             for i, up in enumerate(ups)]
    sup = Supervisor(serve, lanes, metrics)
    other = asyncio.create_task(sup.restart(lanes[0], cause="crash", drain=False))
    await asyncio.sleep(0)
    assert ups[0].restarting and ups[0].num_restarts == 1  # lane 0 holds the lock
    # Lane 1 is asked twice (the health loop and the quality path): both wait for the lock.
    first = asyncio.create_task(sup.restart(lanes[1], cause="unresponsive", drain=False))
    second = asyncio.create_task(sup.restart(lanes[1], cause="quality", kv_dtype="auto", drain=False))
    await asyncio.sleep(0)
    assert not ups[1].restarting  # neither holds the lock yet: the flag cannot tell them apart
    for up in ups:
        up.gate.set()
    results = await asyncio.wait_for(asyncio.gather(other, first, second), timeout=5)
    assert ups[1].num_restarts == 1, f"lane 1 restarted {ups[1].num_restarts} times"
    assert results == [True, True, False]  # the second call found the lane claimed
    assert ups[0].num_restarts == 1 and not ups[1].restarting
