"""The shield: each clamp with exact values, dtype gating, the breaker, and invariants under
arbitrary and adversarial proposals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.engine import EngineCapabilities, MemoryModel
from batchpilot.core.knobs import BUCKETING_MODES, Knobs, Proposal
from batchpilot.core.shield import Shield, ShieldConfig, ShieldInputs
from batchpilot.core.telemetry import SLO

# Memory: weights 400 + activations 80 of a 1000 budget; ceiling 800 leaves 320 for KV.
# 1024-token context = 64 blocks of 16; auto 4/request (max 80), fp8 2/request (max 160).
KV = {"auto": 0.0625, "bfloat16": 0.0625, "fp8": 0.03125, "fp8_e5m2": 0.03125, "int8_per_token_head": 0.03125}


def memory(kv_scale: float = 1.0) -> MemoryModel:
    return MemoryModel(
        budget_bytes=1000.0, weights_bytes=400.0, activation_bytes=80.0, block_size=16,
        kv_block_bytes={k: v * kv_scale for k, v in KV.items()}, num_kv_blocks_total=10_000,
    )


def caps(max_num_seqs: int = 256) -> EngineCapabilities:
    return EngineCapabilities(
        kv_dtypes={"auto": None, "bfloat16": None, "fp8": None,
                   "fp8_e5m2": "fp8 on CPU needs AVX-512 or AMX; this CPU has neither",
                   "int8_per_token_head": None},
        max_model_len=8192, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, block_size=16,
    )


def shield(kv_scale: float = 1.0, **over) -> Shield:
    # Each rule on its own: no overhead, no cooldown, and steps bounded by the cap alone (the
    # inputs here mostly leave the running batch at 0; its rule has tests of its own).
    cfg = ShieldConfig(**{"overhead_frac": 0.0, "breaker_cooldown_s": 0.0, "step_around_running": False, **over})
    return Shield(cfg, memory(kv_scale), caps(), SLO(ttft_ms=1000.0, tpot_ms=100.0, e2el_ms=None))


ROOMY = 0.01  # kv_scale where memory never binds below 256
CALM = ShieldInputs()


def test_pass_through_without_interventions():
    d = shield().apply(Proposal(batch_cap=40, bucketing="weighted"), Knobs(35), CALM, 1.0)
    assert d.knobs == Knobs(40, "weighted", "auto") and d.interventions == {}
    assert d.predicted_memory_fraction == pytest.approx((480 + 40 * 4) / 1000)
    assert d.breaker_level == 0 and not d.alerts and d.shed_max_priority_kept is None
    assert shield().apply(Proposal(), Knobs(35, "shortest_first"), CALM, 1.0).knobs == Knobs(35, "shortest_first")


@pytest.mark.parametrize(
    "cur,want,got",
    [(50, 100, 65), (50, 10, 35), (10, 20, 13), (1, 5, 2), (2, 10, 3), (3, 0, 2)],
)
def test_step_limit(cur, want, got):
    d = shield(ROOMY).apply(Proposal(batch_cap=want), Knobs(cur), CALM, 1.0)
    assert d.knobs.batch_cap == got
    assert "step_limit" in d.interventions or "batch_range" in d.interventions


def test_range_clamps():
    s = shield(ROOMY, min_batch=4, max_batch=200)
    assert s.apply(Proposal(batch_cap=-7), Knobs(5), CALM, 1.0).knobs.batch_cap == 4
    d = s.apply(Proposal(batch_cap=10**12), Knobs(190), CALM, 1.0)
    assert d.knobs.batch_cap == 200 and "batch_range" in d.interventions
    # max_batch above the engine's max_num_seqs is capped there
    s2 = Shield(ShieldConfig(max_batch=512, step_around_running=False), memory(ROOMY), caps(max_num_seqs=64), SLO())
    assert s2.max_batch == 64
    assert s2.apply(Proposal(batch_cap=80), Knobs(60), CALM, 1.0).knobs.batch_cap == 64


def test_memory_ceiling_exact():
    s = shield()
    assert s.max_feasible_batch("auto") == 80 and s.max_feasible_batch("fp8") == 160
    d = s.apply(Proposal(batch_cap=90), Knobs(70), CALM, 1.0)
    assert d.knobs.batch_cap == 80 and "memory_ceiling" in d.interventions
    assert d.predicted_memory_fraction == pytest.approx(0.8)


def test_a_ceiling_below_the_weights_is_named_not_silently_refusing():
    assert shield().no_room_reason() is None
    # Weights + activations are 48 % of the budget: a 45 % ceiling admits no request at all.
    why = shield(memory_ceiling=0.45).no_room_reason()
    assert why is not None and "memory_ceiling=0.45 leaves no room" in why and "48%" in why
    assert shield(memory_ceiling=0.45).max_feasible_batch("auto") == 0


def test_start_kv_dtype_is_8bit_only_where_memory_binds_at_16bit():
    # 16-bit holds 80 requests of the 256 the cap may reach, 8-bit 160: start at 8 bits.
    assert shield().start_kv_dtype("auto", "fp8") == "fp8"
    # Memory does not bind at 16 bits: 8-bit would buy nothing and cost quality.
    assert shield(ROOMY).start_kv_dtype("auto", "fp8") == "auto"
    # An 8-bit dtype this engine cannot run is never the start.
    assert shield().start_kv_dtype("auto", "fp8_e5m2") == "auto"
    # An engine that reads 8-bit KV slower pays on every iteration for the room: worth it where
    # memory binds at 8 bits too (160 of 256 here), not where 8-bit lifts the ceiling above the
    # cap (a cap of 120: the 40 requests 8-bit adds serve only a load heavier than 80).
    assert shield().start_kv_dtype("auto", "fp8", kv8_read_cost=1.1) == "fp8"
    assert shield(max_batch=120).start_kv_dtype("auto", "fp8") == "fp8"
    assert shield(max_batch=120).start_kv_dtype("auto", "fp8", kv8_read_cost=1.1) == "auto"
    # Nothing fits even at 8 bits: no gain, so the engine's 16-bit dtype.
    assert shield(memory_ceiling=0.45).start_kv_dtype("auto", "fp8") == "auto"


def test_over_ceiling_moves_down_never_up():
    s = shield()
    d = s.apply(Proposal(batch_cap=120), Knobs(100), CALM, 1.0)
    assert d.knobs.batch_cap == 80  # feasible, within a step of 100
    d = s.apply(Proposal(batch_cap=200), Knobs(200), CALM, 1.0)
    assert d.knobs.batch_cap == 140  # feasible 80 is more than a step away: one full step down
    assert d.predicted_memory_fraction > 0.8 and "memory_ceiling" in d.interventions


def test_overhead_term_follows_sqrt_batch():
    s = shield(overhead_frac=0.01)
    # 480 + 4 b + 10 sqrt(b) <= 800: the largest such b, found by the predictor
    b = s.max_feasible_batch("auto")
    f = lambda n: (480 + 4 * n + 10 * math.sqrt(n)) / 1000  # noqa: E731
    assert f(b) <= 0.8 < f(b + 1)


def test_calibration_learns_observed_kv_usage():
    s = shield(calibration_rate=1.0)
    # 10 requests of 1024 tokens should hold 640 blocks; the engine reports 320 (prefix sharing)
    s.observe(ShieldInputs(mean_context_len=1024, num_running=10, num_kv_blocks_used=320))
    assert s.kv_calibration == pytest.approx(0.5)
    assert s.max_feasible_batch("auto") == 160
    s.observe(ShieldInputs(mean_context_len=1024, num_running=10, num_kv_blocks_used=64_000))
    assert s.kv_calibration == pytest.approx(2.0)  # clipped
    s.observe(ShieldInputs(mean_context_len=2048))
    assert s.context_len == 2048 and s.max_feasible_batch("auto") == 20


def test_dtype_unavailable_reports_engine_reason():
    s = shield()
    d = s.apply(Proposal(kv_dtype="fp8_e5m2"), Knobs(40), ShieldInputs(demand=500), 10_000.0)
    assert d.knobs.kv_dtype == "auto" and "AVX-512" in d.interventions["dtype_unavailable"]
    d = s.apply(Proposal(kv_dtype="int8"), Knobs(40), ShieldInputs(demand=500), 10_000.0)
    assert d.knobs.kv_dtype == "auto" and "unknown KV-cache dtype" in d.interventions["dtype_unavailable"]
    assert s.num_interventions["dtype_unavailable"] == 2


def test_dtype_dwell_gain_and_memory_gates():
    s = shield(min_dtype_dwell_s=600, dtype_restart_s=60, dtype_gain_horizon_s=600)
    busy = ShieldInputs(demand=150)
    # light load: auto already fits the demand, no gain to repay the restart
    d = s.apply(Proposal(kv_dtype="fp8"), Knobs(40), ShieldInputs(demand=50), 100.0)
    assert d.knobs.kv_dtype == "auto" and "dtype_not_worth" in d.interventions
    # heavy load: 80 -> 150 in flight, +87 % x 600 s repays 60 s; no switch yet, so no dwell
    d = s.apply(Proposal(batch_cap=104, kv_dtype="fp8"), Knobs(80), busy, 100.0)
    assert d.knobs == Knobs(104, "fifo", "fp8") and d.dtype_switched and d.interventions == {}
    assert d.predicted_memory_fraction == pytest.approx((480 + 104 * 2) / 1000)
    d = s.apply(Proposal(kv_dtype="auto"), Knobs(60, "fifo", "fp8"), ShieldInputs(demand=60), 200.0)
    assert d.knobs.kv_dtype == "fp8" and "dtype_dwell" in d.interventions  # 100 s after the switch
    # back to 16 bit at cap 120: auto allows 80 < 120 - 36, refused for memory
    d = s.apply(Proposal(kv_dtype="auto"), Knobs(120, "fifo", "fp8"), ShieldInputs(demand=120), 800.0)
    assert d.knobs.kv_dtype == "fp8" and "dtype_memory" in d.interventions
    # back to 16 bit when it costs no throughput
    d = s.apply(Proposal(batch_cap=60, kv_dtype="auto"), Knobs(60, "fifo", "fp8"), ShieldInputs(demand=60), 800.0)
    assert d.knobs == Knobs(60, "fifo", "auto") and d.dtype_switched
    d = s.apply(Proposal(batch_cap=104, kv_dtype="fp8"), Knobs(80), busy, 900.0)
    assert d.knobs.kv_dtype == "auto" and "dtype_dwell" in d.interventions  # between switches


def test_dtype_gain_counts_only_the_batch_the_tpot_objective_allows():
    """A smaller KV dtype lifts the memory ceiling; on an engine whose TPOT already sits near
    its objective that buys nothing, and the restart is lost."""
    s = shield(dtype_restart_s=40, dtype_gain_horizon_s=600)  # auto holds 80, fp8 160
    # 80 running at p99 TPOT 75 ms: the objective (0.8 x 100 ms) allows 85, +6 % < 40/600
    near = ShieldInputs(demand=200, num_running=80, tpot_p99_ms=75.0)
    assert s.latency_batch(near) == 85
    d = s.apply(Proposal(kv_dtype="fp8"), Knobs(80), near, 100.0)
    assert d.knobs.kv_dtype == "auto" and "TPOT objective allow: 85" in d.interventions["dtype_not_worth"]
    # the same memory-bound engine with TPOT far under its objective gains +100 %: switch
    fast = ShieldInputs(demand=200, num_running=80, tpot_p99_ms=10.0)
    assert s.apply(Proposal(kv_dtype="fp8"), Knobs(80), fast, 100.0).knobs.kv_dtype == "fp8"
    # no latency seen yet (nothing finished), or the bound off: memory and demand alone decide
    assert shield(dtype_restart_s=40).latency_batch(ShieldInputs(demand=200, num_running=80)) == 256
    off = shield(dtype_restart_s=40, dtype_gain_latency_frac=0.0)
    assert off.apply(Proposal(kv_dtype="fp8"), Knobs(80), near, 100.0).knobs.kv_dtype == "fp8"
    with pytest.raises(ValueError, match="dtype_gain_latency_frac"):
        ShieldConfig(dtype_gain_latency_frac=-0.1)


def test_invalid_proposal_fields_are_kept_and_reported():
    s = shield(ROOMY)
    for bad in (float("nan"), 3.5, "12", True, float("inf")):
        d = s.apply(Proposal(batch_cap=bad), Knobs(20), CALM, 1.0)  # type: ignore[arg-type]
        assert d.knobs.batch_cap == 20 and "invalid_batch" in d.interventions, bad
    d = s.apply(Proposal(bucketing="random"), Knobs(20, "weighted"), CALM, 1.0)
    assert d.knobs.bucketing == "weighted" and "invalid_bucketing" in d.interventions
    assert s.apply(Proposal(batch_cap=np.int64(22)), Knobs(20), CALM, 1.0).knobs.batch_cap == 22


SLOW = ShieldInputs(ttft_p99_ms=2000.0)  # > 1.5 x 1000 ms SLO


def test_breaker_level1_shrinks_by_030_and_overrides_proposal():
    s = shield(ROOMY)
    d = s.apply(Proposal(batch_cap=120), Knobs(100), SLOW, 1.0)
    assert d.knobs.batch_cap == 70 and d.breaker_level == 1 and "breaker_shrink" in d.interventions
    d = s.apply(Proposal(batch_cap=120), Knobs(11), SLOW, 2.0)
    assert d.knobs.batch_cap == 8  # ceil(0.7 x 11) = 8, a cut of 3 = floor(0.3 x 11)
    for trigger in (ShieldInputs(preemptions=10), ShieldInputs(oom=True), ShieldInputs(e2el_p99_ms=1e9)):
        fresh = shield(ROOMY, breach_metrics=["ttft", "e2el"])
        got = fresh.apply(Proposal(), Knobs(100), trigger, 1.0)
        # e2el has no SLO by default, so it never breaches
        assert got.breaker_level == (0 if trigger.e2el_p99_ms else 1)
    assert shield(ROOMY).apply(Proposal(), Knobs(100), ShieldInputs(preemptions=9), 1.0).breaker_level == 0


def test_overload_breach_sheds_instead_of_shrinking():
    """TTFT high because 300 wait behind 100 running: cutting the batch would deepen the queue."""
    s = shield(ROOMY)
    overload = ShieldInputs(ttft_p99_ms=5000.0, demand=400, num_running=100)
    d = s.apply(Proposal(batch_cap=120), Knobs(100), overload, 1.0)
    assert d.knobs.batch_cap == 120 and d.breaker_level == 2 and d.shed_max_priority_kept == 0
    assert "breaker_shed" in d.interventions and "breaker_shrink" not in d.interventions
    # the same latency with no backlog is the engine's: shrink
    d = shield(ROOMY).apply(Proposal(), Knobs(100), ShieldInputs(ttft_p99_ms=5000.0, demand=100, num_running=100), 1.0)
    assert d.knobs.batch_cap == 70 and d.breaker_level == 1
    # a TPOT breach is always the engine's, backlog or not
    tpot = ShieldInputs(tpot_p99_ms=500.0, demand=400, num_running=100)
    assert shield(ROOMY).apply(Proposal(), Knobs(100), tpot, 1.0).knobs.batch_cap == 70
    # sustained overload alerts after 3 failed sheds, and clean intervals lift the shedding
    alerts = [bool(s.apply(Proposal(), Knobs(100), overload, 2.0 + t).alerts) for t in range(4)]
    assert alerts == [False, False, True, True]
    for t in range(3):
        d = s.apply(Proposal(batch_cap=110), Knobs(100), CALM, 10.0 + t)
    assert d.breaker_level == 0 and d.shed_max_priority_kept is None and d.knobs.batch_cap == 110


def test_breaker_cooldown_holds_cap():
    s = shield(ROOMY, breaker_cooldown_s=2.0)
    assert s.apply(Proposal(), Knobs(100), SLOW, 10.0).knobs.batch_cap == 70
    d = s.apply(Proposal(batch_cap=90), Knobs(70), SLOW, 11.0)
    assert d.knobs.batch_cap == 70 and "breaker_hold" in d.interventions
    assert s.apply(Proposal(), Knobs(70), SLOW, 12.5).knobs.batch_cap == 49


def test_breaker_waits_for_a_cut_to_take_effect_before_the_next():
    """A lower cap stops admissions only; while more requests run than the cap allows, the
    latency window still shows the batch before the cut, and cutting again overshoots."""
    s = shield(ROOMY, breaker_cooldown_s=2.0)
    slow = ShieldInputs(tpot_p99_ms=500.0, demand=256, num_running=256)
    assert s.apply(Proposal(), Knobs(256), slow, 10.0).knobs.batch_cap == 180
    for t, running in ((13.0, 240), (16.0, 181)):  # past the cooldown, still above the cap
        d = s.apply(Proposal(batch_cap=250), Knobs(180), ShieldInputs(tpot_p99_ms=500.0, demand=256, num_running=running), t)
        assert d.knobs.batch_cap == 180 and "breaker_hold" in d.interventions
        assert "running above the cap" in d.interventions["breaker_hold"]
    d = s.apply(Proposal(), Knobs(180), ShieldInputs(tpot_p99_ms=500.0, demand=180, num_running=180), 17.0)
    assert d.knobs.batch_cap == 126 and "breaker_shrink" in d.interventions
    # an engine that fails (a preemption storm) is cut at once, whatever runs
    storm = ShieldInputs(preemptions=50, demand=256, num_running=256)
    assert shield(ROOMY).apply(Proposal(), Knobs(100), storm, 1.0).knobs.batch_cap == 70


def test_tpot_breach_counts_only_while_tokens_still_come_slowly():
    """The window's TPOT is over finished requests, each averaged over its whole decode, so it
    shows a batch long after a cut shrank it; the present time between tokens (running /
    output tokens per s) says whether the batch running now is too slow."""
    s = shield(ROOMY)
    # 100 running at 2,000 tokens/s: 50 ms between tokens, within the 100 ms objective
    flowing = ShieldInputs(tpot_p99_ms=300.0, demand=100, num_running=100, output_tokens_per_s=2000.0)
    d = s.apply(Proposal(batch_cap=100), Knobs(100), flowing, 1.0)
    assert d.knobs.batch_cap == 100 and d.breaker_level == 0 and d.interventions == {}
    # 100 running at 500 tokens/s: 200 ms between tokens, the breach is now
    slow = ShieldInputs(tpot_p99_ms=300.0, demand=100, num_running=100, output_tokens_per_s=500.0)
    assert s.apply(Proposal(batch_cap=100), Knobs(100), slow, 2.0).knobs.batch_cap == 70
    # no tokens while requests run (a stalled engine), or the rate unknown: the window decides
    for rate in (0.0, None):
        stalled = ShieldInputs(tpot_p99_ms=300.0, demand=100, num_running=100, output_tokens_per_s=rate)
        assert shield(ROOMY).apply(Proposal(), Knobs(100), stalled, 1.0).knobs.batch_cap == 70
    # off: the window alone, as before
    off = shield(ROOMY, tpot_breach_needs_present=False)
    assert off.apply(Proposal(batch_cap=100), Knobs(100), flowing, 1.0).knobs.batch_cap == 70


def test_a_ttft_breach_soon_after_a_backlog_is_still_queueing():
    """The TTFT window holds the requests that waited in a backlog for seconds after it has
    drained; cutting the cap on them (measured: 134 -> 66 with an empty queue) only queues the
    next burst behind a low cap."""
    s = shield(ROOMY, overload_memory_s=10.0)
    backlog = ShieldInputs(ttft_p99_ms=5000.0, demand=150, num_running=100)
    assert "breaker_shed" in s.apply(Proposal(batch_cap=100), Knobs(100), backlog, 1.0).interventions
    drained = ShieldInputs(ttft_p99_ms=5000.0, demand=100, num_running=100)
    d = s.apply(Proposal(batch_cap=100), Knobs(100), drained, 8.0)
    assert d.knobs.batch_cap == 100 and "after a backlog" in d.interventions["breaker_shed"]
    # once the window has turned over, a TTFT breach without a backlog is the engine's
    assert s.apply(Proposal(batch_cap=100), Knobs(100), drained, 12.0).knobs.batch_cap == 70
    with pytest.raises(ValueError, match="overload_memory_s must be >= 0"):
        ShieldConfig(overload_memory_s=-1.0)
    # 0: only a backlog in the interval itself counts
    s0 = shield(ROOMY, overload_memory_s=0.0)
    s0.apply(Proposal(batch_cap=100), Knobs(100), backlog, 1.0)
    assert s0.apply(Proposal(batch_cap=100), Knobs(100), drained, 2.0).knobs.batch_cap == 70


def test_a_late_backlog_is_overload_when_asked():
    """Served first, on-time requests keep the TTFT window near the objective while the late
    ones pile up behind them; with ``late_queue_overload`` (the default) more late than running
    sheds."""
    piled = ShieldInputs(ttft_p99_ms=1050.0, demand=3800, num_running=150, num_late_waiting=3000)
    d = shield(ROOMY, late_queue_overload=True).apply(Proposal(batch_cap=200), Knobs(200), piled, 1.0)
    assert d.breaker_level == 2 and "3000 waiting past their TTFT" in d.interventions["breaker_shed"]
    assert d.knobs.batch_cap == 200  # shed, the cap stays with the controller
    few = ShieldInputs(ttft_p99_ms=1050.0, demand=300, num_running=150, num_late_waiting=100)
    assert shield(ROOMY, late_queue_overload=True).apply(Proposal(), Knobs(200), few, 1.0).breaker_level == 0
    assert shield(ROOMY, late_queue_overload=False).apply(Proposal(), Knobs(200), piled, 1.0).breaker_level == 0
    assert shield(ROOMY).apply(Proposal(), Knobs(200), piled, 1.0).breaker_level == 2  # on by default


def test_cap_stays_within_a_step_of_the_running_batch():
    """A cap raised above an engine that does not fill it admits a whole burst at once later
    (wind-up); one cut far below a batch still draining holds the engine under capacity once
    it has drained."""
    s = shield(ROOMY, step_around_running=True)
    idle = ShieldInputs(num_running=10)
    d = s.apply(Proposal(batch_cap=160), Knobs(128), idle, 1.0)
    assert d.knobs.batch_cap == 128 and "10 running" in d.interventions["step_limit"]
    # the cap binds: the usual 30 % step
    assert s.apply(Proposal(batch_cap=160), Knobs(128), ShieldInputs(num_running=128), 2.0).knobs.batch_cap == 160
    # draining after a cut: 250 still run, the cap goes at most a step below them
    d = s.apply(Proposal(batch_cap=126), Knobs(180), ShieldInputs(num_running=250), 3.0)
    assert d.knobs.batch_cap == 175 and "250 running" in d.interventions["step_limit"]
    # never moved the other way: a cut below an idle engine's cap is the usual step
    assert s.apply(Proposal(batch_cap=100), Knobs(128), idle, 4.0).knobs.batch_cap == 100
    # the breaker and the memory ceiling are not bound by it
    storm = ShieldInputs(preemptions=50, num_running=250)
    assert s.apply(Proposal(), Knobs(180), storm, 5.0).knobs.batch_cap == 126


STORM = ShieldInputs(preemptions=50)  # >= preemption_storm (10): the engine itself fails


def _walk(s: Shield, inputs: ShieldInputs, n: int) -> tuple[list[int], list[int], list[bool], list[str]]:
    cap, caps_seen, levels, alerts, texts = 20, [], [], [], []
    for t in range(n):
        d = s.apply(Proposal(batch_cap=cap + 5), Knobs(cap), inputs, float(t))
        cap = d.knobs.batch_cap
        caps_seen.append(cap)
        levels.append(d.breaker_level)
        alerts.append(bool(d.alerts))
        texts.extend(d.alerts)
    return caps_seen, levels, alerts, texts


def test_breaker_alert_after_three_failed_adjustments_then_shed_and_restart():
    s = shield(ROOMY, alert_after=3, restart_after=3)
    caps_seen, levels, alerts, texts = _walk(s, STORM, 13)
    # level 1 cuts 20 -> 14 -> 10 -> 7 -> 5 -> 4 -> 3 -> 2 -> 1, then level 2 at min_batch
    assert caps_seen[:8] == [14, 10, 7, 5, 4, 3, 2, 1]
    assert alerts[:3] == [False, False, False] and all(alerts[3:])
    assert levels[:8] == [1] * 8 and levels[8:11] == [2, 2, 2] and levels[11:] == [3, 3]
    assert s.num_interventions["breaker_shed"] == 5
    d = s.apply(Proposal(), Knobs(1), STORM, 20.0)
    assert d.shed_max_priority_kept == 0 and d.recommend_restart
    # the restart alert is raised once, on entering level 3, not on every decision after
    assert sum("restart" in a for a in texts + d.alerts) == 1
    # a clean spell resets everything
    for t in range(3):
        d = s.apply(Proposal(batch_cap=2), Knobs(1), CALM, 30.0 + t)
    assert d.breaker_level == 0 and d.shed_max_priority_kept is None and d.knobs.batch_cap == 2


def test_a_latency_breach_at_min_batch_sheds_and_alerts_but_never_restarts():
    """A restart cannot make a slow engine meet its objective; it only takes it down."""
    s = shield(ROOMY, alert_after=3, restart_after=3)
    caps_seen, levels, alerts, texts = _walk(s, ShieldInputs(tpot_p99_ms=500.0), 20)
    assert caps_seen[-1] == 1 and max(levels) == 2 and levels[-1] == 2
    assert all(alerts[3:]) and not any("restart" in a for a in texts)
    d = s.apply(Proposal(), Knobs(1), ShieldInputs(tpot_p99_ms=500.0), 30.0)
    assert not d.recommend_restart and d.shed_max_priority_kept == 0


def test_breaker_recovers_after_clean_intervals():
    s = shield(ROOMY, recover_after=3)
    s.apply(Proposal(), Knobs(100), SLOW, 0.0)
    held = [s.apply(Proposal(batch_cap=90), Knobs(70), CALM, float(t)) for t in (1, 2)]
    assert all(d.knobs.batch_cap == 70 and d.breaker_level == 1 for d in held)
    d = s.apply(Proposal(batch_cap=90), Knobs(70), CALM, 3.0)
    assert d.breaker_level == 0 and d.knobs.batch_cap == 90


def test_config_validation():
    with pytest.raises(ValueError, match="breaker_shrink"):
        ShieldConfig(breaker_shrink=0.5)
    with pytest.raises(ValueError, match="min_batch"):
        ShieldConfig(min_batch=10, max_batch=5)
    with pytest.raises(ValueError, match="Key 'max_step' not in 'ShieldConfig'"):
        ShieldConfig.from_cfg({"max_step": 0.3})
    with pytest.raises(ValueError, match="breach_metrics"):
        ShieldConfig(breach_metrics=("p50",))


# --- invariants -------------------------------------------------------------------------
def check_invariants(s: Shield, cur: Knobs, d) -> None:
    k, cfg = d.knobs, s.cfg
    assert cfg.min_batch <= k.batch_cap <= s.max_batch
    assert k.bucketing in BUCKETING_MODES
    assert s.capabilities.can_run(k.kv_dtype)
    step = s.max_step(cur.batch_cap)
    assert abs(k.batch_cap - cur.batch_cap) <= step, (cur, k, step)
    frac = s.predicted_fraction(k.batch_cap, k.kv_dtype)
    assert frac == pytest.approx(d.predicted_memory_fraction)
    if frac > cfg.memory_ceiling + 1e-12:
        # only allowed while walking down from an over-ceiling setting as fast as allowed
        assert k.batch_cap == max(cfg.min_batch, cur.batch_cap - step), (cur, k, frac)
    if s.predicted_fraction(cur.batch_cap, k.kv_dtype) > cfg.memory_ceiling + 1e-12:
        assert k.batch_cap <= cur.batch_cap
        assert k.batch_cap < cur.batch_cap or cur.batch_cap == cfg.min_batch


weird_ints = st.one_of(
    st.none(), st.integers(-(10**18), 10**18), st.integers(-3, 300),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 2.5, "7", True]),
)
dtypes = st.sampled_from(["auto", "bfloat16", "fp8", "fp8_e5m2", "int8_per_token_head", "int8", "", None, 42])
buckets = st.one_of(st.none(), st.sampled_from(BUCKETING_MODES), st.text(max_size=8))
inputs = st.builds(
    ShieldInputs,
    preemptions=st.integers(0, 50),
    oom=st.booleans(),
    ttft_p99_ms=st.floats(0, 1e5, allow_nan=False),
    e2el_p99_ms=st.floats(0, 1e6, allow_nan=False),
    mean_context_len=st.floats(0, 1e5, allow_nan=False),
    num_running=st.integers(0, 300),
    num_kv_blocks_used=st.one_of(st.none(), st.integers(0, 10**6)),
    demand=st.integers(0, 1000),
)


@settings(max_examples=400, deadline=None)
@given(
    proposal=st.builds(Proposal, batch_cap=weird_ints, bucketing=buckets, kv_dtype=dtypes),
    kv_scale=st.sampled_from([0.001, 0.1, 1.0, 3.0]),
    cur_cap=st.integers(1, 256),
    cur_dtype=st.sampled_from(["auto", "fp8", "int8_per_token_head"]),
    cur_bucket=st.sampled_from(BUCKETING_MODES),
    inp=inputs,
    now=st.floats(0, 5000),
    min_batch=st.integers(1, 8),
)
def test_invariants_hold_for_arbitrary_proposals(proposal, kv_scale, cur_cap, cur_dtype, cur_bucket, inp, now, min_batch):
    s = shield(kv_scale, min_batch=min_batch, overhead_frac=0.002, min_dtype_dwell_s=100.0)
    cur = Knobs(max(cur_cap, min_batch), cur_bucket, cur_dtype)
    d = s.apply(proposal, cur, inp, now)
    check_invariants(s, cur, d)
    assert set(d.interventions) <= set(s.num_interventions)


def test_10000_random_and_adversarial_steps():
    rng = np.random.default_rng(1)
    s = shield(1.0, overhead_frac=0.002, min_dtype_dwell_s=50.0, breaker_cooldown_s=1.0)
    knobs = Knobs(32)
    choices_dtype = ["auto", "fp8", "fp8_e5m2", "int8", "int8_per_token_head", None, "bfloat16"]
    special = [None, 0, -1, -(10**9), 10**9, 2**63, float("nan"), 1.5, "x", 256, 1]
    t, over_ceiling, switches = 0.0, 0, 0
    for i in range(10_000):
        t += float(rng.exponential(0.5))
        mode = i % 4
        if mode == 0:
            cap = int(rng.integers(-50, 600))
        elif mode == 1:
            cap = special[int(rng.integers(len(special)))]
        elif mode == 2:  # bang-bang
            cap = 10**6 if (i // 8) % 2 else -(10**6)
        else:
            cap = knobs.batch_cap + int(rng.integers(-3, 4))
        proposal = Proposal(
            batch_cap=cap,
            bucketing=[None, "fifo", "weighted", "shortest_first", "lifo"][int(rng.integers(5))],
            kv_dtype=choices_dtype[int(rng.integers(len(choices_dtype)))],
        )
        inp = ShieldInputs(
            preemptions=int(rng.poisson(3)),
            oom=bool(rng.random() < 0.01),
            ttft_p99_ms=float(rng.lognormal(6.5, 1.0)),
            # context spikes (long prompts) put the current cap over the ceiling now and then
            mean_context_len=float(rng.lognormal(7, 1)) * (30.0 if (i // 200) % 5 == 0 else 1.0),
            num_running=knobs.batch_cap,
            num_kv_blocks_used=int(rng.integers(0, 20_000)),
            demand=int(rng.integers(0, 800)),
        )
        d = s.apply(proposal, knobs, inp, t)
        check_invariants(s, knobs, d)
        over_ceiling += s.predicted_fraction(knobs.batch_cap, d.knobs.kv_dtype) > s.cfg.memory_ceiling
        switches += d.dtype_switched
        knobs = d.knobs
    assert s.num_decisions == 10_000
    assert s.num_interventions["step_limit"] > 100 and s.num_interventions["breaker_shrink"] > 10
    assert s.num_interventions["memory_ceiling"] > 50 and s.num_interventions["dtype_unavailable"] > 100
    assert over_ceiling > 50 and switches > 20  # the hard branches were exercised


def test_snapshot_inputs_are_converted_once_in_the_shield_stage():
    """One type crosses the telemetry/shield boundary: the control loop's shield stage converts
    a ``Snapshot`` (``shield_inputs``), and the shield refuses one handed to it directly."""
    from batchpilot.core.control import PassThroughShield, guard, shield_inputs
    from batchpilot.core.telemetry import Snapshot

    snap = Snapshot(
        time=0.0, interval_s=1.0, arrival_rate=1.0, mean_prompt_len=2048.0, queue_depth=(5, 3, 0),
        num_running=40, num_waiting_engine=2, kv_cache_usage=0.5, request_throughput=1.0,
        output_throughput=1.0, request_goodput=1.0, ttft_p50_ms=1.0, ttft_p99_ms=5000.0,
        tpot_p50_ms=1.0, tpot_p99_ms=1.0, e2el_p50_ms=1.0, e2el_p99_ms=1.0, slo_attainment=1.0,
        preemptions=0, rejected=0, shield_interventions=0, knobs=Knobs(40), time_since_dtype_switch_s=0.0,
    )
    s = shield(ROOMY, overload_backlog_factor=1.0)  # 10 waiting <= 40 running: the engine's breach
    inp = shield_inputs(snap, s)  # KV blocks from the shield's memory model (10,000), no OOM
    assert inp == ShieldInputs.from_snapshot(snap, num_kv_blocks_total=10_000)
    assert (inp.demand, inp.num_kv_blocks_used, inp.mean_context_len, inp.oom) == (50, 5000, 2048.0, False)
    for sh, method in ((s, "Shield.apply"), (PassThroughShield(s), "PassThroughShield.apply")):
        with pytest.raises(TypeError, match=rf"{method} takes ShieldInputs, got Snapshot.*ShieldInputs\.from_snapshot"):
            sh.apply(Proposal(batch_cap=45), Knobs(40), snap, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Shield\.check_dtype takes ShieldInputs.*from_snapshot"):
        s.check_dtype("fp8", Knobs(40), snap, 1.0)  # type: ignore[arg-type]
    assert s.num_decisions == 0  # refused before any state moved
    d = guard(Proposal(batch_cap=45), snap, Knobs(40), s, 1.0).decision  # p99 TTFT 5 s: breach
    assert d.knobs.batch_cap == 28 and d.breaker_level == 1
    assert s.predict_fraction(d.knobs) == pytest.approx(d.predicted_memory_fraction)
    assert d.shed_max_priority_kept is None
    twin = shield(ROOMY, overload_backlog_factor=1.0)
    assert twin.apply(Proposal(batch_cap=45), Knobs(40), inp, 1.0) == d  # the stage adds only the conversion


@pytest.mark.parametrize("start, lo, hi", [(200, 1, 64), (2, 8, 256)])
def test_a_cap_outside_the_range_is_walked_in_within_the_step_limit(start: int, lo: int, hi: int) -> None:
    """The 30 % step used to be skipped when the cap in force was outside [min, max] (an
    operator's or a config's): it was clamped in one jump. Now it walks in, a step at a time."""
    s = shield(ROOMY, min_batch=lo, max_batch=hi)
    cap, seen = start, [start]
    for i in range(40):
        d = s.apply(Proposal(batch_cap=(lo + hi) // 2), Knobs(cap), CALM, float(i))
        assert abs(d.knobs.batch_cap - cap) <= s.max_step(cap), (cap, d.knobs.batch_cap)
        cap = d.knobs.batch_cap
        seen.append(cap)
        if lo <= cap <= hi:
            break
    assert lo <= cap <= hi and len(seen) > 2, seen  # got there, in more than one decision
