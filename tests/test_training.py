"""Training entry point (tiny runs), best-model selection, and PPOController over the shipped
policy."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batchpilot.config import REPO_ROOT
from batchpilot.core.knobs import BUCKETING_MODES, Knobs, Proposal
from batchpilot.core.telemetry import Snapshot
from batchpilot.policies.artifact import PolicyLoadError
from batchpilot.policies.callbacks import selection_key, slo_deficit
from batchpilot.policies.controllers import build_controller
from batchpilot.policies.ppo_controller import PRETRAINED_DIR, PPOController
from batchpilot.policies.runtime import PolicyRuntime

pytest.importorskip("sb3_contrib")

#: A tiny but complete run: two rollouts, short episodes and validation, one evaluation.
TINY = [
    "train.total_timesteps=512",
    "train.n_steps=128",
    "train.batch_size=64",
    "train.n_epochs=2",
    "train.eval_freq=0",
    "train.checkpoint_freq=256",
    "train.progress_bar=false",
    "env.episode_s=16",
    "env.drain_timeout_s=30",
]


def _run_train(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "train.py"), *args],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.mark.slow
def test_multirun_wandb_offline_and_none(tmp_path: Path) -> None:
    """One Hydra multirun, two jobs: logger=wandb leaves an offline run with history under the
    job's output folder, TensorBoard events and a loadable policy; logger=none leaves no W&B."""
    sweep = tmp_path / "sweep"
    proc = _run_train(
        ["-m", *TINY, "train.n_envs=2", "logger=wandb,none", f"hydra.sweep.dir={sweep}"],
        tmp_path,
    )
    job_wandb, job_none = sweep / "0", sweep / "1"

    runs = list((job_wandb / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"expected one offline W&B run, found {runs}\n{proc.stdout[-2000:]}"
    history = list(runs[0].glob("run-*.wandb"))
    assert history and history[0].stat().st_size > 0
    blob = history[0].read_bytes()
    assert b"rollout/ep_rew_mean" in blob and b"eval/mean_request_goodput" in blob  # curves
    assert b"eval/comparison" in blob  # the eval table
    assert list((job_wandb / "tb").rglob("events.out.tfevents.*")), "no TensorBoard event file"

    for job in (job_wandb, job_none):
        rt = PolicyRuntime.from_dir(job / "policy")
        assert rt.act(np.zeros(rt.n_features, dtype=np.float32)).shape == (3,)
        summary = json.loads((job / "comparison.json").read_text())
        assert {r["controller"] for r in summary["rows"]} == {"pid", "ppo"}
        assert (job / "best" / "model.zip").is_file()
        guards = json.loads((job / "policy_guards.json").read_text())  # for scripts/export.py
        cfg = rt.manifest["training"]["config"]
        assert guards["controller"] == cfg["controller"] and guards["observation_range"] == cfg["observation_range"]
        assert cfg["controller"]["action_mode"] == "residual_pid" and len(cfg["observation_range"]["low"]) == rt.n_features
        assert list((job / "checkpoints").glob("model_*_steps.zip"))
    assert not (job_none / "wandb").exists()
    assert not (job_none / "tb").exists()
    assert "request_goodput" in proc.stdout  # the printed comparison table


# --- best-model selection ------------------------------------------------------------------
def _res(goodput: float, att: float) -> dict[str, dict[str, float]]:
    return {"a": {"request_goodput": goodput, "slo_attainment": att}}


def test_selection_prefers_feasible_then_goodput() -> None:
    base = _res(10.0, 0.9)
    assert slo_deficit(_res(12.0, 0.95), base) == 0.0
    assert slo_deficit(_res(12.0, 0.85), base) == pytest.approx(0.05)
    assert slo_deficit(_res(12.0, math.nan), base) == pytest.approx(0.9)
    feasible_low = selection_key(_res(8.0, 0.9), base)
    feasible_high = selection_key(_res(11.0, 0.91), base)
    infeasible_high = selection_key(_res(50.0, 0.5), base)
    assert infeasible_high < feasible_low < feasible_high
    assert selection_key(_res(50.0, 0.8), base) > infeasible_high  # smaller deficit first


# --- PPOController over the shipped policy -------------------------------------------------
def _snapshot(**kw: object) -> Snapshot:
    d: dict[str, object] = dict(
        time=30.0, interval_s=1.0, arrival_rate=25.0, mean_prompt_len=900.0,
        queue_depth=(12, 3, 0), num_running=60, num_waiting_engine=2, kv_cache_usage=0.55,
        request_throughput=22.0, output_throughput=4200.0, request_goodput=20.0,
        ttft_p50_ms=180.0, ttft_p99_ms=850.0, tpot_p50_ms=25.0, tpot_p99_ms=60.0,
        e2el_p50_ms=5000.0, e2el_p99_ms=14000.0, slo_attainment=0.93, preemptions=0,
        rejected=0, shield_interventions=0, knobs=Knobs(64, "fifo", "auto"),
        time_since_dtype_switch_s=30.0,
    )
    d.update(kw)
    return Snapshot(**d)  # type: ignore[arg-type]


needs_shipped = pytest.mark.skipif(
    not (PRETRAINED_DIR / "manifest.json").is_file(), reason="no shipped policy in policies/pretrained/"
)


@needs_shipped
def test_ppo_controller_shipped_policy_gives_valid_proposals() -> None:
    ctl = build_controller({"kind": "ppo", "path": None}, 256)
    assert isinstance(ctl, PPOController) and ctl.name == "ppo"
    rng = np.random.default_rng(0)
    knobs = Knobs(64, "fifo", "auto")
    ctl.reset(knobs)
    for _ in range(50):
        snap = _snapshot(
            arrival_rate=float(rng.uniform(0, 80)), ttft_p99_ms=float(rng.uniform(0, 5000)),
            queue_depth=tuple(int(x) for x in rng.integers(0, 500, 3)), knobs=knobs,
            kv_cache_usage=float(rng.uniform(0, 1)), slo_attainment=float(rng.uniform(0, 1)),
        )
        p = ctl.decide(snap, knobs)
        assert isinstance(p, Proposal)
        assert p.batch_cap is not None and 1 <= p.batch_cap
        assert abs(p.batch_cap - knobs.batch_cap) <= max(1, int(0.3 * knobs.batch_cap))
        # None: out of the training range (a long-bucket queue), PID's cap and the order kept
        assert p.bucketing in BUCKETING_MODES or (p.bucketing is None and ctl.fell_back)
        assert p.kv_dtype is None  # 8-bit is masked unless the engine says it can run it
        knobs = Knobs(max(1, min(256, p.batch_cap)), p.bucketing or knobs.bucketing, "auto")


@needs_shipped
def test_ppo_controller_sees_the_training_observation() -> None:
    """The controller rebuilds exactly the observation the environment gives the policy."""
    from batchpilot.envs.serving_env import ServingEnv

    env = ServingEnv(overrides=["workload=poisson", "env.episode_s=5"])
    try:
        obs, _ = env.reset(seed=3)
        caps = env.engine.capabilities()
        ctl = PPOController.from_dir(
            None, max_num_seqs=caps.max_num_seqs, max_model_len=caps.max_model_len,
            kv_runnable={d: caps.can_run(d) for d in (env.kv16_dtype, env.kv8_dtype)},
        )
        assert np.array_equal(ctl.mask, env.action_masks())
        for _ in range(4):
            np.testing.assert_allclose(ctl.observation(env.snapshot), obs, rtol=1e-6, atol=1e-6)
            obs, *_ = env.step_proposal(ctl.decide(env.snapshot, env.knobs))
    finally:
        env.close()


def test_ppo_controller_bad_artifact_raises(tmp_path: Path) -> None:
    with pytest.raises(PolicyLoadError):
        build_controller({"kind": "ppo", "path": str(tmp_path)}, 256)
    with pytest.raises(ValueError, match="Key 'pth' not in 'PPOPolicyConfig'"):
        build_controller({"kind": "ppo", "pth": "x"}, 256)
