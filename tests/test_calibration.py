"""Calibration: the fit recovers a known step-time law (no engine needed), and a tiny-grid
calibration against the live engine writes a profile the simulator loads and whose predicted
iteration times match the measured ones it was fitted to."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from batchpilot.config import load_config
from batchpilot.core.engine import IterationShape, Request
from batchpilot.core.specs import HardwareSpec, ModelSpec
from batchpilot.envs.sim_engine import SimEngine
from batchpilot.evaluation.calibration import (
    CalibrationError,
    Fit,
    IterationSample,
    fit_samples,
    fit_to_hardware,
    residuals,
)
from batchpilot.evaluation.sim_to_real import MetricComparison, summary_json
from batchpilot.schemas.engine import SimEngineConfig

TINY = ModelSpec.from_cfg(load_config(["model=tiny_llama"]).model)
BASE = HardwareSpec(name="test_cpu", peak_tflops=0.5, hbm_tb_s=0.05, memory_gb=2.0)


def _synthetic(truth: Fit) -> list[IterationSample]:
    """Samples whose times follow ``truth`` exactly (decode, prefill and mixed shapes)."""
    out = []
    for b in (1, 4, 16, 64, 256):
        for ctx in (16, 512):
            f = np.array([1.0, b, b, b * ctx, 0.0, 0.0])
            out.append(IterationSample("decode", f"d{b}/{ctx}", IterationShape(
                0, 0.0, 0.0, b, b * ctx, b, float(f @ truth.as_array()))))
    for c in (32, 256, 1024, 2000):
        for prior in (0, 512):
            pairs = c * prior + c * (c + 1) / 2
            f = np.array([1.0, c, 1, 0.0, pairs, 1.0])
            out.append(IterationSample("prefill", f"p{c}/{prior}", IterationShape(
                c, pairs, c + prior, 0, 0.0, 1, float(f @ truth.as_array()))))
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
    bad = [replace(s, shape=replace(s.shape, seconds=s.seconds * 5)) if i in (0, 7) else s
           for i, s in enumerate(samples)]
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
    assert out["targets_missed"] == 0


def test_a_row_within_the_live_spread_only_is_not_called_a_met_target() -> None:
    """A noisy host's spread can cover any error; the report says so rather than "yes"."""
    met = MetricComparison("azure_conv", "median_tpot_ms", 2.1, (2.0, 2.0, 2.0))
    spread = MetricComparison("azure_conv", "median_tpot_ms", 1.3, (6.4, 1.5, 1.5))
    missed = MetricComparison("azure_conv", "median_tpot_ms", 9.0, (2.0, 2.1, 1.9))
    untargeted = MetricComparison("azure_conv", "median_e2el_ms", 9.0, (2.0, 2.1, 1.9))
    assert [met.verdict, spread.verdict, missed.verdict, untargeted.verdict] == ["yes", "spread", "NO", ""]
    assert spread.ok and not missed.ok
    out = summary_json([met, spread, missed, untargeted], preemptions_sim=0, preemptions_live=0)
    assert (out["targets_met"], out["targets_within_spread_only"], out["targets_missed"]) == (1, 1, 1)


@pytest.mark.live
@pytest.mark.slow
def test_tiny_grid_calibration_writes_a_profile_the_simulator_loads(tmp_path: Path,
                                                                    tiny_model_path: Path) -> None:
    pytest.importorskip("vllm")
    from rich.console import Console

    from batchpilot.evaluation.calibration import run_fit

    out = tmp_path / "cpu_test.yaml"
    cfg = load_config(
        [
            f"out={out}", "profile=cpu_test", f'live_overrides=["engine.model={tiny_model_path}"]',
            "warmup.seconds=5", "warmup.max_batch=32",
            "grid.batch_sizes=[1,8,32]", "grid.contexts=[16,128]", "grid.decode_steps=12",
            "grid.mixed_batches=[8]", "grid.mixed_chunks=[256]", "grid.mixed_repeats=2",
            "grid.chunks=[64,512,1536]", "grid.priors=[0,256]", "grid.prefill_reqs=[1,2]",
            "grid.prefill_repeats=2", "level_seconds=3",
        ],
        config_name="calibrate",
    )
    res = run_fit(cfg, Console(quiet=True))
    assert len(res.samples) == 6 + 2 + 10
    text = out.read_text()
    assert text.startswith("# cpu_test") and "Residuals of this profile" in text
    # The level: recorded traffic priced by the grid's fit sets the profile's slowdown.
    assert res.level["iterations"] > 0 and "Level: 3 s of varied traffic" in text
    assert res.hardware.slowdown == pytest.approx(res.level["measured_s"] / res.level["predicted_s"])
    assert 0.2 < res.hardware.slowdown < 5
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
    # noisy points, so the typical error is what is held tight: within 20 %, or within the
    # points' own spread over their repeats when a busy host makes that larger; no fit can
    # follow the data closer than the data follows itself).
    err = np.abs(residuals(res.samples, replace(hw, slowdown=1.0), TINY, 2048, 256))
    noise = float(np.median([s.spread for s in res.samples]))
    detail = (res.fit, f"median spread {noise:.2f}", [(s.label, round(e, 2), round(s.spread, 2))
                                                        for s, e in zip(res.samples, err)])
    assert np.median(err) < max(0.2, noise), detail
    # One point hit by a load spike must not fail the test; most points must still fit.
    assert np.mean(err < 0.5) >= 0.75, detail


def _hydra_list(*items: str) -> str:
    return "[" + ",".join(f'"{x}"' for x in items) + "]"


@pytest.mark.slow
def test_a_short_report_probes_the_live_engine_and_accounts_for_every_run(tiny_model_path: Path) -> None:
    """The report on the live engine with the state probe: each run is bracketed by probes on the
    engine the episodes ran on (idle again after each), and the summary says how many runs were
    made and how many were set aside as slow; the simulator is compared with the rest."""
    pytest.importorskip("vllm")
    from rich.console import Console

    from batchpilot.evaluation.sim_to_real import run_report

    cfg = load_config(
        [
            f'live_overrides=["engine.model={tiny_model_path}"]', "warmup.seconds=3",
            "warmup.max_batch=16", "runs=2", "state_probe.max_runs=3", "~workloads.azure_conv",
            "~load_vs_capacity.azure_conv",
            "workloads.burst=" + _hydra_list(
                "workload=poisson", "workload.rate=4", "workload.duration_s=6",
                "workload.lengths.prompt_mean=64", "workload.lengths.output_mean=16"),
            "common_overrides=" + _hydra_list(
                "policy=static", "policy.batch_cap=64", "control.interval_s=1.0", "env.episode_s=6",
                "env.drain_on_truncate=true", "env.drain_timeout_s=60", "logger=none"),
        ],
        config_name="calibrate",
    )
    out = run_report(cfg, Console(quiet=True))
    runs, slow, compared = out["burst/live_runs"], out["burst/slow_runs"], out["burst/compared_runs"]
    assert 2 <= runs <= 3 and 0 <= slow <= runs
    # Two fast runs end the loop; a third is made only when one of the first two was slow.
    assert runs == 2 or slow >= 1
    # The fast runs are compared when there are two; else all of them.
    assert compared == (runs - slow if runs - slow >= 2 else runs)
    for m in ("output_throughput", "median_tpot_ms", "p99_ttft_ms"):
        assert np.isfinite(out[f"burst/{m}"]) and out[f"burst/{m}_live_spread"] >= 0
        assert np.isfinite(out[f"burst/{m}_at_speed"])
    # Every run's own iterations were priced: a real engine takes a positive share of the profile.
    assert 0.1 < out["burst/engine_vs_profile"] < 20


def test_the_served_fit_recovers_what_the_served_path_adds():
    """served = in-process step + a + b*n is recovered; the terms are never negative; the
    profile it makes predicts the served points."""
    from batchpilot.config import load_config
    from batchpilot.core.specs import HardwareSpec, ModelSpec
    from batchpilot.envs.step_time import StepTimeModel
    from batchpilot.evaluation.calibration import CalibrationError, fit_served_extra, with_served_extra

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


class _BusyHost(SimEngine):
    """The simulator on a host whose other tenants stretch every iteration by ``factor`` while
    the iteration count lies in ``busy`` (a half-open range): the 1x / 1.5-3x states a shared
    machine switches between (docs/sim_to_real.md)."""

    def __init__(self, *args, busy: tuple[float, float], factor: float, **kw) -> None:
        super().__init__(*args, **kw)
        self.busy, self.factor, self.iterations = busy, factor, 0

    def step(self):
        r = super().step()
        if self.busy[0] <= self.iterations < self.busy[1]:
            self._now += r.duration * (self.factor - 1.0)
            r.duration *= self.factor
        self.iterations += r.num_iterations
        return r


def _probe_grid():
    from batchpilot.schemas.calibrate import Grid

    return Grid(batch_sizes=(1, 2, 4, 8, 16, 32), contexts=(16, 128), context_spread=0.5, max_decode_tokens=8192,
                decode_steps=6, mixed_batches=(8,), mixed_chunks=(256,), mixed_repeats=2,
                chunks=(64, 512, 1024), priors=(0,), prefill_reqs=(1, 2), prefill_repeats=2)


def _cpu_tiny(**busy) -> SimEngine:
    hw = HardwareSpec.from_cfg(load_config(["hardware=cpu_tiny"]).hardware)
    cfg = SimEngineConfig(block_size=32, max_num_batched_tokens=2048, max_num_seqs=256)
    return _BusyHost(hw, TINY, cfg, **busy) if busy else SimEngine(hw, TINY, cfg)


def test_mixed_points_that_do_not_fit_the_token_budget_are_skipped_not_an_error() -> None:
    """``b`` decodes plus a ``c``-token prefill over the 2,048-token budget cannot be one
    iteration: the grid leaves that pair out (as it does prefill points), and measures the rest."""
    import dataclasses

    from batchpilot.evaluation.calibration import measure_grid

    grid = dataclasses.replace(_probe_grid(), batch_sizes=(8, 64), contexts=(16,), mixed_batches=(8, 64),
                               mixed_chunks=(256, 2000), chunks=(64,), prefill_reqs=(1,))
    mixed = sorted(s.label for s in measure_grid(_cpu_tiny(), grid, 32) if s.kind == "mixed")
    assert len(mixed) == 3 and not any(m.startswith("mixed b=64") and m.endswith("2000") for m in mixed)


@pytest.mark.parametrize(("start", "until"), [(60, 400), (350, 10**9)])
def test_the_state_probe_retakes_or_sets_aside_points_measured_on_a_busy_host(start: int, until: int) -> None:
    """A stretch of 2.5x slower iterations from the grid's ``start``-th iteration on: with the state
    probe the points it hit are measured again once it has passed and then equal the quiet
    host's measurements; if it never passes they carry their slow state and the fit leaves them
    out."""
    from batchpilot.evaluation.calibration import StateMeter, fit_set, measure_grid
    from batchpilot.schemas.calibrate import StateProbe

    grid = _probe_grid()
    quiet = measure_grid(_cpu_tiny(), grid, 32)
    probe = StateProbe(enabled=True, batch=8, context=64, steps=4, tolerance=0.2, retries=2, max_runs=6)
    busy = _cpu_tiny(busy=(start, until), factor=2.5)
    first_pass: list[IterationSample] = []
    probed = measure_grid(busy, grid, 32, progress=first_pass.append,
                          meter=StateMeter(busy, probe, grid.context_spread))
    assert [s.label for s in probed] == [s.label for s in quiet]
    hit = [s.label for s in first_pass[:len(quiet)] if s.state > 1.2]
    assert hit and len(hit) < len(quiet), hit  # the stretch hit some points, not the first ones
    slow = [s for s in probed if s.state > 1.2]
    if until < 10**9:  # it passed: every point re-taken in the fast state, as on the quiet host
        assert not slow and len(first_pass) > len(quiet)
        for q, p in zip(quiet, probed):
            assert p.seconds == pytest.approx(q.seconds, rel=1e-6), p.label
    else:  # it never passed: the points from the first one it hit on stay slow
        assert {s.label for s in slow} >= set(hit)
        for q, p in zip(quiet, probed):
            if p.state <= 1.2:
                assert p.seconds == pytest.approx(q.seconds, rel=1e-6), p.label
            else:
                assert p.seconds > 1.5 * q.seconds, p.label
        fast_mixed = sum(s.kind == "mixed" and s.state <= 1.2 for s in probed)
        assert fast_mixed >= 1
        used, note = fit_set(probed, probe.tolerance, min_per_kind=fast_mixed)
        assert len(used) == len(probed) - len(slow) and "left out of the fit" in note
        # Too few fast points of a kind to fit its terms: all are fitted, and the note says so.
        used, note = fit_set(probed, probe.tolerance, min_per_kind=fast_mixed + 1)
        assert len(used) == len(probed) and "busy throughout" in note


def test_compared_runs_keep_the_fast_state_unless_too_few() -> None:
    from batchpilot.evaluation.sim_to_real import compared_runs

    assert compared_runs([1.0, 1.9, 1.05, 1.1], 0.2, runs=3) == [0, 2, 3]
    assert compared_runs([1.0, 1.9, 1.05, 1.1], 0.2, runs=2) == [0, 2]
    assert compared_runs([1.9, 1.0, 2.2], 0.2, runs=3) == [0, 1, 2]  # one fast run: all compared
    assert compared_runs([float("nan")] * 3, 0.2, runs=3) == [0, 1, 2]  # not probed


def test_the_fast_state_is_anchored_on_a_quantile_of_the_probes() -> None:
    """One lucky probe must not make an idle host read as busy: with ``anchor_quantile`` the
    fast state is that quantile of the probes; 0 keeps the fastest; the report's floor (the
    profile's own prediction of the probe) still wins when it is faster."""
    from batchpilot.evaluation.calibration import StateMeter
    from batchpilot.schemas.calibrate import StateProbe

    kw = dict(enabled=True, batch=8, context=64, steps=4, tolerance=0.2, retries=2, max_runs=6)
    probes = [2.4, *[3.0 + 0.01 * i for i in range(18)], 6.0]  # one outlier, the host's usual ~3 ms, one slow
    fastest = StateMeter(None, StateProbe(**kw), 0.9)  # type: ignore[arg-type]  (no probe is taken)
    tenth = StateMeter(None, StateProbe(**kw, anchor_quantile=0.1), 0.9)  # type: ignore[arg-type]
    for m in (fastest, tenth):
        m.probes.extend(probes)
    assert fastest.anchor_s == 2.4 and fastest.slow(3.05)  # the usual state reads as busy
    assert tenth.anchor_s == pytest.approx(3.0) and not tenth.slow(3.05) and tenth.slow(6.0)
    assert tenth.fastest_s == 2.4 and tenth.count == len(probes)
    tenth.floor_s = 2.8
    assert tenth.anchor_s == 2.8
    with pytest.raises(ValueError, match="anchor_quantile"):
        StateProbe(**kw, anchor_quantile=1.0)


def test_a_missed_target_says_why_and_what_to_change() -> None:
    """Issue 16: a fit that misses a target says exactly why not and what to change."""
    from batchpilot.evaluation.sim_to_real import diagnose

    rows = [
        MetricComparison("azure_conv", "p99_ttft_ms", 15333.0, (14986.0, 11574.0, 21.5)),  # a coin toss
        MetricComparison("burst", "median_tpot_ms", 9.5, (20.0, 10.0, 9.0)),                # a noisy host
        MetricComparison("burst", "output_throughput", 3000.0, (2000.0, 2050.0, 1990.0)),  # sim too fast
        MetricComparison("burst", "median_tpot_ms", 30.0, (20.0, 20.5, 19.8)),             # sim too slow
        MetricComparison("burst", "p99_ttft_ms", 100.0, (98.0, 101.0, 103.0)),              # met
        MetricComparison("burst", "p99_e2el_ms", 900.0, (100.0, 110.0, 90.0)),              # no target
        # One run of six far off (the first, the host slower), the rest within the target.
        MetricComparison("azure_conv", "p99_ttft_ms", 330.9, (5499.0, 449.6, 478.6, 300.4, 368.1, 345.8)),
    ]
    assert [r.verdict for r in rows] == ["spread", "spread", "NO", "NO", "yes", "", "spread"]
    why = diagnose(rows, "cpu_tiny_x")
    assert len(why) == 5
    assert why[0].startswith("azure_conv p99_ttft_ms") and "runs at this machine's capacity" in why[0]
    assert "load_vs_capacity.azure_conv=0.7" in why[0]
    assert "own spread" in why[1] and "runs=5" in why[1]
    assert "simulator is faster" in why[2] and "`cpu_tiny_x` does not describe" in why[2]
    assert "simulator is slower" in why[3]
    assert "one live run is far from the others (run 1: 5499.0" in why[4] and "(-15%)" in why[4]
    # A workload already sized off capacity is told to move further from where it is.
    sized = diagnose(rows[:1], "cpu_tiny_x", {"azure_conv": 0.65})
    assert "sized at 65%" in sized[0] and "load_vs_capacity.azure_conv=0.52" in sized[0]
    # Every compared run in the slow state and the simulator faster: the state, not the profile.
    slow = diagnose(rows[2:4], "cpu_tiny_x", slow_states={"burst": [1.53, 1.78]})
    assert "every run was in this machine's slow state" in slow[0] and "1.53-1.78x" in slow[0]
    assert "simulator is slower" in slow[1]  # slower than a slow machine: still the profile


def test_a_miss_is_split_into_the_engines_speed_and_the_simulators_scheduling() -> None:
    """The live runs' own iterations priced by the profile (``EngineSpeed``) say whether the
    engine ran slower than the profile, and the simulator at that speed whether speed is the
    whole gap: three different reasons, three different changes."""
    from batchpilot.evaluation.calibration import EngineSpeed
    from batchpilot.evaluation.sim_to_real import diagnose

    live = (2000.0, 2050.0, 1990.0)
    slow_engine = EngineSpeed(1.24, 1.26, 1.20, 5741)
    on_speed = EngineSpeed(1.03, 1.02, 1.05, 5741)
    # Slower engine, and at its speed the simulator is within the target: speed is the gap.
    why = diagnose([MetricComparison("burst", "output_throughput", 2600.0, live, 2033.0)], "p",
                   speeds={"burst": slow_engine})
    assert "took 1.24x the time `p` gives them (decode-only 1.26x, with a prefill 1.20x)" in why[0]
    assert "within the target (+1%)" in why[0] and "the engine's speed is the whole gap" in why[0]
    assert "found compared runs in the fast state" in why[0] and "`p` is too fast" in why[0]
    # ... and the probe saw the slow state: the host is named, not the profile.
    why = diagnose([MetricComparison("burst", "output_throughput", 2600.0, live, 2033.0)], "p",
                   slow_states={"burst": [1.4, 1.5]}, speeds={"burst": slow_engine})
    assert "1.40-1.50x the fast state" in why[0] and "report again when the host is quiet" in why[0]
    # At capacity, the measured speed says how close to the engine's own capacity the load was.
    coin = MetricComparison("burst", "p99_ttft_ms", 107.0, (535.0, 11291.0, 2677.0), 2523.0)
    why = diagnose([coin], "p", {"burst": 0.65}, speeds={"burst": slow_engine})
    assert "1.24x its time on the runs' own iterations: about 81% of the engine's own capacity" in why[0]
    # Slower engine, but even at its speed the simulator misses: scheduling too.
    why = diagnose([MetricComparison("burst", "output_throughput", 2600.0, live, 2400.0)], "p",
                   speeds={"burst": slow_engine})
    assert "Even at that speed the simulator is +19%" in why[0]
    # The engine at the profile's speed and the simulator at it still off: the scheduler model.
    why = diagnose([MetricComparison("burst", "output_throughput", 2600.0, live, 2590.0)], "p",
                   speeds={"burst": on_speed})
    assert "ran at the profile's speed" in why[0] and "the scheduler model, not the profile" in why[0]
    # A small speed difference that near capacity is the whole TPOT gap is called speed, not
    # scheduling (seen live: 1.06x, TPOT -17 %, the simulator at 1.06x -0.3 %).
    tpot = MetricComparison("burst", "median_tpot_ms", 4.86, (5.56, 6.18), 5.85)
    why = diagnose([tpot], "p", speeds={"burst": EngineSpeed(1.06, 1.03, 1.14, 12000)})
    assert "the engine's speed is the whole gap" in why[0] and "scheduler model" not in why[0]


def test_engine_speed_prices_each_iteration_with_the_profile() -> None:
    from batchpilot.envs.step_time import StepTimeModel
    from batchpilot.evaluation.calibration import EngineSpeed

    hw = HardwareSpec.from_cfg(load_config(["hardware=cpu_tiny"]).hardware)
    st = StepTimeModel.build(hw, ModelSpec.from_cfg(load_config(["model=tiny_llama"]).model), "auto", 2048, 256)
    decode = IterationShape(0, 0.0, 0.0, 32, 32 * 300.0, 32, 0.0)
    mixed = IterationShape(256, 256 * 257 / 2, 256.0, 16, 16 * 300.0, 17, 0.0)
    # The decode iterations ran 1.5x the profile's time, the mixed ones exactly at it.
    log = [replace(decode, seconds=1.5 * st.iteration_time(decode))] * 3 + \
          [replace(mixed, seconds=st.iteration_time(mixed))]
    speed = EngineSpeed.of(log, st)
    assert speed.decode_only == pytest.approx(1.5) and speed.with_prefill == pytest.approx(1.0)
    total = 3 * st.iteration_time(decode) + st.iteration_time(mixed)
    assert speed.factor == pytest.approx((4.5 * st.iteration_time(decode) + st.iteration_time(mixed)) / total)
    assert speed.iterations == 4
    assert np.isnan(EngineSpeed.of(log[:1], st).with_prefill)
    with pytest.raises(CalibrationError, match="no iterations"):
        EngineSpeed.of([], st)


def test_a_load_sized_to_capacity_offers_that_share_of_what_the_profile_serves() -> None:
    """``load_vs_capacity``: the rate factor puts the workload's mean load at the asked share of
    the simulated engine's saturated rate at the controller's cap, whatever its own rate was."""
    from batchpilot.evaluation.calibration import CalibrationError
    from batchpilot.evaluation.sim_to_real import capacity_scale

    cal = load_config([], config_name="calibrate")
    sim = load_config([*cal.sim_overrides, *cal.common_overrides, *cal.workloads["azure_conv"]])
    sim.control.initial_batch_cap = 64
    scale, offered, capacity = capacity_scale(sim, 0.65)
    assert offered > 0 and capacity > 0
    assert scale * offered == pytest.approx(0.65 * capacity)
    # Doubling the workload's own rate halves the factor: the sized load stays where it was.
    sim.workload.rate_scale = 2 * float(sim.workload.rate_scale)
    scale2, offered2, capacity2 = capacity_scale(sim, 0.65)
    assert offered2 == pytest.approx(2 * offered, rel=0.02)
    assert scale2 * offered2 == pytest.approx(scale * offered, rel=0.05)
    with pytest.raises(CalibrationError, match="must be > 0"):
        capacity_scale(sim, 0.0)


def test_a_load_share_for_a_workload_the_report_does_not_run_is_an_error() -> None:
    from rich.console import Console

    from batchpilot.evaluation.calibration import CalibrationError
    from batchpilot.evaluation.sim_to_real import run_report

    cfg = load_config(["+load_vs_capacity.azure_cnv=0.6"], config_name="calibrate")
    with pytest.raises(CalibrationError, match=r"\['azure_cnv'\], not among the workloads"):
        run_report(cfg, Console(quiet=True))
