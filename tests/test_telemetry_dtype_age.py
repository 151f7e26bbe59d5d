"""The KV-switch age the policy observes means what the shield's dwell means: no switch since
start-up is "long ago" (the feature saturates at 1), not "just now" — otherwise a long-running
gateway leaves the range a 120 s training episode covers and the policy stops acting."""

from __future__ import annotations

import math

from batchpilot.core.knobs import Knobs
from batchpilot.core.telemetry import FEATURE_NAMES, SLO, Telemetry

AGE = FEATURE_NAMES.index("time_since_dtype_switch")


def _snap(t: Telemetry, now: float):
    return t.snapshot(now, queue_depth=(0, 0, 0), num_running=0, num_waiting_engine=0, kv_cache_usage=0.0,
                      knobs=Knobs(8))


def test_no_switch_since_start_up_is_saturated_at_any_uptime():
    t = Telemetry(SLO(ttft_ms=1000.0, tpot_ms=100.0))
    t.reset(5.0)
    for now in (6.0, 130.0, 10_000.0):
        snap = _snap(t, now)
        assert math.isinf(snap.time_since_dtype_switch_s)
        assert t.observation(snap)[AGE] == 1.0


def test_a_switch_counts_from_when_it_happened_and_a_reset_keeps_it():
    t = Telemetry(SLO(ttft_ms=1000.0, tpot_ms=100.0))
    t.reset(0.0)
    t.on_dtype_switch(100.0)
    assert _snap(t, 160.0).time_since_dtype_switch_s == 60.0
    t.reset(200.0)  # the windows start afresh; the switch still happened at 100
    snap = _snap(t, 400.0)
    assert snap.time_since_dtype_switch_s == 300.0
    assert abs(float(t.observation(snap)[AGE]) - 0.5) < 1e-6
    assert t.observation(_snap(t, 1000.0))[AGE] == 1.0  # past the 600 s scale: saturated


def test_the_shipped_policy_keeps_acting_on_a_gateway_up_for_an_hour():
    """The regression this guards: the age read 0 at start-up, grew past the training range
    after ~159 s, and every later interval fell back to PID."""
    from batchpilot.policies.ppo_controller import PPOController

    ctl = PPOController.from_dir(None, max_num_seqs=256, max_model_len=8192)
    t = Telemetry(SLO(ttft_ms=1000.0, tpot_ms=100.0), max_num_seqs=256, max_model_len=8192)
    t.reset(0.0)
    obs = ctl.observation(_snap(t, 3600.0))
    assert "time_since_dtype_switch" not in ctl.out_of_range(obs)
