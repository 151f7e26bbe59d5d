"""``PPOController``: a trained, exported policy behind the same ``Controller`` protocol as PID,
AIMD and static (``policies/controllers.py``), so the environment, evaluation and the gateway
run it the same way: snapshot in, proposal out, the shield in between.

It needs only the dependency-light runtime (numpy + safetensors). The observation is rebuilt
from the snapshot with ``observation_from_snapshot`` and the scales recorded at training time
(manifest ``training.config.observation_scales``), so the features mean what they meant in
training. ``policy=ppo`` with ``path: null`` loads the shipped policy in ``policies/pretrained/``.

Two guards keep a policy from being much worse than the PID baseline, whatever it learnt:

* a policy trained with ``env.action_mode: residual_pid`` only scales PID's cap by 0.7-1.3
  (``batchpilot.core.residual``; the PID it corrects is recorded in the manifest);
* an observation outside the range seen in training (manifest
  ``training.config.observation_range``, widened by ``ood_margin`` of each feature's span) hands
  the cap to that PID (the order in force stays): the policy is not asked where it has never been.
  ``num_fallbacks`` counts those intervals and ``last_fallback`` names the features.

A policy folder may carry a KV-precision agent (``<folder>/kv_agent``, ``policies/kv_agent.py``):
given the engine's restart time it owns the KV part of every proposal, once per epoch.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from batchpilot.core.actions import action_mask, action_to_proposal
from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.core.residual import ACTION_MODES, ResidualPID, residual_pid_config
from batchpilot.core.telemetry import FEATURE_NAMES, SLO, Snapshot, observation_from_snapshot
from batchpilot.nodes import from_node
from batchpilot.policies.artifact import PolicyLoadError
from batchpilot.policies.kv_agent import KV_AGENT_SUBDIR, KVAgent
from batchpilot.policies.runtime import PolicyRuntime
from batchpilot.schemas.policy import PPOPolicyConfig

#: The shipped default policy (what ``policy=ppo`` means when no path is given).
PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained"

__all__ = ["PPOController", "PRETRAINED_DIR", "build_ppo_controller"]


def _scales(manifest: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """Observation scales from the manifest: ``observation_scales`` (written by training), else
    the training config's ``control`` section (the scales) and ``env`` section (the KV dtypes)."""
    cfg = manifest.get("training", {}).get("config", {})
    s = dict(cfg.get("observation_scales") or {})
    # Artifacts trained before the control group (issue 54) kept the scales in ``env``: read
    # there as a fallback, so they still load.
    sections = [cfg.get("control") or {}, cfg.get("env") or {}]
    for key in ("rate_scale", "token_rate_scale", "kv16_dtype", "kv8_dtype"):
        for sec in sections:
            if key not in s and key in sec:
                s[key] = sec[key]
    missing = [k for k in ("rate_scale", "token_rate_scale") if k not in s]
    if missing:
        raise PolicyLoadError(
            f"policy artifact {path}: manifest training config lacks the observation scales "
            f"{missing} (re-export it with policies/training.py or scripts/export.py)"
        )
    return s


class PPOController:
    """Deterministic exported policy as a controller.

    ``max_num_seqs`` / ``max_model_len`` are the engine's (they normalise running counts and
    prompt lengths); when not given, the values recorded at training are used. ``kv_runnable``
    says which KV dtypes the engine can run (``{dtype: bool}``); choices it cannot run are
    masked. ``None`` allows only the 16-bit dtype.
    """

    name = "ppo"

    def __init__(
        self,
        runtime: PolicyRuntime,
        *,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        kv_runnable: Mapping[str, bool] | None = None,
        ood_margin: float = 0.25,
        kv_agent: KVAgent | None = None,
        slo: SLO | None = None,
    ) -> None:
        self.runtime = runtime
        path = runtime.artifact.path
        s = _scales(runtime.manifest, path)
        self.rate_scale = float(s["rate_scale"])
        self.token_rate_scale = float(s["token_rate_scale"])
        self.kv16_dtype = str(s.get("kv16_dtype", "auto"))
        self.kv8_dtype = str(s.get("kv8_dtype", "fp8"))
        seqs = max_num_seqs if max_num_seqs is not None else s.get("max_num_seqs")
        model_len = max_model_len if max_model_len is not None else s.get("max_model_len")
        if seqs is None or model_len is None:
            raise PolicyLoadError(
                f"policy artifact {path}: max_num_seqs/max_model_len neither given nor recorded in the manifest"
            )
        self.max_num_seqs, self.max_model_len = int(seqs), int(model_len)
        trained = runtime.manifest.get("slo") or {}
        #: The objectives the policy was trained at, and those it serves now (``slo``; default:
        #: the trained ones). Latencies are observed relative to the served SLO and the PID it
        #: corrects steers on it, so the policy aims at the deployment's objectives.
        self.trained_slo = SLO(ttft_ms=trained.get("ttft_ms"), tpot_ms=trained.get("tpot_ms"),
                               e2el_ms=trained.get("e2el_ms"))
        self.slo = slo if slo is not None else self.trained_slo
        self.set_kv_runnable(kv_runnable)
        cfg = runtime.manifest.get("training", {}).get("config", {})
        ctl = cfg.get("controller") or {}
        self.action_mode = str(ctl.get("action_mode", (cfg.get("env") or {}).get("action_mode", "absolute")))
        if self.action_mode not in ACTION_MODES:
            raise PolicyLoadError(f"policy artifact {path}: action_mode {self.action_mode!r} not in {ACTION_MODES}")
        try:
            self._pid_cfg = residual_pid_config(self.slo, self.max_num_seqs, ctl.get("pid"), self.trained_slo)
        except (TypeError, ValueError) as exc:
            raise PolicyLoadError(f"policy artifact {path}: bad controller.pid in the manifest: {exc}") from exc
        #: PID: the base a residual policy scales, and who acts outside the training range.
        self.residual = ResidualPID(self._pid_cfg)
        #: Where an episode under this policy starts: a residual policy where its PID starts
        #: (factor 1 is that PID); None = the environment's default start (an absolute policy).
        self.initial_batch_cap: int | None = (
            self._pid_cfg.initial_batch_cap if self.action_mode == "residual_pid" else None
        )
        self.ood_margin = float(ood_margin)
        self.obs_low, self.obs_high = _observation_range(cfg.get("observation_range"), path, self.ood_margin)
        self.num_decisions = 0
        self.num_fallbacks = 0
        self.last_fallback: list[str] = []
        #: Whether the last decision was PID's because the observation was out of range.
        self.fell_back = False
        #: The KV-precision agent (one decision per epoch; ``policies/kv_agent.py``), if any.
        self.kv_agent = kv_agent
        self._lanes: dict[Any, PPOController] = {}

    @classmethod
    def from_dir(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        kv_agent: bool = True,
        kv_restart_s: float | None = None,
        **kwargs: Any,
    ) -> "PPOController":
        """Load an artifact folder (``None`` = the shipped policy), with its KV agent
        (``<folder>/kv_agent``) when it has one and ``kv_agent`` is true. The agent weighs the
        engine's restart time ``kv_restart_s`` (the shield's ``dtype_restart_s``); without
        it the agent is not loaded. Raises ``PolicyLoadError`` with what is wrong; the caller
        falls back to PID."""
        p = Path(path) if path is not None else PRETRAINED_DIR
        ctl = cls(PolicyRuntime.from_dir(p), **kwargs)
        if kv_agent and kv_restart_s is not None and (p / KV_AGENT_SUBDIR).is_dir():
            ctl.kv_agent = KVAgent.from_dir(p / KV_AGENT_SUBDIR, restart_s=kv_restart_s,
                                            kv16_dtype=ctl.kv16_dtype, kv8_dtype=ctl.kv8_dtype)
        return ctl

    def set_kv_runnable(self, kv_runnable: Mapping[str, bool] | None) -> None:
        """Which KV dtypes the engine can run (e.g. from ``engine.capabilities().can_run``)."""
        runnable = dict(kv_runnable) if kv_runnable is not None else {self.kv16_dtype: True}
        self.mask = action_mask(runnable, kv16_dtype=self.kv16_dtype, kv8_dtype=self.kv8_dtype)
        for lane in getattr(self, "_lanes", {}).values():
            lane.mask = self.mask

    def for_lane(self, key: Any) -> "PPOController":
        """This policy for one stream of decisions (a gateway lane): the weights are shared,
        the PID state it corrects is the stream's own."""
        if key not in self._lanes:
            clone = copy.copy(self)
            clone.residual = ResidualPID(self._pid_cfg)
            clone._lanes = {}
            clone.last_fallback = []
            clone.kv_agent = self.kv_agent.fresh() if self.kv_agent is not None else None
            self._lanes[key] = clone
        return self._lanes[key]

    # --- Controller protocol -------------------------------------------------------------
    def reset(self, knobs: Knobs) -> None:
        self.residual.reset(knobs)  # the network is memoryless; the PID it corrects is not
        if self.kv_agent is not None:
            self.kv_agent.reset()

    def observation(self, snapshot: Snapshot) -> np.ndarray:
        return observation_from_snapshot(
            snapshot,
            self.slo,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            rate_scale=self.rate_scale,
            token_rate_scale=self.token_rate_scale,
        )

    def out_of_range(self, obs: np.ndarray) -> list[str]:
        """Features outside the (widened) range seen in training; empty when none or unknown."""
        if self.obs_low is None or self.obs_high is None:
            return []
        bad = np.flatnonzero((obs < self.obs_low) | (obs > self.obs_high))
        return [FEATURE_NAMES[i] for i in bad]

    def decide(self, snapshot: Snapshot, knobs: Knobs) -> Proposal:
        proposal = self._decide_batch(snapshot, knobs)
        if self.kv_agent is None:
            return proposal
        # The KV agent owns the precision: its choice at an epoch's end, else keep.
        return dataclasses.replace(proposal, kv_dtype=self.kv_agent.decide(snapshot, knobs))

    def _decide_batch(self, snapshot: Snapshot, knobs: Knobs) -> Proposal:
        self.num_decisions += 1
        obs = self.observation(snapshot)
        outside = self.out_of_range(obs)
        self.fell_back = bool(outside)
        if outside:
            # PID takes the cap; the order stays the one in force (the policy's last in-range
            # choice): PID's configured order is no safer, only different.
            self.num_fallbacks += 1
            self.last_fallback = outside
            return dataclasses.replace(self.residual.base(snapshot, knobs), bucketing=None)
        action = self.runtime.act(obs, self.mask)
        kv = {"kv16_dtype": self.kv16_dtype, "kv8_dtype": self.kv8_dtype}
        if self.action_mode == "residual_pid":
            return self.residual.propose(action, snapshot, knobs, **kv)
        self.residual.base(snapshot, knobs)  # kept warm for the intervals it may take over
        return action_to_proposal(action, knobs, **kv)


def _observation_range(node: Any, path: Path, margin: float) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The training range ``{low: [...], high: [...]}`` widened by ``margin`` x each feature's
    span (at least 0.05); ``(None, None)`` when the artifact predates the record."""
    if node is None:
        return None, None
    try:
        lo = np.asarray(node["low"], dtype=np.float64)
        hi = np.asarray(node["high"], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as exc:
        raise PolicyLoadError(f"policy artifact {path}: observation_range needs numeric 'low' and 'high' lists") from exc
    n = len(FEATURE_NAMES)
    if lo.shape != (n,) or hi.shape != (n,) or not (np.isfinite(lo).all() and np.isfinite(hi).all()) or (lo > hi).any():
        raise PolicyLoadError(f"policy artifact {path}: observation_range must be {n} finite low <= high pairs")
    pad = np.maximum(margin * (hi - lo), 0.05)
    return (lo - pad).astype(np.float32), (hi + pad).astype(np.float32)


def build_ppo_controller(cfg_policy: Any, max_num_seqs: int) -> PPOController:
    """``build_controller`` entry for ``kind: ppo`` (``conf/policy/ppo.yaml``; ``PPOPolicyConfig``)."""
    pc = from_node(PPOPolicyConfig, cfg_policy, drop=("kind", "name"))
    return PPOController.from_dir(
        pc.path,
        max_num_seqs=max_num_seqs,
        max_model_len=pc.max_model_len,
        kv_runnable=None if pc.kv_runnable is None else dict(pc.kv_runnable),
        ood_margin=pc.ood_margin,
        kv_agent=pc.kv_agent,
        kv_restart_s=pc.kv_restart_s,
        slo=None if pc.slo is None else SLO.from_metrics(pc.slo),
    )
