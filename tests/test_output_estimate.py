"""The output estimate admission's memory check charges with ``charge: estimate``
(batchpilot/core/output_estimate.py): a high quantile of what finished requests generated, over a
sliding window, the prior until enough have finished, never above a request's cap."""

from __future__ import annotations

import numpy as np
import pytest

from batchpilot.core.admission import Admission, AdmissionConfig
from batchpilot.core.engine import Request
from batchpilot.core.knobs import Knobs
from batchpilot.core.output_estimate import OutputEstimate


def test_the_quantile_is_the_higher_order_statistic_of_the_window() -> None:
    est = OutputEstimate(quantile=0.9, window=10, min_samples=10)
    for n in range(1, 11):  # 1..10
        est.observe(n)
    assert est.value == 9  # ceil(0.9 * 10) = 9th smallest
    est.observe(1000)  # slides out 1: window 2..10, 1000
    assert est.num_samples == 10 and est.num_observed == 11 and est.value == 10
    for _ in range(10):  # the window forgets everything before the last 10
        est.observe(5)
    assert est.value == 5 and sorted(est._sorted) == [5] * 10


def test_it_matches_numpy_over_random_streams() -> None:
    rng = np.random.default_rng(3)
    for q, w in ((0.5, 7), (0.95, 100), (0.99, 250), (1.0, 40)):
        est = OutputEstimate(quantile=q, window=w, min_samples=1)
        xs = rng.lognormal(5, 1, 600).astype(int)
        for i, x in enumerate(xs):
            est.observe(int(x))
            win = xs[max(0, i + 1 - w): i + 1]
            assert est.value == int(np.quantile(win, q, method="inverted_cdf")), (q, w, i)


def test_the_prior_holds_until_min_samples_completions() -> None:
    strict = OutputEstimate(quantile=0.5, window=100, min_samples=5)  # prior: the cap itself
    fixed = OutputEstimate(quantile=0.5, window=100, min_samples=5, prior_tokens=700)
    for _ in range(4):
        for e in (strict, fixed):
            e.observe(10)
            assert e.value is None
        assert strict.charge(4096) == 4096 and strict.charge(None) == 0
        assert fixed.charge(4096) == 700 and fixed.charge(300) == 300 and fixed.charge(None) == 700
    strict.observe(10)
    fixed.observe(10)
    assert strict.charge(4096) == fixed.charge(4096) == 10 and strict.charge(None) == 10


def test_the_charge_never_exceeds_the_cap() -> None:
    rng = np.random.default_rng(0)
    est = OutputEstimate(quantile=0.99, window=50, min_samples=3, prior_tokens=10_000)
    for _ in range(300):
        cap = int(rng.integers(1, 5000))
        assert 0 <= est.charge(cap) <= cap
        est.observe(int(rng.integers(0, 8000)))


@pytest.mark.parametrize("kw,match", [
    ({"quantile": 0.0}, "quantile"), ({"quantile": 1.5}, "quantile"), ({"window": 0}, "window"),
    ({"min_samples": 0}, "min_samples"), ({"window": 5, "min_samples": 6}, "min_samples"),
    ({"prior_tokens": -1}, "prior_tokens"),
])
def test_bad_settings_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OutputEstimate(**kw)
    cfg = {"charge_" + k: v for k, v in kw.items()}
    with pytest.raises(ValueError, match=r"admission\.charge_\*.*" + match):
        AdmissionConfig.from_cfg(cfg)
    with pytest.raises(ValueError, match="admission.charge must be one of"):
        AdmissionConfig(charge="oracle")
    with pytest.raises(ValueError):
        OutputEstimate().observe(-1)


class _Memory:
    """A memory check counting tokens: a block per token, a ceiling of ``limit`` tokens."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def request_blocks(self, prompt_len: int, output_len: int, num_seqs: int = 1) -> int:
        return (prompt_len + output_len) * num_seqs

    def fits(self, kv_blocks: int, num_seqs: int, kv_dtype: str) -> bool:
        return kv_blocks <= self.limit


def test_admission_charges_the_estimate_once_known_and_requeues_at_the_new_charge() -> None:
    """Strict until ``charge_min_samples`` finished, then the quantile; a request that waited
    while the estimate moved is charged the new value when it is admitted."""
    cfg = AdmissionConfig(charge="estimate", charge_quantile=1.0, charge_window=8, charge_min_samples=2)
    a = Admission(cfg, Knobs(batch_cap=100), memory=_Memory(8_500))
    reqs = [Request(f"r{i}", float(i), 100, 1, max_tokens=4000) for i in range(6)]
    got = [r for r in reqs if a.submit_or_admit(r, 0.0)[1]]
    assert [r.request_id for r in got] == ["r0", "r1"]  # 2 x 4,100 within 8,500: strict
    assert a.num_waiting == 4
    a.on_finished("r0", 150)  # one sample: the prior (the cap) still holds
    assert a.output_estimate.value is None and a.charged_output(reqs[2]) == 4000
    assert [r.request_id for r in a.admit(1.0)] == ["r2"] and a.kv_blocks_in_flight == 2 * 4100
    a.on_finished("r1", 200)  # two: the max of {150, 200}
    assert a.charged_output(reqs[3]) == 200
    assert [r.request_id for r in a.admit(2.0)] == ["r3", "r4", "r5"]
    assert a.kv_blocks_in_flight == 4100 + 3 * 300  # charged the estimate, not what they queued at
    a.on_finished("r2")  # cut short: not a length
    assert a.output_estimate.num_observed == 2
    a.check_counts()
    strict = Admission(AdmissionConfig(charge="max_tokens"), Knobs(batch_cap=100), memory=_Memory(8_500))
    assert strict.output_estimate is None and strict.charged_output(reqs[0]) == 4000
