"""The ``launcher`` group (``conf/launcher/*.yaml``): how the evaluation runs its episodes
(``evaluation/matrix.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchpilot.nodes import from_node

LAUNCHERS = ("serial", "ray")


@dataclass(frozen=True, slots=True)
class LauncherConfig:
    """Where the evaluation's cells run (``conf/launcher/<kind>.yaml``; docs/scaling.md)."""

    kind: str = "serial"
    #: Ray cluster to join (``auto``, ``HOST:6379``, ``ray://HOST:10001``); None = start a
    #: local one for the run.
    address: str | None = None
    #: CPUs of a local cluster started for the run (None = all of this machine's).
    num_cpus: int | None = None
    #: CPUs Ray reserves per cell: a simulator episode is single-threaded.
    cpus_per_cell: float = 1.0
    #: Further ``ray.init`` keyword arguments (e.g. ``runtime_env``, ``object_store_memory``).
    init: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.address == "":
            object.__setattr__(self, "address", None)
        if self.kind not in LAUNCHERS:
            raise ValueError(f"launcher.kind must be one of {LAUNCHERS}, got {self.kind!r}")
        if self.cpus_per_cell <= 0:
            raise ValueError(f"launcher.cpus_per_cell must be > 0, got {self.cpus_per_cell}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"launcher.num_cpus must be >= 1 or null, got {self.num_cpus}")

    @classmethod
    def from_cfg(cls, node: Any) -> "LauncherConfig":
        return from_node(cls, node)
