"""The safety shield: the only path from a controller's ``Proposal`` to the ``Knobs`` in force.

Every controller (PPO, PID, AIMD, static) goes through it, in training and in production, so
no policy can take the service outside these limits:

* **step**: the batch cap moves at most ``max_step_frac`` (30 %) of its current value per
  decision, and at least ``min_step`` (1) so tiny caps can still move; a controller's cap also
  stays within a step of the batch actually running (``step_around_running``: no wind-up
  above an engine that does not fill the cap, no cut far below a batch still draining). At caps 1-3, 30 % rounds
  down to 0, so there the minimum step is the step: 1 -> 2 is +100 %, 2 -> 3 +50 %, 3 -> 4
  +33 %; from 4 up the 30 % holds. A cap outside the range (an operator's or a config's) is
  walked into it at that pace too, never clamped in one jump;
* **range**: ``min_batch <= batch_cap <= max_batch`` (``max_batch`` at most the engine's
  ``max_num_seqs``); bucketing one of ``BUCKETING_MODES``; KV dtype one the engine can run;
* **memory**: the predicted memory at the new setting stays at or below ``memory_ceiling``
  (80 %) of the engine's budget. When the current setting is already above it, the cap moves
  down (as far as the step allows), never up;
* **KV dtype**: switches (an engine restart in vLLM) only after ``min_dtype_dwell_s`` since the
  last switch (none yet at start-up: the first needs only the gain check), only to a runnable
  dtype (refusals carry the engine's reason), and only when the predicted gain, counted up to
  the batch the memory, the demand and the TPOT objective allow, pays for the restart (see
  ``Shield._dtype_gate``);
* **circuit breaker** (graded): on an OOM (``report_oom``: the gateway's upstream answered
  with an out-of-memory error or its engine process exited), a preemption storm or P99 latency above
  ``breach_factor`` x SLO that the engine causes, level 1 shrinks the cap by ``breaker_shrink``
  (x0.7, itself within the 30 % step), and for a latency breach cuts again only once the last
  cut has taken effect (no more requests running than the cap: a lower cap only stops
  admissions); if a cut would go below ``min_batch``, level 2 also sheds low-priority load in
  admission; after ``alert_after`` (3) adjustments in a row that leave the breach in place an
  alert is raised; when ``restart_after`` more cuts at level 2 (shedding on) still leave the
  engine *failing* (OOM, preemption storm), level 3 restarts it (``breaker_restart``; else
  recommends it). A latency breach at ``min_batch`` stays at level 2 with the alert: a restart
  cannot make a slow engine fast, it only takes it down (DeepSeek-V3: 600 s). What each level
  does to the engine is ``batchpilot.core.plant.actuate``, the same in the environment and the
  gateway. A TTFT/E2E breach with a backlog bigger than the batch
  is overload, not an engine problem (TTFT counts the admission queue): shrinking the batch
  would lengthen the queue and spiral down, so the breaker goes straight to level 2 (shed) and
  leaves the cap to the controller.

Memory model. vLLM pre-allocates its whole KV pool at start, so device memory in use does not
move with the batch. "Memory" here is what the engine *needs* at a setting: weights +
activation workspace + the KV blocks ``batch`` requests of the expected context occupy +
an overhead growing with sqrt(batch) (the guide's formula, made exact for the engine's block
layout through ``envs.engine.MemoryModel``)::

    kv_blocks = batch * ceil(expected_context / block_size) * calibration
    predicted = weights + activation + kv_blocks * kv_block_bytes[dtype]
                + overhead_frac * budget * sqrt(batch)
    fraction  = predicted / budget          # must stay <= memory_ceiling

``expected_context`` is the mean prompt + output-so-far of running requests from telemetry
(an EMA; ``initial_context_len`` before any is seen); ``calibration`` is an EMA of observed /
predicted KV blocks (clipped), so prefix sharing or short outputs are learnt online.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from batchpilot.core.engine import KV_DTYPES_16BIT, EngineCapabilities, MemoryModel
from batchpilot.core.knobs import BUCKETING_MODES, Knobs, Proposal
from batchpilot.core.telemetry import SLO, Snapshot
from batchpilot.nodes import from_node

log = logging.getLogger(__name__)

#: Kinds of intervention, as counted in ``Shield.num_interventions`` and keys of
#: ``Decision.interventions``.
INTERVENTION_KINDS: tuple[str, ...] = (
    "invalid_batch",
    "batch_range",
    "step_limit",
    "memory_ceiling",
    "invalid_bucketing",
    "dtype_unavailable",
    "dtype_dwell",
    "dtype_not_worth",
    "dtype_memory",
    "breaker_shrink",
    "breaker_hold",
    "breaker_shed",
    "stale_telemetry",  # the gateway's: an interval without the engine's counters
    "memory_unknown",  # the gateway's: no KV budget known, the cap held at the safe static cap
)


@dataclass(slots=True)
class ShieldConfig:
    """Hard limits and breaker settings (``conf/shield/default.yaml``)."""

    #: Largest batch change per decision, as a fraction of the current cap.
    max_step_frac: float = 0.30
    #: Smallest allowed step, so a cap of 1-3 can still move.
    min_step: int = 1
    #: The controller's cap also moves at most a step from the batch actually running: a cap
    #: raised above an engine that does not fill it admits a whole burst at once when traffic
    #: returns (wind-up), and one cut far below a batch still draining holds the engine under
    #: its capacity once it has drained. The breaker and the memory ceiling are not bound by it.
    step_around_running: bool = True
    #: Predicted memory must stay at or below this fraction of the engine's budget.
    memory_ceiling: float = 0.80
    min_batch: int = 1
    #: Upper bound of the cap; the shield uses min(this, engine max_num_seqs) and logs it.
    max_batch: int = 256
    #: Seconds between KV dtype switches (each one is an engine restart).
    min_dtype_dwell_s: float = 600.0
    #: Estimated engine restart time for a dtype switch (capacity lost while it runs).
    dtype_restart_s: float = 60.0
    #: Seconds over which a dtype switch's throughput gain must repay the restart.
    dtype_gain_horizon_s: float = 600.0
    #: A switch's gain counts only the batch the TPOT objective allows: TPOT taken as
    #: proportional to the running batch (so an upper bound on that batch: TPOT has a fixed
    #: part) and held at this fraction of the TPOT SLO (PID's target). 0: memory and demand only.
    dtype_gain_latency_frac: float = 0.8
    #: Memory overhead per sqrt(batch), as a fraction of the budget (guide's overhead term).
    overhead_frac: float = 0.002
    #: Expected tokens per request (prompt + output so far) before telemetry reports any.
    initial_context_len: int = 1024
    #: EMA rate for the expected context and the KV calibration ratio.
    calibration_rate: float = 0.1
    calibration_min: float = 0.5
    calibration_max: float = 2.0
    #: Preemptions in one interval that count as a storm.
    preemption_storm: int = 10
    #: P99 above breach_factor x SLO on any of ``breach_metrics`` is a breach.
    breach_factor: float = 1.5
    breach_metrics: tuple[str, ...] = ("ttft", "tpot", "e2el")
    #: A TPOT breach counts only while the present time between tokens (running requests /
    #: output tokens per second in the last interval) is above the TPOT SLO too. The window's
    #: TPOT is over finished requests, each averaged over its whole decode (tens of seconds on a
    #: large model), so it shows a batch long after a cut has shrunk it: measured, the breaker
    #: cut 184 -> 32 over 10 s while tokens already flowed within the SLO. Unknown rate: as false.
    tpot_breach_needs_present: bool = True
    #: A TTFT/E2E breach while more than this x cap requests wait is overload (queueing): the
    #: breaker sheds instead of shrinking the batch, which would only lengthen the queue. 0: any
    #: backlog (= conf/shield/default.yaml; the code default was 1.0 while the file said 0).
    overload_backlog_factor: float = 0.0
    #: A TTFT/E2E breach within this many seconds of such a backlog is still queueing: the
    #: latency window (telemetry's ``window_s``) holds the requests that waited in it for that
    #: long after it has drained. Measured: the breaker cut 134 -> 66 with an empty queue on the
    #: TTFTs of a backlog just served. 0: only a backlog in the interval itself counts.
    overload_memory_s: float = 10.0
    #: More requests waiting past their TTFT objective than running is overload too (shed).
    #: Served first, the on-time requests keep the TTFT window near the objective while the
    #: late ones pile up behind them (measured: 3,700 waiting, p99 TTFT 1.06 s, never shed).
    #: On since 2026-12-02: the live gateway shed such a backlog on its TTFT and the simulator
    #: did not, so the twin mispredicted every gateway path 3-6x (docs/live_evaluation.md).
    late_queue_overload: bool = True
    #: Level-1 shrink factor of the cap.
    breaker_shrink: float = 0.7
    #: Seconds after a breaker shrink before the next one (latency windows need time to show it).
    breaker_cooldown_s: float = 2.0
    #: Alert after this many breaker adjustments in a row that did not clear the breach.
    alert_after: int = 3
    #: Level 3 (restart the engine) after this many failed adjustments at level 2 (shedding on),
    #: counted only while the engine itself fails (out of memory, preemption storm): a restart
    #: cannot make a slow engine meet a latency objective, it only takes it down.
    restart_after: int = 3
    #: Whether level 3 restarts the engine (the environment's, a managed upstream); false: the
    #: restart is only recommended (alert, status).
    breaker_restart: bool = True
    #: Clean decisions in a row before the breaker resets to level 0 (and shedding stops).
    recover_after: int = 3
    #: Level 2 keeps requests with priority <= this (0 = core) and sheds the rest.
    shed_max_priority_kept: int = 0

    def __post_init__(self) -> None:
        self.breach_metrics = tuple(self.breach_metrics)
        if not 0 < self.max_step_frac <= 1:
            raise ValueError(f"shield.max_step_frac must be in (0, 1], got {self.max_step_frac}")
        if self.min_step < 1:
            raise ValueError(f"shield.min_step must be >= 1, got {self.min_step}")
        if not 0 < self.memory_ceiling <= 1:
            raise ValueError(f"shield.memory_ceiling must be in (0, 1], got {self.memory_ceiling}")
        if not 1 <= self.min_batch <= self.max_batch:
            raise ValueError(
                f"shield needs 1 <= min_batch <= max_batch, got min_batch={self.min_batch}, "
                f"max_batch={self.max_batch}"
            )
        if not (1 - self.max_step_frac) - 1e-9 <= self.breaker_shrink < 1:
            raise ValueError(
                f"shield.breaker_shrink={self.breaker_shrink} must be in [1 - max_step_frac, 1) "
                f"= [{1 - self.max_step_frac:.2f}, 1) so the breaker's cut respects the step limit"
            )
        if not self.overload_memory_s >= 0:
            raise ValueError(f"shield.overload_memory_s must be >= 0 seconds, got {self.overload_memory_s}")
        unknown = set(self.breach_metrics) - {"ttft", "tpot", "e2el"}
        if unknown:
            raise ValueError(f"shield.breach_metrics: unknown {sorted(unknown)}; use ttft, tpot, e2el")
        if not 0 < self.calibration_rate <= 1:
            raise ValueError(f"shield.calibration_rate must be in (0, 1], got {self.calibration_rate}")
        if not 0 < self.calibration_min <= 1 <= self.calibration_max:
            raise ValueError("shield needs 0 < calibration_min <= 1 <= calibration_max")
        for name in ("alert_after", "restart_after", "recover_after", "preemption_storm"):
            if getattr(self, name) < 1:
                raise ValueError(f"shield.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("min_dtype_dwell_s", "dtype_restart_s", "overhead_frac", "breaker_cooldown_s", "dtype_gain_latency_frac"):
            if getattr(self, name) < 0:
                raise ValueError(f"shield.{name} must be >= 0, got {getattr(self, name)}")
        if self.dtype_gain_horizon_s <= 0 or self.breach_factor <= 0:
            raise ValueError("shield.dtype_gain_horizon_s and breach_factor must be > 0")

    @classmethod
    def from_cfg(cls, node: Any) -> "ShieldConfig":
        """From the ``shield`` node (checked against ``shield/schema`` at compose time) or a
        mapping; an unknown key or a wrong type raises naming the key."""
        return from_node(cls, node)


@dataclass(slots=True)
class ShieldInputs:
    """What the shield sees of the last interval (all from gateway-visible signals)."""

    preemptions: int = 0
    #: The engine ran out of memory in the interval. The env's engines never do (the simulator
    #: preempts, the live engine's KV pool is fixed); the gateway sets it through
    #: ``Shield.report_oom`` from an upstream's out-of-memory error answers and engine exits.
    oom: bool = False
    ttft_p99_ms: float = 0.0
    tpot_p99_ms: float = 0.0
    e2el_p99_ms: float = 0.0
    #: Mean tokens held per running request (prompt + output so far); 0 = unknown.
    mean_context_len: float = 0.0
    num_running: int = 0
    #: Output tokens per second in the last interval, counted as generated; None = unknown.
    output_tokens_per_s: float | None = None
    #: KV blocks in use as the engine reports them; None = unknown (no calibration).
    num_kv_blocks_used: int | None = None
    #: Requests that want to run (waiting in admission + running); sizes a dtype switch's gain.
    demand: int = 0
    #: Waiting requests past their TTFT objective.
    num_late_waiting: int = 0

    @property
    def backlog(self) -> int:
        """Requests that want to run but do not."""
        return max(0, self.demand - self.num_running)

    @classmethod
    def from_snapshot(
        cls,
        snap: Snapshot,
        *,
        mean_context_len: float = 0.0,
        num_kv_blocks_total: int | None = None,
        oom: bool = False,
    ) -> "ShieldInputs":
        """Inputs from a telemetry snapshot. Without a context estimate the mean prompt of
        recent arrivals is used (a lower bound: output so far is not in it)."""
        blocks = None
        if num_kv_blocks_total is not None:
            blocks = int(round(snap.kv_cache_usage * num_kv_blocks_total))
        return cls(
            preemptions=snap.preemptions,
            oom=oom,
            ttft_p99_ms=snap.ttft_p99_ms,
            tpot_p99_ms=snap.tpot_p99_ms,
            e2el_p99_ms=snap.e2el_p99_ms,
            mean_context_len=mean_context_len or snap.mean_prompt_len,
            num_running=snap.num_running,
            output_tokens_per_s=snap.output_throughput,
            num_kv_blocks_used=blocks,
            demand=snap.num_running + snap.num_waiting_engine + snap.queue_total,
            num_late_waiting=snap.num_late_waiting,
        )


def require_inputs(inputs: object, method: str) -> None:
    """Refuse anything but ``ShieldInputs`` at the shield's boundary: one type crosses it, and a
    telemetry ``Snapshot`` is converted once, in the control loop's shield stage, never here
    (a second conversion point could fill what a snapshot lacks differently)."""
    if not isinstance(inputs, ShieldInputs):
        raise TypeError(
            f"{method} takes ShieldInputs, got {type(inputs).__name__}: convert a telemetry Snapshot "
            f"with ShieldInputs.from_snapshot (as the control loop's shield stage does, "
            f"batchpilot.core.control.shield_inputs)"
        )


@dataclass(slots=True)
class Decision:
    """What the shield applied and why. ``interventions`` maps a kind (``INTERVENTION_KINDS``)
    to a human-readable reason; empty when the proposal passed unchanged."""

    knobs: Knobs
    interventions: dict[str, str] = field(default_factory=dict)
    predicted_memory_fraction: float = 0.0
    breaker_level: int = 0
    alerts: list[str] = field(default_factory=list)
    #: Set at breaker level >= 2: admission should shed priorities above this (None = no shedding).
    shed_max_priority_kept: int | None = None
    recommend_restart: bool = False
    dtype_switched: bool = False

    @property
    def num_interventions(self) -> int:
        return len(self.interventions)


class Shield:
    """Turns proposals into knobs inside the hard limits; keeps the breaker and calibration state."""

    def __init__(
        self,
        cfg: ShieldConfig,
        memory: MemoryModel,
        capabilities: EngineCapabilities,
        slo: SLO | None = None,
        now: float = 0.0,
    ) -> None:
        self.cfg = cfg
        #: Breach thresholds are multiples of these objectives (pass the run's SLO).
        self.slo = slo if slo is not None else SLO()
        self.memory = memory
        self.capabilities = capabilities
        self.max_batch = cfg.max_batch
        self.set_engine(memory, capabilities)
        self.num_interventions: Counter[str] = Counter()
        self.oom_reason: str | None = None
        self.num_decisions = 0
        self.num_alerts = 0
        self.reset(now)

    def set_engine(self, memory: MemoryModel, capabilities: EngineCapabilities) -> None:
        """Engine facts (again after a restart: the memory model may have changed)."""
        self.memory = memory
        self.capabilities = capabilities
        if self.cfg.max_batch > capabilities.max_num_seqs:
            log.info(
                "shield.max_batch=%d above the engine's max_num_seqs=%d; using %d",
                self.cfg.max_batch, capabilities.max_num_seqs, capabilities.max_num_seqs,
            )
        self.max_batch = max(self.cfg.min_batch, min(self.cfg.max_batch, capabilities.max_num_seqs))

    def no_room_reason(self) -> str | None:
        """Why the memory ceiling admits no request at all on this engine (None: it admits
        some). Per-request memory admission would then refuse every request
        (``too_large_for_memory``) while the engine itself could run them."""
        m = self.memory
        floor = min(self.blocks_fraction(1, 1, d) for d in m.kv_block_bytes)
        if floor <= self.cfg.memory_ceiling:
            return None
        return (f"shield.memory_ceiling={self.cfg.memory_ceiling:g} leaves no room for a single request: "
                f"weights {m.weights_bytes / 1e9:.1f} GB + activations {m.activation_bytes / 1e9:.1f} GB "
                f"(+ one sequence's overhead) already take {floor:.0%} of the engine's memory budget "
                f"({m.budget_bytes / 1e9:.1f} GB = gpu_memory_utilization x memory); use a GPU with more "
                f"memory, raise model.tensor_parallel, or raise shield.memory_ceiling")

    def start_kv_dtype(self, kv16: str, kv8: str, kv8_read_cost: float = 1.0) -> str:
        """The KV dtype to start an engine with, while a switch costs no restart: ``kv8`` when
        at the expected context (``initial_context_len`` before any traffic) the memory ceiling
        holds fewer requests at ``kv16`` than the cap may reach (``max_batch``) and more at
        ``kv8``; else ``kv16``. Where memory does not bind, 8-bit buys nothing and costs quality.
        Where the engine reads 8-bit KV slower (``kv8_read_cost`` > 1, e.g. an A100 without
        native fp8) every iteration pays for the room, so ``kv8`` only where the ceiling binds
        at 8 bits too (the engine is memory-bound at either precision, and any load that fills
        the 16-bit room fills the 8-bit one); where 8-bit would lift the ceiling above the cap,
        the room it adds serves only loads heavier than the 16-bit room, unknown before any
        traffic: ``kv16`` (the KV agent may still switch later)."""
        if not self.capabilities.can_run(kv8) or kv8 not in self.memory.kv_block_bytes:
            return kv16
        at16, at8 = self.max_feasible_batch(kv16), self.max_feasible_batch(kv8)
        if not at16 < self.max_batch or not at8 > at16:
            return kv16
        return kv16 if kv8_read_cost > 1.0 and at8 >= self.max_batch else kv8

    def update_memory_model(self, memory: MemoryModel) -> None:
        """After an engine restart (e.g. a new KV dtype) the block layout may differ."""
        self.set_engine(memory, self.capabilities)

    def report_oom(self, reason: str) -> None:
        """The engine ran out of memory (or died) since the last decision: the next ``apply``
        treats the interval as an OOM breach (``ShieldInputs.oom``). The gateway calls this for
        what vLLM really reports: an error answer naming out-of-memory, the engine process
        exiting. Several reports before a decision count once."""
        self.pending_oom = self.pending_oom or reason

    def reset(self, now: float) -> None:
        """Start of an episode / a fresh engine: no breaker, no calibration, no switch yet (the
        dwell is the time *between* switches: the first one needs only the gain check; a dwell
        counted from start-up refused every switch in a training episode shorter than it)."""
        self.last_dtype_switch = -math.inf
        self.pending_oom: str | None = None
        self.breaker_level = 0
        self.num_breached_in_row = 0
        self.num_clean_in_row = 0
        self.num_failed_sheds = 0
        self.last_breach_kind = "engine"
        self.last_breaker_action = -math.inf
        self.last_backlog_time = -math.inf
        self.kv_calibration = 1.0
        self.context_len = float(self.cfg.initial_context_len)

    # --- memory predictor ----------------------------------------------------------------
    def blocks_fraction(self, kv_blocks: float, num_seqs: int, kv_dtype: str) -> float:
        """The one prediction: memory with ``kv_blocks`` KV blocks held by ``num_seqs``
        sequences at ``kv_dtype``, as a fraction of the budget (weights + activations + KV x
        calibration + overhead x sqrt(sequences)). The cap's check and admission's per-request
        check both come here."""
        m = self.memory
        kv = kv_blocks * self.kv_calibration * m.kv_block_bytes[kv_dtype]
        overhead = self.cfg.overhead_frac * m.budget_bytes * math.sqrt(max(num_seqs, 0))
        return (m.weights_bytes + m.activation_bytes + kv + overhead) / m.budget_bytes

    def predicted_fraction(self, batch: int, kv_dtype: str) -> float:
        """Predicted memory at ``batch`` and ``kv_dtype`` (each request at the expected context),
        as a fraction of the budget."""
        blocks_per_req = max(1, math.ceil(self.context_len / self.memory.block_size))
        return self.blocks_fraction(batch * blocks_per_req, batch, kv_dtype)

    # --- the per-request check (admission's ``memory``) ----------------------------------
    def request_blocks(self, prompt_len: int, output_len: int, num_seqs: int = 1) -> int:
        """KV blocks a request holds at its end: each of its sequences at prompt + output
        tokens (no sharing between them assumed: the worst case)."""
        tokens = max(int(prompt_len), 0) + max(int(output_len), 0)
        per_seq = max(1, math.ceil(tokens / self.memory.block_size))
        return per_seq if num_seqs == 1 else max(1, int(num_seqs)) * per_seq  # one per request, mostly

    def fits(self, kv_blocks: int, num_seqs: int, kv_dtype: str) -> bool:
        """Whether ``kv_blocks`` for ``num_seqs`` sequences stay within the memory ceiling
        (admission asks this with what is in flight plus the candidate)."""
        m = self.memory
        block_bytes = m.kv_block_bytes
        if kv_dtype not in block_bytes:
            return False
        # ``blocks_fraction``, inline (admission asks twice per request), the same arithmetic.
        kv = kv_blocks * self.kv_calibration * block_bytes[kv_dtype]
        overhead = self.cfg.overhead_frac * m.budget_bytes * math.sqrt(max(num_seqs, 0))
        return (m.weights_bytes + m.activation_bytes + kv + overhead) / m.budget_bytes <= self.cfg.memory_ceiling

    def predict_fraction(self, knobs: Knobs) -> float:
        """``predicted_fraction`` at these knobs (the context estimate is the shield's own,
        updated by ``apply``/``observe``)."""
        return self.predicted_fraction(knobs.batch_cap, knobs.kv_dtype)

    def max_feasible_batch(self, kv_dtype: str) -> int:
        """Largest cap in [0, max_batch] whose prediction is within the ceiling (0: none)."""
        lo, hi = 0, self.max_batch
        ceiling = self.cfg.memory_ceiling
        if self.predicted_fraction(hi, kv_dtype) <= ceiling:
            return hi
        # predicted_fraction(mid) <= ceiling, its arithmetic inline and in the same order (the
        # search runs every interval): only the operands that do not depend on mid are hoisted.
        m = self.memory
        blocks_per_req = max(1, math.ceil(self.context_len / m.block_size))
        calibration, block_bytes, budget = self.kv_calibration, m.kv_block_bytes[kv_dtype], m.budget_bytes
        fixed = m.weights_bytes + m.activation_bytes
        overhead_per_root = self.cfg.overhead_frac * budget
        while hi - lo > 1:  # invariant: lo feasible (or 0), hi infeasible
            mid = (lo + hi) // 2
            kv = mid * blocks_per_req * calibration * block_bytes
            if (fixed + kv + overhead_per_root * math.sqrt(max(mid, 0))) / budget <= ceiling:
                lo = mid
            else:
                hi = mid
        return lo

    def observe(self, inputs: ShieldInputs) -> None:
        """Update the context estimate and the KV calibration from what the engine reports."""
        r = self.cfg.calibration_rate
        if inputs.mean_context_len > 0 and math.isfinite(inputs.mean_context_len):
            self.context_len += r * (inputs.mean_context_len - self.context_len)
        if inputs.num_kv_blocks_used is not None and inputs.num_running > 0 and inputs.mean_context_len > 0:
            blocks_per_req = max(1, math.ceil(inputs.mean_context_len / self.memory.block_size))
            predicted = inputs.num_running * blocks_per_req
            ratio = min(max(inputs.num_kv_blocks_used / predicted, self.cfg.calibration_min), self.cfg.calibration_max)
            self.kv_calibration += r * (ratio - self.kv_calibration)

    # --- the decision --------------------------------------------------------------------
    def max_step(self, current: int) -> int:
        return max(self.cfg.min_step, int(math.floor(self.cfg.max_step_frac * current + 1e-9)))

    def _around_running(self, target: int, cur: int, running: int, why: dict[str, str]) -> int:
        """``target`` bounded to a step around the ``running`` batch, never moving past ``cur``
        the other way (see ``ShieldConfig.step_around_running``)."""
        step = self.max_step(running)
        hi, lo = max(cur, running + step), min(cur, running - step)
        if lo <= target <= hi:
            return target
        new = min(max(target, lo), hi)
        why["step_limit"] = (
            f"batch_cap {target} is more than {step} from the {running} running; set {new}"
        )
        return new

    def apply(self, proposal: Proposal, current: Knobs, inputs: ShieldInputs, now: float) -> Decision:
        """The knobs to apply for ``proposal`` given the knobs in force and the last interval
        (``ShieldInputs`` only: the control loop's shield stage converts a telemetry snapshot,
        ``batchpilot.core.control.shield_inputs``). The stages run in
        this order because each bounds the next: the dtype first (memory depends on it), then
        range and step, the breaker's bound, the memory ceiling, bucketing."""
        inputs = self._take_inputs(current, inputs)
        why: dict[str, str] = {}
        alerts: list[str] = []
        cur = int(current.batch_cap)
        target = self._asked_cap(proposal, cur, why)
        dtype = self._dtype_gate(proposal.kv_dtype, current, inputs, now, why)
        target = self._range_and_step(target, cur, inputs.num_running, why)
        level, shrink_to = self._breaker(inputs, cur, now, why, alerts)
        if shrink_to is not None and target > shrink_to:
            target = shrink_to
        target = self._memory_bound(target, cur, dtype, why, alerts)
        bucketing = self._bucketing(proposal, current, why)
        return self._record(Knobs(batch_cap=target, bucketing=bucketing, kv_dtype=dtype),
                            current, level, why, alerts, now)

    def _take_inputs(self, current: Knobs, inputs: ShieldInputs) -> ShieldInputs:
        """The interval as the shield sees it, folded into its state: a pending OOM report
        (``report_oom``) marks it a breach, and the context / KV calibration estimates learn
        from it before any limit is computed (the memory prediction uses them). Refuses knobs
        in force whose dtype the memory model does not know: no limit could be computed."""
        require_inputs(inputs, "Shield.apply")
        if current.kv_dtype not in self.memory.kv_block_bytes:
            raise ValueError(
                f"current kv_dtype {current.kv_dtype!r} has no entry in the memory model "
                f"({sorted(self.memory.kv_block_bytes)})"
            )
        if self.pending_oom is not None:
            inputs = replace(inputs, oom=True)
            self.oom_reason, self.pending_oom = self.pending_oom, None
        self.num_decisions += 1
        self.observe(inputs)
        return inputs

    @staticmethod
    def _asked_cap(proposal: Proposal, cur: int, why: dict[str, str]) -> int:
        """The cap the controller asked for, sanitised: none means "keep", and a value that is
        not an integer (a float from a policy's head, a bool) is refused rather than rounded."""
        target = proposal.batch_cap
        if target is None:
            return cur
        if not _is_int(target):
            why["invalid_batch"] = f"batch_cap {target!r} is not an integer; kept {cur}"
            return cur
        return int(target)

    def _range_and_step(self, target: int, cur: int, running: int, why: dict[str, str]) -> int:
        """``target`` within [min_batch, max_batch] and a step of ``cur`` (and, with
        ``step_around_running``, of the running batch): no single decision can move the
        engine far, whatever a controller proposes."""
        lo_b, hi_b = self.cfg.min_batch, self.max_batch
        if not lo_b <= target <= hi_b:
            why["batch_range"] = f"batch_cap {target} outside [{lo_b}, {hi_b}]"
            target = min(max(target, lo_b), hi_b)
        step = self.max_step(cur)
        if abs(target - cur) > step:
            clipped = min(max(target, cur - step), cur + step)
            why["step_limit"] = f"batch_cap {target} is more than {step} from {cur}; set {clipped}"
            target = clipped
        if self.cfg.step_around_running and lo_b <= cur <= hi_b:
            target = self._around_running(target, cur, running, why)
        return target

    def _memory_bound(self, target: int, cur: int, dtype: str, why: dict[str, str], alerts: list[str]) -> int:
        """``target`` under the memory ceiling at ``dtype``, but never more than a step below
        ``cur`` (the breaker, not this rule, makes big cuts); then back in the range, or, for a
        cap outside it (an operator's), one step towards it, never a jump."""
        cfg = self.cfg
        lo_b, hi_b = cfg.min_batch, self.max_batch
        feasible = self.max_feasible_batch(dtype)
        # (Above max_batch, "feasible" is only the range's end: check the prediction itself.)
        if target > feasible and self.predicted_fraction(target, dtype) > cfg.memory_ceiling:
            new = max(feasible, max(lo_b, cur - self.max_step(cur)))
            if new < target:
                why["memory_ceiling"] = (
                    f"batch_cap {target} predicts {self.predicted_fraction(target, dtype):.0%} of "
                    f"memory (ceiling {cfg.memory_ceiling:.0%}); set {new}"
                )
                target = new
            if feasible < lo_b:
                alerts.append(
                    f"memory ceiling {cfg.memory_ceiling:.0%} unreachable even at min_batch={lo_b} "
                    f"with kv_dtype={dtype}"
                )
        if lo_b <= cur <= hi_b:
            return min(max(target, lo_b), hi_b)
        return min(target, cur) if cur > hi_b else max(target, cur)  # walking into the range

    @staticmethod
    def _bucketing(proposal: Proposal, current: Knobs, why: dict[str, str]) -> str:
        """The bucketing mode: the proposal's if it is one of ``BUCKETING_MODES``, else the one
        in force (or the first mode, if the one in force is unknown too)."""
        bucketing = current.bucketing if current.bucketing in BUCKETING_MODES else BUCKETING_MODES[0]
        if proposal.bucketing is not None:
            if proposal.bucketing in BUCKETING_MODES:
                bucketing = proposal.bucketing
            else:
                why["invalid_bucketing"] = (
                    f"unknown bucketing {proposal.bucketing!r}; kept {bucketing!r} (one of {BUCKETING_MODES})"
                )
        return bucketing

    def _record(self, knobs: Knobs, current: Knobs, level: int, why: dict[str, str], alerts: list[str],
                now: float) -> Decision:
        """The decision, counted: the dwell clock restarts on a dtype switch, and the
        intervention and alert counters (the env's info, the gateway's /metrics) move."""
        cfg = self.cfg
        switched = knobs.kv_dtype != current.kv_dtype
        if switched:
            self.last_dtype_switch = now
        self.num_interventions.update(why.keys())
        self.num_alerts += len(alerts)
        return Decision(
            knobs=knobs,
            interventions=why,
            predicted_memory_fraction=self.predicted_fraction(knobs.batch_cap, knobs.kv_dtype),
            breaker_level=level,
            alerts=alerts,
            shed_max_priority_kept=cfg.shed_max_priority_kept if level >= 2 else None,
            recommend_restart=level >= 3,
            dtype_switched=switched,
        )

    def check_dtype(self, want: str, current: Knobs, inputs: ShieldInputs, now: float) -> dict[str, str]:
        """Why a switch to ``want`` would be refused now (empty: it would pass), without
        deciding anything: for an operator's request, which goes through the same gate."""
        require_inputs(inputs, "Shield.check_dtype")
        why: dict[str, str] = {}
        self._dtype_gate(want, current, inputs, now, why)
        return why

    def _dtype_gate(
        self, want: Any, current: Knobs, inputs: ShieldInputs, now: float, why: dict[str, str]
    ) -> str:
        """The dtype to run. A switch must be runnable, past the dwell time, not push the cap
        over the ceiling by more than a step, and worth its restart:

        * towards a smaller KV footprint: the relative throughput gain ``g`` (throughput taken
          as proportional to the batch the memory, the demand and the TPOT objective allow,
          ``latency_batch``) must repay the
          restart, ``g * dtype_gain_horizon_s >= dtype_restart_s``;
        * back to 16 bit (better quality): no throughput loss, ``g >= 0``.
        """
        have = current.kv_dtype
        if want is None or want == have:
            return have
        if not isinstance(want, str) or not self.capabilities.can_run(want):
            reason = self.capabilities.why_not(want) if isinstance(want, str) else "not a dtype name"
            why["dtype_unavailable"] = f"kv_dtype {want!r} cannot run here: {reason}; kept {have!r}"
            return have
        if want not in self.memory.kv_block_bytes:
            why["dtype_unavailable"] = f"kv_dtype {want!r} has no memory model; kept {have!r}"
            return have
        since = now - self.last_dtype_switch
        if since < self.cfg.min_dtype_dwell_s:
            why["dtype_dwell"] = (
                f"kv_dtype switch {have!r}->{want!r} {since:.0f}s after the last one "
                f"(min {self.cfg.min_dtype_dwell_s:.0f}s); kept {have!r}"
            )
            return have
        cur = int(current.batch_cap)
        if self.max_feasible_batch(want) < max(self.cfg.min_batch, cur - self.max_step(cur)):
            why["dtype_memory"] = f"kv_dtype {want!r} would put batch_cap {cur} over the memory ceiling"
            return have
        reach = max(1, min(inputs.demand, self.max_batch, self.latency_batch(inputs)))
        eff_have = max(1, min(self.max_feasible_batch(have), reach))
        eff_want = min(self.max_feasible_batch(want), reach)
        gain = eff_want / eff_have - 1.0
        if want in KV_DTYPES_16BIT and have not in KV_DTYPES_16BIT:
            worth = gain >= 0.0
        else:
            worth = gain * self.cfg.dtype_gain_horizon_s >= self.cfg.dtype_restart_s and gain > 0
        if not worth:
            why["dtype_not_worth"] = (
                f"kv_dtype {have!r}->{want!r}: predicted throughput gain {gain:+.0%} over "
                f"{self.cfg.dtype_gain_horizon_s:.0f}s does not repay a {self.cfg.dtype_restart_s:.0f}s restart"
                f" (batch the demand and the TPOT objective allow: {reach})"
            )
            return have
        return want

    def latency_batch(self, inputs: ShieldInputs) -> int:
        """The largest batch the TPOT objective allows, from the last interval: a KV switch that
        only lifts the memory ceiling above it gains nothing (measured: a switch on a
        latency-bound engine lost 72 % of goodput, docs/training.md). Unknown: ``max_batch``."""
        frac, slo = self.cfg.dtype_gain_latency_frac, self.slo.tpot_ms
        if frac <= 0 or not slo or not inputs.tpot_p99_ms > 0 or inputs.num_running <= 0:
            return self.max_batch
        return max(1, int(inputs.num_running * frac * slo / inputs.tpot_p99_ms))

    @staticmethod
    def _tpot_now_ms(inputs: ShieldInputs) -> float:
        """The present time between a running request's tokens: inf when the rate is unknown
        or the engine stalls, 0 when nothing runs (then there is no batch to cut)."""
        rate = inputs.output_tokens_per_s
        if rate is None:
            return math.inf
        if inputs.num_running <= 0:
            return 0.0
        return 1e3 * inputs.num_running / rate if rate > 0 else math.inf

    def _breached(self, inputs: ShieldInputs, queueing: bool) -> tuple[str, str] | None:
        """(why, kind) when the last interval counts as a breach, else None. ``kind`` is
        "failure" (the engine itself fails: out of memory, a preemption storm; only these walk
        the breaker to level 3, a restart), "engine" (the batch is too big for the engine's
        latency: TPOT, or a TTFT/E2E breach without a backlog) or "overload" (a TTFT/E2E breach
        while ``queueing``: a backlog now or within ``overload_memory_s``, so the latency is
        queueing, and a smaller batch would only lengthen it)."""
        if inputs.oom:
            return f"engine out of memory ({self.oom_reason or 'reported by its engine'})", "failure"
        if inputs.preemptions >= self.cfg.preemption_storm:
            return f"preemption storm ({inputs.preemptions} >= {self.cfg.preemption_storm})", "failure"
        seen = {"ttft": inputs.ttft_p99_ms, "tpot": inputs.tpot_p99_ms, "e2el": inputs.e2el_p99_ms}
        found: tuple[str, str] | None = None
        backlog = inputs.backlog
        for m in sorted(self.cfg.breach_metrics, key=lambda m: m != "tpot"):  # engine-side first
            limit = self.slo.for_metric(m)
            if limit is None or not seen[m] > self.cfg.breach_factor * limit:
                continue
            if m == "tpot" and self.cfg.tpot_breach_needs_present and self._tpot_now_ms(inputs) <= limit:
                continue  # the window still shows a batch a cut has already shrunk
            why = f"p99 {m} {seen[m]:.0f} ms > {self.cfg.breach_factor} x SLO {limit:.0f} ms"
            if m == "tpot" or not queueing:
                return why, "engine"
            found = found or (f"{why} with {backlog} waiting" if backlog else f"{why} after a backlog", "overload")
        if found is None and self.cfg.late_queue_overload and inputs.num_late_waiting > inputs.num_running:
            found = (f"{inputs.num_late_waiting} waiting past their TTFT objective, more than the "
                     f"{inputs.num_running} running", "overload")
        return found

    def _breaker(
        self, inputs: ShieldInputs, cur: int, now: float, why: dict[str, str], alerts: list[str]
    ) -> tuple[int, int | None]:
        """Advance the breaker; returns (level, upper bound on the cap or None)."""
        cfg = self.cfg
        if inputs.backlog > cfg.overload_backlog_factor * cur:
            self.last_backlog_time = now
        breach = self._breached(inputs, queueing=now - self.last_backlog_time <= cfg.overload_memory_s)
        if breach is None:
            self.num_breached_in_row = 0
            self.num_clean_in_row += 1
            if self.breaker_level and self.num_clean_in_row >= cfg.recover_after:
                self.breaker_level = 0
                self.num_failed_sheds = 0
            if self.breaker_level and self.last_breach_kind != "overload":
                why["breaker_hold"] = f"breaker level {self.breaker_level} recovering; cap held at {cur}"
                return self.breaker_level, cur
            return self.breaker_level, None
        reason, kind = breach
        self.num_clean_in_row = 0
        self.last_breach_kind = kind
        if kind == "overload":
            # Shed instead of shrinking; the controller may still move the cap (memory allowing).
            self.num_breached_in_row += 1
            self.breaker_level = max(self.breaker_level, 2)
            why["breaker_shed"] = f"{reason}: overload, shedding priority > {cfg.shed_max_priority_kept}"
            failed = self.num_breached_in_row - 1
            if failed >= cfg.alert_after:
                alerts.append(f"overload persists after {failed} sheds in a row: {reason}")
            return self.breaker_level, None
        if kind == "engine" and inputs.num_running > cur:
            # A lower cap only stops admissions; the running requests finish at their own pace, so
            # until they are down to the cap the last cut has not taken effect, and the latency
            # window still shows the batch before it. Cutting again then overshoots (measured:
            # 256 -> 3 in 30 s after a restart's refill, docs/training.md).
            why["breaker_hold"] = (
                f"{reason}; {inputs.num_running} running above the cap: waiting for the last cut "
                f"to take effect, cap held at {cur}"
            )
            return self.breaker_level, cur
        if now - self.last_breaker_action < cfg.breaker_cooldown_s:
            why["breaker_hold"] = f"{reason}; waiting for the last cut to show, cap held at {cur}"
            return self.breaker_level, cur
        self.last_breaker_action = now
        self.num_breached_in_row += 1  # adjustments made while the breach persists
        shrink = max(int(math.ceil(cfg.breaker_shrink * cur - 1e-9)), cur - self.max_step(cur))
        shrink = min(shrink, cur - 1)
        if shrink >= cfg.min_batch:
            self.breaker_level = max(self.breaker_level, 1)
            why["breaker_shrink"] = f"{reason}; batch_cap {cur} -> {shrink}"
        else:
            shrink = cfg.min_batch
            if self.breaker_level >= 2 and kind == "failure":
                self.num_failed_sheds += 1  # shedding was already on and the engine still fails
            self.breaker_level = max(self.breaker_level, 2)
            why["breaker_shed"] = (
                f"{reason} at min_batch={cfg.min_batch}; shedding priority > {cfg.shed_max_priority_kept}"
            )
        failed = self.num_breached_in_row - 1  # earlier cuts that did not clear the breach
        if failed >= cfg.alert_after:
            alerts.append(f"breach persists after {failed} adjustments in a row: {reason}")
        if self.breaker_level >= 2 and self.num_failed_sheds >= cfg.restart_after:
            if self.breaker_level < 3:  # alert on the way in, not on every decision after
                alerts.append(f"breaker level 3: recommend an engine restart ({reason})")
            self.breaker_level = 3
        return self.breaker_level, shrink


def _is_int(x: Any) -> bool:
    """A real integer (bool and floats are not; numpy integers are)."""
    if isinstance(x, bool):
        return False
    try:
        return int(x) == x and not isinstance(x, float)
    except (TypeError, ValueError, OverflowError):
        return False
