"""``scripts/evaluate.py``'s top config (``conf/evaluate.yaml`` and ``evaluate_matrix.yaml``):
``EvaluateApp`` with its ``best_static`` and ``load`` nodes, read by ``evaluation/plan.py`` and
``evaluation/matrix.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchpilot.core.knobs import BUCKETING_MODES


@dataclass(frozen=True, slots=True)
class BestStaticConfig:
    """``best_static`` of ``conf/evaluate.yaml``: the grid ``best_static`` searches and its
    objective (``evaluation/matrix.py``)."""

    #: Batch caps to try (values above the engine's max_num_seqs are clipped to it).
    batch_caps: tuple[int, ...]
    bucketing: tuple[str, ...]
    #: "auto" (16-bit) and/or 8-bit dtypes; ones the engine cannot run are skipped, said so.
    kv_dtypes: tuple[str, ...]
    #: Only grid points at or above this SLO attainment compete on goodput.
    min_slo_attainment: float
    #: Seeds (trace windows) the grid is scored on; must be disjoint from the scored ``seeds``.
    tune_seeds: tuple[int, ...]
    #: Also run the grid on the scored seeds and report their best point as
    #: ``best_static_hindsight``: an upper bound no static setting tuned beforehand can beat.
    hindsight: bool

    def __post_init__(self) -> None:
        for name in ("batch_caps", "bucketing", "kv_dtypes", "tune_seeds"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.batch_caps or min(self.batch_caps) < 1:
            raise ValueError(f"best_static.batch_caps must be non-empty and >= 1, got {list(self.batch_caps)}")
        bad = [b for b in self.bucketing if b not in BUCKETING_MODES]
        if not self.bucketing or bad:
            raise ValueError(f"best_static.bucketing must be a non-empty subset of {BUCKETING_MODES}, "
                             f"got {list(self.bucketing)}")
        if not self.kv_dtypes:
            raise ValueError("best_static.kv_dtypes must not be empty (e.g. [auto, fp8])")
        if not 0.0 <= self.min_slo_attainment <= 1.0:
            raise ValueError(f"best_static.min_slo_attainment must be in [0, 1], got {self.min_slo_attainment}")
        if not self.tune_seeds or len(set(self.tune_seeds)) != len(self.tune_seeds):
            raise ValueError(f"best_static.tune_seeds must be a non-empty list of distinct ints, "
                             f"got {list(self.tune_seeds)}")


LOAD_MODES = ("probe", "table", "none")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """``load`` of ``conf/evaluate.yaml``: how a workload's load is sized per deployment (its
    ``rate_scale`` is multiplied by capacity(deployment) / capacity(the workload's own
    deployment), so every deployment runs at the load the workload was written for)."""

    #: probe: measure each capacity on the simulator (saturated, the workload's own lengths);
    #: table: only ``table``; none: every deployment gets the workload's rates unchanged.
    mode: str
    #: "model/hardware" -> multiplier; wins over the probe for that deployment.
    table: dict[str, float]
    #: Completions the probe counts (after as many again to fill the engine).
    probe_completions: int

    def __post_init__(self) -> None:
        if self.mode not in LOAD_MODES:
            raise ValueError(f"load.mode must be one of {LOAD_MODES}, got {self.mode!r}")
        bad = {k: v for k, v in self.table.items() if not v > 0}
        if bad:
            raise ValueError(f"load.table: multipliers must be > 0, got {bad}")
        if self.probe_completions < 10:
            raise ValueError(f"load.probe_completions must be >= 10, got {self.probe_completions}")


@dataclass(slots=True)
class EvaluateApp:
    """``conf/evaluate.yaml`` (and ``evaluate_matrix.yaml``, built on it): see the comments
    there for each key; ``evaluation/plan.py EvalConfig.from_cfg`` reads them."""

    # Groups (their own schemas).
    hardware: Any
    model: Any
    workload: Any
    slo: Any
    control: Any
    env: Any
    shield: Any
    logger: Any
    engine: Any
    launcher: Any
    # Run-wide settings.
    policies: list[str]
    seeds: list[int]
    workloads: list[str] | None
    deployments: list[str] | None
    load: LoadConfig
    trace_windows: bool
    trace_window_stride_s: float | None
    max_episode_s: float
    workload_overrides: dict[str, list[str]]
    policy_overrides: dict[str, dict[str, Any]]
    best_static: BestStaticConfig
    timeline_seeds: list[int] | None
    plots: bool
    out_dir: str
