"""Early refusal (``admission.early_refusal``): a request above ``deadline_max_priority_kept``
whose predicted time to first token exceeds ``early_refusal_slack`` x the TTFT objective is
refused at submit ("no_slack"), from admission's own telemetry (the prefill drain rate measured
from first tokens), in the Admission unit, the simulator env and the gateway's lane."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from batchpilot.config import load_config
from batchpilot.core.admission import REJECT_REASONS, Admission, AdmissionConfig
from batchpilot.core.engine import Request
from batchpilot.core.knobs import Knobs
from batchpilot.envs.serving_env import ServingEnv

RATE = 10_000.0  # tokens/s: 1000-token prompts reaching their first token 0.1 s after admission


def _adm(**cfg) -> Admission:
    a = Admission(AdmissionConfig(early_refusal=True, **cfg), Knobs(batch_cap=1))
    a.use_slo(1000.0)
    return a


def _warm(a: Admission, n: int, t0: float = 0.0, gap_s: float = 1.0) -> float:
    """``n`` drain samples: a 1000-token prompt alone, first token 0.1 s after admission, then
    idle for ``gap_s``. Returns the time after the last."""
    t = t0
    for i in range(n):
        rej, took = a.submit_or_admit(Request(f"w{t0}-{i}", t, 1000, 10), t)
        assert rej is None and took
        a.on_first_token(f"w{t0}-{i}", t + 0.1)
        a.on_finished(f"w{t0}-{i}", 10)
        t += 0.1 + gap_s
    return t


def _backlog(a: Admission, t: float, n_queued: int) -> None:
    """One core request in flight without its first token, ``n_queued`` core ones queued
    behind it (1000 prompt tokens each)."""
    assert a.submit_or_admit(Request("busy", t, 1000, 10), t) == (None, True)
    for i in range(n_queued):
        assert a.submit(Request(f"q{i}", t, 1000, 10), t) is None


def test_nothing_is_refused_early_before_the_drain_rate_is_measured() -> None:
    a = _adm()
    t = _warm(a, 7)
    assert a.drain_rate is None and a.predicted_first_token_s(1000, t, t) is None
    _backlog(a, t, 20)  # 2.1 s of prefill ahead at the true rate: far past the 1 s objective
    assert a.submit(Request("low0", t, 1000, 10, priority=1), t) is None  # not measured: it waits
    a.on_first_token("busy", t + 0.1)  # the eighth sample
    assert a.drain_rate == pytest.approx(RATE)
    rej = a.submit(Request("low1", t + 0.1, 1000, 10, priority=1), t + 0.1)
    assert rej is not None and rej.reason == "no_slack" and rej.request_id == "low1"
    assert a.num_rejected_by_reason == {"no_slack": 1} and a.is_waiting("low0") and not a.is_waiting("low1")
    a.check_counts()


def test_idle_time_between_requests_does_not_lower_the_rate() -> None:
    """Samples an hour apart measure the same rate as back to back: only backlog time counts."""
    for gap in (0.0, 3600.0):
        a = _adm()
        _warm(a, 8, gap_s=gap)
        assert a.drain_rate == pytest.approx(RATE)


def test_a_queue_held_by_a_full_batch_cap_counts_as_backlog_time() -> None:
    """Requests waiting here while the cap is full of decodes (no prefill in flight) drain no
    faster than slots free: that time counts, so the rate shows the queue's real pace."""
    a = _adm()
    t = _warm(a, 8)
    assert a.submit_or_admit(Request("decoding", t, 1000, 10), t) == (None, True)
    a.on_first_token("decoding", t + 0.1)  # prefills at the usual pace, then decodes for 5 s
    assert a.submit(Request("queued", t + 0.2, 1000, 10), t + 0.2) is None
    a.on_finished("decoding", 10)
    assert [r.request_id for r in a.admit(t + 5.2)] == ["queued"]
    a.on_first_token("queued", t + 5.3)  # 5.1 s after it began to wait
    assert a.drain_rate == pytest.approx(10 * 1000 / (9 * 0.1 + 5.1))
    a.check_counts()


def test_the_prediction_counts_the_queue_the_prefill_in_flight_its_prompt_and_its_wait() -> None:
    a = _adm()
    t = _warm(a, 8)
    _backlog(a, t, 5)
    # 5000 queued + 1000 in flight + 2000 own = 0.8 s; arrived 0.15 s before it is submitted
    assert a.predicted_first_token_s(2000, t - 0.15, t) == pytest.approx(0.95)
    assert a.submit(Request("fits", t - 0.15, 2000, 10, priority=1), t) is None  # 0.95 s < 1 s
    # now 7000 queued: 0.7 + 0.1 + 0.2 = 1.0 s, plus 0.15 s waited: 1.15 s
    rej = a.submit(Request("late", t - 0.15, 2000, 10, priority=1), t)
    assert rej is not None and rej.reason == "no_slack"
    a.check_counts()


def test_requests_gone_late_leave_the_queue_the_prediction_counts() -> None:
    """A queued request past its objective ranks after on-time ones (``on_time_first``): it is
    not ahead of a new arrival, so it no longer counts."""
    a = _adm()
    t = _warm(a, 8)
    _backlog(a, t, 12)  # 1.2 s queued on time
    assert a.waiting_on_time_tokens == 12_000
    a.admit(t + 1.5)  # nothing admitted (cap 1), but all twelve are marked late
    assert a.num_late_waiting == 12 and a.waiting_on_time_tokens == 0
    assert a.submit(Request("low", t + 1.5, 1000, 10, priority=1), t + 1.5) is None  # 0.2 s predicted
    a.check_counts()


def test_core_priority_is_never_refused_early_unless_configured() -> None:
    a = _adm()
    t = _warm(a, 8)
    _backlog(a, t, 30)
    assert a.submit(Request("core", t, 1000, 10, priority=0), t) is None
    assert a.submit(Request("low", t, 1000, 10, priority=1), t).reason == "no_slack"
    every = _adm(deadline_max_priority_kept=-1)
    t = _warm(every, 8)
    every.cfg.early_refusal = False  # the backlog is core too: let it queue
    _backlog(every, t, 30)
    every.cfg.early_refusal = True
    assert every.submit(Request("core", t, 1000, 10, priority=0), t).reason == "no_slack"
    every.check_counts()


@pytest.mark.parametrize("slack, refused", [(0.5, True), (1.0, True), (1.5, False), (3.0, False)])
def test_the_slack_factor_moves_the_threshold(slack: float, refused: bool) -> None:
    a = _adm(early_refusal_slack=slack)
    t = _warm(a, 8)
    _backlog(a, t, 10)  # 1.0 queued + 0.1 in flight + 0.1 own = 1.2 s predicted
    rej = a.submit(Request("low", t, 1000, 10, priority=1), t)
    assert (rej is not None and rej.reason == "no_slack") == refused


def test_off_or_without_an_objective_nothing_is_refused_early() -> None:
    for a in (Admission(AdmissionConfig(), Knobs(batch_cap=1)), _adm()):
        if not a.cfg.early_refusal:
            a.use_slo(1000.0)
        else:
            a.use_slo(None)
        t = _warm(a, 8)
        _backlog(a, t, 50)
        assert a.submit(Request("low", t, 1000, 10, priority=1), t) is None


def test_the_measured_first_token_time_is_a_floor_for_the_engine_part() -> None:
    """With ``first_token_margin`` admission measures admission-to-first-token; the prediction's
    engine part is at least that (here 0.9 s, where the rate alone says 0.2 s)."""
    a = _adm(first_token_margin=True, first_token_margin_rate=1.0)
    t = _warm(a, 8)
    assert a.submit_or_admit(Request("slow", t, 1000, 10), t) == (None, True)
    a.on_first_token("slow", t + 0.9)  # one slow first token: the rate barely moves, first_token_s = 0.9
    assert a.first_token_s == pytest.approx(0.9)
    t += 1.0
    assert 1000 / a.drain_rate < 0.5 and a.predicted_first_token_s(1000, t, t) == pytest.approx(0.9)


def test_validation_names_the_field() -> None:
    for kw, field in [(dict(early_refusal_slack=0.0), "early_refusal_slack"),
                      (dict(early_refusal_slack=float("inf")), "early_refusal_slack"),
                      (dict(early_refusal_min_samples=0), "early_refusal_min_samples"),
                      (dict(early_refusal_window=4, early_refusal_min_samples=8), "early_refusal_window")]:
        with pytest.raises(ValueError, match=f"admission.{field}"):
            AdmissionConfig(**kw)
    assert "no_slack" in REJECT_REASONS and "deadline" in REJECT_REASONS


@pytest.mark.parametrize("seed", range(6))
def test_counts_balance_and_the_fast_path_agrees_under_early_refusal(seed: int) -> None:
    """Random arrivals, first tokens and finishes: the books balance after every call and
    ``submit_or_admit`` refuses exactly what ``submit`` does."""
    rng = random.Random(seed)
    cfg = dict(on_time_first=rng.random() < 0.7, early_refusal_min_samples=4, early_refusal_window=16,
               early_refusal_slack=rng.choice([0.5, 1.0, 2.0]))
    plain, fast = (Admission(AdmissionConfig(early_refusal=True, **cfg), Knobs(4)) for _ in range(2))
    for a in (plain, fast):
        a.use_slo(500.0)
        a.use_token_budget(2048)
    now, refused = 0.0, 0
    for n in range(600):
        now += rng.expovariate(20.0)
        op = rng.random()
        if op < 0.5:
            r = Request(f"r{n}", now - rng.choice([0.0, 0.0, 0.2]), rng.choice([50, 500, 1500, 4000]), 10,
                        priority=rng.choice([0, 1, 2]))
            rej_p, rej_f = plain.submit(r, now), fast.submit_or_admit(r, now)[0]
            assert (rej_p is None) == (rej_f is None) and (rej_p is None or rej_p.reason == rej_f.reason)
            refused += rej_p is not None and rej_p.reason == "no_slack"
            for a in (plain, fast):
                a.admit(now)
        elif op < 0.8 and plain._awaiting_first:
            for rid in sorted(plain._awaiting_first)[: rng.choice([1, 3])]:
                plain.on_first_token(rid, now)
                fast.on_first_token(rid, now)
        elif plain._in_flight:
            rid = rng.choice(sorted(plain._in_flight))
            for a in (plain, fast):
                a.on_finished(rid, 10)
                a.admit(now)
        for a in (plain, fast):
            a.check_counts()
        assert (plain.num_waiting, plain.num_in_flight, plain.waiting_on_time_tokens, plain.drain_rate) == (
            fast.num_waiting, fast.num_in_flight, fast.waiting_on_time_tokens, fast.drain_rate)
    assert refused > 0, "the sequence never ran out of slack: it exercises too little"


def test_the_env_refuses_no_slack_only_with_early_refusal_on() -> None:
    """An overloaded simulated episode (Llama-3-8B/H100, Poisson at ~5x capacity, half the
    requests above core priority): "no_slack" appears only with the flag, never for core
    requests, and the env's metrics count the refusals."""
    rejected = {}
    for on in (False, True):
        env = ServingEnv(cfg=load_config(["env.episode_s=15", "workload.duration_s=15", "workload=poisson",
                                          "workload.rate=150", "workload.priorities=[0.5,0.5]",
                                          f"env.admission.early_refusal={str(on).lower()}"]))
        env.reset(seed=0)
        done = False
        while not done:
            *_, term, trunc, _ = env.step(env.action_space.nvec // 2)
            done = term or trunc
        adm = env.admission
        adm.check_counts()
        rejected[on] = dict(adm.num_rejected_by_reason)
        no_slack = [r for r in env._rejections if getattr(r, "reason", None) == "no_slack"]
        assert all(r.request.priority > 0 for r in no_slack)
        assert len(no_slack) == adm.num_rejected_by_reason["no_slack"]  # each one reached the env's books
        assert env.episode_metrics()["rejected"] == len(env._rejections) >= adm.num_rejected
        env.close()
    assert "no_slack" not in rejected[False]
    assert rejected[True].get("no_slack", 0) > 100, rejected


def test_the_gateway_answers_no_slack_with_429_and_retry_after() -> None:
    """At the gateway's lane: once the drain rate is measured, a request above core priority
    arriving behind more prefill than its objective allows is refused at once (429 "no_slack",
    Retry-After, counted); a core request waits."""
    from test_control_parity import _gateway

    from batchpilot.serving.errors import Refused

    gw, _ = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    adm = lane.admission
    adm.cfg.early_refusal = True
    assert adm.ttft_s == gw.settings.slo.ttft_ms / 1000.0
    lane.set_knobs(lane.knobs.with_(batch_cap=1))
    _warm(adm, 8, t0=time.monotonic() - 100.0)
    queued = int(adm.ttft_s * RATE / 1000) + 2  # more queued prefill than the objective drains

    async def go() -> tuple:
        now = time.monotonic()
        tasks = [asyncio.create_task(lane.acquire(Request(f"c{i}", now, 1000, 10, priority=0), now + 60))
                 for i in range(queued + 1)]
        await asyncio.sleep(0)
        low = asyncio.create_task(lane.acquire(Request("low", now, 1000, 10, priority=1), now + 60))
        core = asyncio.create_task(lane.acquire(Request("core", now, 1000, 10, priority=0), now + 60))
        await asyncio.sleep(0)
        out = (low.exception() if low.done() else "waiting", core.exception() if core.done() else "waiting")
        for t in [*tasks, core]:
            t.cancel()
        return out

    low, core = asyncio.run(go())
    assert core == "waiting"
    assert isinstance(low, Refused) and low.reason == "no_slack" and low.status == 429 and low.retry_after
    assert gw.metrics.rejected.labels("no_slack")._value.get() == 1


@pytest.mark.parametrize("bucketing", ["fifo", "shortest_first", "weighted"])
def test_while_the_queue_runs_newest_first_only_what_goes_before_counts(bucketing: str) -> None:
    """Overloaded (a request was just refused for lack of time), the on-time queue runs newest
    first: a new request is served before the on-time ones of its own bucket, so they are not
    ahead of it. Counting them (as FIFO order would) refused requests that would be served
    next. Under ``shortest_first`` the shorter buckets still go first; ``weighted`` interleaves
    the buckets, so the whole queue counts there."""
    a = _adm(newest_first_when_late=True, boundaries=(512, 8192))
    a.set_knobs(Knobs(batch_cap=1, bucketing=bucketing))
    t = _warm(a, 8)
    _backlog(a, t, 20)  # 20 x 1000 tokens queued on time, 2.0 s at the rate: past the 1 s objective
    short = [a.submit(Request(f"s{i}", t, 100, 10), t) for i in range(30)]  # 3,000 tokens, a shorter bucket
    assert short == [None] * 30 and a.bucket_of(100) < a.bucket_of(1000)
    fifo_ahead = a.predicted_first_token_s(1000, t, t)
    assert fifo_ahead == pytest.approx((23_000 + 1000 + 1000) / RATE)  # not overloaded yet: all of it
    rej = a.submit(Request("low0", t, 1000, 10, priority=1), t)
    assert rej is not None and rej.reason == "no_slack"  # and now the queue runs newest first
    predicted = a.predicted_first_token_s(1000, t, t)
    ahead = {"fifo": 0, "shortest_first": 3_000, "weighted": 23_000}[bucketing]
    assert predicted == pytest.approx((ahead + 1000 + 1000) / RATE)
    rej = a.submit(Request("low1", t, 1000, 10, priority=1), t)
    assert (rej is None) == (bucketing != "weighted")  # served next: kept (FIFO order refused it)
    a.check_counts()
    # Once the objective has passed with nothing late and no refusal, FIFO order is back.
    later = t + 1.01
    a._refused_late_at = -1.0  # noqa: SLF001 (nothing refused since; the lateness check runs in admit)
    assert a.predicted_first_token_s(1000, later, later) == pytest.approx(
        (a.waiting_on_time_tokens + 2000) / RATE)


@pytest.mark.parametrize("counted", [True, False])
def test_non_streamed_requests_feed_the_drain_rate_when_they_finish(counted: bool) -> None:
    """Half the traffic not streamed (its first token unseen): each finished one's prompt counts
    in the drain rate at its finish (``on_finished(..., now)``), so the rate is the engine's.
    Left out (no ``now``), the time their prefill took counts as backlog with nothing drained in
    it, and the rate reads half the engine's: early refusal would refuse what it could serve."""
    a = _adm()
    n = 40
    for i in range(n):  # a backlog of 1000-token prompts, every other one not streamed
        assert a.submit(Request(f"r{i}", 0.0, 1000, 1, priority=1, reports_first_token=i % 2 == 0), 0.0) is None
    t = 0.0
    while a.num_waiting:
        (req,) = a.admit(t)  # cap 1: one at a time, its first token (and end) 0.1 s later
        t += 0.1
        if req.reports_first_token:
            a.on_first_token(req.request_id, t)
            a.on_finished(req.request_id, 1)
        else:
            a.on_finished(req.request_id, 1, t if counted else None)
        a.check_counts()
    assert a.drain_rate == pytest.approx(RATE if counted else RATE / 2, rel=0.05)
