"""Export a trained stable-baselines3 policy (sb3-contrib ``MaskablePPO`` or ``PPO``, with a
``MultiDiscrete`` action space) and its ``VecNormalize`` statistics into the artifact that
``policies.runtime`` serves without torch.

Only the deterministic actor is exported: the observation normaliser, the actor MLP
(``mlp_extractor.policy_net``) and the action head (``action_net``: one Linear with
``sum(nvec)`` outputs, split per sub-action). After writing, the artifact is reloaded with the
runtime and must pick the same actions as ``model.predict(..., deterministic=True)`` on random
observations, with and without masks — otherwise export fails. torch and SB3 are imported
lazily so that importing this module stays cheap.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from batchpilot.core.actions import ACTION_NVEC, BATCH_STEPS, KV_CHOICES
from batchpilot.core.knobs import BUCKETING_MODES
from batchpilot.core.kv_epoch import KV_ACTIONS
from batchpilot.core.telemetry import FEATURE_NAMES, OBS_HIGH, OBS_LOW
from batchpilot.policies.artifact import Normalization, write_artifact
from batchpilot.policies.runtime import PolicyRuntime

if TYPE_CHECKING:  # pragma: no cover
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecNormalize

ACTION_NAMES: tuple[str, ...] = ("batch", "bucketing", "kv_dtype")
#: Largest tolerated |runtime logit - torch logit|, relative to the largest logit (float32
#: matmuls in a different summation order differ by ~1e-7 relative).
LOGIT_RTOL = 1e-4


class ExportError(RuntimeError):
    """The model cannot be exported faithfully (unsupported layout or failed parity)."""


def action_section(nvec: Sequence[int]) -> dict[str, Any]:
    """The manifest's action description: batchpilot's ``MultiDiscrete([5, 3, 3])``, or the KV
    agent's ``MultiDiscrete([2])`` (``batchpilot.core.kv_epoch``)."""
    if tuple(nvec) == (len(KV_ACTIONS),):
        return {"type": "MultiDiscrete", "nvec": [len(KV_ACTIONS)], "names": ["kv_precision"],
                "meaning": {"kv_precision": list(KV_ACTIONS)}}
    if tuple(nvec) != ACTION_NVEC:
        raise ExportError(
            f"model action space nvec {list(nvec)} is not batchpilot's {list(ACTION_NVEC)}"
        )
    return {
        "type": "MultiDiscrete",
        "nvec": list(ACTION_NVEC),
        "names": list(ACTION_NAMES),
        "batch_steps": list(BATCH_STEPS),
        "meaning": {
            "batch": [f"{s:+.0%} of the in-flight cap" for s in BATCH_STEPS],
            "bucketing": list(BUCKETING_MODES),
            "kv_dtype": list(KV_CHOICES),
        },
    }


def _actor_layers(policy: Any) -> tuple[str, list[tuple[np.ndarray, np.ndarray]]]:
    """Pull (activation, [(W, b), ...]) out of an ActorCriticPolicy; refuse anything the
    runtime would not reproduce exactly."""
    import torch.nn as nn
    from stable_baselines3.common.torch_layers import FlattenExtractor

    extractor = getattr(policy, "pi_features_extractor", policy.features_extractor)
    if not isinstance(extractor, FlattenExtractor):
        raise ExportError(
            f"features extractor {type(extractor).__name__} not supported (only FlattenExtractor)"
        )
    layers: list[tuple[np.ndarray, np.ndarray]] = []
    acts: set[str] = set()
    for i, mod in enumerate(policy.mlp_extractor.policy_net):
        if isinstance(mod, nn.Linear):
            if mod.bias is None:
                raise ExportError(f"policy_net[{i}] is a Linear without bias; not supported")
            layers.append((_np(mod.weight), _np(mod.bias)))
        elif isinstance(mod, nn.Tanh):
            acts.add("tanh")
        elif isinstance(mod, nn.ReLU):
            acts.add("relu")
        else:
            raise ExportError(
                f"policy_net[{i}] is {type(mod).__name__}; only Linear, Tanh and ReLU are supported"
            )
    if len(acts) > 1:
        raise ExportError(f"policy_net mixes activations {sorted(acts)}; the runtime applies one")
    fn = getattr(policy, "activation_fn", None)
    fallback = {nn.Tanh: "tanh", nn.ReLU: "relu"}.get(fn, "tanh")
    activation = acts.pop() if acts else fallback
    head = policy.action_net
    if not isinstance(head, nn.Linear):
        raise ExportError(f"action_net is {type(head).__name__}, expected a Linear")
    layers.append((_np(head.weight), _np(head.bias)))
    return activation, layers


def _np(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def _normalization(vecnormalize: "VecNormalize | None", n_features: int) -> Normalization | None:
    if vecnormalize is None or not getattr(vecnormalize, "norm_obs", False):
        return None
    rms = vecnormalize.obs_rms
    if isinstance(rms, dict):
        raise ExportError("VecNormalize over a Dict observation space is not supported")
    mean, var = np.asarray(rms.mean, dtype=np.float64), np.asarray(rms.var, dtype=np.float64)
    if mean.shape != (n_features,):
        raise ExportError(
            f"VecNormalize stats have shape {mean.shape}, the model expects ({n_features},)"
        )
    eps, clip = float(vecnormalize.epsilon), float(vecnormalize.clip_obs)
    return Normalization(mean=mean, var=var, epsilon=eps, clip_obs=clip)


def torch_logits(policy: Any, obs_norm: np.ndarray) -> np.ndarray:
    import torch as th

    with th.no_grad():
        t = th.as_tensor(obs_norm, dtype=th.float32, device=policy.device)
        latent = policy.mlp_extractor.forward_actor(policy.pi_features_extractor(t))
        return policy.action_net(latent).cpu().numpy()


def check_parity(
    model: Any,
    vecnormalize: "VecNormalize | None",
    runtime: PolicyRuntime,
    *,
    n: int = 4096,
    seed: int = 0,
) -> dict[str, float]:
    """Compare runtime and SB3 on ``n`` random observations (and random masks where the model
    supports them). Raises ``ExportError`` on any action mismatch that is not a near-tie."""
    rng = np.random.default_rng(seed)
    obs = rng.uniform(OBS_LOW, OBS_HIGH, size=(n, runtime.n_features)).astype(np.float32)
    obs_norm = vecnormalize.normalize_obs(obs) if vecnormalize is not None else obs
    if not np.array_equal(runtime.normalize(obs), np.asarray(obs_norm, dtype=np.float32)):
        raise ExportError("runtime normalisation differs from VecNormalize.normalize_obs")
    ref_logits = torch_logits(model.policy, obs_norm)
    max_logit_err = float(np.abs(runtime.logits(obs) - ref_logits).max())
    scale = max(1.0, float(np.abs(ref_logits).max()))
    if not max_logit_err <= LOGIT_RTOL * scale:
        raise ExportError(
            f"parity failed: runtime logits differ from torch by {max_logit_err:.2e} "
            f"(scale {scale:.2g})"
        )
    # Decisions may differ only where two logits are within a few rounding errors of each other.
    tie_tol = max(10.0 * max_logit_err, 1e-7)
    maskable = _is_maskable(model)
    masks_list: list[np.ndarray | None] = [None]
    if maskable:
        m = rng.random((n, runtime.n_logits)) < 0.7
        starts = np.concatenate([[0], np.cumsum(runtime.nvec)[:-1]])
        for s, k in zip(starts, runtime.nvec):  # keep one allowed value per sub-action
            m[np.arange(n), s + rng.integers(0, k, size=n)] = True
        masks_list.append(m)
    mismatches = ties = 0
    for masks in masks_list:
        if maskable:
            ref, _ = model.predict(obs_norm, action_masks=masks, deterministic=True)
        else:
            ref, _ = model.predict(obs_norm, deterministic=True)
        got = runtime.act(obs, masks)
        bad, tie = parity_mismatches(ref, got, ref_logits, masks, runtime.nvec, tie_tol)
        mismatches, ties = mismatches + bad, ties + tie
    if mismatches:
        raise ExportError(
            f"parity failed: runtime and SB3 disagree on {mismatches} of {n * len(masks_list)} "
            f"decisions (max logit error {max_logit_err:.2e})"
        )
    n_total = float(n * len(masks_list))
    return {"n": n_total, "max_logit_err": max_logit_err, "near_ties": float(ties)}


def parity_mismatches(
    ref: np.ndarray,
    got: np.ndarray,
    ref_logits: np.ndarray,
    masks: np.ndarray | None,
    nvec: Sequence[int],
    tol: float,
) -> tuple[int, int]:
    """Count rows where two action batches differ: (real disagreements, near-tie ones).

    A disagreement is a near tie when, in a sub-action where they differ, the reference's two
    best allowed logits are closer than ``tol`` — float32 rounding may then flip the argmax."""
    got = np.asarray(got)
    ref = np.asarray(ref).reshape(got.shape)
    if masks is not None:
        masks = np.broadcast_to(np.asarray(masks, dtype=bool), (got.shape[0], int(sum(nvec))))
    diff = ref != got  # (n, n_sub)
    rows = np.flatnonzero(diff.any(axis=1))
    real = 0
    starts = np.concatenate([[0], np.cumsum(nvec)[:-1]])
    for r in rows:
        near = False
        for k in np.flatnonzero(diff[r]):
            seg = ref_logits[r, starts[k] : starts[k] + nvec[k]].astype(np.float64)
            if masks is not None:
                seg = np.where(masks[r, starts[k] : starts[k] + nvec[k]], seg, -np.inf)
            top2 = np.sort(seg)[-2:]
            near = near or bool(np.isfinite(top2).all() and top2[1] - top2[0] < tol)
        real += not near
    return real, len(rows) - real


def _is_maskable(model: Any) -> bool:
    try:
        from sb3_contrib import MaskablePPO
    except ImportError:  # pragma: no cover - sb3-contrib is part of the train extra
        return False
    return isinstance(model, MaskablePPO)


def export_policy(
    model: "PPO | Any",
    vecnormalize: "VecNormalize | None",
    out_dir: str | os.PathLike[str],
    *,
    features: Sequence[str] = FEATURE_NAMES,
    shield: dict[str, Any],
    slo: dict[str, Any],
    train_config: dict[str, Any],
    parity_samples: int = 4096,
) -> Path:
    """Write the artifact for ``model`` (+ its VecNormalize) into ``out_dir``, reload it with
    the runtime and verify parity; returns the artifact folder."""
    from gymnasium import spaces

    obs_space, act_space = model.observation_space, model.action_space
    if not isinstance(act_space, spaces.MultiDiscrete):
        raise ExportError(f"action space {act_space} is not MultiDiscrete")
    if not isinstance(obs_space, spaces.Box) or obs_space.shape != (len(features),):
        raise ExportError(f"observation space {obs_space} does not match {len(features)} features")
    for key in ("max_step_frac", "memory_ceiling"):
        v = shield.get(key)
        if not isinstance(v, (int, float)) or not 0.0 < float(v) <= 1.0:
            raise ExportError(f"shield[{key!r}] must be a number in (0, 1], got {v!r}")
    activation, layers = _actor_layers(model.policy)
    out = write_artifact(
        out_dir,
        features=list(features),
        normalization=_normalization(vecnormalize, len(features)),
        action=action_section(act_space.nvec.tolist()),
        activation=activation,
        layers=layers,
        shield=dict(shield),
        slo=dict(slo),
        train_config=train_config,
        obs_bounds=(OBS_LOW, OBS_HIGH),
    )
    runtime = PolicyRuntime.from_dir(out, expected_features=tuple(features),
                                     expected_nvec=tuple(int(n) for n in act_space.nvec))
    check_parity(model, vecnormalize, runtime, n=parity_samples)
    return out


def load_sb3(
    model_path: str | os.PathLike[str], vecnorm_path: str | os.PathLike[str] | None = None
) -> tuple[Any, "VecNormalize | None"]:
    """Load a saved model (MaskablePPO or PPO, told apart by the policy class recorded in the
    zip) and, if given, its VecNormalize statistics (SB3's own pickle, from our training run)."""
    path = Path(model_path)
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} not found")
    try:
        with zipfile.ZipFile(path) as zf:
            data = json.loads(zf.read("data"))
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise ExportError(f"{path} is not a stable-baselines3 model zip (model.zip of a training run): {e}") from None
    policy_module = str(data.get("policy_class", {}).get("__module__", ""))
    if "maskable" in policy_module:
        from sb3_contrib import MaskablePPO as Algo
    else:
        from stable_baselines3 import PPO as Algo
    model = Algo.load(path, device="cpu")
    vecnorm = None
    if vecnorm_path is not None:
        from stable_baselines3.common.vec_env import VecNormalize

        vpath = Path(vecnorm_path)
        if not vpath.is_file():
            raise FileNotFoundError(f"VecNormalize file {vpath} not found")
        try:
            with vpath.open("rb") as f:
                vecnorm = pickle.load(f)  # VecNormalize.load without a venv; trusted training output
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as e:
            raise ExportError(f"{vpath} is not a VecNormalize file (vecnormalize.pkl of a training run): {e}") from None
        if not isinstance(vecnorm, VecNormalize):
            raise ExportError(f"{vpath} holds a {type(vecnorm).__name__}, not a VecNormalize")
        vecnorm.training = False
        vecnorm.norm_reward = False
    return model, vecnorm
