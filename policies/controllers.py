"""Baseline controllers: PID (the tuning guide's), AIMD (Clipper / AIBrix style) and static
settings (including vLLM's defaults). Each maps a telemetry ``Snapshot`` to a ``Proposal``;
the shield turns proposals into knobs, so controllers never clamp for safety themselves.

``build_controller(cfg.policy, max_num_seqs)`` dispatches on ``cfg.kind`` through
``CONTROLLER_BUILDERS``; other controllers (PPO) join with ``register_controller``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from batchpilot.config import config_fields
from batchpilot.core.controller import Controller
from batchpilot.core.knobs import BUCKETING_MODES, Knobs, Proposal
from batchpilot.core.telemetry import Snapshot

LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")


def p99_ms(snap: Snapshot, metric: str) -> float:
    return {"ttft": snap.ttft_p99_ms, "tpot": snap.tpot_p99_ms, "e2el": snap.e2el_p99_ms}[metric]


def backlog(snap: Snapshot) -> int:
    """Requests waiting (admission queues + the engine's own queue)."""
    return snap.queue_total + snap.num_waiting_engine


def steering_metric(
    snap: Snapshot, cap: int, metric: str, slo_ms: float, queue_aware: bool, tpot_slo_ms: float | None
) -> tuple[str, float]:
    """(metric, its SLO) to steer on this interval: ``metric``, or TPOT while queue-aware
    and more requests wait than run (queueing latency says nothing about the batch)."""
    if queue_aware and metric != "tpot" and tpot_slo_ms and backlog(snap) > cap:
        return "tpot", float(tpot_slo_ms)
    return metric, slo_ms


def _node(cfg: Any) -> dict[str, Any]:
    return dict(cfg or {})


def _check_common(kind: str, d: dict[str, Any]) -> None:
    if d.get("metric", "ttft") not in LATENCY_METRICS:
        raise ValueError(f"policy {kind}: metric must be one of {LATENCY_METRICS}, got {d['metric']!r}")
    if d.get("bucketing", "fifo") not in BUCKETING_MODES:
        raise ValueError(f"policy {kind}: bucketing must be one of {BUCKETING_MODES}, got {d['bucketing']!r}")


# --- PID ---------------------------------------------------------------------------------
@dataclass(slots=True)
class PIDConfig:
    """The guide's PID on the batch cap. These defaults are the ones ``conf/policy/pid.yaml``
    spells out (a test keeps them equal), so a PID built without that file (the gateway's
    fallback when it serves a policy) is the same PID the evaluation ran."""

    #: Latency whose P99 is controlled.
    metric: str = "tpot"
    #: SLO of that metric in ms (filled from the top config's SLO by ``build_controller``).
    slo_ms: float = 1000.0
    #: Aim for P99 = target_frac x SLO (headroom for noise).
    target_frac: float = 0.8
    kp: float = 1.0
    ki: float = 0.05
    kd: float = 0.1
    #: EMA factor on the output (1 = no smoothing).
    smoothing: float = 1.0
    #: Largest step per decision as a fraction of the current cap (the shield still limits it).
    max_step_frac: float = 0.25
    #: The integral is kept within +-integral_limit (anti-windup).
    integral_limit: float = 2.0
    #: Normalised errors are clipped to [-error_clip, 1] so one huge outlier cannot dominate.
    error_clip: float = 2.0
    #: Mean prompts above length_ref tokens shrink upward steps by length_ref / mean_prompt_len.
    length_ref: float = 1024.0
    min_length_weight: float = 0.1
    #: Outputs smaller than this (relative) are ignored, so the cap does not dither.
    deadband: float = 0.02
    #: The guide samples every 50 ms; the caller runs decide() at this interval.
    interval_s: float = 0.05
    #: After a cut, no further cut for this long. The P99 comes from a sliding window of
    #: finished requests (telemetry's window_s), so a cut shows fully only once the window has
    #: turned over; cutting on the stale P99 meanwhile drives the cap far below what was needed.
    settle_s: float = 10.0
    #: With more requests waiting than running, TTFT/E2E measure the queue, not the batch, and a
    #: smaller cap would only lengthen it: steer on TPOT (engine-side) until the backlog clears.
    queue_aware: bool = True
    #: TPOT SLO in ms for queue-aware steering (filled from the top config's SLO).
    tpot_slo_ms: float | None = 100.0
    initial_batch_cap: int = 128
    min_batch: int = 1
    max_batch: int = 256
    bucketing: str = "weighted"

    def __post_init__(self) -> None:
        _check_common("pid", {"metric": self.metric, "bucketing": self.bucketing})
        if self.slo_ms <= 0 or not 0 < self.target_frac <= 2:
            raise ValueError(f"pid: need slo_ms > 0 and target_frac in (0, 2], got {self.slo_ms}, {self.target_frac}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"pid.smoothing must be in (0, 1], got {self.smoothing}")
        if not 0 < self.max_step_frac <= 1 or self.integral_limit < 0 or self.error_clip <= 0:
            raise ValueError("pid: need max_step_frac in (0, 1], integral_limit >= 0, error_clip > 0")
        if self.settle_s < 0:
            raise ValueError(f"pid.settle_s must be >= 0, got {self.settle_s}")
        if not 1 <= self.min_batch <= self.initial_batch_cap <= self.max_batch:
            raise ValueError(
                f"pid: need 1 <= min_batch <= initial_batch_cap <= max_batch, got "
                f"{self.min_batch}, {self.initial_batch_cap}, {self.max_batch}"
            )


class PIDController:
    """Gradient-style PID on the batch cap from P99 latency against its target.

    Error ``e = (target - p99) / target`` (positive = room to grow), clipped. Output
    ``u = kp e + ki I + kd (e - e_prev)``, clipped to [-1, 1], smoothed by an EMA, and applied
    as a relative step ``u * max_step_frac * cap``. Upward steps are scaled down for long mean
    prompts and only taken when requests are waiting. After a cut the controller waits
    ``settle_s`` before cutting again (the windowed P99 lags the cap). Anti-windup: the integral
    is clamped and frozen while the output is saturated or the cap cannot move the way the error
    asks (a bound, or a cut still settling).
    """

    name = "pid"

    def __init__(self, cfg: PIDConfig) -> None:
        self.cfg = cfg
        self.reset(Knobs(cfg.initial_batch_cap, cfg.bucketing))

    def reset(self, knobs: Knobs) -> None:
        self.integral = 0.0
        self.prev_error: float | None = None
        self.output = 0.0
        self.last_cut_time = -math.inf

    def error(self, snap: Snapshot, cap: int) -> float:
        metric, slo = steering_metric(snap, cap, self.cfg.metric, self.cfg.slo_ms, self.cfg.queue_aware, self.cfg.tpot_slo_ms)
        target = self.cfg.target_frac * slo
        p99 = p99_ms(snap, metric)
        e = (target - p99) / target if math.isfinite(p99) else -self.cfg.error_clip
        return min(max(e, -self.cfg.error_clip), 1.0)

    def decide(self, snapshot: Snapshot, knobs: Knobs) -> Proposal:
        c = self.cfg
        e = self.error(snapshot, knobs.batch_cap)
        has_queue = snapshot.queue_total > 0 or snapshot.num_waiting_engine > 0
        if e > 0 and not has_queue:
            e = 0.0  # room to grow but nobody to admit: hold, and let nothing wind up
        de = 0.0 if self.prev_error is None else e - self.prev_error
        self.prev_error = e
        raw = c.kp * e + c.ki * self.integral + c.kd * de
        u = min(max(raw, -1.0), 1.0)
        cap = knobs.batch_cap
        settling = snapshot.time - self.last_cut_time < c.settle_s
        blocked = (e > 0 and cap >= c.max_batch) or (e < 0 and (cap <= c.min_batch or settling))
        # Conditional integration: no integrating further into a saturated output or against a
        # bound the cap already sits on (integrating an error of the other sign unwinds it).
        saturated = (raw > 1.0 and e > 0) or (raw < -1.0 and e < 0)
        if not saturated and not blocked:
            self.integral = min(max(self.integral + e, -c.integral_limit), c.integral_limit)
        self.output = c.smoothing * u + (1.0 - c.smoothing) * self.output
        out = self.output
        if out > 0:
            out *= self.length_weight(snapshot.mean_prompt_len)
            if not has_queue:
                out = 0.0
        if abs(out) < c.deadband or (out < 0 and settling):
            return Proposal(batch_cap=cap, bucketing=c.bucketing)
        if out < 0:
            self.last_cut_time = snapshot.time
        step = out * c.max_step_frac * cap
        step = math.copysign(max(1.0, abs(step)), step)
        new = int(round(cap + step))
        return Proposal(batch_cap=min(max(new, c.min_batch), c.max_batch), bucketing=c.bucketing)

    def length_weight(self, mean_prompt_len: float) -> float:
        """1 for prompts up to length_ref, falling as length_ref / length beyond it."""
        if mean_prompt_len <= self.cfg.length_ref:
            return 1.0
        return max(self.cfg.min_length_weight, self.cfg.length_ref / mean_prompt_len)


# --- AIMD --------------------------------------------------------------------------------
@dataclass(slots=True)
class AIMDConfig:
    """Additive increase / multiplicative decrease on the cap (``conf/policy/aimd.yaml``)."""

    metric: str = "ttft"
    slo_ms: float = 1000.0
    #: A breach is P99 above target_frac x SLO.
    target_frac: float = 1.0
    additive_increase: int = 4
    multiplicative_decrease: float = 0.75
    #: Treat preemptions in the interval as a breach too (memory pressure).
    decrease_on_preemption: bool = True
    #: As PIDConfig.queue_aware: judge the SLO on TPOT while the backlog exceeds the cap.
    queue_aware: bool = True
    tpot_slo_ms: float | None = 100.0
    initial_batch_cap: int = 32
    min_batch: int = 1
    max_batch: int = 256
    bucketing: str = "fifo"

    def __post_init__(self) -> None:
        _check_common("aimd", {"metric": self.metric, "bucketing": self.bucketing})
        if self.additive_increase < 1 or not 0 < self.multiplicative_decrease < 1:
            raise ValueError(
                f"aimd: need additive_increase >= 1 and 0 < multiplicative_decrease < 1, got "
                f"{self.additive_increase}, {self.multiplicative_decrease}"
            )
        if not 1 <= self.min_batch <= self.initial_batch_cap <= self.max_batch:
            raise ValueError("aimd: need 1 <= min_batch <= initial_batch_cap <= max_batch")


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
@dataclass(slots=True)
class StaticConfig:
    """Fixed knobs (``conf/policy/static.yaml``; ``vllm_default.yaml`` = vLLM's defaults).
    ``batch_cap: null`` means the engine's ``max_num_seqs``."""

    batch_cap: int | None = 64
    bucketing: str = "fifo"
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check_common("static", {"bucketing": self.bucketing})
        if self.batch_cap is not None and self.batch_cap < 1:
            raise ValueError(f"static.batch_cap must be >= 1 or null, got {self.batch_cap}")


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


def _fields(cls: type, d: dict[str, Any], kind: str, drop: tuple[str, ...] = ("kind", "name")) -> dict[str, Any]:
    return config_fields(cls, d, f"policy {kind}", drop=drop)


def _bounded(cls: type, d: dict[str, Any], max_num_seqs: int) -> dict[str, Any]:
    """``d`` with max_batch and initial_batch_cap (the dataclass defaults when unset) capped
    at the engine's ``max_num_seqs``."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    d["max_batch"] = min(int(d.get("max_batch", defaults["max_batch"])), max_num_seqs)
    d["initial_batch_cap"] = min(int(d.get("initial_batch_cap", defaults["initial_batch_cap"])), d["max_batch"])
    return d


def _build_pid(cfg: Any, max_num_seqs: int) -> Controller:
    return PIDController(PIDConfig(**_bounded(PIDConfig, _fields(PIDConfig, _node(cfg), "pid"), max_num_seqs)))


def _build_aimd(cfg: Any, max_num_seqs: int) -> Controller:
    return AIMDController(AIMDConfig(**_bounded(AIMDConfig, _fields(AIMDConfig, _node(cfg), "aimd"), max_num_seqs)))


def _build_static(cfg: Any, max_num_seqs: int) -> Controller:
    d = _node(cfg)
    sc = StaticConfig(**_fields(StaticConfig, d, "static"))
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


def build_controller(cfg_policy: Any, max_num_seqs: int, slo_ms: dict[str, float | None] | None = None) -> Controller:
    """The controller ``cfg_policy.kind`` names. ``slo_ms`` (``{"ttft": .., "tpot": .., "e2el": ..}``
    from the top config) fills PID/AIMD ``slo_ms`` when the policy config leaves it out."""
    d = _node(cfg_policy)
    kind = d.get("kind")
    if kind not in CONTROLLER_BUILDERS:
        raise ValueError(f"unknown policy kind {kind!r}; known: {sorted(CONTROLLER_BUILDERS)}")
    if slo_ms and kind in ("pid", "aimd"):
        slo = slo_ms.get(d.get("metric", "ttft"))
        if slo is not None and "slo_ms" not in d:
            d["slo_ms"] = float(slo)
        if "tpot_slo_ms" not in d:
            d["tpot_slo_ms"] = slo_ms.get("tpot")
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
