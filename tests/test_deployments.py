"""Deployment randomisation (``env.deployments``): each episode on a drawn model/hardware pair,
its load sized to that pair's capacity; off by default."""

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from batchpilot.config import load_config
from batchpilot.envs.capacity import CapacityProbeError, saturated_rate
from batchpilot.envs.engines import EngineFactory
from batchpilot.envs.serving_env import ServingEnv

PAIRS = ["llama3_8b/h100", "llama3_8b/a100_80gb", "tiny_llama/cpu_tiny"]


@pytest.fixture(scope="module")
def env():
    e = ServingEnv(cfg=load_config([f"env.deployments=[{','.join(PAIRS)}]", "env.episode_s=10"]))
    yield e
    e.close()


def test_off_by_default():
    cfg = load_config()
    assert list(cfg.env.deployments) == []
    e = ServingEnv(cfg=cfg)
    e.reset(seed=0)
    assert e.deployments is None and e.deployment is None
    e.close()


def test_episodes_draw_deployments_deterministically_per_seed(env):
    drawn = {}
    for seed in range(12):
        env.reset(seed=seed)
        drawn[seed] = env.deployment.label
        d = env.deployment
        assert env.engine.capabilities().max_model_len == env._caps.max_model_len
        assert env.rate_scale == pytest.approx(float(env.cfg.env.rate_scale) * d.load_multiplier)
        base = float(env.cfg.workload.get("rate_scale", 1.0))
        assert float(d.workload.rate_scale) == pytest.approx(base * d.load_multiplier)
    assert set(drawn.values()) == set(PAIRS)  # 12 draws of 3 pairs
    for seed in (3, 7):
        env.reset(seed=seed)
        assert env.deployment.label == drawn[seed]
    # The engine really is the drawn model: the tiny model's context is 2048 tokens.
    seed = next(s for s, lab in drawn.items() if lab == "tiny_llama/cpu_tiny")
    env.reset(seed=seed)
    assert env._caps.max_model_len == 2048


def test_load_is_sized_by_capacity(env):
    mult = {d.label: d.load_multiplier for d in env.deployments.deployments}
    assert mult["llama3_8b/h100"] == pytest.approx(1.0)  # the config's own deployment
    assert 0.2 < mult["llama3_8b/a100_80gb"] < 0.9  # an A100 serves fewer requests/s than an H100


def test_env_checker_passes_with_deployments(env):
    check_env(env, skip_render_check=True)


def test_rollout_across_deployments_stays_in_the_spaces(env):
    for seed in range(4):
        obs, _ = env.reset(seed=seed)
        done = False
        while not done:
            assert env.observation_space.contains(obs)
            obs, _, term, trunc, info = env.step(env.action_space.sample(mask=None))
            done = term or trunc
        assert np.isfinite(info["episode_metrics"]["request_throughput"])


@pytest.mark.parametrize("bad, match", [
    ("llama3_8b", "not MODEL/HARDWARE"),
    ("llama3_8b/h100/x", "not MODEL/HARDWARE"),
    ("no_such_model/h100", "no_such_model"),
])
def test_bad_deployments_say_what_is_wrong(bad, match):
    with pytest.raises(ValueError, match=match):
        ServingEnv(cfg=load_config([f"env.deployments=[{bad}]"]))


def test_capacity_probe_needs_requests():
    cfg = load_config()
    engine = EngineFactory(cfg)()
    with pytest.raises(CapacityProbeError, match="no requests"):
        saturated_rate(engine, [], 8)


def test_the_live_engine_refuses_deployment_randomisation():
    """Checked before any engine starts: a live engine runs its own model."""
    cfg = load_config(["engine=vllm", "env.deployments=[llama3_8b/h100]"])
    with pytest.raises(ValueError, match="needs the simulator"):
        ServingEnv(cfg=cfg)
