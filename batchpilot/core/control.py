"""The one control step, shared by training, evaluation and the gateway:

    snapshot + knobs in force -> controller -> proposal -> shield -> decision

``ServingEnv`` takes it for a controller's proposal (a PPO action becomes one first), the
evaluation for PID/AIMD/static/PPO, and the gateway's control loop for whichever controller
acts on a lane; what each then does with the decision (apply knobs, shed, switch the KV dtype)
is the plant's business.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot.core.controller import Controller
from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.core.shield import Decision, Shield
from batchpilot.core.telemetry import Snapshot


@dataclass(frozen=True, slots=True)
class ControlStep:
    """One decision: what the controller proposed and what the shield let through."""

    proposal: Proposal
    decision: Decision


def guard(proposal: Proposal, snapshot: Snapshot, knobs: Knobs, shield: Shield, now: float) -> ControlStep:
    """The shield's half of the step, for a proposal made already (a policy's action)."""
    return ControlStep(proposal, shield.apply(proposal, knobs, snapshot, now))


def control_step(controller: Controller, snapshot: Snapshot, knobs: Knobs, shield: Shield, now: float) -> ControlStep:
    """Ask ``controller`` about the interval ``snapshot`` summarises, then the shield."""
    return guard(controller.decide(snapshot, knobs), snapshot, knobs, shield, now)
