"""The canary's verdict compares per-request SLO attainment, not goodput (issue 14). Routing
gives each lane a share of traffic that depends on its own cap, so goodput (requests/s meeting
the SLO) measured how much a lane was sent as much as how well it served: a canary that was sent
more and failed half its requests matched the incumbent's goodput and was promoted; a good
canary sent less traffic was rolled back."""

from __future__ import annotations

import pytest

from batchpilot.core.knobs import Knobs
from batchpilot.core.telemetry import SLO, Telemetry
from batchpilot.policies.ppo_controller import PPOController
from batchpilot.serving.policy_manager import Canary


def _canary() -> Canary:
    return Canary(PPOController.from_dir(None), "shipped", share=0.5)


def _run(c: Canary, incumbent: tuple[int, int], canary: tuple[int, int], n: int = 3):
    verdicts = []
    for _ in range(n):
        verdicts.append(c.record("policy", *incumbent, min_intervals=n, max_drop=0.10))
        verdicts.append(c.record("canary", *canary, min_intervals=n, max_drop=0.10))
    assert verdicts[:-1] == [None] * (2 * n - 1)  # no verdict before the canary's n intervals
    return verdicts[-1]


def test_a_canary_sent_more_traffic_that_fails_half_of_it_is_rolled_back() -> None:
    # Per interval: incumbent 10 requests, all within the SLO (goodput 10/s); canary 20, 10 within
    # (goodput 10/s too: the old verdict promoted it).
    promote, why = _run(_canary(), incumbent=(10, 10), canary=(20, 10))
    assert promote is False and "rolled back" in why and "50.0%" in why


def test_a_good_canary_sent_less_traffic_is_promoted() -> None:
    # Canary 5 requests, all within (goodput 5/s: the old verdict rolled it back at < 9/s).
    promote, why = _run(_canary(), incumbent=(10, 10), canary=(5, 5))
    assert promote is True and "promoted" in why


@pytest.mark.parametrize("canary_met, promoted", [(88, False), (91, True)])
def test_the_threshold_is_relative_to_the_incumbent(canary_met: int, promoted: bool) -> None:
    promote, _ = _run(_canary(), incumbent=(100, 100), canary=(100, canary_met))
    assert promote is promoted


def test_no_verdict_until_both_sides_served_requests() -> None:
    c = _canary()
    for _ in range(5):
        assert c.record("canary", 0, 0, min_intervals=3, max_drop=0.1) is None
        assert c.record("policy", 4, 4, min_intervals=3, max_drop=0.1) is None
    verdict = c.record("canary", 2, 2, min_intervals=3, max_drop=0.1)
    assert verdict is not None and verdict[0] is True


def test_the_manager_counts_requests_from_the_snapshot_refusals_as_misses() -> None:
    """``PolicyManager.record`` reads the interval's finished requests, those within the SLO
    and the refused ones (a canary that sheds its traffic does not look better for it)."""
    from batchpilot.schemas.serve import ControlConfig
    from batchpilot.serving.policy_manager import PolicyManager
    from batchpilot.serving.prom import GatewayMetrics

    pm = PolicyManager(ControlConfig(mode="pid", canary_min_intervals=1), GatewayMetrics(), max_num_seqs=256,
                       kv_runnable={"auto": True}, note=lambda _m: None)
    pm.canary = _canary()
    tel = Telemetry(SLO(ttft_ms=1000.0, tpot_ms=100.0), window_s=10.0)
    tel.reset(0.0)
    for i in range(4):
        tel.on_finished(f"ok{i}", 0.5, 0.1, 0.01, 0.5)
    tel.on_finished("slow", 0.6, 5.0, 0.01, 5.5)
    tel.on_rejected(3)
    snap = tel.snapshot(2.0, queue_depth=(0, 0, 0), num_running=0, num_waiting_engine=0, kv_cache_usage=0.0,
                        knobs=Knobs(8))
    pm.record("policy", snap)
    assert pm.canary.requests["incumbent"] == 8 and pm.canary.met["incumbent"] == 4


def test_no_verdict_on_a_handful_of_requests() -> None:
    """A slow canary finishes few requests; the verdict waits for min_requests on each side
    (the requests queued behind its first ones are the ones that miss)."""
    c = Canary(policy=None, path="p", share=0.5)  # type: ignore[arg-type]
    kw = {"min_intervals": 3, "max_drop": 0.1, "min_requests": 20}
    for _ in range(30):
        c.record("policy", 2, 2, **kw)
        assert c.record("canary", 0, 0, **kw) is None  # nothing finished yet
    assert c.record("canary", 3, 3, **kw) is None  # 3 met out of 3, but 3 < 20 requests
    verdicts = [c.record("canary", 1, 0, **kw) for _ in range(17)]  # the queued ones, late
    assert verdicts[:-1] == [None] * 16 and verdicts[-1] is not None
    assert verdicts[-1][0] is False and "rolled back" in verdicts[-1][1]


def test_the_gateways_policy_steers_on_the_gateways_slo() -> None:
    """The served policy observes and steers on the SLO the gateway's PID and shield use."""
    from batchpilot.schemas.serve import ControlConfig
    from batchpilot.serving.policy_manager import PolicyManager
    from batchpilot.serving.prom import GatewayMetrics

    slo = SLO(ttft_ms=800.0, tpot_ms=30.0)
    pm = PolicyManager(ControlConfig(mode="policy"), GatewayMetrics(), max_num_seqs=256,
                       kv_runnable={"auto": True}, note=lambda _m: None, slo=slo)
    assert pm.policy is not None and pm.policy.slo == slo and pm.policy._pid_cfg.tpot_slo_ms == 30.0
