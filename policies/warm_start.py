"""Warm start of a PPO run from an exported policy (``train.init_from``, issue 16).

An exported artifact (``policies/export.py``: ``manifest.json`` + ``policy.safetensors``) holds
only the deterministic actor and the observation normalisation. A run started from it gets:

- **loaded**: the actor MLP (``mlp_extractor.policy_net``) and the action head (``action_net``),
  copied bit for bit; VecNormalize's observation statistics (mean, var; ``count`` set to the
  source run's training steps so that a short fine-tune moves them slowly); the observation
  scales the policy was trained with (``control.rate_scale``, ``control.token_rate_scale``: features must
  mean what they meant to the policy, and a gateway serving the result reads them from its
  manifest); the observation range the source saw (merged into the new run's, so the result
  does not hand intervals back to PID that the source handled);
- **fresh**: the critic (value MLP and head: not exported), the reward normalisation, the
  optimiser state. ``train.critic_warmup_steps`` > 0 trains the critic alone (actor frozen)
  for that many steps first, so the first policy updates use a value function fitted to the
  new environment rather than a random one.

Anything that differs between the manifest and the run's config (features, action space,
activation, layer widths, ``env.action_mode``, ``clip_obs``) is an error naming the difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.config import REPO_ROOT
from batchpilot.core.actions import ACTION_NVEC
from batchpilot.core.telemetry import FEATURE_NAMES
from batchpilot.policies.artifact import MANIFEST_FILE, Artifact, PolicyLoadError, read_artifact


class WarmStartError(ValueError):
    """``train.init_from`` cannot be applied: bad path, malformed artifact or a mismatch."""


@dataclass(frozen=True)
class WarmStart:
    """The loaded source policy and what the run records about it."""

    artifact: Artifact
    train_config: dict[str, Any]

    @property
    def record(self) -> dict[str, Any]:
        """What the exported manifest records about where the run started from."""
        m = self.artifact.manifest
        return {
            "path": str(self.artifact.path),
            "created": m.get("created"),
            "weights_sha256": m.get("weights", {}).get("sha256"),
            "config_sha256": m.get("training", {}).get("config_sha256"),
            "source_total_timesteps": self.source_steps,
            "loaded": ["actor", "action_head", "obs_normalization", "observation_scales", "observation_range"],
            "fresh": ["critic", "reward_normalization", "optimizer"],
        }

    @property
    def source_steps(self) -> int:
        t = self.train_config.get("train") or {}
        return int(t.get("total_timesteps") or 0)

    @property
    def observation_scales(self) -> dict[str, Any]:
        return dict(self.train_config.get("observation_scales") or {})

    @property
    def observation_range(self) -> dict[str, list[float]] | None:
        r = self.train_config.get("observation_range")
        return dict(r) if r else None


def load_warm_start(path: str | Path) -> WarmStart:
    """Read and check the artifact at ``path`` (its folder or its ``manifest.json``)."""
    p = Path(path).expanduser()
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p  # e.g. policies/pretrained from any working directory
    if p.is_file() and p.name == MANIFEST_FILE:
        p = p.parent
    if not p.exists():
        raise WarmStartError(f"train.init_from: {p} does not exist (give an exported policy folder or its {MANIFEST_FILE})")
    if p.is_file():
        raise WarmStartError(f"train.init_from: {p} is a file but not {MANIFEST_FILE}; give the policy folder")
    try:
        art = read_artifact(p, expected_features=FEATURE_NAMES, expected_nvec=ACTION_NVEC)
    except PolicyLoadError as e:
        raise WarmStartError(f"train.init_from: {e}") from e
    cfg = (art.manifest.get("training") or {}).get("config") or {}
    if not isinstance(cfg, dict):
        raise WarmStartError(f"train.init_from: {p}/{MANIFEST_FILE} training.config is not an object")
    return WarmStart(artifact=art, train_config=cfg)


def check_compatible(ws: WarmStart, *, net_arch: tuple[int, ...], activation: str, action_mode: str,
                     clip_obs: float, norm_obs: bool) -> None:
    """Raise ``WarmStartError`` naming every difference between the artifact and the run."""
    art = ws.artifact
    diffs: list[str] = []
    hidden = tuple(int(w.shape[0]) for w, _ in art.layers[:-1])
    if hidden != tuple(net_arch):
        diffs.append(f"actor layer widths {list(hidden)} in the manifest vs train.net_arch {list(net_arch)}")
    if art.activation != activation:
        diffs.append(f"activation {art.activation!r} in the manifest vs train.activation {activation!r}")
    src_mode = (ws.train_config.get("controller") or {}).get("action_mode") or (
        (ws.train_config.get("env") or {}).get("action_mode"))
    if src_mode is not None and src_mode != action_mode:
        diffs.append(f"action_mode {src_mode!r} in the manifest vs env.action_mode {action_mode!r}")
    if art.normalization is None and norm_obs:
        diffs.append("the manifest has no observation normalisation but train.norm_obs is true")
    if art.normalization is not None and not norm_obs:
        diffs.append("the manifest normalises observations but train.norm_obs is false")
    if art.normalization is not None and float(art.normalization.clip_obs) != float(clip_obs):
        diffs.append(f"clip_obs {art.normalization.clip_obs} in the manifest vs train.clip_obs {clip_obs}")
    if diffs:
        raise WarmStartError(f"train.init_from {art.path} does not fit this run: " + "; ".join(diffs))


def apply_observation_scales(ws: WarmStart, cfg: Any) -> dict[str, tuple[Any, Any]]:
    """Set the run config's ``control.rate_scale`` / ``control.token_rate_scale`` (and
    ``env.kv16_dtype`` / ``env.kv8_dtype``) to the source policy's: returns ``{key: (old, new)}``
    for those that changed."""
    changed: dict[str, tuple[Any, Any]] = {}
    for group, key in (("control", "rate_scale"), ("control", "token_rate_scale"),
                       ("env", "kv16_dtype"), ("env", "kv8_dtype")):
        if key not in ws.observation_scales:
            continue
        new = ws.observation_scales[key]
        old = cfg[group].get(key)
        if old != new:
            cfg[group][key] = new
            changed[key] = (old, new)
    return changed


def load_actor(model: Any, ws: WarmStart) -> None:
    """Copy the artifact's actor layers and head into ``model.policy`` (shapes checked)."""
    import torch
    import torch.nn as nn

    linears = [m for m in model.policy.mlp_extractor.policy_net if isinstance(m, nn.Linear)]
    targets = [*linears, model.policy.action_net]
    layers = ws.artifact.layers
    if len(targets) != len(layers):
        raise WarmStartError(f"train.init_from: the manifest has {len(layers)} actor layers, the model {len(targets)}")
    with torch.no_grad():
        for i, (mod, (w, b)) in enumerate(zip(targets, layers)):
            if tuple(mod.weight.shape) != w.shape or tuple(mod.bias.shape) != b.shape:
                raise WarmStartError(
                    f"train.init_from: actor layer {i} is {tuple(w.shape)} in the manifest, "
                    f"{tuple(mod.weight.shape)} in the model")
            mod.weight.copy_(torch.as_tensor(w, dtype=mod.weight.dtype))
            mod.bias.copy_(torch.as_tensor(b, dtype=mod.bias.dtype))


def load_obs_normalization(vecnorm: Any, ws: WarmStart) -> None:
    """The manifest's observation statistics into ``vecnorm.obs_rms`` (reward stats untouched).
    ``count`` becomes the source run's training steps: VecNormalize keeps updating the stats
    while training, and with its fresh count (1e-4) the first batch of new observations would
    replace them, changing what every input means to the loaded actor at once."""
    norm = ws.artifact.normalization
    if norm is None or vecnorm is None:
        return
    rms = vecnorm.obs_rms
    rms.mean = np.asarray(norm.mean, dtype=np.float64).copy()
    rms.var = np.asarray(norm.var, dtype=np.float64).copy()
    rms.count = float(max(ws.source_steps, 1))
    vecnorm.epsilon = float(norm.epsilon)


def merge_observation_range(ws: WarmStart, new: dict[str, list[float]] | None) -> dict[str, list[float]] | None:
    """The union of the source's training range and this run's."""
    src = ws.observation_range
    if src is None or new is None:
        return new if new is not None else src
    lo = np.minimum(np.asarray(src["low"], dtype=np.float64), np.asarray(new["low"], dtype=np.float64))
    hi = np.maximum(np.asarray(src["high"], dtype=np.float64), np.asarray(new["high"], dtype=np.float64))
    return {"low": [float(x) for x in lo], "high": [float(x) for x in hi]}


def actor_params(model: Any) -> list[Any]:
    """The actor's parameters (frozen during the critic warm-up)."""
    return [*model.policy.mlp_extractor.policy_net.parameters(), *model.policy.action_net.parameters()]


def set_actor_trainable(model: Any, trainable: bool) -> None:
    for p in actor_params(model):
        p.requires_grad_(trainable)
