"""``train.init_from`` (issue 16): a freshly built MaskablePPO on the simulator takes the
exported policy's actor and observation normalisation bit for bit; the critic stays fresh;
mismatches and bad artifacts are clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sb3_contrib")

from omegaconf import OmegaConf  # noqa: E402

from batchpilot.config import load_config  # noqa: E402
from batchpilot.core.actions import ACTION_NVEC  # noqa: E402
from batchpilot.core.telemetry import OBS_HIGH, OBS_LOW  # noqa: E402
from batchpilot.policies import warm_start as ws  # noqa: E402
from batchpilot.policies.export import torch_logits  # noqa: E402
from batchpilot.policies.ppo_controller import PRETRAINED_DIR  # noqa: E402
from batchpilot.policies.runtime import PolicyRuntime  # noqa: E402
from batchpilot.policies.training import build_model, build_train_env, validation_base_cfg  # noqa: E402
from batchpilot.schemas.train import TrainConfig  # noqa: E402


def _probs(logits: np.ndarray) -> list[np.ndarray]:
    out, start = [], 0
    for k in ACTION_NVEC:
        seg = logits[..., start : start + k].astype(np.float64)
        e = np.exp(seg - seg.max(axis=-1, keepdims=True))
        out.append(e / e.sum(axis=-1, keepdims=True))
        start += k
    return out


@pytest.fixture(scope="module")
def warm_model():
    cfg = load_config(["train.n_envs=1", "env.episode_s=8"])
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    tc = TrainConfig.from_cfg(plain.train)
    warm = ws.load_warm_start(PRETRAINED_DIR)
    ws.check_compatible(warm, net_arch=tc.net_arch, activation=tc.activation,
                        action_mode=str(plain.env.action_mode), clip_obs=tc.clip_obs, norm_obs=tc.norm_obs)
    ws.apply_observation_scales(warm, plain)
    venv = build_train_env(plain, tc, seed=0)
    model = build_model(venv, tc, seed=0)
    critic_before = [p.detach().clone() for p in model.policy.mlp_extractor.value_net.parameters()]
    ws.load_actor(model, warm)
    ws.load_obs_normalization(venv, warm)
    yield model, venv, warm, critic_before
    venv.close()


def test_loaded_actor_and_normalisation_equal_the_exported_policy(warm_model) -> None:
    model, venv, _, _ = warm_model
    rt = PolicyRuntime.from_dir(PRETRAINED_DIR)
    obs = np.random.default_rng(0).uniform(OBS_LOW, OBS_HIGH, size=(256, rt.n_features)).astype(np.float32)
    venv.training = False  # normalize_obs must not update the statistics here
    try:
        norm = venv.normalize_obs(obs)
    finally:
        venv.training = True
    assert np.array_equal(rt.normalize(obs), np.asarray(norm, dtype=np.float32))
    got, want = torch_logits(model.policy, norm), rt.logits(obs)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
    for p_got, p_want in zip(_probs(got), _probs(want)):
        np.testing.assert_allclose(p_got, p_want, atol=1e-6)
    # Greedy actions as the runtime (the deployed path) picks them.
    pred, _ = model.predict(norm, deterministic=True)
    assert (np.asarray(pred) == rt.act(obs)).mean() > 0.99


def test_critic_stays_fresh_and_scales_follow_the_policy(warm_model) -> None:
    model, venv, warm, critic_before = warm_model
    for a, b in zip(critic_before, model.policy.mlp_extractor.value_net.parameters()):
        assert np.array_equal(a.numpy(), b.detach().numpy())  # not touched by the warm start
    assert venv.obs_rms.count == warm.source_steps > 1000  # the stats move slowly while fine-tuning
    assert venv.ret_rms.count < 1.0  # reward normalisation fresh
    rec = warm.record
    assert rec["weights_sha256"] == json.loads((PRETRAINED_DIR / "manifest.json").read_text())["weights"]["sha256"]
    assert "critic" in rec["fresh"] and "actor" in rec["loaded"]
    cfg = load_config(["engine=vllm"])
    changed = ws.apply_observation_scales(warm, cfg)
    assert cfg.control.rate_scale == warm.observation_scales["rate_scale"] and "rate_scale" in changed
    assert cfg.env.kv8_dtype == warm.observation_scales["kv8_dtype"]


def test_manifest_path_and_relative_path_load() -> None:
    a = ws.load_warm_start(PRETRAINED_DIR / "manifest.json")
    b = ws.load_warm_start("policies/pretrained")
    assert a.artifact.path.resolve() == b.artifact.path.resolve() == PRETRAINED_DIR.resolve()


def test_mismatch_names_what_differs() -> None:
    warm = ws.load_warm_start(PRETRAINED_DIR)
    with pytest.raises(ws.WarmStartError) as e:
        ws.check_compatible(warm, net_arch=(32, 32), activation="relu", action_mode="absolute",
                            clip_obs=5.0, norm_obs=True)
    msg = str(e.value)
    for what in ("train.net_arch [32, 32]", "train.activation 'relu'", "env.action_mode 'absolute'", "clip_obs"):
        assert what in msg, msg


def test_bad_path_and_malformed_manifest(tmp_path: Path) -> None:
    with pytest.raises(ws.WarmStartError, match="does not exist"):
        ws.load_warm_start(tmp_path / "nowhere")
    bad = tmp_path / "bad"
    shutil.copytree(PRETRAINED_DIR, bad)
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(ws.WarmStartError, match="not valid JSON"):
        ws.load_warm_start(bad)
    (bad / "manifest.json").write_text(json.dumps({"format": "batchpilot-policy"}))
    with pytest.raises(ws.WarmStartError, match="lacks required keys"):
        ws.load_warm_start(bad / "manifest.json")
    (bad / "notes.txt").write_text("x")
    with pytest.raises(ws.WarmStartError, match="not manifest.json"):
        ws.load_warm_start(bad / "notes.txt")


def test_observation_range_is_the_union() -> None:
    warm = ws.load_warm_start(PRETRAINED_DIR)
    src = warm.observation_range
    assert src is not None
    n = len(src["low"])
    merged = ws.merge_observation_range(warm, {"low": [-1.0] * n, "high": [0.0] * n})
    assert merged is not None
    assert merged["low"] == [-1.0] * n and merged["high"] == [max(0.0, h) for h in src["high"]]


def test_validation_on_the_simulated_twin_of_a_live_engine() -> None:
    cfg = load_config(["engine=vllm", "train=finetune_live", "engine.num_gpu_blocks_override=96"])
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    twin = validation_base_cfg(plain, plain.train.validation)
    assert twin.engine.kind == "sim" and plain.engine.kind == "vllm"
    assert twin.engine.block_size == plain.engine.block_size == 32
    assert twin.engine.num_gpu_blocks_override == 96
    assert twin.model.name == "tiny_llama" and twin.hardware.name == "cpu_tiny"
    tc = TrainConfig.from_cfg(plain.train)
    assert tc.init_from == "policies/pretrained" and tc.n_envs == 1 and tc.export_select == "final"
    assert validation_base_cfg(plain, {"seeds": [1]}) is plain  # no engine key: the run's own engine
