"""A gateway lane as the plant a decision acts on (``batchpilot.core.plant``; the environment's
is ``EnginePlant`` in ``envs/serving_env.py``). ``actuate`` decides what happens; this says how
it happens in front of one upstream ``vllm serve``:

* knobs: admission's cap and bucketing, published as gauges;
* shed: queued requests above the kept priority get 429 + ``Retry-After`` ("shed_low_priority");
* a KV switch restarts a managed upstream in the background (drained first, one lane at a time,
  by the supervisor) and the new dtype is in force once it is up; an unmanaged upstream is only
  advised (log + ``batchpilot:kv_dtype_recommended``); the quality guard's block on 8-bit wins.
  Every restart onto another dtype (the controller's, the quality guard's fallback, the
  operator's) is ``restart_onto``, which starts the shield's dwell again once it is in force;
* the quality guard's veto: knobs put in force at 8-bit KV while the guard blocks 8-bit send a
  managed upstream back to 16-bit (a background restart), inside ``set_knobs``, so it is part of
  ``actuate`` and no step of the control loop comes after it;
* a breaker restart (level 3) restarts a managed upstream (core requests stay queued); an
  unmanaged one is advised in the log and the events.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

from batchpilot.core.engine import KV_DTYPES_8BIT, EngineCapabilities
from batchpilot.core.knobs import Knobs
from batchpilot.core.shield import Shield
from batchpilot.serving.lanes import Lane
from batchpilot.serving.prom import GatewayMetrics
from batchpilot.serving.quality_guard import QualityGuard
from batchpilot.serving.supervisor import Supervisor

log = logging.getLogger(__name__)


class LaneServices(Protocol):
    """What a lane's plant uses of the gateway (``Gateway`` is one): typed here rather than by
    importing the gateway, which builds the control loop that builds the plants."""

    metrics: GatewayMetrics
    quality: QualityGuard | None
    supervisor: Supervisor


class LanePlant:
    """One lane's engine side, for ``actuate``; ``shield`` gives the lane's shield (its
    capabilities, its dwell clock). ``acting`` names the controller whose decision is carried
    out (for the events)."""

    def __init__(self, gw: LaneServices, lane: Lane, shield: Callable[[], Shield], note: Callable[[str], None]) -> None:
        self.gw = gw
        self.lane = lane
        self._shield = shield
        self._note = note
        self.acting = "controller"

    def capabilities(self) -> EngineCapabilities:
        return self._shield().capabilities

    def set_knobs(self, knobs: Knobs) -> None:
        """Put ``knobs`` in force on the lane; the quality guard vetoes 8-bit KV (see the module
        docstring)."""
        lane, guard = self.lane, self.gw.quality
        lane.set_knobs(knobs)
        if guard is not None and guard.blocks_8bit and lane.knobs.kv_dtype in KV_DTYPES_8BIT \
                and lane.upstream.managed is not None and not lane.upstream.restarting:
            self._note(f"quality guard: output-diff rate {guard.diff_rate:.1%} above threshold; "
                       f"{lane.name} back to 16-bit KV")
            self.gw.supervisor.spawn(self.restart_onto("auto", "quality"), "batchpilot-restart")

    def shed(self, max_priority_kept: int) -> int:
        n = self.lane.shed_queued(max_priority_kept)
        if n:
            self._note(f"breaker level 2 on {self.lane.name}: shed {n} queued requests of priority > {max_priority_kept}")
        return n

    def switch_kv_dtype(self, dtype: str) -> bool:
        lane, guard = self.lane, self.gw.quality
        if dtype in KV_DTYPES_8BIT and guard is not None and guard.blocks_8bit:
            return False  # the quality guard keeps 16-bit
        if lane.upstream.managed is not None:
            self._note(f"{self.acting} switches {lane.name} KV cache to {dtype}: restarting it")
            self.gw.supervisor.spawn(self.restart_onto(dtype, "kv_dtype"), "batchpilot-restart")
        else:
            self.gw.metrics.kv_recommendation.labels(lane.name, dtype).set(1)
            log.info("recommend kv_cache_dtype=%s for %s (not managed: not applied)", dtype, lane.name)
        return False  # in force only once the restart is done

    async def restart_onto(self, dtype: str, cause: str) -> bool:
        """Restart the upstream onto ``dtype``; once it runs it, the shield's dwell starts again,
        whoever asked: the quality guard's fallback to 16-bit did not start it, and the
        controller switched back to 8-bit 179 s after it once the block was lifted (dwell 600 s).
        False: no restart (one already asked for or under way, or it failed)."""
        done = await self.gw.supervisor.restart(self.lane, cause=cause, kv_dtype=dtype)
        if done:
            self._shield().last_dtype_switch = time.monotonic()
        return done

    def restart(self, cause: str) -> bool:
        lane = self.lane
        if lane.upstream.managed is None:
            self._note(f"breaker level 3 on {lane.name}: restart recommended (not managed)")
            return False
        self._note(f"breaker level 3 on {lane.name}: restarting it (core requests stay queued)")
        self.gw.supervisor.spawn(self.gw.supervisor.restart(lane, cause=cause), "batchpilot-restart")
        return True
