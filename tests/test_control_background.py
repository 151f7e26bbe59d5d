"""The gateway's background work without vLLM: warm-up stays within the batch cap, and a
background task that fails (a supervisor task, one the control loop spawns, a quality replay)
is logged with its traceback instead of vanishing with an unretrieved exception; a control tick
that fails is logged and the next one still runs."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import pytest
from test_control_parity import _gateway

from batchpilot.core.admission import AdmissionConfig
from batchpilot.core.knobs import Knobs
from batchpilot.core.telemetry import SLO, Telemetry
from batchpilot.schemas.serve import QualityGuardConfig, ServeConfig
from batchpilot.serving.lanes import Lane
from batchpilot.serving.prom import GatewayMetrics
from batchpilot.serving.quality_guard import QualityGuard, Sample
from batchpilot.serving.supervisor import Supervisor
from batchpilot.serving.upstream import EngineInfo, Upstream

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _lane(batch_cap: int, metrics: GatewayMetrics) -> Lane:
    lane = Lane.build(0, Upstream("http://127.0.0.1:9", name="vllm0"), AdmissionConfig(), Knobs(batch_cap=batch_cap),
                      Telemetry(SLO()), metrics, 1)
    lane.upstream.healthy = True
    lane.upstream.info = EngineInfo(model="m", max_model_len=2048)
    return lane


async def test_warm_up_sends_every_prompt_but_at_most_batch_cap_at_once() -> None:
    """Warm-up prompts went out all at once, past the cap (they bypass admission); now at most
    ``batch_cap`` run together and every prompt is still sent."""
    prompts = [f"frequent prefix {i}" for i in range(7)]
    serve = ServeConfig.from_cfg({"managed": True, "warmup": {"prompts": prompts, "max_tokens": 1}})
    metrics = GatewayMetrics()
    lane = _lane(2, metrics)
    running, most, seen = 0, 0, []

    class Client:
        async def post(self, path: str, json: dict, timeout: float) -> None:
            nonlocal running, most
            running += 1
            most = max(most, running)
            seen.append(json["prompt"])
            await asyncio.sleep(0.01)  # the engine takes a while on each
            running -= 1

    real = lane.upstream.client
    lane.upstream.client = Client()  # type: ignore[assignment]
    await Supervisor(serve, [lane], metrics).warm_up(lane)
    assert sorted(seen) == sorted(prompts) and most == 2
    lane.set_knobs(lane.knobs.with_(batch_cap=1))
    seen.clear()
    most = 0
    await Supervisor(serve, [lane], metrics).warm_up(lane)
    assert len(seen) == 7 and most == 1
    await real.aclose()


async def test_a_failing_supervisor_task_is_logged_and_let_go(caplog: pytest.LogCaptureFixture) -> None:
    serve = ServeConfig.from_cfg({"managed": True, "warmup": {"prompts": []}})
    metrics = GatewayMetrics()
    lane = _lane(4, metrics)
    sup = Supervisor(serve, [lane], metrics)

    async def fails() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("boom in the background")

    async def waits() -> None:
        await asyncio.sleep(3600)

    with caplog.at_level(logging.ERROR, logger="batchpilot.serving.supervisor"):
        bad = sup.spawn(fails(), "test-failing")
        slow = sup.spawn(waits(), "test-cancelled")
        await asyncio.gather(bad, return_exceptions=True)
        slow.cancel()
        await asyncio.gather(slow, return_exceptions=True)
        await asyncio.sleep(0)
    failed = [r for r in caplog.records if "test-failing failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info and "boom in the background" in str(failed[0].exc_info[1])
    assert not any("test-cancelled" in r.getMessage() for r in caplog.records)  # a cancel is no failure
    assert not sup._tasks  # let go once done
    await lane.upstream.aclose()


async def test_a_task_the_control_loop_spawns_is_logged_when_it_fails(caplog: pytest.LogCaptureFixture) -> None:
    """The operator's KV switch on a managed upstream runs in the background (restarts one by
    one): when it fails, the failure is in the log, with its traceback."""
    from types import SimpleNamespace

    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    lane.upstream.managed = SimpleNamespace(alive=lambda: True, proc=None)
    loop.lane_ctl[lane.index].shield.capabilities.kv_dtypes["float16"] = None  # a dtype it can run

    async def restart(ln, *, cause: str, kv_dtype: str | None = None, drain: bool = True) -> bool:
        raise RuntimeError("the restart blew up")

    gw.supervisor.restart = restart  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="batchpilot.serving.supervisor"):
        out = loop.force_kv_dtype("float16", force=True)
        assert out["upstreams"] == {"vllm0": "restarting"}
        await asyncio.gather(*gw.supervisor._tasks, return_exceptions=True)
        await asyncio.sleep(0)
    failed = [r for r in caplog.records if "batchpilot-admin-kv-dtype failed" in r.getMessage()]
    assert len(failed) == 1 and "the restart blew up" in str(failed[0].exc_info[1])


async def test_a_failing_control_tick_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    gw, loop = _gateway("pid", {"kind": "pid"})
    gw.settings.control = dataclasses.replace(gw.settings.control, interval_s=0.01)
    ticks = []

    async def tick(lane, now: float | None = None) -> None:
        ticks.append(time.monotonic())
        if len(ticks) == 1:
            raise RuntimeError("a bad tick")

    loop.tick = tick  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="batchpilot.serving.control_loop"):
        await loop.start()
        deadline = time.monotonic() + 30  # a condition, not a speed: ends at the third tick
        while len(ticks) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await loop.stop()
    assert len(ticks) >= 3  # the loop survived the failure
    failed = [r for r in caplog.records if "control tick failed on vllm0" in r.getMessage()]
    assert len(failed) == 1 and "a bad tick" in str(failed[0].exc_info[1])


async def test_a_quality_replay_that_fails_unexpectedly_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A replay whose answer breaks in a way it does not expect (an empty ``choices`` is an
    IndexError) used to vanish with its task; now it is logged with its traceback, counted as an
    error sample, and its admission slot is freed all the same. Cancelled replays are no failure."""
    metrics = GatewayMetrics()
    lane = _lane(4, metrics)
    guard = QualityGuard(QualityGuardConfig(reference_url="http://127.0.0.1:9"), metrics)

    async def compare(a, b, path, body) -> float:
        assert lane.admission.num_in_flight == 1  # the replay holds a slot while it runs
        return [][0]  # what _output does with {"choices": []}

    guard.compare = compare  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="batchpilot.serving.quality_guard"):
        guard.submit(Sample(lane, {"prompt": "x"}, "/v1/completions", prompt_len=3))
        await asyncio.gather(*guard._tasks, return_exceptions=True)
        await asyncio.sleep(0)
    failed = [r for r in caplog.records if "batchpilot-quality-replay failed" in r.getMessage()]
    assert len(failed) == 1 and isinstance(failed[0].exc_info[1], IndexError)
    assert metrics.quality_samples.labels("error")._value.get() == 1
    assert lane.admission.num_in_flight == 0 and not guard._tasks

    stuck = asyncio.Event()

    async def hangs(a, b, path, body) -> float:
        await stuck.wait()
        return 1.0

    guard.compare = hangs  # type: ignore[method-assign]
    caplog.clear()
    guard.submit(Sample(lane, {"prompt": "x"}, "/v1/completions", prompt_len=3))
    await asyncio.sleep(0.01)
    assert lane.admission.num_in_flight == 1
    await guard.aclose()  # cancels the replay and waits for it
    assert lane.admission.num_in_flight == 0 and not guard._tasks
    assert not any("failed" in r.getMessage() for r in caplog.records)
    await lane.upstream.aclose()
