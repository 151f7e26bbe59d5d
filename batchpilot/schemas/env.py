"""The ``env`` group's schema (``conf/env/default.yaml``): ``ServingEnv``'s settings and the
reward's weights (``env.reward``), read by ``envs/serving_env.py`` and ``envs/reward.py``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from batchpilot.core.admission import AdmissionConfig
from batchpilot.nodes import from_node


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


@dataclass(slots=True)
class EnvNode:
    """``conf/env/default.yaml``: ``ServingEnv``'s settings (``envs/serving_env.py`` reads the
    node and checks the values; this is its schema). The top-level keys are required (no
    default here, so none can disagree with the file); ``admission`` and ``reward`` are their
    dataclasses, the same ``AdmissionConfig`` the gateway's ``serve.admission`` is."""

    #: Engine seconds per episode (truncation). One step is one control interval, the control
    #: group's ``control.interval_s`` (``batchpilot.schemas.control.ControlLoopConfig``: also the
    #: latency window, the start knobs and the observation's scales, shared with the gateway).
    episode_s: float
    #: What the actions "16-bit" and "8-bit" mean.
    kv16_dtype: str
    kv8_dtype: str
    #: residual_pid | absolute (``batchpilot.core.residual.ACTION_MODES``).
    action_mode: str
    #: Admit a request only if the memory model predicts it fits beside what is in flight.
    memory_admission: bool
    #: At the last step, let requests in flight finish (at most drain_timeout_s).
    drain_on_truncate: bool
    drain_timeout_s: float
    #: With drain_on_truncate: after the last step the episode goes on, the controller and the
    #: shield acting each interval, until every request is served (the gateway's loop runs until
    #: the client's last answer); false: drain at the last knobs.
    drain_controlled: bool
    #: The start KV dtype counts as a switch at t=0 for the shield's dwell (``kv_start``).
    start_dtype_dwell: bool
    #: false: no shield between the controller and the engine (vLLM as shipped: proposals pass
    #: unchecked, no breaker, no fail-safe rules), by construction (``PassThroughShield``).
    shielded: bool
    #: Deployment randomisation (training): "model/hardware" pairs an episode draws from; the
    #: workload's load is sized per deployment. Empty = the config's model and hardware.
    deployments: list[str]
    #: [low, high] or null: draw each episode's mean load as this share of the engine's capacity
    #: for the episode's own requests (a saturation probe per episode), log-uniformly.
    load_vs_capacity: list[float] | None
    #: [low, high] or null: draw each episode's engine ``gpu_memory_utilization`` (the KV
    #: budget) on a 0.05 grid; simulator only.
    memory_utilization: list[float] | None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
