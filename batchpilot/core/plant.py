"""The plant contract: what a control decision acts on, and the one place it is acted on.

Two plants implement ``Plant``: the environment's engine side (``ServingEnv``, on the simulator or
an in-process vLLM) and a gateway lane (one upstream ``vllm serve``). ``actuate`` turns the
shield's ``Decision`` into calls on either, so every level of the breaker and every KV switch
means the same in training, in evaluation and in front of users:

* **knobs**: the batch cap and the bucketing take effect at once (admission holds them).
* **KV dtype**: a switch restarts the engine onto the new dtype. The environment's restart
  blocks (the engine is down for the model's restart time, in engine time); a lane's runs in the
  background, drained, and the new dtype is in force only once it is done. A plant may also
  decline (the gateway's quality guard keeps 16-bit; an unmanaged upstream is only advised).
* **breaker level 2**: at every decision taken at level 2 or above, queued requests above the
  kept priority are rejected ("shed_low_priority"); arrivals queue as usual and meet the next
  decision's shed unless a slot frees first. Core requests (priority <= kept) always stay.
* **breaker level 3** (the engine itself keeps failing: out of memory, preemption storms): the
  engine is restarted once per trip when ``shield.breaker_restart`` allows it, else the
  restart is only recommended; the trip ends when the breaker is back at level 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from batchpilot.core.engine import EngineCapabilities
from batchpilot.core.knobs import Knobs
from batchpilot.core.shield import Decision


class Plant(Protocol):
    """What a decision acts on."""

    def capabilities(self) -> EngineCapabilities:
        """What the engine behind this plant can run (KV dtypes, ``max_num_seqs``, KV budget)."""
        ...

    def set_knobs(self, knobs: Knobs) -> None:
        """Put ``knobs`` in force (the KV dtype in them is the one already running)."""
        ...

    def shed(self, max_priority_kept: int) -> int:
        """Reject the queued requests with a priority above ``max_priority_kept``; how many."""
        ...

    def switch_kv_dtype(self, dtype: str) -> bool:
        """Restart the engine onto ``dtype``. True: in force now; False: later or not at all."""
        ...

    def restart(self, cause: str) -> bool:
        """Restart the engine on its current settings (breaker level 3). False: only advised."""
        ...


@dataclass(slots=True)
class BreakerTrip:
    """Per plant: whether this trip of the breaker (level 3 until level 0) restarted already."""

    restarted: bool = False


@dataclass(frozen=True, slots=True)
class Actuation:
    """What ``actuate`` did: the knobs now in force and the plant calls it made."""

    knobs: Knobs
    shed: int = 0
    kv_switch: str | None = None
    restart: str | None = None  # "done" (restarted) or "advised" (the plant could not)

    @property
    def kv_in_force(self) -> bool:
        """Whether the KV switch asked for runs now (else later, or not at all)."""
        return self.kv_switch is not None and self.knobs.kv_dtype == self.kv_switch


def actuate(decision: Decision, current: Knobs, plant: Plant, trip: BreakerTrip, *, restart_on_trip: bool) -> Actuation:
    """Act on ``decision`` (the shield's, for knobs ``current`` in force) through ``plant``."""
    knobs = decision.knobs
    kv_switch = None
    if knobs.kv_dtype != current.kv_dtype:
        kv_switch = knobs.kv_dtype
        if not plant.switch_kv_dtype(kv_switch):
            knobs = knobs.with_(kv_dtype=current.kv_dtype)
    plant.set_knobs(knobs)
    shed = 0
    if decision.breaker_level >= 2 and decision.shed_max_priority_kept is not None:
        shed = plant.shed(decision.shed_max_priority_kept)
    restart = None
    if decision.recommend_restart and not trip.restarted:
        trip.restarted = True
        restart = "done" if restart_on_trip and plant.restart("breaker") else "advised"
    if decision.breaker_level == 0:
        trip.restarted = False
    return Actuation(knobs, shed, kv_switch, restart)
