"""The policy's action space and its meaning, shared by the environment and the gateway.

An action is three integers (``MultiDiscrete([5, 3, 3])``):

| index | name      | values                                                     |
|-------|-----------|------------------------------------------------------------|
| 0     | batch     | step of the in-flight cap: -30 %, -15 %, 0, +15 %, +30 %    |
| 1     | bucketing | fifo, shortest_first, weighted                              |
| 2     | kv_dtype  | keep, 16-bit, 8-bit (the engine's configured 8-bit dtype)    |
"""

from __future__ import annotations

import math

import numpy as np

from batchpilot.core.knobs import BUCKETING_MODES, Knobs, Proposal

BATCH_STEPS: tuple[float, ...] = (-0.30, -0.15, 0.0, 0.15, 0.30)
KV_CHOICES: tuple[str, ...] = ("keep", "16bit", "8bit")
ACTION_NVEC: tuple[int, ...] = (len(BATCH_STEPS), len(BUCKETING_MODES), len(KV_CHOICES))


def parse_action(action: np.ndarray | list[int] | tuple[int, ...]) -> tuple[int, int, int]:
    """The three sub-actions as ints; anything else is an error that names the space."""
    a = [int(x) for x in np.asarray(action).reshape(-1)]
    if len(a) != len(ACTION_NVEC) or any(not 0 <= x < n for x, n in zip(a, ACTION_NVEC)):
        raise ValueError(f"action {a} outside MultiDiscrete{list(ACTION_NVEC)}")
    return a[0], a[1], a[2]


def kv_choice(index: int, knobs: Knobs, *, kv16_dtype: str = "auto", kv8_dtype: str = "fp8") -> str | None:
    """The KV dtype a sub-action asks for (``None``: keep the one in force)."""
    kv = {0: None, 1: kv16_dtype, 2: kv8_dtype}[index]
    return None if kv == knobs.kv_dtype else kv


def action_to_proposal(
    action: np.ndarray | list[int] | tuple[int, ...],
    knobs: Knobs,
    *,
    kv16_dtype: str = "auto",
    kv8_dtype: str = "fp8",
) -> Proposal:
    """Translate a policy action into a proposal relative to the knobs in force."""
    a_batch, a_bucket, a_kv = parse_action(action)
    step = BATCH_STEPS[a_batch]
    cap = knobs.batch_cap
    if step != 0.0:
        delta = cap * step
        # Round away from zero so small caps can still move by one.
        cap = cap + int(math.copysign(max(1, math.floor(abs(delta))), delta))
    kv = kv_choice(a_kv, knobs, kv16_dtype=kv16_dtype, kv8_dtype=kv8_dtype)
    return Proposal(batch_cap=cap, bucketing=BUCKETING_MODES[a_bucket], kv_dtype=kv)


def action_mask(kv_runnable: dict[str, bool], *, kv16_dtype: str = "auto", kv8_dtype: str = "fp8") -> np.ndarray:
    """Flat boolean mask over the three sub-actions (sb3-contrib ``MaskablePPO`` layout).

    A KV choice is masked when the engine cannot run that dtype; "keep" is always allowed.
    """
    mask = np.ones(sum(ACTION_NVEC), dtype=bool)
    off = ACTION_NVEC[0] + ACTION_NVEC[1]
    mask[off + 1] = kv_runnable.get(kv16_dtype, False)
    mask[off + 2] = kv_runnable.get(kv8_dtype, False)
    return mask
