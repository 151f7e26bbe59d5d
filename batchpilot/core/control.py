"""The one control step, shared by training, evaluation and the gateway:

    snapshot + knobs in force -> controller chain -> proposal -> shield stage -> decision

* **controller chain** (``ControllerChain``): the acting controller (a policy, its canary, PID,
  static, frozen knobs); behind it a fallback (PID) that takes the same interval over when the
  acting controller fails (raises ``ValueError``: non-finite outputs, a broken artifact) and
  that decides every interval even when it does not act, so its state (integral, settle timer)
  is current the moment it takes over. A policy's own out-of-range hand-over to its PID
  (``PPOController.fell_back``) is reported, not repeated.
* **shield stage** (``guard``): the snapshot turned into what the shield sees
  (``shield_inputs``: the one place a ``Snapshot`` becomes ``ShieldInputs``; the shield takes
  nothing else), the shield's limits (``Shield.apply``), then the rules for what
  the plant cannot see (``FailSafe``): an unknown memory budget heads the cap for the safe static
  cap, and intervals without the engine's counters (stale telemetry) never let the cap grow and,
  after ``stale_limit`` of them, head it for the safe cap with one alert. Stale telemetry cannot
  happen in the simulator (its counters are always there), but it is this same code that would
  answer it. Nothing acts on the knobs after this stage; what comes next is the plant's
  ``actuate`` (``batchpilot.core.plant``).

``ServingEnv`` takes the shield stage for a proposal (a PPO action becomes one first), the
evaluation and the gateway the whole step. A plant without a shield (vLLM as shipped) runs with
``PassThroughShield`` and no ``FailSafe``, by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from batchpilot.core.controller import Controller
from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.core.shield import Decision, Shield, ShieldInputs, require_inputs
from batchpilot.core.telemetry import Snapshot


@dataclass(frozen=True, slots=True)
class Chosen:
    """What the controller chain proposed, and who: ``acting`` is the acting controller's name,
    or the fallback's when the acting one failed (``failure`` then says why); ``out_of_range``
    names the features a policy found outside its training range (it handed the cap to its PID)."""

    proposal: Proposal
    acting: str
    failure: Exception | None = None
    out_of_range: tuple[str, ...] = ()


class ControllerChain:
    """The acting controller with a fallback behind it (see the module docstring). ``fallback``
    None: no fallback (the evaluation's single controller); a failure then propagates."""

    def __init__(self, fallback: Controller | None = None, fallback_name: str = "pid") -> None:
        self.fallback = fallback
        self.fallback_name = fallback_name

    def decide(self, controller: Controller, acting: str, snapshot: Snapshot, knobs: Knobs, *,
               may_fail: bool = False, keep_warm: bool = True) -> Chosen:
        """``controller``'s proposal for the interval ``snapshot`` summarises. ``may_fail``: a
        ``ValueError`` from it hands the interval to the fallback (else it propagates);
        ``keep_warm``: the fallback decides too (its proposal unused) when it is not acting."""
        fb = self.fallback
        if controller is fb or fb is None:
            return Chosen(controller.decide(snapshot, knobs), acting)
        try:
            proposal = controller.decide(snapshot, knobs)
        except ValueError as exc:
            if not may_fail:
                raise
            return Chosen(fb.decide(snapshot, knobs), self.fallback_name, failure=exc)
        if keep_warm:
            fb.decide(snapshot, knobs)
        outside = tuple(getattr(controller, "last_fallback", ())) if getattr(controller, "fell_back", False) else ()
        return Chosen(proposal, acting, out_of_range=outside)


@dataclass(frozen=True, slots=True)
class FailSafe:
    """The shield's rules for what the controller cannot see (the gateway's
    ``serve.control.safe_batch_cap`` and ``stale_limit``): no known memory budget, or intervals
    without the engine's counters. ``where`` names the engine in the reasons."""

    safe_batch_cap: int
    stale_limit: int

    def __post_init__(self) -> None:
        if self.safe_batch_cap < 1 or self.stale_limit < 1:
            raise ValueError(f"FailSafe: safe_batch_cap and stale_limit must be >= 1, got "
                             f"{self.safe_batch_cap}, {self.stale_limit}")

    @classmethod
    def from_cfg(cls, node: Any) -> "FailSafe":
        """From a node with ``safe_batch_cap`` and ``stale_limit`` (``serve.control``)."""
        return cls(safe_batch_cap=int(node.safe_batch_cap), stale_limit=int(node.stale_limit))

    def apply(self, dec: Decision, current: Knobs, shield: Shield, *, stale_intervals: int = 0,
              where: str = "the engine") -> Decision:
        """``dec`` (the shield's) with the cap held by these rules; each change an intervention
        (``memory_unknown``, ``stale_telemetry``), entering the stale fallback an alert."""
        cur = current.batch_cap
        if not shield.memory.known:  # no budget to check against: the safe cap, never a guess
            cap = min(dec.knobs.batch_cap, max(self.safe_batch_cap, cur - shield.max_step(cur)))
            if cap < dec.knobs.batch_cap:
                why = (f"memory budget of {where} unknown ({shield.memory.source}): heading for the safe cap "
                       f"{self.safe_batch_cap}")
                dec = replace(dec, knobs=dec.knobs.with_(batch_cap=cap),
                              interventions={**dec.interventions, "memory_unknown": why})
        n = stale_intervals
        if n == 0:
            return dec
        cap = min(dec.knobs.batch_cap, cur)
        why = f"no /metrics from {where} for {n} interval(s): the cap does not grow"
        alerts = dec.alerts
        if n >= self.stale_limit:
            safe = self.safe_batch_cap
            cap = min(cap, max(safe, cur - shield.max_step(cur)))
            why = f"no /metrics from {where} for {n} intervals: heading for the safe cap {safe}"
            if n == self.stale_limit:
                alerts = [*alerts, f"telemetry from {where} lost for {n} intervals: holding it at or below the "
                                   f"safe cap {safe} until /metrics answers again"]
        if cap == dec.knobs.batch_cap and alerts is dec.alerts:
            return dec
        interventions = dec.interventions if cap == dec.knobs.batch_cap else \
            {**dec.interventions, "stale_telemetry": why}
        return replace(dec, knobs=dec.knobs.with_(batch_cap=cap), interventions=interventions, alerts=alerts)


class PassThroughShield:
    """No shield: every proposal passes as it is (no breaker, no shedding, no step or memory
    limit) — vLLM as shipped. It keeps the real shield's other duties (memory predictions for
    telemetry and admission's books) by delegating them."""

    def __init__(self, shield: Shield) -> None:
        self._shield = shield

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shield, name)

    def apply(self, proposal: Proposal, current: Knobs, inputs: ShieldInputs, now: float) -> Decision:
        """The proposal's knobs (unset ones kept), unchecked; ``inputs`` unused but held to the
        shield's boundary type, so a caller that skips the shield stage's conversion fails with
        either shield."""
        require_inputs(inputs, "PassThroughShield.apply")
        knobs = Knobs(
            batch_cap=current.batch_cap if proposal.batch_cap is None else int(proposal.batch_cap),
            bucketing=proposal.bucketing or current.bucketing,
            kv_dtype=proposal.kv_dtype or current.kv_dtype,
        )
        return Decision(
            knobs=knobs,
            predicted_memory_fraction=self._shield.predicted_fraction(knobs.batch_cap, knobs.kv_dtype),
            dtype_switched=knobs.kv_dtype != current.kv_dtype,
        )


@dataclass(frozen=True, slots=True)
class ControlStep:
    """One decision: what the controller proposed (and who), and what the shield let through."""

    proposal: Proposal
    decision: Decision
    acting: str = "controller"
    failure: Exception | None = None
    out_of_range: tuple[str, ...] = ()


def shield_inputs(snapshot: Snapshot, shield: Shield) -> ShieldInputs:
    """The interval ``snapshot`` summarises as the shield sees it: the one conversion between
    telemetry and the shield (the env's and the gateway's steps and an operator's dtype check
    all come here). What a snapshot lacks is filled the same everywhere: KV blocks in use from
    its KV usage x the pool of the shield's memory model (which follows engine restarts), the
    context length from its mean prompt (the shield's estimate learns from it), and no OOM (the
    shield marks a reported one itself, ``Shield.report_oom``)."""
    return ShieldInputs.from_snapshot(snapshot, num_kv_blocks_total=shield.memory.num_kv_blocks_total)


def guard(proposal: Proposal, snapshot: Snapshot, knobs: Knobs, shield: Shield, now: float, *,
          fail_safe: FailSafe | None = None, stale_intervals: int = 0, where: str = "the engine") -> ControlStep:
    """The shield stage, for a proposal made already (a policy's action): the snapshot as the
    shield's inputs, the shield, then the ``fail_safe`` rules (None: none, as for a plant
    without a shield)."""
    dec = shield.apply(proposal, knobs, shield_inputs(snapshot, shield), now)
    if fail_safe is not None:
        dec = fail_safe.apply(dec, knobs, shield, stale_intervals=stale_intervals, where=where)
    return ControlStep(proposal, dec)


def control_step(controller: Controller, snapshot: Snapshot, knobs: Knobs, shield: Shield, now: float, *,
                 chain: ControllerChain | None = None, acting: str = "controller", may_fail: bool = False,
                 keep_warm: bool = True, fail_safe: FailSafe | None = None, stale_intervals: int = 0,
                 where: str = "the engine") -> ControlStep:
    """Ask ``controller`` (through ``chain``, if given) about the interval ``snapshot``
    summarises, then the shield stage."""
    chosen = (chain or _NO_FALLBACK).decide(controller, acting, snapshot, knobs, may_fail=may_fail,
                                           keep_warm=keep_warm)
    step = guard(chosen.proposal, snapshot, knobs, shield, now, fail_safe=fail_safe,
                 stale_intervals=stale_intervals, where=where)
    return replace(step, acting=chosen.acting, failure=chosen.failure, out_of_range=chosen.out_of_range)


_NO_FALLBACK = ControllerChain()
