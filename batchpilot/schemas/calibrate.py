"""``scripts/calibrate.py``'s top config (``conf/calibrate.yaml``): ``CalibrateApp`` with its grid,
state probe, nominal base and served path, read by ``evaluation/calibration.py`` and
``evaluation/sim_to_real.py``; ``ServedDecodeSettings`` is shared with the bench's
``served_decode`` node."""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchpilot.core.specs import HardwareSpec
from batchpilot.nodes import node_schema
from batchpilot.schemas.engine import EngineWarmupConfig


@dataclass(frozen=True, slots=True)
class Grid:
    """``grid`` of ``conf/calibrate.yaml``: what the calibration measures
    (``evaluation/calibration.py``)."""

    #: Decode batch sizes x prompt (context) lengths; points with batch x context above
    #: ``max_decode_tokens`` are skipped (their prefill alone would take too long).
    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    #: Decode prompts drawn from ``context x [1 - s, 1 + s]`` (0 = all equal); see measure_decode.
    context_spread: float
    max_decode_tokens: int
    decode_steps: int
    #: Decode points with these batch sizes also measure mixed iterations: one fresh prompt of
    #: each of ``mixed_chunks`` tokens prefilled beside the decodes.
    mixed_batches: tuple[int, ...]
    mixed_chunks: tuple[int, ...]
    mixed_repeats: int
    #: Prefill chunk sizes x prior (prefix-cached) contexts x requests per iteration; points
    #: whose prompt reaches ``max_model_len`` or whose chunks exceed the token budget are skipped.
    chunks: tuple[int, ...]
    priors: tuple[int, ...]
    prefill_reqs: tuple[int, ...]
    prefill_repeats: int

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))


@dataclass(frozen=True, slots=True)
class StateProbe:
    """``state_probe`` of ``conf/calibrate.yaml``: a fixed reference iteration timed before and
    after every grid point and every live run, so measurements taken while other tenants slow
    the machine down are re-taken or set aside (``evaluation/calibration.py``, docs/sim_to_real.md)."""

    enabled: bool
    #: The reference: pure decode of ``batch`` sequences of ``context`` tokens (spread as the
    #: grid's), median of ``steps`` iterations.
    batch: int
    context: int
    steps: int
    #: A probe more than this over the fastest reference is the slow state.
    tolerance: float
    #: Grid points measured in the slow state are measured again up to this many times.
    retries: int
    #: Live runs attempted (at most) to get ``runs`` of them in the fast state.
    max_runs: int
    #: The fast state's reference: this quantile of the probes taken so far (0 = the fastest).
    #: Where the host's probe varies by itself, its single fastest time is an outlier that makes
    #: an idle host read as busy (docs/sim_to_real.md, "A third CPU").
    anchor_quantile: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.anchor_quantile) < 1.0:
            raise ValueError(f"state_probe.anchor_quantile: must be in [0, 1), got {self.anchor_quantile!r}")
        for name in ("batch", "context", "steps", "max_runs"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"state_probe.{name}: must be >= 1, got {getattr(self, name)!r}")
        if int(self.retries) < 0:
            raise ValueError(f"state_probe.retries: must be >= 0, got {self.retries!r}")
        if not (math.isfinite(float(self.tolerance)) and float(self.tolerance) > 0):
            raise ValueError(f"state_probe.tolerance: must be > 0, got {self.tolerance!r}")


#: ``base`` of ``conf/calibrate.yaml``: the nominal peaks a fitted profile is relative to, i.e.
#: ``HardwareSpec`` less ``name`` and ``memory_gb`` (filled by the calibration); what the file
#: leaves out is ``HardwareSpec``'s own default, as when the profile is built from it.
CalibrationBase = node_schema(HardwareSpec, "CalibrationBase", exclude=("name", "memory_gb"))


@dataclass(slots=True)
class ServedDecodeSettings:
    """What ``serving/served_decode.py`` measures: batches of ``concurrencies`` simultaneous
    requests of ``prompt_tokens`` + ``max_tokens``, best of ``repeats``, after ``warmup`` batches."""

    concurrencies: list[int]
    warmup: list[int]
    repeats: int
    prompt_tokens: int
    max_tokens: int


@dataclass(slots=True)
class ServedCalibrationNode(ServedDecodeSettings):
    """``served`` of ``conf/calibrate.yaml``: what ``vllm serve`` adds to the in-process profile."""

    enabled: bool
    out: str


@dataclass(slots=True)
class CalibrateApp:
    """``conf/calibrate.yaml`` (``evaluation/calibration.py``: the fit, ``evaluation/sim_to_real.py``:
    the report; see the comments there)."""

    fit: bool
    report: bool
    seed: int
    live_overrides: list[str]
    #: Read from the command line by ``scripts/calibrate.py`` before torch loads; here so the
    #: keys are known and typed.
    omp_wait_policy: str | None
    omp_num_threads: int | None
    warmup: EngineWarmupConfig
    profile: str
    out: str
    base: CalibrationBase  # type: ignore[valid-type]
    grid: Grid
    #: Seconds of varied traffic after the grid whose recorded iterations set the profile's
    #: level (``slowdown``): the grid fixes the shape, episodes' iterations the speed. 0 = off.
    level_seconds: float
    state_probe: StateProbe
    runs: int
    common_overrides: list[str]
    sim_overrides: list[str]
    live_report_overrides: list[str]
    report_rate_scale: float
    #: Workload name -> the Hydra overrides that make it.
    workloads: dict[str, list[str]]
    #: Workload name -> the share of the profile's simulated capacity its load is sized to
    #: (``capacity_scale``); a workload not named keeps its own rate.
    load_vs_capacity: dict[str, float]
    #: The served path (``scripts/calibrate.py served=true``): measured through ``vllm serve``,
    #: its extra over ``profile`` written as ``served.out``.
    served: ServedCalibrationNode
