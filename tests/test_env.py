"""ServingEnv on the simulator: Gymnasium conventions, the info contract, masking, the shield's
invariants under random and adversarial actions, determinism and request accounting."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import batchpilot.envs  # noqa: F401  (registers the id)
from batchpilot.config import load_config
from batchpilot.core.engine import KV_DTYPES_8BIT
from batchpilot.core.knobs import BUCKETING_MODES
from batchpilot.envs import ENV_ID
from batchpilot.envs.serving_env import ServingEnv
from batchpilot.policies.controllers import build_controller

SHORT = ["env.episode_s=20", "workload.duration_s=20"]


def make(*overrides: str) -> ServingEnv:
    return ServingEnv(cfg=load_config([*SHORT, *overrides]))


def test_registered_default_is_the_simulator_and_passes_check_env():
    env = gym.make(ENV_ID)
    assert env.unwrapped.cfg.engine.kind == "sim"
    check_env(env.unwrapped, skip_render_check=False)
    env.close()


def test_info_contract_and_observation_bounds():
    env = make()
    obs, info = env.reset(seed=1)
    assert env.observation_space.contains(obs)
    for _ in range(10):
        obs, r, term, trunc, info = env.step(env.action_space.sample())
        assert env.observation_space.contains(obs) and math.isfinite(r)
        assert {"batch_cap", "bucketing", "kv_dtype"} <= set(info["knobs"])
        assert 0.0 <= info["predicted_memory_fraction"] <= 0.8 + 1e-9
        assert isinstance(info["shield"], dict)
        assert set(info["reward_terms"]) >= {"throughput", "latency", "memory", "slo_miss"}


def test_same_seed_same_episode():
    def rollout(seed: int) -> list[float]:
        env = make()
        env.action_space.seed(seed)
        obs, _ = env.reset(seed=seed)
        out = [float(obs.sum())]
        for _ in range(15):
            obs, r, *_ = env.step(env.action_space.sample())
            out += [float(obs.sum()), r]
        return out

    assert rollout(3) == rollout(3)
    assert rollout(3) != rollout(4)


def test_unavailable_dtype_is_masked_and_reported_never_mapped():
    env = make("hardware.kv8_dtypes=[int8_per_token_head]", "env.kv8_dtype=fp8")
    env.reset(seed=0)
    mask = env.action_masks()
    assert mask.tolist()[-1] is False  # "8-bit" (fp8 here) is masked
    assert "fp8" in env.unavailable and "h100" in env.unavailable["fp8"].lower()
    # Choosing it anyway: the shield refuses, reports it, and the dtype stays 16-bit.
    _, _, _, _, info = env.step(np.array([2, 0, 2]))
    assert info["knobs"]["kv_dtype"] == "auto"
    assert any("fp8" in str(v) for v in info["shield"].values())


def test_8bit_switch_pays_off_where_kv_binds_and_charges_the_restart():
    # Llama-3-70B on A100-80GB with ~4k prompts is KV-bound: 8-bit KV doubles the blocks, the
    # gain repays the model's 120 s restart, and the shield allows it.
    # Core traffic (priority 0): the breaker never sheds it, so the backlog that makes the switch
    # pay stays (untagged traffic, shed at level 2, leaves no demand for the gain to repay).
    env = make("model=llama3_70b", "hardware=a100_80gb", "workload=poisson",
               "workload.lengths.prompt_mean=4000", "env.episode_s=300",
               "workload.duration_s=300", "shield.min_dtype_dwell_s=0", "workload.priorities=[1.0]")
    env.reset(seed=0)
    blocks16 = env.engine.memory_model().num_kv_blocks_total
    for _ in range(50):
        t0 = env.engine.now
        _, _, _, _, info = env.step(np.array([4, 0, 2]))
        if info["knobs"]["kv_dtype"] in KV_DTYPES_8BIT:
            break
    else:
        pytest.fail(f"8-bit KV never applied: {env.shield.num_interventions}")
    assert env.engine.memory_model().num_kv_blocks_total > 1.8 * blocks16
    # The restart is charged in engine time: the intervals go on while nothing runs.
    restart_s = float(env.cfg.model.restart_base_s)
    assert env.engine.now == pytest.approx(t0 + env.interval_s)
    down = [env.step(np.array([2, 0, 0]))[4]["metrics"]["output_throughput"] for _ in range(int(restart_s) - 2)]
    assert max(down) == 0.0 and env.engine.down_until == pytest.approx(t0 + restart_s)
    while env.engine.now < t0 + restart_s + 5:
        env.step(np.array([2, 0, 0]))
    assert env.snapshot.output_throughput > 0  # back up
    assert env.episode_metrics()["dtype_switches"] == 1.0


@pytest.mark.parametrize("start_dwell", [True, False])
def test_a_chosen_start_dtype_starts_the_dwell(start_dwell: bool):
    """``env.start_dtype_dwell`` (an evaluation sets it for a policy whose start dtype it chose,
    ``kv_start``): the shield's dwell runs from the start, so a switch back is refused for
    ``min_dtype_dwell_s``; without it the first switch needs no dwell."""
    env = make("engine.kv_dtype=fp8", f"env.start_dtype_dwell={str(start_dwell).lower()}")
    env.reset(seed=0)
    assert env.knobs.kv_dtype == "fp8"
    _, _, _, _, info = env.step(np.array([2, 0, 1]))  # ask for 16-bit KV
    assert ("dtype_dwell" in info["shield"]) is start_dwell
    if start_dwell:
        assert info["knobs"]["kv_dtype"] == "fp8" and env.shield.num_interventions["dtype_dwell"] == 1


def test_8bit_refused_where_it_gains_nothing():
    # Llama-3-8B on H100: max_num_seqs binds before KV does, so the restart is not worth it.
    env = make("shield.min_dtype_dwell_s=0")
    env.reset(seed=0)
    for _ in range(15):
        _, _, _, _, info = env.step(np.array([4, 0, 2]))
        assert info["knobs"]["kv_dtype"] == "auto"
    assert env.shield.num_interventions["dtype_not_worth"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("adversarial", [False, True])
def test_10k_steps_never_break_the_shield(adversarial: bool):
    """Random and adversarial (always max up / always flip dtype) actions, 10,000 steps."""
    env = make("env.episode_s=50", "workload.duration_s=50")
    env.reset(seed=7)
    rng = np.random.default_rng(7)
    max_seqs = env.engine.capabilities().max_num_seqs
    prev_cap = env.knobs.batch_cap
    for i in range(10_000):
        if adversarial:
            a = np.array([4 if (i // 50) % 2 == 0 else 0, rng.integers(3), 1 + i % 2])
        else:
            a = env.action_space.sample()
        _, _, term, trunc, info = env.step(a)
        cap = info["knobs"]["batch_cap"]
        assert 1 <= cap <= max_seqs
        assert abs(cap - prev_cap) <= max(1, math.floor(0.3 * prev_cap)), (prev_cap, cap, info["shield"])
        assert info["predicted_memory_fraction"] <= 0.8 + 1e-9
        assert info["knobs"]["bucketing"] in BUCKETING_MODES
        prev_cap = cap
        if term or trunc:
            env.reset()
            prev_cap = env.knobs.batch_cap


def _controlled_episode(env, seed: int) -> tuple[int, dict]:
    """One episode of the config's controller from reset(seed): its steps and the last info."""
    ctl = build_controller(env.cfg.policy, env.engine.capabilities().max_num_seqs)
    env.reset(seed=seed)
    ctl.reset(env.knobs)
    steps = 0
    while True:
        _, _, term, trunc, info = env.step_proposal(ctl.decide(env.snapshot, env.knobs))
        steps += 1
        if term or trunc:
            return steps, info

def test_every_request_ends_finished_or_rejected_with_drain():
    env = make("env.drain_on_truncate=true", "workload=bursty", "workload.duration_s=20")
    _, info = _controlled_episode(env, seed=2)
    arrived = len(env.stream)
    m = info["episode_metrics"]
    assert m["completed"] + m["rejected"] == arrived
    assert m["completed"] > 0.5 * arrived



def test_ttft_splits_into_the_admission_wait_and_the_engines_part():
    """The episode says where TTFT went, as a live run's gateway and vLLM do: the mean wait in
    admission plus the mean from admission to the first token is the mean TTFT (every admitted
    request finished here), and the engine's iterations and their tokens are counted."""
    env = make("env.drain_on_truncate=true", "workload=bursty", "workload.duration_s=20", "workload.rate_scale=4")
    _, info = _controlled_episode(env, seed=2)
    m = info["episode_metrics"]
    assert m["mean_admission_wait_ms"] > 0 and m["mean_engine_ttft_ms"] > 0  # overloaded: both
    assert m["mean_admission_wait_ms"] + m["mean_engine_ttft_ms"] == pytest.approx(m["mean_ttft_ms"], rel=1e-6)
    budget = env.engine.capabilities().max_num_batched_tokens
    assert m["engine_iterations"] > 0 and 0 < m["mean_iteration_tokens"] <= budget


def test_the_first_token_margin_is_measured_on_the_engines_clock():
    """With ``first_token_margin`` the env feeds admission the engine's first-token times: the
    margin is measured (between 0 and the objective's bound) and, overloaded, it changes which
    requests count as late and so the episode; off, nothing is measured."""
    common = ("env.drain_on_truncate=true", "workload=bursty", "workload.duration_s=20", "workload.rate_scale=4")
    on, off = make(*common, "env.admission.first_token_margin=true"), make(*common)
    _, info_on = _controlled_episode(on, seed=2)
    _, info_off = _controlled_episode(off, seed=2)
    adm, ttft_s = on.admission, on.slo.ttft_ms / 1000.0
    assert adm.first_token_s is not None and adm.first_token_s > 0
    assert 0 < adm.late_margin_s <= adm.cfg.first_token_margin_max * ttft_s
    assert off.admission.first_token_s is None and off.admission.late_margin_s == 0.0
    assert info_on["episode_metrics"] != info_off["episode_metrics"]


def test_a_controlled_drain_keeps_the_controller_acting_until_the_last_request():
    """Evaluation as the gateway serves: past the window the controller and the shield keep
    acting each interval until every request is finished or rejected, and the episode's clock
    stops at the last answer; without it the backlog drains at the last knobs."""
    runs = {}
    for controlled in (False, True):
        env = make("env.drain_on_truncate=true", f"env.drain_controlled={controlled}", "workload=bursty",
                   "workload.duration_s=20", "workload.rate_scale=4")
        steps, info = _controlled_episode(env, seed=2)
        m = info["episode_metrics"]
        assert m["completed"] + m["rejected"] == len(env.stream)
        runs[controlled] = (steps, env.max_steps, m, max(f.finish_time for f in env.finished_requests))
    (frozen_steps, n, _, _), (steps, _, m, last) = runs[False], runs[True]
    assert frozen_steps == n < steps  # a backlog was left at the window's end, and controlled
    assert (steps - 1) * env.interval_s < m["duration_s"] <= steps * env.interval_s
    assert m["duration_s"] == pytest.approx(last, abs=1e-9)  # the clock ends at the last answer


@pytest.mark.parametrize("memory_admission", [True, False])
def test_memory_is_checked_per_request_in_the_env_as_in_the_gateway(memory_admission: bool):
    """Long prompts on DeepSeek-V3/H200 at a cap the count alone allows: with the per-request
    check (the default, as the gateway) the predicted memory of what is in flight never passes
    the ceiling; counting only (vLLM as shipped) goes past it."""
    env = make("model=deepseek_v3", "hardware=h200", "workload=poisson", "workload.rate_scale=3",
               "workload.lengths.prompt_mean=6000", f"env.memory_admission={memory_admission}",
               "control.initial_batch_cap=256")
    env.reset(seed=0)
    adm, shield = env.admission, env.shield
    peak = 0.0
    for _ in range(20):
        env.step(np.array([2, 0, 0]))
        frac = shield.blocks_fraction(adm.kv_blocks_in_flight, adm.num_seqs_in_flight, env.knobs.kv_dtype)
        peak = max(peak, frac)
    ceiling = shield.cfg.memory_ceiling
    if memory_admission:
        assert 0.3 < peak <= ceiling
    else:
        assert adm.memory is None and adm.kv_blocks_in_flight == 0  # nothing charged: count only


@pytest.mark.parametrize("hold", [True, False])
def test_prompts_wait_in_admission_not_in_the_engines_queue(hold: bool):
    """Long prompts above capacity at a high cap: with the prefill backlog (the default) the
    engine has about one token budget of prompts ahead of it and the rest wait in admission,
    where its order applies; without it they pile up in the engine's first-come queue."""
    budgets = "1.0" if hold else "null"
    # Clients capped at 1024 tokens: the memory check (charging prompt + max_tokens) leaves room
    # for the pile-up this test is about; none sent (8k a request) it would bind first. Core
    # traffic, which the breaker never sheds, so the pile-up stays in admission.
    env = make("workload=poisson", "workload.rate_scale=3", "workload.lengths.prompt_mean=3000", "workload.priorities=[1.0]",
               "workload.max_tokens.caps=[1024]", "workload.max_tokens.weights=null",
               "control.initial_batch_cap=256", f"env.admission.prefill_backlog_budgets={budgets}")
    env.reset(seed=0)
    budget = env.engine.capabilities().max_num_batched_tokens
    peak_engine_queue = peak_admission_queue = 0
    for _ in range(15):
        env.step(np.array([2, 0, 0]))
        peak_engine_queue = max(peak_engine_queue, env.engine.stats().num_waiting)
        peak_admission_queue = max(peak_admission_queue, env.admission.num_waiting)
        env.admission.check_counts()
    if hold:
        assert env.admission.prefill_hold_tokens == budget
        assert peak_engine_queue <= 10 and peak_admission_queue > 500  # 8192 tokens: a few prompts
    else:
        assert env.admission.prefill_hold_tokens is None and peak_engine_queue > 50
