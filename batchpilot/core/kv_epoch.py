"""The KV-precision agent's view: one slow decision per epoch of engine time.

A KV dtype switch restarts the engine (35-600 s by model), so its value shows over minutes,
not over the 1 s control interval the batch knob lives on (docs/training.md, "The
KV-precision knob"). The agent that decides it therefore sees a summary of the last epoch
(``epoch_s`` of control intervals) and decides once per epoch. ``KVEpoch`` is that summary,
built from the same snapshots every controller sees, in training (``envs/kv_env.py``) and in
front of vLLM (``PPOController`` with a KV agent), so both mean the same features.
"""

from __future__ import annotations

import math

import numpy as np

from batchpilot.core.engine import KV_DTYPES_8BIT
from batchpilot.core.telemetry import Snapshot

#: The KV agent's observation, in order: (name, what it is, how it is normalised). Written out
#: in docs/observation.md; keep the two in step.
KV_FEATURES: tuple[tuple[str, str, str], ...] = (
    ("kv_usage_mean", "mean KV blocks in use over the epoch (0..1)", "as is"),
    ("kv_usage_max", "peak KV blocks in use over the epoch", "as is"),
    ("preemptions", "preemptions in the epoch", "log1p / log1p(1000)"),
    ("queue_mean", "mean admission queue depth", "log1p / log1p(1024)"),
    ("running_per_cap", "mean requests running / batch cap", "clipped at 1"),
    ("held_by_memory", "share of intervals with a queue while fewer than the cap ran", "as is"),
    ("slo_attainment", "mean share of recent requests meeting the SLO", "as is"),
    ("served_per_arrival", "SLO-meeting finishes / arrivals in the epoch", "clipped at 2"),
    ("kv_8bit", "KV cache runs an 8-bit dtype", "0/1"),
    ("restart_cost", "the engine's restart time for a switch", "/ 600 s, clipped at 2"),
    ("time_since_switch", "seconds since the last KV switch (none: 1)", "/ 600, clipped at 1"),
)
KV_FEATURE_NAMES: tuple[str, ...] = tuple(f[0] for f in KV_FEATURES)
#: The agent's action (``MultiDiscrete([2])``): keep the KV precision in force, or switch to
#: the other one (16-bit <-> the engine's 8-bit dtype). "Keep" is the safe default a fresh agent
#: leans to, and a random agent does not flap.
KV_ACTIONS: tuple[str, ...] = ("keep", "switch")


class KVEpoch:
    """Summary of the control intervals since the last KV decision."""

    def __init__(self, epoch_s: float) -> None:
        if not (math.isfinite(epoch_s) and epoch_s > 0):
            raise ValueError(f"the KV agent's epoch_s must be > 0, got {epoch_s!r}")
        self.epoch_s = float(epoch_s)
        self.clear(None)

    def clear(self, start: float | None) -> None:
        """Start a new epoch at engine time ``start`` (None: at the next snapshot)."""
        self.start = start
        self.n = 0
        self._kv_sum = self._kv_max = 0.0
        self._preempt = 0
        self._queue_sum = 0.0
        self._running_sum = 0.0
        self._held = 0
        self._slo_sum = 0.0
        self._good = 0.0
        self._arrived = 0.0
        self._last: Snapshot | None = None

    def add(self, snap: Snapshot) -> bool:
        """Count one interval; True once the epoch is complete (time to decide)."""
        if self.start is None:
            self.start = snap.time - snap.interval_s
        self.n += 1
        self._kv_sum += snap.kv_cache_usage
        self._kv_max = max(self._kv_max, snap.kv_cache_usage)
        self._preempt += snap.preemptions
        q = snap.queue_total
        self._queue_sum += q
        cap = max(1, snap.knobs.batch_cap)
        self._running_sum += min(snap.num_running / cap, 1.0)
        self._held += int(q > 0 and snap.num_running < cap)
        self._slo_sum += snap.slo_attainment
        self._good += snap.request_goodput * snap.interval_s
        self._arrived += snap.arrival_rate * snap.interval_s
        self._last = snap
        return snap.time - self.start >= self.epoch_s - 1e-9

    @property
    def served_per_arrival(self) -> float:
        """SLO-meeting finishes over arrivals in the epoch (1 when nothing arrived): the
        evaluation's goodput, relative to the load, so it means the same on every deployment."""
        return self._good / self._arrived if self._arrived > 0 else 1.0

    def observation(self, restart_s: float) -> np.ndarray:
        """The features of ``KV_FEATURES`` for the epoch so far."""
        if self._last is None:
            raise ValueError("no interval in this epoch yet")
        n = float(self.n)
        last = self._last
        served = self.served_per_arrival
        vec = [
            self._kv_sum / n,
            self._kv_max,
            math.log1p(self._preempt) / math.log1p(1000),
            math.log1p(self._queue_sum / n) / math.log1p(1024),
            self._running_sum / n,
            self._held / n,
            self._slo_sum / n,
            min(served, 2.0),
            float(last.knobs.kv_dtype in KV_DTYPES_8BIT),
            min(max(restart_s, 0.0) / 600.0, 2.0),
            min(last.time_since_dtype_switch_s / 600.0, 1.0),
        ]
        obs = np.asarray(vec, dtype=np.float32)
        if not np.isfinite(obs).all():
            bad = [KV_FEATURE_NAMES[i] for i in np.flatnonzero(~np.isfinite(obs))]
            raise ValueError(f"KV observation has NaN/inf in {bad}")
        return np.clip(obs, 0.0, 2.0)


def kv_target(index: int, current: str, *, kv16_dtype: str, kv8_dtype: str) -> str | None:
    """The dtype an action asks for (None: keep ``current``)."""
    if index not in (0, 1):
        raise ValueError(f"KV action {index} outside MultiDiscrete([2])")
    if index == 0:
        return None
    return kv16_dtype if current in KV_DTYPES_8BIT else kv8_dtype
