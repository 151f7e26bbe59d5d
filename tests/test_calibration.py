"""Calibration: the fit recovers a known step-time law (no engine needed), and a tiny-grid
calibration against the live engine writes a profile the simulator loads and whose predicted
iteration times match the measured ones it was fitted to."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import yaml

from batchpilot.config import load_config
from batchpilot.core.engine import Request
from batchpilot.envs.sim_engine import SimEngine, SimEngineConfig
from batchpilot.envs.specs import HardwareSpec, ModelSpec
from batchpilot.policies.calibration import (
    Fit,
    IterationSample,
    MetricComparison,
    fit_samples,
    fit_to_hardware,
    residuals,
    summary_json,
)

TINY = ModelSpec.from_cfg(load_config(["model=tiny_llama"]).model)
BASE = HardwareSpec(name="test_cpu", peak_tflops=0.5, hbm_tb_s=0.05, memory_gb=2.0)


def _synthetic(truth: Fit) -> list[IterationSample]:
    """Samples whose times follow ``truth`` exactly (decode, prefill and mixed shapes)."""
    out = []
    for b in (1, 4, 16, 64, 256):
        for ctx in (16, 512):
            f = np.array([1.0, b, b, b * ctx, 0.0, 0.0])
            out.append(IterationSample("decode", f"d{b}/{ctx}", 0, 0.0, 0.0, b, b * ctx, b,
                                       float(f @ truth.as_array())))
    for c in (32, 256, 1024, 2000):
        for prior in (0, 512):
            pairs = c * prior + c * (c + 1) / 2
            f = np.array([1.0, c, 1, 0.0, pairs, 1.0])
            out.append(IterationSample("prefill", f"p{c}/{prior}", c, pairs, c + prior, 0, 0.0, 1,
                                       float(f @ truth.as_array())))
    return out


def test_fit_recovers_a_known_law_and_the_profile_reproduces_it() -> None:
    truth = Fit(const=1.0e-3, per_token=1.1e-5, per_seq=4.0e-5, per_decode_ctx=6e-8,
                per_prefill_pair=6e-9, per_prefill_step=1.5e-3)
    samples = _synthetic(truth)
    fit = fit_samples(samples)
    np.testing.assert_allclose(fit.as_array(), truth.as_array(), rtol=1e-6)
    hw = fit_to_hardware(fit, TINY, BASE)
    assert hw.roofline_p == 1.0 and 0 < hw.compute_efficiency <= 1
    res = residuals(samples, hw, TINY, max_tokens=2048, max_seqs=256)
    # Exact up to the prefill attention's max(pairs, context) form, negligible at these sizes.
    assert np.abs(res).max() < 0.02


def test_fit_is_robust_to_a_few_outliers() -> None:
    truth = Fit(1.0e-3, 1.1e-5, 4.0e-5, 6e-8, 6e-9, 1.5e-3)
    samples = _synthetic(truth)
    bad = [s.__class__(**{**{k: getattr(s, k) for k in s.__slots__}, "seconds": s.seconds * 5})
           if i in (0, 7) else s for i, s in enumerate(samples)]
    fit = fit_samples(bad)
    np.testing.assert_allclose(fit.as_array()[:3], truth.as_array()[:3], rtol=0.15)


def test_summary_json_keys_and_spread() -> None:
    rows = [MetricComparison("burst", "output_throughput", 110.0, (100.0, 90.0, 110.0)),
            MetricComparison("burst", "p99_ttft_ms", 50.0, (40.0, 60.0, 50.0))]
    out = summary_json(rows, preemptions_sim=0, preemptions_live=1.5)
    assert out["output_throughput"] == pytest.approx(0.1)
    assert out["output_throughput_live_spread"] == pytest.approx(0.1)
    assert out["p99_ttft_ms_live_spread"] == pytest.approx(0.2)
    assert out["preemptions_sim"] == 0 and out["preemptions_live"] == 1.5
    assert rows[0].ok and rows[1].ok


@pytest.mark.live
@pytest.mark.slow
def test_tiny_grid_calibration_writes_a_profile_the_simulator_loads(tmp_path: Path,
                                                                    tiny_model_path: Path) -> None:
    pytest.importorskip("vllm")
    from rich.console import Console

    from batchpilot.policies.calibration import run_fit

    out = tmp_path / "cpu_test.yaml"
    cfg = load_config(
        [
            f"out={out}", "profile=cpu_test", f'live_overrides=["engine.model={tiny_model_path}"]',
            "warmup.seconds=5", "warmup.max_batch=32",
            "grid.batch_sizes=[1,8,32]", "grid.contexts=[16,128]", "grid.decode_steps=12",
            "grid.mixed_batches=[8]", "grid.mixed_chunks=[256]", "grid.mixed_repeats=2",
            "grid.chunks=[64,512,1536]", "grid.priors=[0,256]", "grid.prefill_reqs=[1,2]",
            "grid.prefill_repeats=2",
        ],
        config_name="calibrate",
    )
    res = run_fit(cfg, Console(quiet=True))
    assert len(res.samples) == 6 + 2 + 10
    text = out.read_text()
    assert text.startswith("# cpu_test") and "Residuals of this profile" in text
    hw = HardwareSpec.from_cfg(yaml.safe_load(text))
    for k, v in asdict(res.hardware).items():  # written with 6 significant digits
        assert getattr(hw, k) == (pytest.approx(v, rel=1e-5) if isinstance(v, float) else v), k
    # The simulator loads it with the live engine's scheduler settings and serves requests.
    sim = SimEngine(hw, TINY, SimEngineConfig(block_size=32, max_num_batched_tokens=2048,
                                              max_num_seqs=256))
    for i in range(4):
        sim.add_request(Request(f"r{i}", 0.0, 100 + 50 * i, 20))
    done = sim.advance_until(10.0).finished
    assert len(done) == 4 and all(0 < f.ttft <= f.e2el < 1.0 for f in done)
    # Predicted iteration times against the measured ones the fit used (a shared machine:
    # noisy points, so the typical error is what is held tight).
    err = np.abs(residuals(res.samples, hw, TINY, 2048, 256))
    detail = (res.fit, [(s.label, round(e, 2)) for s, e in zip(res.samples, err)])
    assert np.median(err) < 0.2, detail
    # One point hit by a load spike must not fail the test; most points must still fit.
    assert np.mean(err < 0.5) >= 0.75, detail


def test_the_served_fit_recovers_what_the_served_path_adds():
    """served = in-process step + a + b*n is recovered; the terms are never negative; the
    profile it makes predicts the served points."""
    from batchpilot.config import load_config
    from batchpilot.envs.specs import HardwareSpec, ModelSpec
    from batchpilot.envs.step_time import StepTimeModel
    from batchpilot.policies.calibration import CalibrationError, fit_served_extra, with_served_extra

    cfg = load_config(["model=tiny_llama", "hardware=cpu_tiny"])
    hw, model = HardwareSpec.from_cfg(cfg.hardware), ModelSpec.from_cfg(cfg.model)
    st = StepTimeModel.build(hw, model, "auto", 2048, 256)
    ctx = 232.0
    pred = {n: st.step_time(0, 0.0, 0.0, n, n * ctx, n) * 1e3 for n in (1, 8, 32, 128)}
    fit = fit_served_extra([(n, p + 1.5 + 0.4 * n) for n, p in pred.items()], st, ctx)
    assert fit.per_step_s == pytest.approx(1.5e-3, rel=1e-6) and fit.per_sequence_s == pytest.approx(0.4e-3, rel=1e-6)
    served = with_served_extra(hw, fit, "cpu_tiny_served")
    st2 = StepTimeModel.build(served, model, "auto", 2048, 256)
    for n, p in pred.items():
        assert st2.step_time(0, 0.0, 0.0, n, n * ctx, n) * 1e3 == pytest.approx(p + 1.5 + 0.4 * n, rel=1e-6)
    # Faster than the profile (a machine idler than at the fit): nothing negative is added.
    fit = fit_served_extra([(n, 0.5 * p) for n, p in pred.items()], st, ctx)
    assert fit.per_step_s == 0.0 and fit.per_sequence_s == 0.0
    with pytest.raises(CalibrationError, match="no measured points"):
        fit_served_extra([], st, ctx)
