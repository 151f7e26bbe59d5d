"""The ``control`` group's schema (``conf/control/default.yaml``): the control loop's timing and
start knobs, one config for the simulator's ``ServingEnv`` (training, evaluation, the live twin)
and the gateway's loop (``serving/control_loop.py``), which run the same decisions
(``batchpilot/core/control.py``). Declared once here, so a trained policy and the gateway that
serves it cannot disagree on the interval, the latency window or the observation's scales.

What stays elsewhere: the episode (``env.episode_s``, draining, the reward) is the simulator's;
the gateway's own loop settings (``serve.control.mode``, ``stale_limit``, ``safe_batch_cap``,
``kv_start``, the canary) are the gateway's."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from batchpilot.core.knobs import BUCKETING_MODES
from batchpilot.nodes import ConfigError, from_node


@dataclass(frozen=True, slots=True)
class ControlLoopConfig:
    """``control`` (``conf/control/default.yaml``): when the loop decides, what it measures over,
    where it starts and how it scales the observation. Read by ``ServingEnv`` and the gateway
    from the composed config's ``control`` node (``from_cfg``)."""

    #: Seconds between decisions (the simulator's step; the gateway's tick).
    interval_s: float = 1.0
    #: Sliding window of the latency percentiles (seconds).
    window_s: float = 10.0
    #: The batch cap and request order in force before the first decision (the gateway's
    #: start-up knobs; an evaluation episode's unless its controller names its own).
    initial_batch_cap: int = 64
    initial_bucketing: str = "fifo"
    #: Observation scales: requests/s and output tokens/s (about this model and hardware's
    #: capacity). A served policy uses the ones recorded at its training (its manifest).
    rate_scale: float = 30.0
    token_rate_scale: float = 6000.0

    def __post_init__(self) -> None:
        for key in ("interval_s", "window_s", "rate_scale", "token_rate_scale"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"control.{key} must be a finite number > 0, got {v!r}")
            object.__setattr__(self, key, float(v))
        if isinstance(self.initial_batch_cap, bool) or not isinstance(self.initial_batch_cap, int) \
                or self.initial_batch_cap < 1:
            raise ValueError(f"control.initial_batch_cap must be an integer >= 1, got {self.initial_batch_cap!r}")
        if self.initial_bucketing not in BUCKETING_MODES:
            raise ValueError(f"control.initial_bucketing={self.initial_bucketing!r}; one of {BUCKETING_MODES}")

    @classmethod
    def from_cfg(cls, node: Any) -> "ControlLoopConfig":
        """From the ``control`` node (checked against ``control/schema`` at compose time) or a
        mapping; an unknown key, a wrong type or a value out of range raises naming the key."""
        return from_node(cls, node)


#: Keys that moved into ``control`` (issue 54): where they were -> where they are. A config or
#: command line still naming the old place fails at compose (the env's and the gateway's schemas
#: no longer have them); ``moved_key_hint`` turns that error into the new name.
MOVED_KEYS: dict[str, str] = {
    **{f"env.{k}": f"control.{k}" for k in ("interval_s", "initial_batch_cap", "initial_bucketing",
                                           "rate_scale", "token_rate_scale")},
    "env.telemetry_window_s": "control.window_s",
    **{f"serve.control.{k}": f"control.{k}" for k in ("interval_s", "window_s", "initial_batch_cap",
                                                     "initial_bucketing", "rate_scale", "token_rate_scale")},
}


def moved_key_hint(message: str) -> str | None:
    """The sentence naming the new place of a moved key mentioned in a compose error's
    ``message`` (Hydra's: ``Could not override 'env.interval_s'`` / ``full_key:
    env.interval_s``), or None when it names none."""
    found = [old for old in MOVED_KEYS if re.search(rf"(?<![\w.]){re.escape(old)}(?![\w])", message)]
    return _where_now(found) if found else None


def _where_now(old_keys: list[str]) -> str:
    """The sentence naming where each of ``old_keys`` (keys of ``MOVED_KEYS``) lives now."""
    return "; ".join(f"{old} is now {MOVED_KEYS[old]} (the control group, shared by the simulator and the gateway: "
                     "batchpilot/schemas/control.py)" for old in old_keys)


def moved_key_note(exc: BaseException) -> str:
    """``"\\n" +`` the sentence naming where a moved key lives now, when compose error ``exc``
    (or an error it was raised from) names one; else "". Hydra's own message for an old key on
    the command line suggests appending it (``+env.interval_s=...``), which nothing would read."""
    hint = moved_key_hint("\n".join(str(e) for e in _chain(exc)))
    return "" if hint is None else f"\n{hint}"


def _has(node: Any, path: list[str]) -> bool:
    """Whether mapping ``node`` (a DictConfig or a dict) holds the dotted ``path``."""
    for part in path:
        if not hasattr(node, "keys") or part not in node:
            return False
        node = node[part]
    return True


def _chain(exc: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def check_no_moved_keys(cfg: Any) -> None:
    """Raise ``ConfigError`` when the composed ``cfg`` still holds a key that moved into
    ``control`` (added with ``+env.interval_s=...``, which compose lets through): it would be
    read by nobody, and the run would use ``control``'s value instead."""
    found = [old for old in MOVED_KEYS if _has(cfg, old.split("."))]
    if found:
        raise ConfigError(_where_now(found))
