"""Metrics as users read them, on real simulated episodes: goodput over the arrival window (a
drain after it does not count), SLO attainment over every offered request (a refused one is a
miss), refusal rate, attainment per prompt bucket and per token, and the capacity bound at the
SLO (``envs/capacity.py``), each checked against figures recomputed here from the episode's
requests."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchpilot.config import load_config
from batchpilot.core.engine import Engine
from batchpilot.core.telemetry import SLO
from batchpilot.envs.capacity import capacity_bound, closed_loop_goodput, saturated_rate, slo_rate
from batchpilot.envs.serving_env import ServingEnv
from batchpilot.metrics import length_buckets
from batchpilot.policies.controllers import build_controller

SHORT = ["env.episode_s=20", "workload.duration_s=20", "env.drain_on_truncate=true"]


def make(*overrides: str) -> ServingEnv:
    return ServingEnv(cfg=load_config([*SHORT, *overrides]))


def episode(env: ServingEnv, seed: int = 2, policy: str | None = None) -> dict[str, float]:
    """One episode of the config's controller (or conf/policy/``policy``); its episode metrics."""
    node = env.cfg.policy if policy is None else load_config([f"policy={policy}"]).policy
    ctl = build_controller(node, env.engine.capabilities().max_num_seqs)
    env.reset(seed=seed)
    ctl.reset(env.knobs)
    while True:
        _, _, term, trunc, info = env.step_proposal(ctl.decide(env.snapshot, env.knobs))
        if term or trunc:
            return info["episode_metrics"]


def met_requests(env: ServingEnv) -> list:
    return [r for r in env.finished_requests if env.slo.met(r.ttft, r.tpot, r.e2el)]


def test_a_drain_after_the_window_is_outside_goodputs_denominator():
    """Overloaded, the backlog drains well past the 20 s window: goodput is the SLO-met requests
    over the window, not over the run (which the old figure, ``request_goodput_run``, divided by)."""
    env = make("workload=bursty", "workload.rate_scale=4")
    m = episode(env)
    good = len(met_requests(env))
    assert good > 0
    assert m["window_s"] == pytest.approx(20.0)
    assert m["duration_s"] > 25.0  # the drain ran past the window
    assert m["request_goodput"] == pytest.approx(good / 20.0)
    assert m["request_goodput_run"] == pytest.approx(good / m["duration_s"])
    assert m["request_goodput"] > m["request_goodput_run"]


def test_a_longer_drain_changes_the_runs_length_but_not_goodput():
    """The same episode drained at the last knobs and drained under control ends at other times;
    the window, and so goodput per met request, is the same 20 s."""
    runs = {c: episode(make("workload=bursty", "workload.rate_scale=4", f"env.drain_controlled={c}"))
            for c in (False, True)}
    for m in runs.values():
        assert m["request_goodput"] * 20.0 == pytest.approx(round(m["request_goodput"] * 20.0))
        assert m["window_s"] == pytest.approx(20.0)
    assert runs[False]["duration_s"] != pytest.approx(runs[True]["duration_s"])


def test_refused_requests_are_misses_and_the_refusal_rate_counts_them():
    """A short queue under overload refuses requests: each one counts in the offered requests
    attainment is over, so attainment is below the completed-only figure by exactly that."""
    env = make("workload=bursty", "workload.rate_scale=4", "env.admission.max_queue_len=8")
    m = episode(env)
    offered = len(env.stream)
    good = len(met_requests(env))
    assert m["offered"] == offered and m["rejected"] > 0
    assert m["completed"] + m["rejected"] == offered
    assert m["slo_attainment"] == pytest.approx(good / offered)
    assert m["refusal_rate"] == pytest.approx(m["rejected"] / offered)
    assert m["slo_attainment_completed"] == pytest.approx(good / m["completed"])
    assert m["slo_attainment"] < m["slo_attainment_completed"]


def test_refusing_everything_gives_zero_attainment_and_goodput():
    """Admission that lets nothing in (every prompt counts as long, none may run; waiting past
    0.5 s times out): nothing completes, every request is refused, and the figures say so."""
    env = make("workload=bursty", "env.admission.long_prompt_threshold=0", "env.admission.max_num_long=0",
               "env.admission.max_wait_s=0.5")
    m = episode(env)
    assert m["offered"] == len(env.stream) > 0
    assert m["completed"] == 0 and m["rejected"] == m["offered"]
    assert m["slo_attainment"] == 0.0 and m["request_goodput"] == 0.0
    assert m["refusal_rate"] == 1.0 and m["slo_attainment_tokens"] == 0.0
    assert m["capacity_bound"] > 0 and m["share_of_bound"] == 0.0
    assert math.isnan(m["slo_attainment_completed"])  # over no completed request: not a number


def test_attainment_per_prompt_bucket_and_per_token_match_the_episodes_requests():
    """Buckets at admission's edges (``env.admission.boundaries``, moved here so that an 8k-token
    model draws all three), over the offered requests of each; token-weighted over every offered
    request's prompt + output tokens."""
    env = make("workload=bursty", "workload.rate_scale=3", "workload.lengths.prompt_mean=1500",
               "env.admission.max_queue_len=16", "env.admission.boundaries=[512,2048]",
               "env.admission.weights=[0.5,0.3,0.2]")
    m = episode(env)
    edges = env.admission_cfg.boundaries
    assert edges == (512, 2048)
    offered = length_buckets(env.stream.prompt_len, edges)
    met = met_requests(env)
    met_b = length_buckets(np.array([r.prompt_len for r in met]), edges)
    for i, name in enumerate(("short", "medium", "long")):
        n = int((offered == i).sum())
        assert n > 0, name
        assert m[f"slo_attainment_{name}"] == pytest.approx(int((met_b == i).sum()) / n)
    tokens = float((env.stream.prompt_len + env.stream.output_len).sum())
    assert m["slo_attainment_tokens"] == pytest.approx(sum(r.prompt_len + r.output_len for r in met) / tokens)


def test_buckets_follow_admissions_edges():
    """< first edge short, >= last edge long, between medium (Admission.bucket_of's rule)."""
    got = length_buckets(np.array([1, 1023, 1024, 8191, 8192, 10**6]), (1024, 8192))
    assert got.tolist() == [0, 0, 1, 1, 2, 2]
    assert length_buckets(np.array([5, 50]), (10,)).tolist() == [0, 2]  # two buckets: no medium
    with pytest.raises(ValueError, match="bucket edges"):
        length_buckets(np.array([5]), ())


def test_capacity_bound_sums_min_of_arrivals_and_capacity_per_interval():
    arrivals = np.array([0.1, 0.2, 0.3, 0.9, 1.5, 2.2, 2.3, 3.0, 3.5])
    # Intervals of 1 s over a 3.5 s window: 4, 1, 2 and 1 (the 0.5 s rest; 3.5 is past it).
    # At 2 req/s: min(4, 2) + min(1, 2) + min(2, 2) + min(1, 1) = 6.
    assert capacity_bound(arrivals, 3.5, 1.0, 2.0) == pytest.approx(6.0)
    assert capacity_bound(arrivals, 3.5, 1.0, 100.0) == pytest.approx(8.0)  # every arrival
    assert capacity_bound(arrivals, 3.5, 1.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="capacity"):
        capacity_bound(arrivals, 3.5, 1.0, math.inf)
    with pytest.raises(ValueError, match="classes"):
        capacity_bound(arrivals, 3.5, 1.0, [1.0, 2.0], np.full(arrivals.size, 2))


def test_capacity_bound_spends_each_interval_on_the_fastest_class_first():
    """Two classes: short (4 req/s when the engine does only them) and long (1 req/s). In 1 s:
    3 shorts cost 0.75 s, the rest (0.25 s) serves 0.25 of a long; 2 longs alone cost 2 s."""
    arrivals = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 1.1, 1.2])
    classes = np.array([0, 0, 0, 1, 1, 1, 1])
    assert capacity_bound(arrivals, 2.0, 1.0, [4.0, 1.0], classes) == pytest.approx(3.25 + 1.0)
    assert capacity_bound(arrivals, 2.0, 1.0, [1.0, 4.0], 1 - classes) == pytest.approx(3.25 + 1.0)  # by rate
    assert capacity_bound(arrivals, 2.0, 1.0, [4.0, 0.0], classes) == pytest.approx(3.0)
    assert capacity_bound(arrivals, 2.0, 1.0, [4.0], np.zeros(7, int)) == capacity_bound(arrivals, 2.0, 1.0, 4.0)
    with pytest.raises(ValueError, match="window_s"):
        capacity_bound(arrivals, 0.0, 1.0, 1.0)


def _probe_requests(env: ServingEnv) -> list:
    env.reset(seed=0)
    return env.stream.pop_until(math.inf)


def test_capacity_at_the_slo_is_below_saturation_and_zero_for_an_slo_nobody_meets():
    env = make("workload=bursty")
    reqs = _probe_requests(env)

    def new() -> Engine:
        return env._new_engine()

    top = env.engine.capabilities().max_num_seqs
    rate, conc = slo_rate(new, reqs, top, env.slo)
    assert 0 < rate and 1 <= conc <= top
    assert slo_rate(new, reqs, top, env.slo) == (rate, conc)  # deterministic: one figure per cell
    eng = new()
    try:
        sat = saturated_rate(eng, reqs, top)
    finally:
        eng.close()
    assert rate <= sat * 1.05  # SLO-met requests/s cannot beat finishing everything, saturated
    assert slo_rate(new, reqs, top, SLO(ttft_ms=1e-3, tpot_ms=None))[0] == 0.0
    eng = new()
    try:
        # No objective: every finish counts, and one at a time is slower than the best.
        one = closed_loop_goodput(eng, reqs, 1, SLO(ttft_ms=None, tpot_ms=None), 50)
    finally:
        eng.close()
    assert 0 < one < slo_rate(new, reqs, top, SLO(ttft_ms=None, tpot_ms=None))[0]


def test_every_controller_of_a_cell_gets_the_same_bound_and_it_caps_the_offered_rate():
    env = make("workload=bursty", "workload.rate_scale=2")
    a = episode(env, policy="pid")
    b = episode(env, policy="vllm_default")
    assert a["capacity_bound"] == b["capacity_bound"] and a["slo_capacity"] == b["slo_capacity"]
    assert 0 < a["capacity_bound"] <= a["offered"] / a["window_s"] + 1e-9
    for m in (a, b):
        assert m["share_of_bound"] == pytest.approx(m["request_goodput"] / m["capacity_bound"])


def test_training_episodes_skip_the_probe():
    """Without ``drain_on_truncate`` (training) the bound is not measured: NaN, no probe cost."""
    env = ServingEnv(cfg=load_config(["env.episode_s=10", "workload.duration_s=10", "workload=bursty"]))
    m = episode(env)
    assert math.isnan(m["capacity_bound"]) and math.isnan(m["share_of_bound"])
    assert not math.isnan(m["slo_attainment"])


def _row(pol: str, wl: str, seed: int, goodput: float) -> dict:
    from batchpilot.evaluation import report as rep

    return {**dict.fromkeys(rep.METRIC_KEYS, 0.5), "policy": pol, "workload": wl, "model": "m", "hardware": "h",
            "seed": seed, "request_goodput": goodput}


def test_results_md_divides_by_vllm_tuned_and_falls_back_to_vllm_default_saying_so():
    from batchpilot.evaluation import report as rep

    rows = [_row(p, wl, s, g * k) for wl, k in (("a", 1.0), ("b", 2.0)) for s in (0, 1)
            for p, g in (("ppo", 4.0), ("vllm_tuned", 2.0), ("vllm_default", 1.0))]
    table, summary = rep.reference_comparison(rows)
    assert "Reference: vllm_tuned." in summary and "ppo / vllm_tuned 2.000× (2 cells)" in summary
    assert summary.index("ppo /") < summary.index("vllm_default /")  # PPO's ratio first
    assert "| a | m/h | ppo | 4.00 | 2.00 | 0.500 | 0.500 | 0.500 |" in table
    md = rep.results_markdown(rows, [], [0, 1], [3])
    assert table in md and "refusal rate" in md
    untuned = [r for r in rows if r["policy"] != "vllm_tuned"]
    _, summary = rep.reference_comparison(untuned)
    assert "vllm_tuned did not run: vLLM as shipped is the reference" in summary
    assert "ppo / vllm_default 4.000× (2 cells)" in summary
    assert rep.reference_comparison([r for r in untuned if r["policy"] == "ppo"]) == ("", "")
