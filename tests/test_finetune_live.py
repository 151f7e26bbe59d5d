"""PPO fine-tuning on the live engine (issue 16): a very short ``train=finetune_live`` run on
``engine=vllm`` (a real in-process vLLM on the tiny model) from the shipped policy finishes,
starts from the loaded weights (before any update the model's action distribution on fixed
observations is the exported policy's), and exports a policy whose manifest records where it
started from. The run is a subprocess (one vLLM engine per process); no timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:  # checked without importing it (seconds at collection)
    pytest.skip("vllm is not installed", allow_module_level=True)
pytest.importorskip("sb3_contrib")

from batchpilot.config import REPO_ROOT  # noqa: E402
from batchpilot.core.actions import ACTION_NVEC  # noqa: E402
from batchpilot.core.telemetry import OBS_HIGH, OBS_LOW  # noqa: E402
from batchpilot.policies.export import load_sb3  # noqa: E402
from batchpilot.policies.ppo_controller import PRETRAINED_DIR  # noqa: E402
from batchpilot.policies.runtime import PolicyRuntime  # noqa: E402

pytestmark = [pytest.mark.live, pytest.mark.slow]

STEPS = 64


def _softmax_split(logits: np.ndarray) -> list[np.ndarray]:
    out, start = [], 0
    for k in ACTION_NVEC:
        seg = logits[:, start : start + k].astype(np.float64)
        e = np.exp(seg - seg.max(axis=1, keepdims=True))
        out.append(e / e.sum(axis=1, keepdims=True))
        start += k
    return out


@pytest.mark.timeout(900)
def test_short_live_finetune_from_the_shipped_policy(tmp_path: Path, tiny_model_path: Path) -> None:
    run = tmp_path / "run"
    args = [
        "engine=vllm", "train=finetune_live", f"train.init_from={PRETRAINED_DIR}", f"engine.model={tiny_model_path}",
        f"train.total_timesteps={STEPS}", "train.n_steps=32", "train.batch_size=16", "train.n_epochs=2",
        "train.critic_warmup_steps=32", "train.eval_freq=0", "train.checkpoint_freq=0",
        "train.validation.test_seeds=[2000]",
        "control.interval_s=0.5", "env.episode_s=12", "env.drain_timeout_s=60", "workload.duration_s=12",
        "logger=wandb", f"hydra.run.dir={run}",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "train.py"), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "critic warm-up" in proc.stdout and "warm start from" in proc.stdout

    # Before any update: the model as loaded gives the exported policy's action distribution.
    src = PolicyRuntime.from_dir(PRETRAINED_DIR)
    init_model, init_norm = load_sb3(run / "init" / "model.zip", run / "init" / "vecnormalize.pkl")
    obs = np.random.default_rng(1).uniform(OBS_LOW, OBS_HIGH, size=(64, src.n_features)).astype(np.float32)
    obs[0] = 0.0
    import torch

    with torch.no_grad():
        dist = init_model.policy.get_distribution(torch.as_tensor(init_norm.normalize_obs(obs)))
        probs = [d.probs.numpy() for d in dist.distributions]
    for got, want in zip(probs, _softmax_split(src.logits(obs))):
        np.testing.assert_allclose(got, want, atol=1e-5)

    # The export records where it started, and learnt (the actor moved) from there.
    out = PolicyRuntime.from_dir(run / "policy")
    cfg = out.manifest["training"]["config"]
    src_manifest = json.loads((PRETRAINED_DIR / "manifest.json").read_text())
    assert cfg["init_from"]["path"] == str(PRETRAINED_DIR)
    assert cfg["init_from"]["weights_sha256"] == src_manifest["weights"]["sha256"]
    assert "critic" in cfg["init_from"]["fresh"]
    assert cfg["train"]["init_from"] == str(PRETRAINED_DIR) and cfg["engine"]["kind"] == "vllm"
    assert cfg["export_select"] == "final" and cfg["final_timesteps"] == STEPS
    assert cfg["observation_scales"]["rate_scale"] == src_manifest["training"]["config"]["observation_scales"]["rate_scale"]
    rng_src = src_manifest["training"]["config"]["observation_range"]
    assert all(lo <= s for lo, s in zip(cfg["observation_range"]["low"], rng_src["low"]))
    assert all(hi >= s for hi, s in zip(cfg["observation_range"]["high"], rng_src["high"]))
    assert not np.allclose(out.logits(obs), src.logits(obs), atol=0, rtol=0)
    summary = json.loads((run / "comparison.json").read_text())
    assert summary["init_from"]["path"] == str(PRETRAINED_DIR)
    assert list((run / "wandb").glob("offline-run-*")), "no offline W&B run"
