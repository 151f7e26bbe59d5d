"""The learned policy's guards: a residual on PID's decision (factor 1 is exactly PID, any
action stays within 0.7-1.3 of PID's cap) and the hand-over to PID outside the training range."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.config import load_config
from batchpilot.core.knobs import BUCKETING_MODES, Knobs
from batchpilot.core.pid import PIDConfig
from batchpilot.core.residual import RESIDUAL_FACTORS, ResidualPID, residual_pid_config
from batchpilot.core.telemetry import FEATURE_NAMES, SLO
from batchpilot.envs.serving_env import ServingEnv
from batchpilot.policies.artifact import PolicyLoadError
from batchpilot.policies.controllers import build_controller
from batchpilot.policies.ppo_controller import PRETRAINED_DIR, PPOController

LOADED = ["workload=bursty", "workload.rate_scale=1.5", "env.episode_s=60", "workload.duration_s=60"]
KEEP_WEIGHTED = BUCKETING_MODES.index("weighted")


def _env(*overrides: str) -> ServingEnv:
    return ServingEnv(cfg=load_config([*LOADED, *overrides]))


def test_factor_one_is_exactly_pid():
    """A residual policy that always picks factor 1 (and PID's bucketing) runs the episode PID
    runs: same knobs every interval, same metrics."""
    res_env, pid_env = _env(), _env()
    res_env.reset(seed=3)
    pid_env.reset(seed=3)
    pid = build_controller(load_config(["policy=pid"]).policy, pid_env.engine.capabilities().max_num_seqs,
                           slo=SLO(ttft_ms=1000.0, tpot_ms=100.0, e2el_ms=None))
    pid.reset(pid_env.knobs)
    caps = set()
    for _ in range(60):
        res_env.step(np.array([2, KEEP_WEIGHTED, 0]))
        pid_env.step_proposal(pid.decide(pid_env.snapshot, pid_env.knobs))
        assert res_env.knobs == pid_env.knobs
        caps.add(pid_env.knobs.batch_cap)
    assert len(caps) > 3  # PID moved the cap: the comparison is not trivially constant
    assert res_env.episode_metrics()["request_goodput"] == pid_env.episode_metrics()["request_goodput"]


@functools.cache
def _shared_env() -> ServingEnv:
    return _env()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 256))
def test_any_factor_stays_within_30_percent_of_pid(batch_actions: list[int], start: int):
    """Whatever the policy picks, its cap is PID's proposal for that interval times the factor
    (0.7..1.3), whatever the shield did to the cap before."""
    env = _shared_env()
    env.reset(seed=5)
    env.knobs = env.knobs.with_(batch_cap=start)
    env.residual.reset(env.knobs)
    for a in batch_actions:
        alone = copy.deepcopy(env.residual).base(env.snapshot, env.knobs)  # PID's cap this interval
        p = env.residual.propose([a, 0, 0], env.snapshot, env.knobs)
        assert p.batch_cap == max(1, round(alone.batch_cap * RESIDUAL_FACTORS[a]))
        env.step_proposal(p)


def test_residual_pid_config_fills_the_slo_and_bounds_the_cap():
    cfg = residual_pid_config(SLO(ttft_ms=500.0, tpot_ms=40.0), max_num_seqs=64)
    assert cfg.metric == "tpot" and cfg.slo_ms == 40.0 and cfg.tpot_slo_ms == 40.0
    assert cfg.max_batch == 64 and cfg.initial_batch_cap == 64
    recorded = dataclasses.asdict(PIDConfig(kp=0.7))
    assert residual_pid_config(SLO(), 512, recorded).kp == 0.7
    with pytest.raises(ValueError, match="unknown keys"):
        residual_pid_config(SLO(), 64, {"kq": 1.0})


def test_a_recorded_pid_moves_its_objectives_with_the_served_slo():
    """A PID recorded at training steers at the same share of the objective it is served at."""
    recorded = dataclasses.asdict(PIDConfig(slo_ms=80.0, tpot_slo_ms=100.0, kp=0.7))
    trained = SLO(ttft_ms=1000.0, tpot_ms=100.0)
    cfg = residual_pid_config(SLO(ttft_ms=500.0, tpot_ms=25.0), 256, recorded, trained)
    assert (cfg.slo_ms, cfg.tpot_slo_ms, cfg.kp) == (20.0, 25.0, 0.7)
    assert residual_pid_config(trained, 256, recorded, trained).slo_ms == 80.0
    # no TPOT objective served: the recorded one stands
    assert residual_pid_config(SLO(tpot_ms=None), 256, recorded, trained).tpot_slo_ms == 100.0


def test_a_policy_serves_the_deployments_slo_not_the_one_it_was_trained_at():
    """Under a tighter SLO than training's, PPO observes latencies relative to it and its PID
    cuts where the trained objective would have let it grow (before, under TPOT 25 ms, it
    steered at 80 ms and was 0.14x PID on a sweep, docs/evaluation.md)."""
    env = _env()
    snap = dataclasses.replace(_snapshot_from(env), tpot_p99_ms=40.0, queue_depth=(20, 0, 0))
    knobs = Knobs(batch_cap=64, bucketing="weighted")
    seqs = env.engine.capabilities().max_num_seqs
    node = load_config(["policy=ppo"]).policy
    trained = build_controller(node, seqs)
    served = build_controller(node, seqs, slo=SLO(ttft_ms=500.0, tpot_ms=25.0, e2el_ms=None))
    assert trained.slo == SLO(ttft_ms=1000.0, tpot_ms=100.0) == trained.trained_slo
    assert served.slo == SLO(ttft_ms=500.0, tpot_ms=25.0) and served.trained_slo == trained.slo
    tpot = FEATURE_NAMES.index("tpot_p99")
    assert trained.observation(snap)[tpot] == pytest.approx(0.4)
    assert served.observation(snap)[tpot] == pytest.approx(1.6)
    assert served._pid_cfg.slo_ms == 25.0 and served._pid_cfg.tpot_slo_ms == 25.0
    for ctl in (trained, served):
        ctl.reset(knobs)
    assert trained.residual.base(snap, knobs).batch_cap > 64 > served.residual.base(snap, knobs).batch_cap


def _shipped_copy(tmp_path: Path, edit) -> Path:
    dst = tmp_path / "policy"
    shutil.copytree(PRETRAINED_DIR, dst)
    m = json.loads((dst / "manifest.json").read_text())
    edit(m["training"]["config"])
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _snapshot_from(env: ServingEnv):
    env.reset(seed=1)
    for _ in range(15):
        env.step(np.array([2, 0, 0]))
    return env.snapshot


def test_outside_the_training_range_pid_sets_the_cap_the_order_stays_and_it_is_counted(tmp_path: Path):
    env = _env()
    snap = _snapshot_from(env)
    n = len(FEATURE_NAMES)
    seqs = env.engine.capabilities().max_num_seqs

    def narrow(cfg: dict) -> None:  # a range nothing real falls in
        cfg["observation_range"] = {"low": [5.0] * n, "high": [5.0] * n}

    ctl = PPOController.from_dir(_shipped_copy(tmp_path, narrow), max_num_seqs=seqs)
    pid = ResidualPID(ctl._pid_cfg)
    knobs = Knobs(batch_cap=40, bucketing="fifo")
    pid.reset(knobs)
    ctl.reset(knobs)
    p = ctl.decide(snap, knobs)
    base = pid.base(snap, knobs)
    assert base.bucketing == "weighted"  # PID's own order (conf/policy/pid.yaml)
    # PID's cap exactly; the order in force stays (None = keep), not PID's configured one
    assert (p.batch_cap, p.bucketing, p.kv_dtype) == (base.batch_cap, None, base.kv_dtype)
    assert ctl.num_fallbacks == 1 and ctl.num_decisions == 1 and ctl.last_fallback


def test_inside_the_training_range_the_policy_acts(tmp_path: Path):
    env = _env()
    snap = _snapshot_from(env)
    n = len(FEATURE_NAMES)

    def wide(cfg: dict) -> None:
        cfg["observation_range"] = {"low": [0.0] * n, "high": [10.0] * n}

    ctl = PPOController.from_dir(_shipped_copy(tmp_path, wide), max_num_seqs=env.engine.capabilities().max_num_seqs)
    ctl.decide(snap, Knobs(batch_cap=40))
    assert ctl.num_fallbacks == 0 and ctl.num_decisions == 1


@pytest.mark.parametrize("bad", [{"low": [0.0]}, {"low": [1.0] * len(FEATURE_NAMES), "high": [0.0] * len(FEATURE_NAMES)},
                                 {"low": ["x"] * len(FEATURE_NAMES), "high": [1.0] * len(FEATURE_NAMES)}])
def test_a_bad_observation_range_is_a_clear_load_error(tmp_path: Path, bad: dict):
    path = _shipped_copy(tmp_path, lambda cfg: cfg.update(observation_range=bad))
    with pytest.raises(PolicyLoadError, match="observation_range"):
        PPOController.from_dir(path, max_num_seqs=64)


def test_each_gateway_lane_corrects_its_own_pid():
    ctl = PPOController.from_dir(None, max_num_seqs=64)
    a, b = ctl.for_lane(0), ctl.for_lane(1)
    assert a is ctl.for_lane(0) and a is not b
    assert a.runtime is b.runtime is ctl.runtime and a.residual is not b.residual


def test_a_residual_policy_starts_near_pid():
    """The untrained actor's most likely cap is PID's (factor 1) and it keeps the KV dtype; the
    bucketing order is left to learning."""
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    from batchpilot.policies.training import build_model, start_at_baseline
    from batchpilot.schemas.train import TrainConfig

    venv = VecNormalize(DummyVecEnv([_env]))
    tc = TrainConfig(n_steps=8, batch_size=8, validation={"seeds": [0], "workloads": {}})
    model = build_model(venv, tc, seed=0)
    start_at_baseline(model, tc.baseline_prior_logit)
    obs = venv.reset()
    acts = np.array([model.predict(obs, deterministic=False)[0][0] for _ in range(200)])
    for i, want in ((0, 2), (2, 0)):  # factor 1, keep KV
        assert np.mean(acts[:, i] == want) > 0.5, (i, np.bincount(acts[:, i]))
    assert all(np.mean(acts[:, 1] == b) > 0.15 for b in range(len(BUCKETING_MODES)))  # bucketing: no prior
    # train.bucketing_prior: the order named leans the same way.
    model = build_model(venv, tc, seed=0)
    start_at_baseline(model, tc.baseline_prior_logit, "shortest_first")
    acts = np.array([model.predict(obs, deterministic=False)[0][0] for _ in range(200)])
    assert np.mean(acts[:, 1] == BUCKETING_MODES.index("shortest_first")) > 0.5, np.bincount(acts[:, 1])
    venv.close()
