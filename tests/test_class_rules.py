"""Hand-written rules for request classes with their own objectives (issue 55: the best
hand-written rule per lever), in ``core/admission.py`` so the simulator and the gateway share
them: earliest deadline first across classes (``class_deadline_order``), early refusal counting
only what that order serves first, and the breaker shedding the least important class present
first (``shed_least_important_first``). Each decides as designed on a hand-built queue, and with
one class (one TTFT objective for every request) nothing changes."""

from __future__ import annotations

import random

import pytest
from admission_helpers import warm_drain

from batchpilot.config import load_config
from batchpilot.core.admission import Admission, AdmissionConfig
from batchpilot.core.engine import Request
from batchpilot.core.knobs import BUCKETING_MODES, Knobs
from batchpilot.core.telemetry import SLO
from batchpilot.envs.serving_env import ServingEnv
from batchpilot.policies.controllers import build_controller

#: Class 2 (batch) has 10 s to its first token; every other priority the base 1 s.
TWO = SLO(ttft_ms=1000.0, tpot_ms=100.0, classes={2: {"ttft_ms": 10_000}})
OFF = {"class_deadline_order": False, "shed_least_important_first": False}


def make(mode: str = "shortest_first", cap: int = 1, slo: SLO | float = TWO, **cfg) -> Admission:
    a = Admission(AdmissionConfig(prefill_backlog_budgets=None, **cfg), Knobs(cap, mode))
    a.use_slo(slo)
    return a


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def _next_after(a: Admission, running: str, now: float) -> list[str]:
    """Finish ``running`` (it holds the only slot) and return what ``admit`` takes at ``now``."""
    a.on_finished(running)
    return ids(a.admit(now))


# --- earliest deadline first across classes ---------------------------------------------------------
@pytest.mark.parametrize("mode", BUCKETING_MODES)
def test_a_batch_request_near_its_deadline_overtakes_a_fresh_interactive_one(mode: str) -> None:
    """Batch "b" (3000 tokens, medium bucket) waited 9.6 of its 10 s; interactive "i" (400
    tokens, short bucket) arrived 0.1 s ago with 1 s: b's deadline (10.0) comes before i's
    (10.5). Without the rule shortest_first serves i; fifo (the older head) and weighted (the
    short bucket spent its turn on "run") serve b either way."""
    expected_off = {"fifo": "b", "shortest_first": "i", "weighted": "b"}[mode]
    for on, first in ((True, "b"), (False, expected_off)):
        a = make(mode, **({} if on else OFF))
        assert a.submit_or_admit(Request("run", 0.0, 100, 10), 0.0) == (None, True)
        assert a.submit(Request("b", 0.0, 3000, 10, priority=2), 0.0) is None
        assert a.submit(Request("i", 9.5, 400, 10, priority=1), 9.5) is None
        assert _next_after(a, "run", 9.6) == [first], (mode, on)
        a.check_counts()


def test_interactive_goes_first_while_the_batch_request_has_more_time_left() -> None:
    """Under fifo the older batch head would go first; by deadline the interactive one does."""
    a = make("fifo")
    assert a.submit_or_admit(Request("run", 0.0, 100, 10), 0.0) == (None, True)
    assert a.submit(Request("b", 0.0, 3000, 10, priority=2), 0.0) is None
    assert a.submit(Request("i", 0.5, 400, 10, priority=1), 0.5) is None
    assert _next_after(a, "run", 0.6) == ["i"]
    assert _next_after(a, "i", 0.7) == ["b"]
    a.check_counts()


def test_the_bucketing_mode_still_orders_within_the_earliest_class() -> None:
    """Two interactive heads (short and medium bucket) and a batch one: the class goes by
    deadline (interactive), then shortest_first picks the short bucket, not the older medium."""
    a = make("shortest_first")
    assert a.submit_or_admit(Request("run", 0.0, 100, 10), 0.0) == (None, True)
    assert a.submit(Request("b", 0.0, 5000, 10, priority=2), 0.0) is None
    assert a.submit(Request("i_med", 0.1, 2000, 10, priority=1), 0.1) is None
    assert a.submit(Request("i_short", 0.4, 300, 10, priority=1), 0.4) is None
    assert _next_after(a, "run", 0.5) == ["i_short"]
    assert _next_after(a, "i_short", 0.6) == ["i_med"]
    assert _next_after(a, "i_med", 0.7) == ["b"]


def test_overloaded_the_oldest_batch_request_goes_when_its_deadline_comes_first() -> None:
    """A late interactive request puts the queue newest first; the interactive pick is then the
    newest ("i", due 10.9), and of the batch class the oldest on time ("b_old", due 10.5) goes
    before it, not the newest batch request ("b_new", due 19)."""
    for on, first in ((True, "b_old"), (False, "i")):
        a = make("shortest_first", **({} if on else OFF))
        assert a.submit_or_admit(Request("run", 0.0, 100, 10), 0.0) == (None, True)
        assert a.submit(Request("i_late", 0.0, 400, 10, priority=1), 0.0) is None
        assert a.submit(Request("b_old", 0.5, 3000, 10, priority=2), 0.5) is None
        assert a.submit(Request("b_new", 9.0, 3000, 10, priority=2), 9.0) is None
        assert a.submit(Request("i", 9.9, 400, 10, priority=1), 9.9) is None
        assert _next_after(a, "run", 10.0) == [first], on
        assert a.num_late_waiting == 1
        a.check_counts()


def test_late_requests_still_yield_to_on_time_ones_of_any_class() -> None:
    """An interactive request past its 1 s goes after the batch one still on time."""
    a = make("shortest_first")
    assert a.submit_or_admit(Request("run", 0.0, 100, 10), 0.0) == (None, True)
    assert a.submit(Request("i", 0.0, 400, 10, priority=1), 0.0) is None
    assert a.submit(Request("b", 0.0, 3000, 10, priority=2), 0.0) is None
    assert _next_after(a, "run", 2.0) == ["b"]
    assert a.num_late_waiting == 1


# --- early refusal counts what goes before it ----------------------------------------------------


@pytest.mark.parametrize("on", [True, False])
def test_early_refusal_skips_the_batch_prompts_an_interactive_request_overtakes(on: bool) -> None:
    """18k batch tokens queued on time (1.8 s at 10k tokens/s): a new interactive request (1 s)
    overtakes them under the class order and is kept; counting them refused it."""
    a = make("fifo", early_refusal=True, **({} if on else OFF))
    t = warm_drain(a)
    assert a.submit_or_admit(Request("busy", t, 1000, 10), t) == (None, True)
    for k in range(18):
        assert a.submit(Request(f"b{k}", t, 1000, 10, priority=2), t) is None
    rej = a.submit(Request("i", t, 1000, 10, priority=1), t)
    assert (rej is None) is on
    if on:  # a new batch request still counts them (its own class, first come first served) and "i"
        assert a.predicted_first_token_s(1000, t, t, priority=2) == pytest.approx(0.2 + 1.9)
    a.check_counts()


def test_a_new_batch_request_counts_the_interactive_prompts_ahead_of_it() -> None:
    """Interactive prompts queued on time all have earlier deadlines: a batch request waits for
    them, and for the on-time batch prompts before it; nothing counts for the interactive one
    but its own class (the core warm-up prompts are the base class too)."""
    a = make("fifo", early_refusal=True)
    t = warm_drain(a)
    assert a.submit_or_admit(Request("busy", t, 1000, 10), t) == (None, True)
    for k in range(5):
        assert a.submit(Request(f"i{k}", t, 1000, 10, priority=1), t) is None
    for k in range(3):
        assert a.submit(Request(f"b{k}", t, 1000, 10, priority=2), t) is None
    # engine part: (1000 in flight + 1000 own) / 10k = 0.2 s
    assert a.predicted_first_token_s(1000, t, t, priority=2) == pytest.approx(0.2 + 0.8)
    assert a.predicted_first_token_s(1000, t, t, priority=1) == pytest.approx(0.2 + 0.5)


# --- the breaker sheds the least important class first -------------------------------------------
def _queue(a: Admission, now: float, priorities: tuple[int, ...]) -> None:
    assert a.submit_or_admit(Request("run", now, 100, 10), now) == (None, True)
    for k, p in enumerate(priorities):
        assert a.submit(Request(f"p{p}-{k}", now, 100, 10, priority=p), now) is None


def test_shedding_takes_the_least_important_class_present_only() -> None:
    a = make("fifo")
    _queue(a, 0.0, (0, 1, 2, 1, 2))
    assert sorted(r.request_id for r in a.shed(0, 1.0)) == ["p2-2", "p2-4"]
    assert a.num_waiting == 3
    # No batch request waits now, but one came in within the window: interactive is kept.
    assert a.shed(0, 2.0) == []
    # Once no batch request has come for shed_class_window_s, interactive is the least important.
    assert sorted(r.request_id for r in a.shed(0, 61.0)) == ["p1-1", "p1-3"]
    assert a.num_waiting == 1 and a.is_waiting("p0-0")  # core is never shed
    a.check_counts()


def test_the_kept_priority_still_bounds_it_and_persist_keeps_the_class_level() -> None:
    a = make("fifo", slo=SLO(ttft_ms=1000.0, classes={2: {"ttft_ms": 10_000}, 3: {"ttft_ms": 30_000}}))
    _queue(a, 0.0, (1, 2, 3))
    assert ids(r.request for r in a.shed(2, 0.5)) == ["p3-2"]
    assert ids(r.request for r in a.shed(2, 0.6)) == []  # 3 present within the window, 2 kept
    assert a.shed(1, 0.7, persist=True) == []  # kept <= 2: class 3 is the least important
    assert a.submit(Request("new2", 0.8, 100, 10, priority=2), 0.8) is None
    assert a.submit(Request("new3", 0.8, 100, 10, priority=3), 0.8).reason == "shed_low_priority"


@pytest.mark.parametrize("priorities", [(1, 1, 1), (0, 1, 0, 1), (0, 2, 2)])
def test_with_one_class_above_the_kept_one_it_sheds_as_before(priorities: tuple[int, ...]) -> None:
    shed = []
    for cfg in ({}, OFF):
        a = make("fifo", **cfg)
        _queue(a, 0.0, priorities)
        shed.append(sorted(r.request_id for r in a.shed(0, 1.0)))
    assert shed[0] == shed[1] and shed[0]


def test_a_priority_no_class_declares_cannot_turn_the_shedding_off() -> None:
    """A quality-guard replay (priority 1000) or a client tagging itself less important is no
    class of the operator's: it is shed with the least important declared class, and it does
    not leave the batch class standing while it came within the window."""
    a = make("fifo")
    _queue(a, 0.0, (1, 2, 1000, 1))
    assert sorted(r.request_id for r in a.shed(0, 1.0)) == ["p1000-2", "p2-1"]
    assert a.submit(Request("late1000", 1.5, 100, 10, priority=1000), 1.5) is None
    assert a.submit(Request("b", 1.5, 100, 10, priority=2), 1.5) is None
    assert sorted(r.request_id for r in a.shed(0, 2.0)) == ["b", "late1000"]
    assert set(a._last_submit) <= {2}  # only declared classes are remembered: bounded
    a.check_counts()


@pytest.mark.parametrize("slo", [SLO(), 1000.0, SLO(classes={2: {"tpot_ms": 400}})])
def test_without_classes_of_their_own_ttft_every_priority_above_the_kept_one_is_shed(slo: SLO | float) -> None:
    """One TTFT objective for all, priorities 0, 1 and 2 waiting: level 2 sheds 1 and 2, as
    before the rule (the rule orders classes by their objectives; here there is one)."""
    shed = []
    for cfg in ({}, OFF):
        a = make("fifo", slo=slo, **cfg)
        _queue(a, 0.0, (0, 1, 2, 1))
        shed.append(sorted(r.request_id for r in a.shed(0, 1.0)))
    assert shed[0] == shed[1] == ["p1-1", "p1-3", "p2-2"]


def test_a_class_without_a_ttft_objective_goes_after_and_is_not_counted_ahead() -> None:
    """Class 3 has no TTFT objective (no deadline): an older class-3 head does not overtake a
    fresh interactive request, and early refusal does not count its prompts for it."""
    slo = SLO(ttft_ms=1000.0, classes={2: {"ttft_ms": 10_000}, 3: {"ttft_ms": None}})
    a = make("fifo", slo=slo, early_refusal=True)
    t = warm_drain(a)
    assert a.submit_or_admit(Request("busy", t, 1000, 10), t) == (None, True)
    for k in range(18):
        assert a.submit(Request(f"n{k}", t, 1000, 10, priority=3), t) is None
    assert a.submit(Request("i", t + 0.1, 1000, 10, priority=1), t + 0.1) is None  # kept: 18k not ahead
    assert a.predicted_first_token_s(1000, t, t, priority=1) == pytest.approx(0.2 + 0.1)
    assert _next_after(a, "busy", t + 0.2) == ["i"]
    a.check_counts()


def test_a_bad_window_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"admission.shed_class_window_s must be > 0, got 0"):
        AdmissionConfig(shed_class_window_s=0)


# --- one class: nothing changes ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", BUCKETING_MODES)
@pytest.mark.parametrize("slo", [SLO(ttft_ms=800.0), 800.0], ids=["slo", "ms"])
def test_one_class_admits_refuses_and_sheds_exactly_as_without_the_rules(mode: str, slo: SLO | float) -> None:
    """A random mix of core and untagged requests (one objective) through two admissions, the
    rules on and off, each with early refusal and the TTFT deadline: every call answers alike."""
    rng = random.Random(7)
    on, off = (make(mode, cap=4, slo=slo, early_refusal=True, ttft_deadline=True, **cfg) for cfg in ({}, OFF))
    now, running = 0.0, []
    for k in range(600):
        now += rng.expovariate(20.0)
        r = Request(f"r{k}", now, int(rng.lognormvariate(6.5, 1.2)) + 1, 10, priority=rng.choice((0, 1, 1)))
        outs = [a.submit(r, now) for a in (on, off)]
        assert (outs[0] and outs[0].reason) == (outs[1] and outs[1].reason)
        assert ids(x.request for x in on.expire(now)) == ids(x.request for x in off.expire(now))
        if rng.random() < 0.05:
            assert ids(x.request for x in on.shed(0, now)) == ids(x.request for x in off.shed(0, now))
        while running and rng.random() < 0.5:
            rid = running.pop(rng.randrange(len(running)))
            for a in (on, off):
                a.on_first_token(rid, now)
                a.on_finished(rid, 10, now)
        admitted = ids(on.admit(now))
        assert admitted == ids(off.admit(now)), k
        running += admitted
    on.check_counts()
    assert on.num_rejected_by_reason == off.num_rejected_by_reason and on.num_admitted == off.num_admitted


def _episode(overrides: list[str]) -> tuple[dict, list[tuple[str, float]]]:
    cfg = load_config(["workload=bursty", "env.episode_s=20", "workload.duration_s=20",
                       "env.drain_on_truncate=true", "policy=pid", "env=refuse_early", *overrides])
    env = ServingEnv(cfg=cfg)
    ctl = build_controller(env.cfg.policy, env.engine.capabilities().max_num_seqs, slo=env.slo)
    env.reset(seed=0)
    ctl.reset(env.knobs)
    while True:
        _, _, term, trunc, info = env.step_proposal(ctl.decide(env.snapshot, env.knobs))
        if term or trunc:
            break
    return info["episode_metrics"], sorted((r.request_id, r.ttft) for r in env.finished_requests)


def test_a_one_class_episode_is_identical_with_the_rules_on_or_off() -> None:
    """bursty (core and untagged traffic, one objective), PID with early refusal: the same
    metrics and the same first-token times request by request."""
    on = _episode([])
    off = _episode([f"env.admission.{k}={str(v).lower()}" for k, v in OFF.items()])
    assert on[1] and on == off
