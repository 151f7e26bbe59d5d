"""The training groups' dataclasses: ``train`` (``conf/train/ppo.yaml``, PPO's settings) and
``logger`` (``conf/logger/*.yaml``), read by ``policies/training.py`` and ``policies/kv_training.py``."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from batchpilot.core.knobs import BUCKETING_MODES
from batchpilot.nodes import from_node


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """``conf/train/ppo.yaml``; see the comments there for each key."""

    algo: str = "maskable_ppo"
    total_timesteps: int = 150000
    n_envs: int | None = 2
    torch_threads: int = 1
    device: str = "cpu"
    learning_rate: float = 3e-4
    n_steps: int = 512
    batch_size: int = 256
    n_epochs: int = 10
    gamma: float = 0.97
    gae_lambda: float = 0.95
    clip_range: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    net_arch: tuple[int, ...] = (64, 64)
    activation: str = "tanh"
    norm_obs: bool = True
    norm_reward: bool = True
    clip_obs: float = 10.0
    eval_freq: int = 20000
    eval_on_start: bool = False
    checkpoint_freq: int = 50000
    progress_bar: bool = True
    slo_tolerance: float = 0.0
    baseline_prior_logit: float = 2.0
    # The bucketing order the untrained actor leans to (the same logit), or None for no prior.
    bucketing_prior: str | None = None
    # Deployment randomisation: "model/hardware" pairs the training episodes draw from (set as
    # env.deployments on the training and validation environments); () = the config's own.
    deployments: tuple[str, ...] = ()
    # Warm start: an exported policy folder (or its manifest.json); the actor and the observation
    # normalisation are loaded from it, the critic and reward normalisation start fresh.
    init_from: str | None = None
    critic_warmup_steps: int = 0
    # Which model is exported: "best" (by validation) or "final" (the last one learnt).
    export_select: str = "best"
    validation: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "net_arch", tuple(int(x) for x in self.net_arch))
        object.__setattr__(self, "deployments", tuple(str(x) for x in self.deployments))

    @classmethod
    def from_cfg(cls, node: Any) -> "TrainConfig":
        tc = from_node(cls, node)
        tc.check()
        return tc

    def check(self) -> None:
        if self.algo != "maskable_ppo":
            raise ValueError(f"train.algo must be 'maskable_ppo', got {self.algo!r}")
        if self.total_timesteps < 1:
            raise ValueError(f"train.total_timesteps must be >= 1, got {self.total_timesteps}")
        if self.n_envs is not None and self.n_envs < 1:
            raise ValueError(f"train.n_envs must be >= 1 or null (= CPU cores), got {self.n_envs}")
        if self.activation not in ("tanh", "relu"):
            raise ValueError(f"train.activation must be tanh or relu, got {self.activation!r}")
        if not self.net_arch or min(self.net_arch) < 1:
            raise ValueError(f"train.net_arch must list positive layer widths, got {list(self.net_arch)}")
        if self.n_steps < 2 or self.batch_size < 2:
            raise ValueError(f"train.n_steps and train.batch_size must be >= 2, got {self.n_steps}, {self.batch_size}")
        if self.export_select not in ("best", "final"):
            raise ValueError(f"train.export_select must be best or final, got {self.export_select!r}")
        if self.bucketing_prior is not None and self.bucketing_prior not in BUCKETING_MODES:
            raise ValueError(f"train.bucketing_prior must be null or one of {BUCKETING_MODES}, got {self.bucketing_prior!r}")
        if self.critic_warmup_steps < 0:
            raise ValueError(f"train.critic_warmup_steps must be >= 0, got {self.critic_warmup_steps}")
        if "workloads" not in self.validation or "seeds" not in self.validation:
            raise ValueError("train.validation needs 'seeds' and 'workloads' (see conf/train/ppo.yaml)")
        for name in ("learning_rate", "clip_range", "max_grad_norm", "clip_obs"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"train.{name} must be a finite number > 0, got {v}")
        for name in ("gamma", "gae_lambda"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"train.{name} must be in (0, 1], got {v}")
        for name in ("ent_coef", "vf_coef"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"train.{name} must be a finite number >= 0, got {v}")
        if self.target_kl is not None and not (math.isfinite(self.target_kl) and self.target_kl > 0):
            raise ValueError(f"train.target_kl must be a finite number > 0 or null, got {self.target_kl}")

    def num_envs(self) -> int:
        return self.n_envs if self.n_envs is not None else max(1, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class LoggerConfig:
    """``conf/logger/*.yaml``."""

    wandb: bool = False
    tensorboard: bool = True
    mode: str = "offline"
    project: str = "batchpilot"
    entity: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()
    log_policy_artifact: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "tags", tuple(self.tags or ()))
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode must be offline, online or disabled, got {self.mode!r}")

    @classmethod
    def from_cfg(cls, node: Any) -> "LoggerConfig":
        return from_node(cls, node)
