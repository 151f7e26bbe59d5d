"""The knobs a controller may turn, and the proposal it makes. Only the shield turns a
proposal into knobs (``policies.shield``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Bucketing = Literal["fifo", "shortest_first", "weighted"]
BUCKETING_MODES: tuple[str, ...] = ("fifo", "shortest_first", "weighted")


@dataclass(frozen=True, slots=True)
class Knobs:
    """The settings in force: in-flight cap, bucket order, KV-cache dtype."""

    batch_cap: int
    bucketing: str = "fifo"
    kv_dtype: str = "auto"

    def with_(self, **changes: object) -> "Knobs":
        return replace(self, **changes)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, object]:
        return {"batch_cap": self.batch_cap, "bucketing": self.bucketing, "kv_dtype": self.kv_dtype}


@dataclass(frozen=True, slots=True)
class Proposal:
    """What a controller wants. ``None`` fields mean "keep". ``batch_cap`` is absolute; the
    shield clamps it to the allowed step and memory ceiling."""

    batch_cap: int | None = None
    bucketing: str | None = None
    kv_dtype: str | None = None
