"""Request classes with their own objectives (issue 55, step 4): ``slo.classes`` gives a priority
its own TTFT/TPOT/E2E objectives, and whatever judges one request (met or missed in the metrics
and telemetry, admission's TTFT deadline, early refusal and lateness) reads its class's; the
evaluation's summary adds attainment and goodput per class when the workload has several;
``workload=two_class slo=two_class`` is the preset."""

from __future__ import annotations

import math

import numpy as np
import pytest
from admission_helpers import warm_drain

from batchpilot.config import load_config
from batchpilot.core.admission import Admission, AdmissionConfig
from batchpilot.core.engine import FinishedRequest, Request
from batchpilot.core.knobs import Knobs
from batchpilot.core.telemetry import SLO, Telemetry
from batchpilot.envs.serving_env import ServingEnv, slo_from_cfg
from batchpilot.envs.workloads import build_workload
from batchpilot.evaluation.report import class_table, write_rows
from batchpilot.metrics import SUMMARY_KEYS, Offered, class_keys, class_keys_in, summarize
from batchpilot.policies.controllers import build_controller

#: Class 2 (batch) waits up to 10 s for its first token; every other priority keeps the base 1 s.
TWO = SLO(ttft_ms=1000.0, tpot_ms=100.0, classes={2: {"ttft_ms": 10_000}})


# --- the SLO type --------------------------------------------------------------------------------
def test_for_priority_overrides_only_what_the_class_sets() -> None:
    slo = SLO(ttft_ms=800, tpot_ms=100, classes={2: {"ttft_ms": 20_000, "tpot_ms": 400}, 3: {"e2el_ms": None}})
    assert slo.for_priority(2) == SLO(ttft_ms=20_000, tpot_ms=400)
    assert slo.for_priority(1) is slo and slo.for_priority(0) is slo  # no class of its own: the base
    assert slo.for_priority(3) == SLO(ttft_ms=800, tpot_ms=100, e2el_ms=None)
    assert slo.priorities == (2, 3) and SLO().priorities == () and SLO().for_priority(2) == SLO()
    assert SLO.from_mapping({"classes": {"2": {"ttft_ms": 5000}}}).for_priority(2).ttft_ms == 5000.0  # JSON keys
    assert SLO.from_mapping({"classes": None}) == SLO()


@pytest.mark.parametrize("classes, match", [
    ({-1: {"ttft_ms": 5000}}, r"slo.classes: a priority must be an integer >= 0 .* got -1"),
    ({"batch": {"ttft_ms": 5000}}, r"slo.classes: a priority must be an integer >= 0 .* got 'batch'"),
    ({2: {"ttft": 5000}}, r"slo.classes\[2\]: unknown key\(s\) \['ttft'\]; expected ttft_ms"),
    ({2: {"ttft_ms": 0}}, r"slo.classes\[2\].ttft_ms must be a positive number of milliseconds"),
    ({2: {"tpot_ms": -5}}, r"slo.classes\[2\].tpot_ms must be a positive number"),
    ({2: {"ttft_ms": math.inf}}, r"slo.classes\[2\].ttft_ms must be a positive number"),
    ({2: 5000}, r"slo.classes\[2\] must map objective -> ms"),
    ({2: {"ttft_ms": 1}, "2": {"ttft_ms": 2}}, r"priority 2 is given twice"),
])
def test_bad_classes_are_refused_naming_the_key(classes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SLO(classes=classes)
    with pytest.raises(ValueError, match=match):
        slo_from_cfg({"classes": classes})  # through the schema, as a composed config is built


def test_the_preset_composes_and_a_class_can_be_set_on_the_command_line() -> None:
    slo = slo_from_cfg(load_config(["slo=two_class"]).slo)
    assert slo.ttft_ms == 800.0 and slo.for_priority(2).ttft_ms == 20_000.0 and slo.for_priority(2).tpot_ms == 400.0
    moved = slo_from_cfg(load_config(["slo=two_class", "slo.classes.2.ttft_ms=5000"]).slo)
    assert moved.for_priority(2).ttft_ms == 5000.0 and moved.for_priority(2).tpot_ms == 400.0
    added = slo_from_cfg(load_config(["+slo.classes.3={ttft_ms:30000}"]).slo)
    assert added.for_priority(3).ttft_ms == 30_000.0 and added.for_priority(2) is added
    assert slo_from_cfg(load_config([]).slo) == SLO()  # the default: one class


# --- judging one request --------------------------------------------------------------------------
def _done(rid: str, priority: int, ttft_s: float, arrival: float = 0.0) -> FinishedRequest:
    return FinishedRequest(rid, arrival, arrival + ttft_s, arrival + ttft_s + 0.45, 100, 10, priority=priority)  # TPOT 50 ms


def test_metrics_judge_each_request_by_its_class() -> None:
    """A 5 s TTFT meets class 2's 10 s objective and misses the base 1 s of class 1."""
    finished = [_done("a", 1, 5.0), _done("b", 2, 5.0), _done("c", 1, 0.5), _done("d", 2, 12.0)]
    offered = Offered(np.full(6, 100), np.full(6, 10), np.array([1, 1, 1, 2, 2, 2]))
    m = summarize(finished, 20.0, TWO, num_rejected=2, window_s=10.0, offered=offered)
    assert m["slo_attainment"] == pytest.approx(2 / 6)  # c and b
    assert m["slo_attainment_p1"] == pytest.approx(1 / 3) and m["slo_attainment_p2"] == pytest.approx(1 / 3)
    assert m["request_goodput_p1"] == m["request_goodput_p2"] == pytest.approx(0.1)
    assert class_keys_in(m) == class_keys([2, 1]) == (
        "slo_attainment_p1", "request_goodput_p1", "slo_attainment_p2", "request_goodput_p2")
    # Judged by the base alone, b would miss too.
    assert summarize(finished, 20.0, SLO(), num_rejected=2, offered=offered)["slo_attainment"] == pytest.approx(1 / 6)


def test_one_class_keeps_the_summary_keys_unchanged() -> None:
    finished = [_done("a", 1, 0.5)]
    for offered in (Offered(np.full(2, 100), np.full(2, 10)), Offered(np.full(2, 100), np.full(2, 10), np.ones(2, int))):
        assert tuple(summarize(finished, 5.0, TWO, num_rejected=1, offered=offered)) == SUMMARY_KEYS
    with pytest.raises(ValueError, match="offered priority must be 1-D"):
        Offered(np.full(2, 100), np.full(2, 10), np.ones(3, int))


def test_telemetry_judges_a_finished_request_by_its_class() -> None:
    tel = Telemetry(TWO)
    assert tel.on_finished("a", 5.0, 5.0, 0.05, 6.0, priority=2)
    assert not tel.on_finished("b", 5.0, 5.0, 0.05, 6.0, priority=1)
    assert not tel.on_finished("c", 5.0, 5.0, 0.05, 6.0)  # no priority: the base objectives
    snap = tel.snapshot(10.0, queue_depth=(0, 0, 0), num_running=0, num_waiting_engine=0, kv_cache_usage=0.0,
                        knobs=Knobs(8, "fifo"))
    assert snap.slo_attainment == pytest.approx(1 / 3) and snap.request_goodput == pytest.approx(0.1)


# --- admission --------------------------------------------------------------------------------------
def test_the_ttft_deadline_is_each_class_s_own() -> None:
    a = Admission(AdmissionConfig(ttft_deadline=True, prefill_backlog_budgets=None), Knobs(1, "fifo"))
    a.use_slo(TWO)
    assert a.ttft_s_for(1) == 1.0 and a.ttft_s_for(2) == 10.0 and a.deadline_for(0) is None  # core: kept
    assert a.submit(Request("run", 0.0, 100, 10), 0.0) is None
    assert [r.request_id for r in a.admit(0.0)] == ["run"]  # it holds the only slot
    for rid, prio in (("i", 1), ("b", 2), ("core", 0)):
        assert a.submit(Request(rid, 0.0, 100, 10, priority=prio), 0.0) is None
    assert [r.request_id for r in a.expire(1.5)] == ["i"]  # past 1 s; the batch request has 10
    assert a.expire(9.9) == [] and a.is_waiting("b")
    assert [(r.request_id, r.reason) for r in a.expire(10.01)] == [("b", "deadline")]
    assert a.is_waiting("core") and a.expire(100.0) == []
    a.check_counts()
    # One objective in ms still means one class for everyone.
    a.use_slo(1000.0)
    assert a.ttft_s_for(2) == 1.0


def test_on_time_first_marks_each_class_late_after_its_own_objective() -> None:
    a = Admission(AdmissionConfig(prefill_backlog_budgets=None), Knobs(1, "fifo"))
    a.use_slo(TWO)
    assert a.submit_or_admit(Request("run", 0.0, 100, 10), 0.0) == (None, True)
    assert a.submit(Request("i", 0.0, 100, 10, priority=1), 0.0) is None
    assert a.submit(Request("b", 0.0, 100, 10, priority=2), 0.0) is None
    a.admit(2.0)  # the cap is full: nothing goes, the lateness is marked
    assert a.num_late_waiting == 1 and a.waiting_on_time_tokens == 100  # the batch request is still on time
    a.admit(10.5)
    assert a.num_late_waiting == 2
    a.check_counts()




def test_early_refusal_counts_against_the_class_objective() -> None:
    """2 s of prefill queued: past the 1 s objective of class 1, well inside class 2's 10 s."""
    a = Admission(AdmissionConfig(early_refusal=True), Knobs(1, "fifo"))
    a.use_slo(TWO)
    t = warm_drain(a, 8)
    assert a.drain_rate == pytest.approx(10_000.0)
    assert a.submit_or_admit(Request("busy", t, 1000, 10), t) == (None, True)
    for i in range(18):
        assert a.submit(Request(f"q{i}", t, 1000, 10), t) is None  # core: never refused
    assert a.predicted_first_token_s(1000, t, t) == pytest.approx(2.0)
    rej = a.submit(Request("i", t, 1000, 10, priority=1), t)
    assert rej is not None and rej.reason == "no_slack"
    assert a.submit(Request("b", t, 1000, 10, priority=2), t) is None and a.is_waiting("b")
    a.check_counts()


# --- the preset, in an episode, and its per-class results ----------------------------------------
def test_the_two_class_workload_gives_each_class_its_own_lengths() -> None:
    s = build_workload(load_config(["workload=two_class"]).workload, np.random.default_rng(0), 8192)
    inter, batch = s.priority == 1, s.priority == 2
    assert inter.sum() > 5 * batch.sum() > 0 and not np.any(s.priority == 0)
    assert np.median(s.prompt_len[batch]) > 4 * np.median(s.prompt_len[inter])
    assert np.median(s.output_len[batch]) > 2 * np.median(s.output_len[inter])


def test_a_two_class_episode_reports_per_class_results(tmp_path) -> None:
    cfg = load_config(["workload=two_class", "slo=two_class", "env.episode_s=20", "workload.duration_s=20",
                       "env.drain_on_truncate=true", "policy=pid"])
    env = ServingEnv(cfg=cfg)
    assert env.admission.ttft_s_for(2) == 20.0 and env.admission.ttft_s_for(1) == 0.8
    ctl = build_controller(env.cfg.policy, env.engine.capabilities().max_num_seqs, slo=env.slo)
    env.reset(seed=0)
    ctl.reset(env.knobs)
    while True:
        _, _, term, trunc, info = env.step_proposal(ctl.decide(env.snapshot, env.knobs))
        if term or trunc:
            break
    m = info["episode_metrics"]
    keys = class_keys([1, 2])
    assert set(keys) <= set(m)
    offered = {p: int(np.sum(env.stream.priority == p)) for p in (1, 2)}
    met = {p: sum(1 for r in env.finished_requests if r.priority == p
                  and env.slo.for_priority(p).met(r.ttft, r.tpot, r.e2el)) for p in (1, 2)}
    for p in (1, 2):
        assert m[f"slo_attainment_p{p}"] == pytest.approx(met[p] / offered[p])
    assert m["slo_attainment"] == pytest.approx((met[1] + met[2]) / (offered[1] + offered[2]))
    # The evaluation's rows carry them, results.csv/json too, and results.md gets a table.
    row = {"policy": "pid", "workload": "two_class", "seed": 0, "model": "m", "hardware": "h",
           **{k: m[k] for k in keys}}
    assert "slo_attainment_p2" in class_table([row])
    assert class_table([{"policy": "pid", "workload": "bursty", "seed": 0}]) == ""
    jpath, cpath = write_rows([row], tmp_path)
    assert "request_goodput_p2" in cpath.read_text().splitlines()[0] and "slo_attainment_p1" in jpath.read_text()


# --- the gateway ----------------------------------------------------------------------------------
def test_the_gateway_refuses_and_judges_by_class() -> None:
    """The serve config's ``slo.classes`` reaches the lane's admission and telemetry."""
    from batchpilot.serving.gateway import AppSettings, Gateway

    cfg = load_config(["slo=two_class", "serve.upstreams=[http://127.0.0.1:9]", "serve.tokenizer=chars"],
                      config_name="serve_app")
    settings = AppSettings.from_cfg(cfg)
    assert settings.slo.for_priority(2).ttft_ms == 20_000.0
    gw = Gateway(settings)
    try:
        lane = gw.lanes[0]
        assert lane.admission.ttft_s_for(2) == 20.0 and lane.admission.ttft_s_for(1) == 0.8
        assert lane.telemetry.on_finished("x", 1.0, 5.0, 0.2, 9.0, 2)  # a 5 s TTFT: met for batch
        assert not lane.telemetry.on_finished("y", 1.0, 5.0, 0.2, 9.0, 1)
    finally:
        gw.lanes[0].upstream.pool.close()


def test_a_gateway_lane_refuses_past_the_class_deadline_only() -> None:
    """At the gateway (``serve.admission.ttft_deadline``): of two requests queued 5 s, the
    interactive one (0.8 s objective) gets 429 "deadline", the batch one (20 s) keeps waiting."""
    import asyncio
    import time

    from batchpilot.serving.errors import Refused
    from batchpilot.serving.gateway import AppSettings, Gateway

    cfg = load_config(["slo=two_class", "serve.upstreams=[http://127.0.0.1:9]", "serve.tokenizer=chars",
                       "serve.admission.ttft_deadline=true"], config_name="serve_app")
    gw = Gateway(AppSettings.from_cfg(cfg))
    lane = gw.lanes[0]
    lane.upstream.healthy = True  # as if its health probe had answered: the lane admits
    lane.set_knobs(lane.knobs.with_(batch_cap=1))

    async def go() -> list:
        now = time.monotonic()
        first = asyncio.create_task(lane.acquire(Request("busy", now, 10, 10, priority=0), now + 60))
        await asyncio.sleep(0)  # it takes the one slot
        queued = [Request(f"p{p}", now - 5.0, 10, 10, priority=p) for p in (1, 2)]
        tasks = [asyncio.create_task(lane.acquire(r, now + 60)) for r in queued]
        await asyncio.sleep(0)
        lane.pump()
        await asyncio.sleep(0)
        out = [t.exception() if t.done() else "waiting" for t in tasks]
        for t in tasks + [first]:
            t.cancel()
        return out

    try:
        interactive, batch = asyncio.run(go())
    finally:
        lane.upstream.pool.close()
    assert isinstance(interactive, Refused) and interactive.reason == "deadline" and interactive.status == 429
    assert batch == "waiting"
