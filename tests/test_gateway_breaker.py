"""The circuit breaker's levels on a live gateway: with a TPOT objective no engine can meet, the
breaker shrinks the cap (level 1) down to the minimum and sheds queued low-priority load at every
decision (level 2), while core requests (priority 0) are all served. It never restarts the
engine for it: a restart cannot make a slow engine fast (level 3, a restart, is for an engine
that keeps failing — out of memory, preemption storms — tests/test_control_loop.py)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from gateway_helpers import TRUSTED, RunningGateway, one_request, running_gateway

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def gw(request: pytest.FixtureRequest) -> RunningGateway:
    # TPOT <= 0.01 ms: every finished request breaches it, an "engine" breach (the batch's
    # fault, not queueing), which walks the breaker down to the minimum cap and shedding. A
    # small starting cap and a short cooldown get there in seconds.
    with running_gateway("slo.tpot_ms=0.01", "control.initial_batch_cap=4", "control.interval_s=0.5",
                         "shield.breaker_cooldown_s=0.5", "serve.request_timeout_s=300", request=request) as g:
        yield g


def _headers(prio: int) -> dict[str, str]:
    """Core priority needs a trusted key (an untrusted client could opt out of shedding)."""
    return {"x-priority": str(prio), **(TRUSTED if prio == 0 else {})}


async def _rounds(url: str, per_round: int = 20, min_rounds: int = 3, deadline_s: float = 420.0) -> list[tuple[int, object]]:
    """Rounds of ``per_round`` simultaneous requests alternating core (x-priority: 0) and low
    priority (1), 64 tokens each: at the minimum cap of 1 the round queues for at least 19 x 64
    decode steps, whatever the machine's speed, so decisions at breaker level 2 find queued
    low-priority requests to shed. Until a round has seen one shed (and ``min_rounds`` ran)."""
    out: list[tuple[int, object]] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as c:
        t0 = time.monotonic()
        k = 0
        while time.monotonic() - t0 < deadline_s:
            prios = [i % 2 for i in range(per_round)]
            res = await asyncio.gather(*(
                one_request(c, url, {"prompt": f"breaker load {k}-{i}", "max_tokens": 64, "ignore_eos": True},
                            headers=_headers(p), timeout_s=300) for i, p in enumerate(prios)))
            out.extend(zip(prios, res))
            k += 1
            if k >= min_rounds and any(p == 1 and o.status == 429 for p, o in out):
                break
    return out


def test_breaker_shrinks_and_sheds_keeps_core_requests_and_never_restarts_for_latency(gw: RunningGateway) -> None:
    results = asyncio.run(_rounds(gw.url))
    with open(gw.log_path) as f:
        log = f.read()
    core = [o for p, o in results if p == 0]
    low = [o for p, o in results if p == 1]
    assert core and all(o.status == 200 for o in core), [(o.status, o.reason) for o in core if o.status != 200]
    shed = [o for o in low if o.status == 429]
    assert shed and all(o.reason == "shed_low_priority" and o.retry_after for o in shed), [(o.status, o.reason) for o in low]
    assert all(o.status in (200, 429) for o in low), [(o.status, o.reason) for o in low]
    assert "breaker level 2 on vllm0: shed" in log, log[-3000:]
    assert "breaker level 3" not in log and not gw.metric("batchpilot:upstream_restarts_total", cause="breaker")
    assert gw.metric("batchpilot:shield_interventions_total", kind="breaker_shrink") >= 1
    assert gw.metric("batchpilot:shield_interventions_total", kind="breaker_shed") >= 1
    assert gw.metric("batchpilot:requests_rejected_total", reason="shed_low_priority") == len(shed)
    # The upstream serves on.
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "after", "max_tokens": 2},
                   headers=_headers(0), timeout=120)
    assert r.status_code == 200, r.text
