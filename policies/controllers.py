"""Baseline controllers: PID (the tuning guide's), AIMD (Clipper / AIBrix style) and static
settings (including vLLM's defaults). Each maps a telemetry ``Snapshot`` to a ``Proposal``;
the shield turns proposals into knobs, so controllers never clamp for safety themselves.

``build_controller(cfg.policy, max_num_seqs)`` dispatches on ``cfg.kind`` through
``CONTROLLER_BUILDERS``; other controllers (PPO) join with ``register_controller``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from batchpilot.core.controller import Controller
from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.core.pid import (
    PIDConfig,
    PIDController,
    p99_ms,
    slo_setpoints,
    steering_metric,
)
from batchpilot.core.telemetry import LATENCY_METRICS, SLO, Snapshot
from batchpilot.nodes import from_node, plain
from batchpilot.schemas.policy import AIMDConfig, StaticConfig  # declared there (policy/schema_aimd, schema_static)


def _node(cfg: Any) -> dict[str, Any]:
    return plain(cfg)


# --- AIMD --------------------------------------------------------------------------------
class AIMDController:
    """+a per interval while the SLO holds and requests wait; x b on a breach."""

    name = "aimd"

    def __init__(self, cfg: AIMDConfig) -> None:
        self.cfg = cfg

    def reset(self, knobs: Knobs) -> None:
        pass  # memoryless

    def decide(self, snapshot: Snapshot, knobs: Knobs) -> Proposal:
        c = self.cfg
        cap = knobs.batch_cap
        metric, slo = steering_metric(snapshot, cap, c.metric, c.slo_ms, c.queue_aware, c.tpot_slo_ms)
        breach = p99_ms(snapshot, metric) > c.target_frac * slo
        breach = breach or (c.decrease_on_preemption and snapshot.preemptions > 0)
        if breach:
            new = min(int(math.floor(cap * c.multiplicative_decrease)), cap - 1)
        elif snapshot.queue_total > 0 or snapshot.num_waiting_engine > 0:
            new = cap + c.additive_increase
        else:
            new = cap
        return Proposal(batch_cap=min(max(new, c.min_batch), c.max_batch), bucketing=c.bucketing)


# --- static ------------------------------------------------------------------------------
class StaticController:
    """Always proposes the same knobs (the shield still walks the cap there within its step)."""

    def __init__(self, knobs: Knobs, name: str = "static") -> None:
        self.knobs = knobs
        self.name = name

    def reset(self, knobs: Knobs) -> None:
        pass

    def decide(self, snapshot: Snapshot, knobs: Knobs) -> Proposal:
        k = self.knobs
        return Proposal(batch_cap=k.batch_cap, bucketing=k.bucketing, kv_dtype=k.kv_dtype)


# --- factory -----------------------------------------------------------------------------
#: kind -> builder(cfg_policy, max_num_seqs). Extension point: ``register_controller("ppo", ...)``.
CONTROLLER_BUILDERS: dict[str, Callable[[Any, int], Controller]] = {}


def register_controller(kind: str, builder: Callable[[Any, int], Controller]) -> None:
    """Make ``kind`` buildable by ``build_controller`` (e.g. the PPO policy's module)."""
    CONTROLLER_BUILDERS[kind] = builder


def _bounded(cls: type, d: dict[str, Any], max_num_seqs: int) -> dict[str, Any]:
    """``d`` with max_batch and initial_batch_cap (the dataclass defaults when unset) capped
    at the engine's ``max_num_seqs``."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    d["max_batch"] = min(int(d.get("max_batch", defaults["max_batch"])), max_num_seqs)
    d["initial_batch_cap"] = min(int(d.get("initial_batch_cap", defaults["initial_batch_cap"])), d["max_batch"])
    return d


#: The kinds whose setpoints (``slo_ms``, ``tpot_slo_ms``) build_controller fills from the SLO.
_SETPOINT_CONFIGS: dict[str, type] = {"pid": PIDConfig, "aimd": AIMDConfig}


def _default(cls: type, name: str) -> Any:
    """Dataclass ``cls``'s default for field ``name``."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


#: Policy-file keys that select or label the controller rather than configure it.
_SELECTORS = ("kind", "name")


def _build_pid(cfg: Any, max_num_seqs: int) -> Controller:
    return PIDController(from_node(PIDConfig, _bounded(PIDConfig, _node(cfg), max_num_seqs), drop=_SELECTORS))


def _build_aimd(cfg: Any, max_num_seqs: int) -> Controller:
    return AIMDController(from_node(AIMDConfig, _bounded(AIMDConfig, _node(cfg), max_num_seqs), drop=_SELECTORS))


def _build_static(cfg: Any, max_num_seqs: int) -> Controller:
    d = _node(cfg)
    sc = from_node(StaticConfig, d, drop=_SELECTORS)
    cap = max_num_seqs if sc.batch_cap is None else min(sc.batch_cap, max_num_seqs)
    return StaticController(Knobs(cap, sc.bucketing, sc.kv_dtype), name=str(d.get("name", "static")))


register_controller("pid", _build_pid)
register_controller("aimd", _build_aimd)
register_controller("static", _build_static)


def _build_ppo(cfg: Any, max_num_seqs: int) -> Controller:
    # Imported lazily: loading a policy artifact is only needed for policy=ppo.
    from batchpilot.policies.ppo_controller import build_ppo_controller

    return build_ppo_controller(cfg, max_num_seqs)


register_controller("ppo", _build_ppo)


def _build_lookahead(cfg: Any, max_num_seqs: int) -> Controller:
    # An upper bound on the simulator, not a controller to deploy (policies/lookahead.py).
    from batchpilot.policies.lookahead import build_lookahead

    return build_lookahead(cfg, max_num_seqs)


register_controller("lookahead", _build_lookahead)


def build_controller(cfg_policy: Any, max_num_seqs: int, slo: SLO | None = None) -> Controller:
    """The controller ``cfg_policy.kind`` names. ``slo`` (the top config's) fills PID/AIMD's
    setpoints (``slo_setpoints``) and PPO's / lookahead's served ``slo`` where the policy config
    leaves them out; None: they keep their own (PPO: the SLO it was trained at)."""
    if slo is not None and not isinstance(slo, SLO):
        raise TypeError(f"build_controller: slo must be an SLO (SLO.from_mapping(cfg.slo)), got {type(slo).__name__}")
    d = _node(cfg_policy)
    kind = d.get("kind")
    if kind not in CONTROLLER_BUILDERS:
        raise ValueError(f"unknown policy kind {kind!r}; known: {sorted(CONTROLLER_BUILDERS)}")
    if slo is not None and kind in ("ppo", "lookahead") and "slo" not in d:
        d["slo"] = slo.by_metric()
    # The setpoint is the objective of the metric the controller will steer on: a node without
    # ``metric`` gets its dataclass's (PID: TPOT). An unknown metric is left to the config's
    # check, which names it.
    cls = _SETPOINT_CONFIGS.get(str(kind))
    metric = d.get("metric", _default(cls, "metric")) if cls is not None else None
    if slo is not None and cls is not None and metric in LATENCY_METRICS:
        for key, value in slo_setpoints(slo, metric).items():
            d.setdefault(key, value)
    return CONTROLLER_BUILDERS[kind](d, max_num_seqs)


def initial_knobs(cfg_policy: Any, max_num_seqs: int) -> Knobs:
    """The knobs an episode / the gateway starts with for this policy config."""
    d = _node(cfg_policy)
    if d.get("kind") == "static":
        cap = d.get("batch_cap")
        cap = max_num_seqs if cap is None else min(int(cap), max_num_seqs)
    else:
        cap = min(int(d.get("initial_batch_cap", 32)), max_num_seqs)
    return Knobs(batch_cap=max(1, cap), bucketing=d.get("bucketing", "fifo"), kv_dtype=d.get("kv_dtype", "auto"))
