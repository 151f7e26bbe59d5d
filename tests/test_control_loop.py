"""The gateway's control loop without vLLM (a fake upstream ``/metrics``): telemetry loss fails
safe. A failed scrape used to read as 0 % KV use and let the cap grow (measured 197 -> 373);
now an interval without the engine's counters never raises the cap, and after
``stale_limit`` of them in a row the cap heads for ``safe_batch_cap`` with one alert."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import numpy as np
from test_control_parity import _gateway, _metrics_text, recorded_trace

from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.core.telemetry import FEATURE_NAMES
from batchpilot.serving.upstream import EngineInfo, UpstreamDown


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
    # The stale rule on its own: with the last counters' running batch the shield would also
    # hold the cap (step_around_running), and the rule would have nothing left to do.
    ctl.shield.cfg.step_around_running = False
    lane.set_knobs(lane.knobs.with_(batch_cap=16))  # well under what this KV pool allows (~50)
    answers: list[bool] = [True] * 2 + [False] * 6 + [True] * 2

    async def metrics(timeout_s: float = 2.0) -> str:
        if not answers.pop(0):
            raise UpstreamDown("upstream vllm0 /metrics: ReadTimeout")
        return _full_engine_text(lane)

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


def _full_engine_text(lane) -> str:
    """/metrics of an engine running as many requests as the cap lets in (a backlog waits), so
    the shield's bound around the running batch never holds the cap by itself."""
    return _metrics_text({**recorded_trace()[0], "num_running": lane.knobs.batch_cap})


def _ticks(loop, lane, n: int, start: float = 2000.0) -> list[int]:
    async def metrics(timeout_s: float = 2.0) -> str:
        return _full_engine_text(lane)

    lane.upstream.metrics_text = metrics
    caps = []
    for i in range(n):
        asyncio.run(loop.tick(lane, now=start + i))
        caps.append(lane.knobs.batch_cap)
    return caps


def test_an_operator_freeze_walks_to_its_target_inside_the_limits() -> None:
    """Admin ``freeze`` with knobs used to set the cap in one jump (8 -> 256) with no memory
    check; now the knobs are a target the shield walks to, 30 % a step."""
    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    start = lane.knobs.batch_cap
    loop.freeze(True, {"batch_cap": 2, "bucketing": "weighted"})
    assert lane.knobs.batch_cap == start  # nothing jumped
    caps = _ticks(loop, lane, 20)
    seq = [start, *caps]
    assert all(a - b <= ctl.shield.max_step(a) for a, b in zip(seq, seq[1:])), seq
    assert caps[-1] == 2 and len(set(caps)) > 3 and lane.knobs.bucketing == "weighted"
    assert gw.metrics.admin_overrides.labels("freeze")._value.get() == 0
    assert loop.status()["target"] == {"batch_cap": 2, "bucketing": "weighted"}


def test_a_forced_freeze_jumps_and_is_logged_counted_and_shown() -> None:
    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    loop.freeze(True, {"batch_cap": 2}, force=True)
    assert lane.knobs.batch_cap == 2
    assert gw.metrics.admin_overrides.labels("freeze")._value.get() == 1
    assert any("freeze" in o for o in loop.status()["overrides"])
    assert any("operator override (force)" in e for e in loop.events)


def test_a_reset_clears_the_breaker_and_controller_memory_and_is_counted() -> None:
    """Back-to-back experiments (the live evaluation) must not start under the last run's
    breaker, PID integral and latency windows; the KV dwell survives a reset."""
    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    _ticks(loop, lane, 2)
    lane.check_error_answer(500, b'{"object":"error","message":"CUDA out of memory"}')
    _ticks(loop, lane, 1, start=2100.0)
    lane.telemetry.on_arrival(2100.5, 100)
    ctl.shield.last_dtype_switch = 2050.0
    ctl.pid.integral, ctl.pid.prev_error = 1.5, -0.4  # what a run leaves behind
    assert ctl.shield.breaker_level == 1 and ctl.last_acting == "pid"
    loop.reset_state()
    assert ctl.shield.breaker_level == 0 and ctl.shield.num_breached_in_row == 0
    assert ctl.shield.last_dtype_switch == 2050.0  # no licence to switch KV again sooner
    assert ctl.last_acting is None and lane.telemetry._arrivals == 0
    assert ctl.pid.integral == 0.0 and ctl.pid.prev_error is None
    assert gw.metrics.admin_overrides.labels("reset")._value.get() == 1
    assert any("reset" in o for o in loop.status()["overrides"])


def test_refused_operator_calls_change_nothing() -> None:
    import pytest

    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    before = lane.knobs
    with pytest.raises(ValueError, match="overwritten by the controller"):
        loop.freeze(False, {"batch_cap": 8})  # not frozen, not forced: a controller would undo it
    with pytest.raises(ValueError, match=r"batch_cap must be in \[1, "):
        loop.freeze(True, {"batch_cap": 100_000}, force=True)
    assert lane.knobs == before and not loop.frozen


def test_an_operator_kv_switch_goes_through_the_shield_unless_forced() -> None:
    """The admin KV switch skipped the dwell time, the memory and gain checks and the quality
    guard; now only ``force`` does, and says so."""
    import pytest

    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    ctl.shield.capabilities.kv_dtypes["fp8"] = None  # as if its operator declared fp8
    with pytest.raises(ValueError, match=r"shield refuses.*does not repay"):
        loop.force_kv_dtype("fp8")  # no demand: nothing repays the restart
    assert gw.metrics.admin_overrides.labels("kv_dtype")._value.get() == 0
    out = loop.force_kv_dtype("fp8", force=True)
    assert out["forced"] and out["upstreams"] == {"vllm0": "recommended (not managed)"}
    assert gw.metrics.admin_overrides.labels("kv_dtype")._value.get() == 1
    ctl.shield.capabilities.kv_dtypes["fp8"] = "no fp8 on this engine"
    with pytest.raises(ValueError, match="cannot run here"):
        loop.force_kv_dtype("fp8", force=True)  # force never makes an impossible dtype possible


def test_an_operator_kv_switch_within_the_dwell_is_refused_unless_forced() -> None:
    """The dwell counts for the operator too: a switch a minute after the last one is refused
    with the shield's reason and changes nothing (knobs, dwell clock, overrides); ``force``
    passes it, counted."""
    import time

    import pytest

    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    ctl.shield.capabilities.kv_dtypes["fp8"] = None  # as if its operator declared fp8
    dwell = ctl.shield.cfg.min_dtype_dwell_s
    last = ctl.shield.last_dtype_switch = time.monotonic() - 60.0  # a switch a minute ago
    with pytest.raises(ValueError, match=rf"shield refuses.*s after the last one \(min {dwell:.0f}s\)"):
        loop.force_kv_dtype("fp8")
    assert lane.knobs.kv_dtype == "auto" and ctl.shield.last_dtype_switch == last
    assert gw.metrics.admin_overrides.labels("kv_dtype")._value.get() == 0
    assert gw.metrics.kv_recommendation.labels(lane.name, "fp8")._value.get() == 0
    out = loop.force_kv_dtype("fp8", force=True)
    assert out["forced"] and gw.metrics.admin_overrides.labels("kv_dtype")._value.get() == 1
    assert ctl.shield.last_dtype_switch > last  # the forced switch starts a new dwell


def test_an_operator_8bit_switch_is_refused_while_the_quality_guard_blocks_it() -> None:
    """The quality guard's 8-bit block holds for the operator too (it used to be skipped), before
    the shield's own checks; ``force`` passes it, counted. 16-bit is never blocked by it."""
    import math

    import pytest

    from batchpilot.schemas.serve import QualityGuardConfig
    from batchpilot.serving.quality_guard import QualityGuard

    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    ctl.shield.capabilities.kv_dtypes["fp8"] = None
    assert ctl.shield.last_dtype_switch == -math.inf  # no dwell in the way
    gw.quality = QualityGuard(QualityGuardConfig(min_samples=5), gw.metrics)
    for _ in range(5):
        gw.quality.record(0.5)  # replays disagree with the 16-bit reference
    assert gw.quality.blocks_8bit
    with pytest.raises(ValueError, match=r"quality guard blocks 8-bit KV \(output-diff rate 100.0%\)"):
        loop.force_kv_dtype("fp8")
    assert lane.knobs.kv_dtype == "auto" and ctl.shield.last_dtype_switch == -math.inf
    assert gw.metrics.admin_overrides.labels("kv_dtype")._value.get() == 0
    assert loop.force_kv_dtype("auto")["upstreams"] == {"vllm0": "already"}  # 16-bit: not the guard's
    out = loop.force_kv_dtype("fp8", force=True)
    assert out["forced"] and out["upstreams"] == {"vllm0": "recommended (not managed)"}
    assert gw.metrics.admin_overrides.labels("kv_dtype")._value.get() == 1


def test_the_gateway_admits_by_memory_per_request() -> None:
    """A burst of long requests used to be admitted up to the cap (64 here); the lane's
    admission now asks its shield, per request, with prompt + max_tokens, and holds the rest.
    One that cannot fit alone is a 400 with the reason; core ones are queued, never shed."""
    from batchpilot.core.engine import Request
    from batchpilot.serving.errors import Refused

    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    shield = loop.lane_ctl[lane.index].shield
    assert lane.admission.memory is shield and lane.knobs.batch_cap == 64

    async def burst() -> tuple[int, list[str]]:
        # Not streamed: the prefill backlog (tested in test_admission.py) does not hold them.
        tasks = [asyncio.ensure_future(lane.acquire(Request(f"L{i}", 0.0, 1500, 500, priority=i % 2,
                                                            reports_first_token=False, max_tokens=500),
                                                    deadline=1e12)) for i in range(64)]
        await asyncio.sleep(0)
        admitted = sum(t.done() and t.exception() is None for t in tasks)
        assert lane.admission.predicted_fraction() <= shield.cfg.memory_ceiling
        reasons = []
        try:
            await lane.acquire(Request("huge", 0.0, 1900, 2000, priority=0, num_seqs=64, max_tokens=2000), deadline=1e12)
        except Refused as exc:
            reasons.append(exc.reason)
            assert exc.status == 400 and "ceiling 80%" in exc.message
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return admitted, reasons

    admitted, reasons = asyncio.run(burst())
    per = shield.request_blocks(1500, 500)
    assert admitted < 64 and shield.fits(admitted * per, admitted, "auto")
    assert not shield.fits((admitted + 1) * per, admitted + 1, "auto")
    assert reasons == ["too_large_for_memory"]
    lane.admission.check_counts()


def test_the_breakers_oom_input_is_what_vllm_reports() -> None:
    """``ShieldInputs.oom`` was never set by anything. Now an upstream error answer naming
    out-of-memory (a 5xx body, or a stream's error event) and a managed engine process that
    exited reach the breaker: the next decision shrinks the cap (level 1), with the cause."""
    from types import SimpleNamespace

    from batchpilot.serving.supervisor import Supervisor

    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    caps = _ticks(loop, lane, 2)
    lane.check_error_answer(500, b'{"error": {"message": "Internal Server Error"}}')  # not an OOM
    lane.check_error_answer(400, b'{"error": {"message": "max_tokens too large"}}')
    # A client's own words in a 4xx answer are not the engine's: vLLM repeats the model name.
    lane.check_error_answer(404, b'{"object":"error","message":"The model `out of memory` does not exist."}')
    lane.check_stream_error(b'data: {"error": {"message": "The model `OOM` does not exist", "code": 404}}\n\n')
    lane.check_stream_error(b'data: {"choices": [{"text": "\\"error\\": out of memory"}]}\n\n')
    assert lane.oom_reports == []
    lane.check_stream_error(b'data: {"error": {"message": "CUDA out of memory", "code": 500}}\n\ndata: [DONE]\n\n')
    assert len(lane.oom_reports) == 1
    lane.oom_reports.clear()
    lane.check_error_answer(500, b'{"object":"error","message":"CUDA out of memory. Tried to allocate 2.00 GiB"}')
    assert len(lane.oom_reports) == 1
    before = lane.knobs.batch_cap
    caps = _ticks(loop, lane, 1, start=2100.0)
    why = ctl.last_decision["interventions"].get("breaker_shrink", "")
    assert "out of memory" in why and "CUDA out of memory" in why, ctl.last_decision
    assert caps[-1] < before and ctl.last_decision["breaker_level"] == 1
    assert gw.metrics.upstream_oom.labels(lane.name, "error_answer")._value.get() == 2  # the stream's too
    assert lane.oom_reports == []

    # The managed engine process exits: one report per death, fed to the next decision.
    sup = Supervisor(gw.cfg, gw.lanes, gw.metrics)
    gw.cfg.auto_restart = False
    lane.upstream.managed = SimpleNamespace(alive=lambda: False, proc=SimpleNamespace(returncode=-9))
    lane.upstream.healthy = True
    asyncio.run(sup.probe(lane))
    asyncio.run(sup.probe(lane))
    assert lane.upstream.healthy is False and len(lane.oom_reports) == 1 and "exited" in lane.oom_reports[0]
    assert gw.metrics.upstream_oom.labels(lane.name, "engine_exit")._value.get() == 1


def test_the_gateway_counts_and_shows_intervals_the_policy_hands_to_pid() -> None:
    """An observation outside the policy's training range: PID decides that interval, and the
    gateway counts it in /metrics and shows it in status."""
    gw, loop = _gateway("policy", {"kind": "pid"})
    lane = gw.lanes[0]
    pol = loop.policies.policy
    assert pol is not None
    pol.obs_low = np.full(len(FEATURE_NAMES), 9.0, dtype=np.float32)  # nothing real falls in here
    pol.obs_high = pol.obs_low.copy()
    before = gw.metrics.policy_fallbacks.labels("out_of_range")._value.get()
    _ticks(loop, lane, 4)
    st = loop.policies.status()["out_of_range"]
    assert st["intervals"] == 4 and st["last_features"]
    assert gw.metrics.policy_fallbacks.labels("out_of_range")._value.get() == before + 4


def test_a_policy_that_fails_hands_the_same_interval_to_the_pid_kept_warm() -> None:
    """The controller chain: while the policy acts, the fallback PID decides every interval too
    (its state is a PID's that acted throughout); when the policy fails (broken weights: non-finite
    outputs), that PID acts in the same interval, and the gateway says why."""
    gw, loop = _gateway("policy", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    twin = copy.deepcopy(ctl.pid)  # a PID fed the same intervals by hand

    async def metrics(timeout_s: float = 2.0) -> str:
        return _full_engine_text(lane)

    lane.upstream.metrics_text = metrics  # type: ignore[method-assign]
    for i in range(3):
        knobs = lane.knobs
        asyncio.run(loop.tick(lane, now=3000.0 + i))
        assert ctl.last_decision["acting"] == "policy"
        twin.decide(ctl.last_snapshot, knobs)
        assert vars(ctl.pid) == vars(twin), i  # integral, last error, output: a PID that acted
    runtime = loop.policies.policy.for_lane(lane.index).runtime
    runtime._w_out = np.full_like(runtime._w_out, np.nan)  # the weights broke
    knobs = lane.knobs
    asyncio.run(loop.tick(lane, now=3003.0))
    twin_proposal = twin.decide(ctl.last_snapshot, knobs)
    assert ctl.last_decision["acting"] == "pid" and ctl.last_decision["proposal"] == str(twin_proposal)
    st = loop.status()
    assert st["acting"] == "pid" and "non-finite" in st["fallback_reason"], st["fallback_reason"]
    assert gw.metrics.policy_fallbacks.labels("bad_output")._value.get() >= 1


def test_the_shield_stage_rules_are_core_code_the_env_runs_too() -> None:
    """``FailSafe`` (stale telemetry, unknown memory) is part of ``core.control.guard``, the step
    ``ServingEnv.step_proposal`` takes: the same proposal through the same shield is held the
    same way, with nothing applied after the shield stage."""
    from batchpilot.core.control import FailSafe, guard
    from batchpilot.envs.serving_env import ServingEnv

    env = ServingEnv(overrides=["model=tiny_llama", "hardware=cpu_tiny", "engine=sim"])
    env.reset(seed=0)
    assert env.fail_safe == FailSafe.from_cfg(_gateway("pid", {"kind": "pid"})[0].cfg.control)
    snap, knobs = env.snapshot, env.knobs
    # Nothing runs yet: without this the shield would hold the cap around the running batch.
    env.shield.cfg = dataclasses.replace(env.shield.cfg, step_around_running=False)
    grow = Proposal(batch_cap=knobs.batch_cap + 4)
    fresh = copy.deepcopy(env.shield)
    assert guard(grow, snap, knobs, copy.deepcopy(fresh), snap.time, fail_safe=env.fail_safe).decision.knobs == \
        knobs.with_(batch_cap=knobs.batch_cap + 4)  # counters in, memory known: the rules do not bind
    held = guard(grow, snap, knobs, copy.deepcopy(fresh), snap.time, fail_safe=env.fail_safe, stale_intervals=1)
    assert held.decision.knobs.batch_cap == knobs.batch_cap and "stale_telemetry" in held.decision.interventions
    down = guard(grow, snap, knobs, copy.deepcopy(fresh), snap.time, fail_safe=env.fail_safe,
                 stale_intervals=env.fail_safe.stale_limit)
    assert down.decision.knobs.batch_cap == max(env.fail_safe.safe_batch_cap,
                                                knobs.batch_cap - fresh.max_step(knobs.batch_cap))
    assert len(down.decision.alerts) == 1 and "lost for" in down.decision.alerts[0]
    _, _, _, _, info = env.step_proposal(grow)  # the env's own step: the same stage, the same answer
    assert env.knobs.batch_cap == knobs.batch_cap + 4 and info["shield"] == {}


def test_an_engine_that_keeps_failing_walks_the_breaker_to_one_restart() -> None:
    """OOM reports at every interval: shrink to the minimum (level 1), shed (level 2), then
    restart the managed upstream once (level 3, ``batchpilot.core.plant.actuate``)."""
    from types import SimpleNamespace

    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    lane.upstream.managed = SimpleNamespace(alive=lambda: True, proc=SimpleNamespace(returncode=None))
    causes: list[str] = []

    async def restart(ln, *, cause: str, kv_dtype: str | None = None, drain: bool = True) -> bool:
        causes.append(cause)
        return True

    gw.supervisor.restart = restart  # type: ignore[method-assign]
    text = _metrics_text(recorded_trace()[0])

    async def metrics(timeout_s: float = 2.0) -> str:
        return text

    lane.upstream.metrics_text = metrics  # type: ignore[method-assign]
    levels = []
    for i in range(80):  # ticks further apart than the breaker's cooldown
        lane.report_oom("error_answer", "answered 500 naming out-of-memory: CUDA out of memory")
        asyncio.run(loop.tick(lane, now=5000.0 + 3.0 * i))
        levels.append(ctl.last_decision["breaker_level"])
        if levels[-1] == 3 and len(levels) > 2 and levels[-2] == 3:
            break
    assert levels[0] == 1 and 2 in levels and levels[-1] == 3, levels
    assert lane.knobs.batch_cap == ctl.shield.cfg.min_batch
    assert causes == ["breaker"]  # once per trip, not at every decision at level 3
    assert any("breaker level 3 on vllm0: restarting it" in e for e in loop.events)


def test_a_queued_request_past_its_ttft_deadline_gets_429_from_the_gateway() -> None:
    """``admission.ttft_deadline`` at the gateway: the lane refuses a queued request above core
    priority once it has waited the TTFT objective (429 "deadline", Retry-After); core stays."""
    from batchpilot.core.engine import Request
    from batchpilot.serving.errors import Refused

    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    lane.admission.cfg.ttft_deadline = True
    lane.admission.use_slo(gw.settings.slo.ttft_ms)
    lane.set_knobs(lane.knobs.with_(batch_cap=1))

    async def go() -> list:
        import time

        now = time.monotonic()
        first = asyncio.create_task(lane.acquire(Request("busy", now, 10, 10, priority=0), now + 60))
        await asyncio.sleep(0)  # it takes the one slot
        late = [Request(f"late{p}", now - 5.0, 10, 10, priority=p) for p in (0, 1)]  # waited 5 s > 1 s
        tasks = [asyncio.create_task(lane.acquire(r, now + 60)) for r in late]
        await asyncio.sleep(0)
        lane.pump()
        await asyncio.sleep(0)
        out = [t.exception() if t.done() else "waiting" for t in tasks]
        for t in tasks + [first]:
            t.cancel()
        return out

    core, low = asyncio.run(go())
    assert core == "waiting"  # core priority is never refused by the deadline
    assert isinstance(low, Refused) and low.reason == "deadline" and low.status == 429 and low.retry_after
    assert gw.metrics.rejected.labels("deadline")._value.get() == 1


def test_the_gateway_serves_a_request_still_on_time_before_one_past_its_ttft() -> None:
    """``admission.on_time_first`` (on by default) at the gateway: when a slot frees, a queued
    request that can still meet its TTFT objective gets it before one that waited past it, and
    the late one is not refused; it runs next."""
    from batchpilot.core.engine import Request

    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    assert lane.admission.cfg.on_time_first and lane.admission.late_after_s == gw.settings.slo.ttft_ms / 1000.0
    lane.set_knobs(lane.knobs.with_(batch_cap=1))

    async def go() -> list[str]:
        import time

        now = time.monotonic()
        busy = Request("busy", now, 10, 10, priority=0)
        first = asyncio.create_task(lane.acquire(busy, now + 60))
        await asyncio.sleep(0)  # it takes the one slot
        late = Request("late", now - 5.0, 10, 10, priority=0)  # waited 5 s > 1 s
        fresh = Request("fresh", now, 10, 10, priority=0)
        tasks = {r.request_id: asyncio.create_task(lane.acquire(r, now + 60)) for r in (late, fresh)}
        await asyncio.sleep(0)
        order = []
        for _ in range(2):
            lane.release(busy.request_id if not order else order[-1])
            await asyncio.sleep(0)
            done = [rid for rid, t in tasks.items() if t.done() and rid not in order]
            assert len(done) == 1 and tasks[done[0]].exception() is None
            order.append(done[0])
        for t in [*tasks.values(), first]:
            t.cancel()
        return order

    assert asyncio.run(go()) == ["fresh", "late"]
    assert gw.metrics.rejected.labels("deadline")._value.get() == 0


def test_a_restart_that_brings_back_another_kv_pool_admits_against_the_new_pool() -> None:
    """The restart's own admission pass (the lane reopens) checked requests against the previous
    pool's model until the next decision rebuilt it: one run admitted 12 requests over the 80 %
    ceiling this way. The lane now rebuilds the model before it admits anything."""
    from types import SimpleNamespace

    from batchpilot.core.engine import Request
    from batchpilot.core.shield import Shield, ShieldConfig
    from batchpilot.serving.control_loop import upstream_engine_model

    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    lane.upstream.managed = SimpleNamespace(alive=lambda: True, proc=SimpleNamespace(returncode=None),
                                            kv_cache_space_gib=1)
    gw.cfg.warmup.prompts = []
    back = asyncio.Event()

    async def restart(timeout_s: float, kv_dtype: str | None = None) -> float:
        await back.wait()  # requests queue meanwhile; it comes back with an eighth of the pool
        lane.upstream.info = EngineInfo(model="m", max_model_len=2048, num_kv_blocks=512, block_size=16,
                                        kv_dtype="auto")
        return 1.0

    lane.upstream.restart = restart  # type: ignore[method-assign]

    async def go() -> int:
        task = gw.supervisor.spawn(gw.supervisor.restart(lane, cause="test", drain=False), "test-restart")
        await asyncio.sleep(0)
        assert lane.upstream.restarting
        waits = [asyncio.ensure_future(lane.acquire(Request(f"r{i}", 0.0, 1000, 1000), deadline=1e12))
                 for i in range(30)]
        await asyncio.sleep(0)
        assert lane.admission.num_in_flight == 0  # nothing admitted while it restarts
        back.set()
        await task
        admitted = lane.admission.num_in_flight
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        return admitted

    admitted = asyncio.run(go())
    # What the admitted requests need, from the new pool itself (not from admission's books).
    mem, caps = upstream_engine_model(lane, gw.cfg.max_num_seqs, managed=True)
    fresh = Shield(ShieldConfig.from_cfg(gw.settings.shield), mem, caps, gw.settings.slo)
    need = fresh.blocks_fraction(admitted * fresh.request_blocks(1000, 1000), admitted, "auto")
    assert 0 < admitted and need <= fresh.cfg.memory_ceiling, (admitted, need)
    assert ctl.shield.memory.num_kv_blocks_total == 512  # rebuilt before the lane reopened
    lane.admission.check_counts()


def test_the_quality_guards_fallback_restart_starts_the_kv_dwell() -> None:
    """The quality guard's fallback restart onto 16-bit did not start the shield's dwell: once an
    operator lifted the block, the controller switched back to 8-bit 179 s later (dwell 600 s).
    Every restart onto another dtype (``LanePlant.restart_onto``) now starts it once it runs."""
    import time
    from types import SimpleNamespace

    from batchpilot.schemas.serve import QualityGuardConfig
    from batchpilot.serving.quality_guard import QualityGuard

    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    lane.upstream.managed = SimpleNamespace(alive=lambda: True, proc=SimpleNamespace(returncode=None))
    gw.cfg.warmup.prompts = []
    ctl.shield.capabilities.kv_dtypes["fp8"] = None  # 8-bit runs here
    lane.set_knobs(lane.knobs.with_(kv_dtype="fp8"))
    restarts: list[str | None] = []

    async def restart(timeout_s: float, kv_dtype: str | None = None) -> float:
        restarts.append(kv_dtype)
        return 1.0

    lane.upstream.restart = restart  # type: ignore[method-assign]
    text = _metrics_text(recorded_trace()[0])

    async def metrics(timeout_s: float = 2.0) -> str:
        return text

    lane.upstream.metrics_text = metrics  # type: ignore[method-assign]
    gw.quality = QualityGuard(QualityGuardConfig(min_samples=5), gw.metrics)
    for _ in range(5):
        gw.quality.record(0.5)  # replays disagree with the 16-bit reference: 8-bit blocked

    class Want8bit:
        name = "pid"

        def reset(self, knobs: Knobs) -> None:
            pass

        def decide(self, snapshot: object, knobs: Knobs) -> Proposal:
            return Proposal(kv_dtype="fp8")

    loop._controller = lambda _lane: (Want8bit(), "pid")  # type: ignore[method-assign]

    async def fallback() -> None:
        await loop.tick(lane, now=time.monotonic())  # the guard's fallback, in the background
        await asyncio.gather(*gw.supervisor._tasks)

    t0 = time.monotonic()
    asyncio.run(fallback())
    assert restarts == ["auto"] and lane.knobs.kv_dtype == "auto"
    assert gw.metrics.upstream_restarts.labels(lane.name, "quality")._value.get() == 1
    assert ctl.shield.last_dtype_switch >= t0  # the fallback started the dwell
    gw.quality.reset()  # the operator lifts the block
    asyncio.run(loop.tick(lane, now=ctl.shield.last_dtype_switch + 179.0))
    assert lane.knobs.kv_dtype == "auto" and restarts == ["auto"]
    assert "dtype_dwell" in ctl.last_decision["interventions"], ctl.last_decision


def test_the_measured_restart_time_replaces_the_configured_one() -> None:
    # Without a model config the shield's restart time is a guess (60 s); once the managed
    # upstream has come up, what it took is what a KV switch costs, for the gain gate and for
    # the shipped KV agent alike.
    from batchpilot.policies.ppo_controller import PRETRAINED_DIR

    gw, loop = _gateway("policy", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    agents = [p.kv_agent for p in loop.policies.lane_policies(lane.index)]
    assert (PRETRAINED_DIR / "kv_agent").is_dir() and agents and all(a is not None for a in agents)
    configured = ctl.shield.cfg.dtype_restart_s
    _ticks(loop, lane, 2)
    assert ctl.shield.cfg.dtype_restart_s == configured
    assert loop.status()["lanes"]["vllm0"]["kv_restart_source"] == "configured"
    lane.upstream.measured_restart_s = 421.5
    _ticks(loop, lane, 1, start=3000.0)
    assert ctl.shield.cfg.dtype_restart_s == 421.5
    assert all(p.kv_agent.restart_s == 421.5 for p in loop.policies.lane_policies(lane.index))
    st = loop.status()["lanes"]["vllm0"]
    assert st["kv_restart_s"] == 421.5 and st["kv_restart_source"] == "measured"


def test_every_decision_is_kept_for_admin_decisions() -> None:
    """What the loop saw and set, one record per tick, so a live run can be compared interval by
    interval with its simulation; ``since`` gives only the newer ones, and the history is bounded."""
    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    caps = _ticks(loop, lane, 5)
    recs = loop.decisions()
    assert [r["tick"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r["batch_cap"] for r in recs] == caps
    assert all(r["lane"] == "vllm0" and r["acting"] == "pid" and r["bucketing"] == lane.knobs.bucketing
               for r in recs)
    assert recs[-1]["tpot_p99_ms"] == loop.lane_ctl[lane.index].last_snapshot.tpot_p99_ms
    assert [r["tick"] for r in loop.decisions(since=3)] == [4, 5] and loop.decisions(since=5) == []
    loop.history = type(loop.history)(loop.history, maxlen=2)
    _ticks(loop, lane, 3, start=3000.0)
    assert [r["tick"] for r in loop.decisions()] == [7, 8]
    # A reading that is not finite is listed as null, so the JSON answer never fails.
    from dataclasses import replace

    from batchpilot.core.shield import Decision
    from batchpilot.serving.control_loop import decision_record

    snap = replace(loop.lane_ctl[lane.index].last_snapshot, request_goodput=float("nan"), ttft_p99_ms=float("inf"))
    rec = decision_record(9, "vllm0", 1.0, "pid", snap, Decision(knobs=Knobs(8, "fifo", "auto")))
    assert rec["goodput"] is None and rec["ttft_p99_ms"] is None and rec["batch_cap"] == 8


def test_kv_start_in_front_of_an_engine_whose_memory_binds_at_16_bits() -> None:
    """The evaluation starts a PPO policy at 8-bit KV where the ceiling binds at 16 bits
    (``kv_start``); the gateway does the same before it serves, and says why when it cannot.
    This pool (4,096 blocks of 16 tokens, 1,024-token context) holds ~51 requests at 16 bits
    of the 256 the cap may reach: memory binds."""
    gw, loop = _gateway("policy", {"kind": "pid"})
    lane = gw.lanes[0]
    shield = loop.lane_ctl[lane.index].shield
    assert shield.max_feasible_batch("auto") < min(shield.max_batch, shield.max_feasible_batch("fp8"))
    # Not managed, 8-bit not declared by its operator: stays 16-bit and says why.
    out = asyncio.run(loop.choose_start_kv_dtype())
    assert out["vllm0"].startswith("16-bit: vllm0 is not managed") and "serve.upstream_kv_dtypes" in out["vllm0"]
    assert any("kv_start: vllm0 stays at 16-bit KV although the memory ceiling holds" in e for e in loop.events)
    assert loop.status()["kv_start"] == out
    # Declared: recommended (an unmanaged engine is never restarted by the gateway).
    shield.capabilities.kv_dtypes["fp8"] = None
    assert asyncio.run(loop.choose_start_kv_dtype()) == {"vllm0": "recommended fp8"}
    assert gw.metrics.kv_recommendation.labels("vllm0", "fp8")._value.get() == 1
    assert lane.knobs.kv_dtype == "auto"
    # Hardware that reads 8-bit KV slower: 8-bit while memory binds at 8 bits too (~99 of 256
    # here); 16-bit where 8-bit would lift the ceiling above the cap, and it says so.
    gw.cfg.kv8_read_cost = 1.1
    assert asyncio.run(loop.choose_start_kv_dtype()) == {"vllm0": "recommended fp8"}
    shield.max_batch = 64
    assert "reads 8-bit KV slower (serve.kv8_read_cost=1.1) and at fp8 memory would not bind" in \
        asyncio.run(loop.choose_start_kv_dtype())["vllm0"]
    shield.max_batch = 256
    gw.cfg.kv8_read_cost = 1.0
    # Not the policy's to choose: an explicit dtype, the option off, PID acting.
    gw.cfg.kv_dtype = "bfloat16"
    assert asyncio.run(loop.choose_start_kv_dtype()) == {}
    gw.cfg.kv_dtype, gw.cfg.control.kv_start = "auto", False
    assert asyncio.run(loop.choose_start_kv_dtype()) == {}
    gw_pid, loop_pid = _gateway("pid", {"kind": "pid"})
    loop_pid.lane_ctl[gw_pid.lanes[0].index].shield.capabilities.kv_dtypes["fp8"] = None
    assert asyncio.run(loop_pid.choose_start_kv_dtype()) == {}


def test_kv_start_keeps_16_bits_where_memory_does_not_bind() -> None:
    gw, loop = _gateway("policy", {"kind": "pid"})
    lane = gw.lanes[0]
    lane.upstream.info = EngineInfo(model="m", max_model_len=2048, num_kv_blocks=65536, block_size=16, kv_dtype="auto")
    loop._check_engine(lane)  # the shield takes the new pool
    shield = loop.lane_ctl[lane.index].shield
    shield.capabilities.kv_dtypes["fp8"] = None
    assert asyncio.run(loop.choose_start_kv_dtype()) == {"vllm0": "16-bit"}
    assert shield.max_feasible_batch("auto") == shield.max_batch
    assert not any("kv_start" in e for e in loop.events)
