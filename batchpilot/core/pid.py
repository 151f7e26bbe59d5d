"""The tuning guide's PID on the batch cap: the project's baseline, and the base a learned
policy corrects (``batchpilot.core.residual``), so it lives with the control step that every
path (training, evaluation, the gateway's fallback) shares."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchpilot.core.knobs import BUCKETING_MODES, Knobs, Proposal
from batchpilot.core.telemetry import DEFAULT_TPOT_MS, DEFAULT_TTFT_MS, LATENCY_METRICS, SLO, Snapshot


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


def slo_setpoints(slo: SLO, metric: str) -> dict[str, float | None]:
    """PID's (and AIMD's) setpoint fields filled from the SLO, read through ``SLO.for_metric``:
    ``slo_ms`` = the objective on ``metric`` (left out where that metric has none, so the
    config's own value stays), ``tpot_slo_ms`` = the TPOT objective (None: no queue-aware
    switch). The one place a controller's setpoints come from the declared SLO."""
    out: dict[str, float | None] = {"tpot_slo_ms": slo.for_metric("tpot")}
    own = slo.for_metric(metric)
    if own is not None:
        out["slo_ms"] = float(own)
    return out


def check_common(kind: str, d: dict[str, Any]) -> None:
    if d.get("metric", "ttft") not in LATENCY_METRICS:
        raise ValueError(f"policy {kind}: metric must be one of {LATENCY_METRICS}, got {d['metric']!r}")
    if d.get("bucketing", "fifo") not in BUCKETING_MODES:
        raise ValueError(f"policy {kind}: bucketing must be one of {BUCKETING_MODES}, got {d['bucketing']!r}")


# --- PID ---------------------------------------------------------------------------------
@dataclass(slots=True)
class PIDConfig:
    """The guide's PID on the batch cap. ``conf/policy/pid.yaml`` extends these defaults (its
    schema), so a PID built without that file (the gateway's fallback when it serves a policy)
    is the same PID the evaluation ran.

    The setpoints (``slo_ms``, ``tpot_slo_ms``) stay fields of their own rather than an ``SLO``:
    they are the controller's parameters, which the SLO fills (``slo_setpoints``, from the one
    declared SLO through ``SLO.for_metric``) but need not equal. A trained policy's manifest
    records its PID with them (``controller.pid`` in ``policies/pretrained/manifest.json``), and
    ``residual_pid_config`` moves each by the served / trained objective, so old artifacts load
    and steer as before; a PID built with no SLO keeps the TTFT default (as it always has)."""

    #: Latency whose P99 is controlled. TPOT: the latency the batch cap moves directly; TTFT
    #: counts queueing from arrival, and cutting the cap under a backlog only lengthens the queue
    #: (docs/evaluation.md).
    metric: str = "tpot"
    #: SLO of that metric in ms (filled from the top config's SLO by ``build_controller``). Left
    #: unfilled it is the TTFT default, as it has always been, though ``metric`` is TPOT.
    slo_ms: float = DEFAULT_TTFT_MS
    #: Aim for P99 = target_frac x SLO (headroom for noise).
    target_frac: float = 0.8
    kp: float = 1.0
    ki: float = 0.05
    kd: float = 0.1
    #: EMA factor on the output (1 = no smoothing).
    smoothing: float = 1.0
    #: Largest step per decision as a fraction of the current cap, at full output (the shield
    #: still limits a step, to 30 % by default).
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
    #: One window (the telemetry's 10 s): bursty p99 TTFT 15.2 s -> 7.5 s.
    settle_s: float = 10.0
    #: With more requests waiting than running, TTFT/E2E measure the queue, not the batch, and a
    #: smaller cap would only lengthen it: steer on TPOT (engine-side) until the backlog clears.
    queue_aware: bool = True
    #: TPOT SLO in ms for queue-aware steering (filled from the top config's SLO).
    tpot_slo_ms: float | None = DEFAULT_TPOT_MS
    initial_batch_cap: int = 128
    min_batch: int = 1
    #: Further capped at the engine's max_num_seqs (``build_controller``).
    max_batch: int = 256
    bucketing: str = "weighted"

    def __post_init__(self) -> None:
        check_common("pid", {"metric": self.metric, "bucketing": self.bucketing})
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
