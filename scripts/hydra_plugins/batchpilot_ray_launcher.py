"""``hydra/launcher=ray`` for the scripts here: Hydra sweep jobs as Ray tasks.

Hydra finds launchers only in the ``hydra_plugins`` namespace package; this folder is on the
path of every ``python scripts/<app>.py`` (and of the Ray workers it starts), so the plugin
needs no install step. The work is done in ``batchpilot.cluster.launch_sweep``. Why not
``hydra-ray-launcher``: docs/scaling.md.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


class BatchpilotRayLauncher(Launcher):
    """Settings from ``conf/hydra/launcher/ray.yaml``."""

    def __init__(
        self,
        address: str | None = None,
        num_cpus: int | None = None,
        cpus_per_job: float | None = None,
        init: Mapping[str, Any] | None = None,
    ) -> None:
        self.address = address or None
        self.num_cpus = num_cpus
        self.cpus_per_job = cpus_per_job
        node = OmegaConf.to_container(init, resolve=True) if isinstance(init, DictConfig) else init
        self.init: dict[str, Any] = dict(node or {})  # type: ignore[arg-type]
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from batchpilot.cluster import ClusterUnavailable, launch_sweep

        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        try:
            return launch_sweep(
                self.hydra_context, self.config, self.task_function, job_overrides, initial_job_idx,
                address=self.address, num_cpus=self.num_cpus, cpus_per_job=self.cpus_per_job, init=self.init,
            )
        except ClusterUnavailable as e:
            # No Ray, or no cluster at the address: one line, as the scripts report config
            # errors (Hydra would print a traceback for anything raised here).
            print(f"{Path(sys.argv[0]).stem}: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
