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
        assert env.rate_scale == pytest.approx(float(env.cfg.control.rate_scale) * d.load_multiplier)
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


def _lengths(prompt: float, output: float) -> list[str]:
    return [f"workload.prompt_mean=[{prompt},{prompt}]", f"workload.output_mean=[{output},{output}]",
            "workload.num_phases=[0,0]", "workload.onoff_prob=0.0", "env.episode_s=200", "workload.duration_s=200"]


@pytest.mark.parametrize("share", [0.5, 1.2])
def test_load_vs_capacity_sizes_the_load_on_the_episodes_own_requests(share):
    # Short and long requests: the same share of capacity is a very different request rate,
    # each within the gamma process's noise of share x (what this engine finishes of them).
    rates = {}
    for name, (prompt, output) in {"short": (200, 50), "long": (4000, 1000)}.items():
        e = ServingEnv(cfg=load_config([f"env.load_vs_capacity=[{share},{share}]", *_lengths(prompt, output)]))
        e.reset(seed=3)
        st = e.stream
        requests = list(st.pop_until(float("inf")))
        engine = EngineFactory(e.cfg)()
        try:
            capacity = saturated_rate(engine, requests, e._max_num_seqs)
        finally:
            engine.close()
        rates[name] = len(requests) / st.duration_s
        assert rates[name] == pytest.approx(share * capacity, rel=0.25), name
        e.close()
    assert rates["short"] > 5 * rates["long"]


def test_load_vs_capacity_draws_the_same_episode_per_seed_and_rejects_bad_bounds():
    e = ServingEnv(cfg=load_config(["env.load_vs_capacity=[0.3,1.5]", "env.episode_s=60", "workload.duration_s=60"]))
    e.reset(seed=5)
    first = (e.stream.arrival_s.copy(), e.stream.prompt_len.copy())
    e.reset(seed=5)
    assert np.array_equal(first[0], e.stream.arrival_s) and np.array_equal(first[1], e.stream.prompt_len)
    e.close()
    bad = ServingEnv(cfg=load_config(["env.load_vs_capacity=[1.5,0.3]", "env.episode_s=60"]))
    with pytest.raises(ValueError, match="env.load_vs_capacity must be"):
        bad.reset(seed=0)
    bad.close()


def test_a_drawn_deployment_brings_its_models_restart_time_to_the_shield():
    # The engine charges the drawn model's restart for a KV switch; the shield's gain gate (and
    # the KV agent's observation) must judge with that one, not the config's own model's.
    e = ServingEnv(cfg=load_config(["env.deployments=[llama3_8b/h100,deepseek_v3/h200]", "env.episode_s=10"]))
    seen = {}
    for seed in range(8):
        e.reset(seed=seed)
        seen[e.deployment.label] = (e.shield_cfg.dtype_restart_s, e.shield.cfg.dtype_restart_s)
    e.close()
    restart = {lab: float(load_config([f"model={lab.split('/')[0]}"]).model.restart_base_s) for lab in seen}
    assert set(seen) == {"llama3_8b/h100", "deepseek_v3/h200"}
    assert restart["deepseek_v3/h200"] > 10 * restart["llama3_8b/h100"]
    for lab, got in seen.items():
        assert got == (restart[lab], restart[lab]), lab


def test_memory_utilization_draws_each_episodes_kv_budget():
    e = ServingEnv(cfg=load_config(["env.memory_utilization=[0.4,0.9]", "env.episode_s=10"]))
    budgets = {}
    for seed in range(10):
        e.reset(seed=seed)
        mm = e.engine.memory_model()
        util = mm.budget_bytes / (float(e.cfg.hardware.memory_gb) * 1e9)
        assert 0.4 - 1e-9 <= util <= 0.9 + 1e-9 and abs(util / 0.05 - round(util / 0.05)) < 1e-6
        assert e.shield.memory.num_kv_blocks_total == mm.num_kv_blocks_total  # the shield sees this engine
        budgets[seed] = (util, mm.num_kv_blocks_total)
    assert len({u for u, _ in budgets.values()}) >= 3
    by_util = sorted(budgets.values())
    assert by_util[0][1] < by_util[-1][1]  # less memory, fewer KV blocks
    e.reset(seed=4)
    assert e.engine.memory_model().num_kv_blocks_total == budgets[4][1]
    e.close()
    for bad in ("[0.9,0.4]", "[0.5,1.2]"):
        env = ServingEnv(cfg=load_config([f"env.memory_utilization={bad}", "env.episode_s=10"]))
        with pytest.raises(ValueError, match="env.memory_utilization must be"):
            env.reset(seed=0)
        env.close()
