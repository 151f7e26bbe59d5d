"""Structured-config schemas: the config dataclasses registered with Hydra's ``ConfigStore``.

A group file extends its schema (``defaults: [schema, _self_]``), so composing checks every
key and type against the dataclass (OmegaConf's structured configs): a mistyped key or a value
of the wrong type fails at compose time with Hydra's message naming the key. The dataclass is
the one declaration of each group's fields and types; domain checks (ranges, names) stay in its
``__post_init__`` / ``check`` and run when ``from_node`` builds the object.

Registered (``register()``; ``batchpilot.config.load_config`` and every ``@hydra.main`` app in
``scripts/`` call it before composing):

============================  ==============================================  =====================
store entry                   dataclass                                       extended by
============================  ==============================================  =====================
``shield/schema``             ``batchpilot.core.shield.ShieldConfig``        conf/shield/*.yaml
``slo/schema``                ``batchpilot.core.telemetry.SLO``              conf/slo/*.yaml
``schema/admission``          ``batchpilot.core.admission.AdmissionConfig``  conf/env ``admission``, conf/serve ``admission``
``schema/reward``             ``RewardConfig`` (here)                         conf/env ``reward``
``train/schema``              ``TrainConfig`` (here)                          conf/train/*.yaml
``logger/schema``             ``LoggerConfig`` (here)                         conf/logger/*.yaml
============================  ==============================================  =====================

This module sits with ``batchpilot/config.py`` at the top of the core (tests/test_imports.py):
it imports only the core, so the dataclasses of groups that training reads (reward, train,
logger) are declared here and re-exported by ``envs/reward.py`` and ``policies/training.py``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from batchpilot.config import from_node, schema_node
from batchpilot.core.admission import AdmissionConfig
from batchpilot.core.shield import ShieldConfig
from batchpilot.core.telemetry import SLO


# --- dataclasses of groups read outside the core ---------------------------------------------
@dataclass(frozen=True, slots=True)
class RewardConfig:
    """``env.reward`` (conf/env/default.yaml): the reward's weights and penalties."""

    w_throughput: float = 0.6
    w_latency: float = 0.3
    w_memory: float = 0.1
    penalty_slo_miss: float = 1.0
    penalty_preemption: float = 0.05
    penalty_shield: float = 0.05
    penalty_rejected: float = 0.5
    penalty_queue: float = 0.1
    #: None (yaml ``null``) = the model's prior, ``model.kv8_quality_cost`` (``RewardConfig.from_cfg``).
    quality_cost_8bit: float | None = 0.0
    engine_failure: float = 10.0

    def __post_init__(self) -> None:
        for k in self.__dataclass_fields__:
            v = getattr(self, k)
            if v is None and k == "quality_cost_8bit":
                continue
            if not isinstance(v, (int, float)) or math.isnan(float(v)) or float(v) < 0:
                raise ValueError(f"env.reward.{k} must be a non-negative number, got {v!r}")
            object.__setattr__(self, k, float(v))

    @classmethod
    def from_cfg(cls, node: Any, model_quality_cost: float = 0.0) -> "RewardConfig":
        rc = from_node(cls, node)
        if rc.quality_cost_8bit is None:
            rc = dataclasses.replace(rc, quality_cost_8bit=float(model_quality_cost))
        return rc


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
    # Warm start: an exported policy folder (or its manifest.json); the actor and the observation
    # normalisation are loaded from it, the critic and reward normalisation start fresh.
    init_from: str | None = None
    critic_warmup_steps: int = 0
    # Which model is exported: "best" (by validation) or "final" (the last one learnt).
    export_select: str = "best"
    validation: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "net_arch", tuple(int(x) for x in self.net_arch))

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
        if self.critic_warmup_steps < 0:
            raise ValueError(f"train.critic_warmup_steps must be >= 0, got {self.critic_warmup_steps}")
        if "workloads" not in self.validation or "seeds" not in self.validation:
            raise ValueError("train.validation needs 'seeds' and 'workloads' (see conf/train/ppo.yaml)")

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


# --- registration ---------------------------------------------------------------------------
#: (group, name, dataclass) of every stored schema.
SCHEMAS: tuple[tuple[str, str, type], ...] = (
    ("shield", "schema", ShieldConfig),
    ("slo", "schema", SLO),
    ("schema", "admission", AdmissionConfig),
    ("schema", "reward", RewardConfig),
    ("train", "schema", TrainConfig),
    ("logger", "schema", LoggerConfig),
)


def register() -> None:
    """Store every schema in Hydra's ``ConfigStore`` (idempotent: storing again replaces)."""
    cs = ConfigStore.instance()
    for group, name, cls in SCHEMAS:
        cs.store(group=group, name=name, node=schema_node(cls))


register()
