"""The controller interface: what PID, AIMD, static settings and an exported policy all are
to the control step (snapshot and knobs in force -> proposed knobs; the shield decides)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.core.telemetry import Snapshot


@runtime_checkable
class Controller(Protocol):
    """Maps the last control interval to proposed knobs."""

    name: str

    def reset(self, knobs: Knobs) -> None:
        """Forget history; ``knobs`` are the settings in force at the start."""

    def decide(self, snapshot: Snapshot, knobs: Knobs) -> Proposal:
        """Propose knobs for the next interval; ``knobs`` are those in force now."""
