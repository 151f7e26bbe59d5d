"""The gateway's control loop without vLLM (a fake upstream ``/metrics``): telemetry loss fails
safe. A failed scrape used to read as 0 % KV use and let the cap grow (measured 197 -> 373);
now an interval without the engine's counters never raises the cap, and after
``stale_limit`` of them in a row the cap heads for ``safe_batch_cap`` with one alert."""

from __future__ import annotations

import asyncio

from test_control_parity import _gateway, _metrics_text, recorded_trace

from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.serving.upstream import UpstreamDown


class Grow:
    """Always asks for twice the cap (the shield allows +30 % a step)."""

    name = "grow"

    def reset(self, knobs: Knobs) -> None:
        pass

    def decide(self, snapshot: object, knobs: Knobs) -> Proposal:
        return Proposal(batch_cap=knobs.batch_cap * 2)


def test_stale_telemetry_never_raises_the_cap_and_falls_back_to_the_safe_cap() -> None:
    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    loop._controller = lambda _lane: (Grow(), "pid")  # type: ignore[method-assign]
    lane.set_knobs(lane.knobs.with_(batch_cap=16))  # well under what this KV pool allows (~50)
    text = _metrics_text(recorded_trace()[0])
    answers: list[str | None] = [text] * 2 + [None] * 6 + [text] * 2

    async def metrics(timeout_s: float = 2.0) -> str:
        a = answers.pop(0)
        if a is None:
            raise UpstreamDown("upstream vllm0 /metrics: ReadTimeout")
        return a

    lane.upstream.metrics_text = metrics  # type: ignore[method-assign]
    caps, now, kinds = [lane.knobs.batch_cap], 1000.0, []
    alerts0 = gw.metrics.alerts._value.get()
    for _ in range(10):
        now += 1.0
        asyncio.run(loop.tick(lane, now=now))
        caps.append(lane.knobs.batch_cap)
        kinds.append(set(ctl.last_decision["interventions"]))
    assert caps[1] > caps[0] and caps[2] > caps[1]  # counters in: the controller may grow it
    stale = caps[2:9]  # six intervals without counters
    assert all(b <= a for a, b in zip(stale, stale[1:])), caps  # never up
    assert stale[1] == stale[0] and stale[2] == stale[0]  # the first two: held
    assert stale[-1] < stale[0] and stale[-1] >= gw.cfg.control.safe_batch_cap, caps  # then down, within steps
    assert all(a - b <= ctl.shield.max_step(a) for a, b in zip(stale, stale[1:]))
    assert gw.metrics.alerts._value.get() == alerts0 + 1  # one alert on entering the fallback
    assert any("telemetry from vllm0 lost" in e for e in loop.events)
    assert all("stale_telemetry" in k for k in kinds[2:8]) and not any("stale_telemetry" in k for k in kinds[8:])
    assert caps[-1] > caps[-2]  # counters back: growth resumes
    assert loop.status()["lanes"]["vllm0"]["stale_telemetry_intervals"] == 0
