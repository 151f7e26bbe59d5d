"""The ``workload`` group's settings: one dataclass per workload kind, the one declaration of
its keys, types and defaults.

``batchpilot/schemas/`` stores each as ``workload/schema_<kind>`` and every
``conf/workload/*.yaml`` extends its kind's (``defaults: [schema_<kind>, _self_]``), so a
mistyped key or a value of the wrong type fails at compose time naming ``workload.<key>``.
``envs/workloads.py build_workload`` builds a stream from a node with
``workload_from_node``: the node is merged into its kind's schema again (a mapping built in code,
a mixture's components, a validation workload get the same key and type checks) and the domain
checks (ranges) run, each naming the full key (``workload.rate: must be >= 0, got -2``).

Declared here, at the top of ``batchpilot/`` beside the ``schemas/`` package, because
``schemas/`` may not import ``envs/`` (tests/test_imports.py).

Ranges (``randomized``) are lists ``[low, high]``: OmegaConf's typed nodes cannot hold a
number-or-list union, so a fixed value is ``[x, x]``. The lengths node is one dataclass for the
four length kinds (a nested node cannot pick its schema by its own ``kind``): keys of another
kind are rejected when the workload is built; ``prompt`` / ``output`` are a number (``fixed``)
or ``[low, high]`` or a number (``uniform``), so they are typed ``Any`` and checked then.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from batchpilot.nodes import plain, schema_node

WORKLOAD_KINDS: tuple[str, ...] = (
    "poisson", "gamma", "onoff", "ramp", "diurnal", "trace", "randomized", "mixture",
)
LENGTH_KINDS: tuple[str, ...] = ("fixed", "uniform", "lognormal", "empirical")


class WorkloadConfigError(ValueError):
    """A workload config is wrong; the message names the key (``workload.rate``) and the fix."""


# --- domain checks ---------------------------------------------------------------------------
def _num(where: str, key: str, v: Any, *, lo: float | None = None, lo_open: bool = False,
         hi: float | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise WorkloadConfigError(f"{where}.{key}: must be a finite number, got {v!r}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise WorkloadConfigError(f"{where}.{key}: must be {'>' if lo_open else '>='} {lo}, got {v!r}")
    if hi is not None and v > hi:
        raise WorkloadConfigError(f"{where}.{key}: must be <= {hi}, got {v!r}")


def as_range(where: str, key: str, v: Any, *, lo: float, lo_open: bool = False,
             number_ok: bool = False) -> tuple[float, float]:
    """``v`` as ``(low, high)``: a list of two finite numbers with ``lo <(=) low <= high`` (or,
    with ``number_ok``, one number: low = high)."""
    if number_ok and isinstance(v, (int, float)) and not isinstance(v, bool):
        v = [v, v]
    if not (isinstance(v, Sequence) and not isinstance(v, str) and len(v) == 2 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v
    )):
        what = "[low, high] (or one number)" if number_ok else "[low, high] (a fixed value: [x, x])"
        raise WorkloadConfigError(f"{where}.{key}: must be {what}, got {v!r}")
    a, b = float(v[0]), float(v[1])
    if a > b or a < lo or (lo_open and a == lo):
        raise WorkloadConfigError(f"{where}.{key}: need {lo} {'<' if lo_open else '<='} low <= high, got {v!r}")
    return a, b


# --- lengths -----------------------------------------------------------------------------------
#: The keys each length kind reads (besides ``kind``).
LENGTH_KEYS: dict[str, tuple[str, ...]] = {
    "fixed": ("prompt", "output"),
    "uniform": ("prompt", "output"),
    "lognormal": ("prompt_mean", "prompt_sigma", "output_mean", "output_sigma"),
    "empirical": ("path", "format"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthsConfig:
    """``workload.lengths``: how prompt and output lengths are drawn. ``kind`` picks the keys
    read (``LENGTH_KEYS``); the others stay null."""

    kind: str
    #: fixed: tokens (a number); uniform: ``[low, high]`` (inclusive) or a number.
    prompt: Any = None
    output: Any = None
    #: lognormal: the means in tokens (of the distribution, not of its log) and log-space sigmas.
    prompt_mean: float | None = None
    prompt_sigma: float | None = None
    output_mean: float | None = None
    output_sigma: float | None = None
    #: empirical: (prompt, output) pairs drawn jointly from this trace (azure | mooncake | burstgpt).
    path: str | None = None
    format: str | None = None

    def check(self, where: str) -> None:
        if self.kind not in LENGTH_KINDS:
            raise WorkloadConfigError(
                f"{where}.kind: must be fixed, uniform, lognormal or empirical, got {self.kind!r}")
        reads = LENGTH_KEYS[self.kind]
        other = [f.name for f in fields(self)
                 if f.name != "kind" and f.name not in reads and getattr(self, f.name) is not None]
        if other:
            raise WorkloadConfigError(
                f"{where}: kind {self.kind!r} does not read {other}; it reads {list(reads)}")
        for key in reads:
            if getattr(self, key) is None:
                raise WorkloadConfigError(f"{where}.{key}: missing (kind {self.kind!r} needs it)")
        if self.kind == "fixed":
            for key in reads:
                _num(where, key, getattr(self, key), lo=1)
        elif self.kind == "uniform":
            for key in reads:
                as_range(where, key, getattr(self, key), lo=1, number_ok=True)
        elif self.kind == "lognormal":
            _num(where, "prompt_mean", self.prompt_mean, lo=1)
            _num(where, "prompt_sigma", self.prompt_sigma, lo=0)
            _num(where, "output_mean", self.output_mean, lo=1)
            _num(where, "output_sigma", self.output_sigma, lo=0)


# --- max_tokens ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class MaxTokensConfig:
    """``workload.max_tokens``: the ``max_tokens`` this workload's clients send. Traces record
    what a model generated, not the cap the client set, yet the cap is all a gateway (and so
    admission's memory check) knows before a request runs; each workload declares it.

    ``caps`` lists the caps clients send, ``weights`` their shares (None: equal): a fixed cap is
    ``caps: [512]``, the model's limit ``caps: [null]`` (the client sends none: vLLM lets a chat
    request run to ``max_model_len - prompt_len``), a mix ``caps: [null, 1024, 4096]`` with
    weights. Each request draws one cap, independently of its length. A cap is always cut to
    ``max_model_len - prompt_len``, and a request's output to its cap (vLLM stops generating at
    ``max_tokens``): a fixed cap below some outputs shortens them (the stream's
    ``info["max_tokens"]["clipped"]`` counts them)."""

    caps: list[int | None] = field(default_factory=lambda: [None])
    weights: list[float] | None = None

    def check(self, where: str) -> None:
        if not self.caps:
            raise WorkloadConfigError(f"{where}.caps: must list at least one cap (null = the model's limit), got []")
        for i, c in enumerate(self.caps):
            if c is not None and c < 1:
                raise WorkloadConfigError(f"{where}.caps[{i}]: must be >= 1 token or null (the model's limit), got {c!r}")
        if self.weights is not None:
            if len(self.weights) != len(self.caps):
                raise WorkloadConfigError(f"{where}.weights: needs one weight per cap ({len(self.caps)}), "
                                          f"got {list(self.weights)}")
            for i, w in enumerate(self.weights):
                _num(where, f"weights[{i}]", w, lo=0)
            if sum(self.weights) <= 0:
                raise WorkloadConfigError(f"{where}.weights: must have a positive sum, got {list(self.weights)}")

    @property
    def shares(self) -> list[float]:
        """The weights normalised to sum to 1 (equal shares when none are given)."""
        w = [1.0] * len(self.caps) if self.weights is None else [float(x) for x in self.weights]
        total = sum(w)
        return [x / total for x in w]


# --- workload kinds -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadBase:
    """The keys every kind has."""

    #: Which process (``WORKLOAD_KINDS``); each kind's schema holds its own as the default.
    kind: str
    #: Episode length in engine seconds (trace: the window, in trace seconds).
    duration_s: float
    #: Multiplies every rate (trace: speeds replay up), to size one workload for a model.
    rate_scale: float = 1.0
    #: Added to the episode seed by the environment: the same seeds draw other episodes.
    seed_offset: int = 0
    #: Shares of priority classes 0 (core: what a trusted client tags ``priority: 0``), 1 (what the
    #: gateway gives a request without a priority, ``serve.default_priority``), 2, ... The default
    #: is all class 1, traffic nobody tagged, so the simulator's admission and breaker treat it as
    #: the gateway does (a TTFT deadline or the breaker's shedding may refuse it; core never).
    priorities: list[float] = field(default_factory=lambda: [0.0, 1.0])
    #: The ``max_tokens`` its clients send (``MaxTokensConfig``); default: none, the model's limit.
    max_tokens: MaxTokensConfig = field(default_factory=MaxTokensConfig)
    #: Free text, not read.
    name: str | None = None
    description: str | None = None

    def check(self, where: str) -> None:
        _num(where, "rate_scale", self.rate_scale, lo=0, lo_open=True)
        self.max_tokens.check(f"{where}.max_tokens")
        if self.duration_s is not None:
            _num(where, "duration_s", self.duration_s, lo=0, lo_open=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoissonWorkload(WorkloadBase):
    """``kind: poisson``: a constant rate, Poisson arrivals (gamma with burstiness 1)."""

    kind: str = "poisson"
    rate: float
    lengths: LengthsConfig

    def check(self, where: str) -> None:
        WorkloadBase.check(self, where)
        _num(where, "rate", self.rate, lo=0)
        self.lengths.check(f"{where}.lengths")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Bursty(WorkloadBase):
    #: Gamma shape of the inter-arrival gaps (1 = Poisson, < 1 burstier; ``vllm bench --burstiness``).
    burstiness: float = 1.0

    def check(self, where: str) -> None:
        WorkloadBase.check(self, where)
        _num(where, "burstiness", self.burstiness, lo=0, lo_open=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class GammaWorkload(_Bursty):
    """``kind: gamma``: a constant rate, gamma inter-arrival gaps of shape ``burstiness``."""

    kind: str = "gamma"
    rate: float
    lengths: LengthsConfig

    def check(self, where: str) -> None:
        _Bursty.check(self, where)
        _num(where, "rate", self.rate, lo=0)
        self.lengths.check(f"{where}.lengths")


@dataclass(frozen=True, slots=True, kw_only=True)
class OnOffWorkload(_Bursty):
    """``kind: onoff``: ``on_rate`` for ``on_s`` seconds, ``off_rate`` for ``off_s``, repeated."""

    kind: str = "onoff"
    on_rate: float
    off_rate: float = 0.0
    on_s: float
    off_s: float
    #: Start with a burst (else with the off period).
    start_on: bool = True
    lengths: LengthsConfig

    def check(self, where: str) -> None:
        _Bursty.check(self, where)
        _num(where, "on_rate", self.on_rate, lo=0)
        _num(where, "off_rate", self.off_rate, lo=0)
        _num(where, "on_s", self.on_s, lo=0, lo_open=True)
        _num(where, "off_s", self.off_s, lo=0, lo_open=True)
        self.lengths.check(f"{where}.lengths")


@dataclass(frozen=True, slots=True, kw_only=True)
class RampWorkload(_Bursty):
    """``kind: ramp``: ``start_rate`` until ``ramp_start_s``, linear to ``end_rate`` at
    ``ramp_end_s`` (null = ``duration_s``), then flat."""

    kind: str = "ramp"
    start_rate: float
    end_rate: float
    ramp_start_s: float = 0.0
    ramp_end_s: float | None = None
    lengths: LengthsConfig

    def check(self, where: str) -> None:
        _Bursty.check(self, where)
        _num(where, "start_rate", self.start_rate, lo=0)
        _num(where, "end_rate", self.end_rate, lo=0)
        _num(where, "ramp_start_s", self.ramp_start_s, lo=0)
        if self.ramp_end_s is not None:
            _num(where, "ramp_end_s", self.ramp_end_s, lo=0)
        self.lengths.check(f"{where}.lengths")


@dataclass(frozen=True, slots=True, kw_only=True)
class DiurnalWorkload(_Bursty):
    """``kind: diurnal``: ``mean_rate * (1 + amplitude * sin(2π (t - phase_s) / period_s))``
    (``period_s`` null = ``duration_s``)."""

    kind: str = "diurnal"
    mean_rate: float
    amplitude: float
    period_s: float | None = None
    phase_s: float = 0.0
    lengths: LengthsConfig

    def check(self, where: str) -> None:
        _Bursty.check(self, where)
        _num(where, "mean_rate", self.mean_rate, lo=0)
        _num(where, "amplitude", self.amplitude, lo=0, hi=1)
        if self.period_s is not None:
            _num(where, "period_s", self.period_s, lo=0, lo_open=True)
        _num(where, "phase_s", self.phase_s)
        self.lengths.check(f"{where}.lengths")


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceWorkload(WorkloadBase):
    """``kind: trace``: replay of a trace file (``envs/traces.py read_trace``)."""

    kind: str = "trace"
    #: Relative paths resolve against the repository root.
    path: str
    #: azure | mooncake | burstgpt (``envs/traces.py TRACE_FORMATS``).
    format: str
    #: Window start, trace seconds after the first request.
    start_s: float = 0.0
    #: Window length in trace seconds; null = to the end.
    duration_s: float | None = None
    #: Replay speed-up (times ``rate_scale``).
    time_scale: float = 1.0
    #: Spread requests whose timestamps are quantised to this many seconds; null = as recorded.
    spread_quantum_s: float | None = None
    #: Requests longer than the engine's max_model_len: clip | skip.
    overflow: str = "clip"
    #: burstgpt only: keep rows of this model; null = all.
    model: str | None = None

    def check(self, where: str) -> None:
        WorkloadBase.check(self, where)
        _num(where, "time_scale", self.time_scale, lo=0, lo_open=True)
        _num(where, "start_s", self.start_s, lo=0)
        if self.spread_quantum_s is not None:
            _num(where, "spread_quantum_s", self.spread_quantum_s, lo=0, lo_open=True)


#: ``randomized``'s ranges and their lower bounds (bound, open).
RANDOM_RANGES: dict[str, tuple[float, bool]] = {
    "rate": (0, True), "burstiness": (0, True), "prompt_mean": (1, False), "prompt_sigma": (0, False),
    "output_mean": (1, False), "output_sigma": (0, False), "num_phases": (0, False),
    "phase_window": (0, False), "phase_rate_factor": (0, True), "phase_length_factor": (0, True),
}
ONOFF_RANGES: tuple[str, ...] = ("onoff_on_factor", "onoff_off_factor", "onoff_on_s", "onoff_off_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class RandomizedWorkload(WorkloadBase):
    """``kind: randomized``: domain randomisation, a fresh draw from these ``[low, high]``
    ranges every episode (rate, burstiness and means log-uniform, sigmas uniform)."""

    kind: str = "randomized"
    rate: list[float]
    burstiness: list[float]
    prompt_mean: list[float]
    prompt_sigma: list[float]
    output_mean: list[float]
    output_sigma: list[float]
    #: Phase changes per episode (integers, inclusive).
    num_phases: list[float]
    #: Where changes may fall, as fractions of duration_s (inside [0, 1)).
    phase_window: list[float]
    phase_rate_factor: list[float]
    phase_length_factor: list[float]
    #: Probability of on/off bursts on top; the four ranges below are read only when it is > 0.
    onoff_prob: float = 0.0
    onoff_on_factor: list[float] | None = None
    onoff_off_factor: list[float] | None = None
    onoff_on_s: list[float] | None = None
    onoff_off_s: list[float] | None = None

    def check(self, where: str) -> None:
        WorkloadBase.check(self, where)
        for key, (lo, lo_open) in RANDOM_RANGES.items():
            as_range(where, key, getattr(self, key), lo=lo, lo_open=lo_open)
        if self.phase_window[1] >= 1:
            raise WorkloadConfigError(
                f"{where}.phase_window: must lie inside [0, 1) (fractions of duration_s), "
                f"got {tuple(float(x) for x in self.phase_window)}")
        _num(where, "onoff_prob", self.onoff_prob, lo=0.0, hi=1.0)
        if self.onoff_prob > 0:
            for key in ONOFF_RANGES:
                v = getattr(self, key)
                if v is None:
                    raise WorkloadConfigError(f"{where}.{key}: missing (kind 'randomized' needs it)")
                as_range(where, key, v, lo=0, lo_open=True)

    def range(self, key: str) -> tuple[float, float]:
        v = getattr(self, key)
        return float(v[0]), float(v[1])


@dataclass(frozen=True, slots=True, kw_only=True)
class MixtureWorkload(WorkloadBase):
    """``kind: mixture``: the superposition of ``components``, each a workload mapping of another
    kind (its ``duration_s`` defaults to the mixture's; its ``rate_scale`` is multiplied by it)."""

    kind: str = "mixture"
    components: list[Any]

    def check(self, where: str) -> None:
        WorkloadBase.check(self, where)
        if not self.components:
            raise WorkloadConfigError(
                f"{where}.components: must be a non-empty list of workload configs, got {self.components!r}")


#: kind -> its dataclass; ``batchpilot/schemas/`` stores each as ``workload/schema_<kind>``.
WORKLOAD_SCHEMAS: dict[str, type[WorkloadBase]] = {
    "poisson": PoissonWorkload, "gamma": GammaWorkload, "onoff": OnOffWorkload, "ramp": RampWorkload,
    "diurnal": DiurnalWorkload, "trace": TraceWorkload, "randomized": RandomizedWorkload,
    "mixture": MixtureWorkload,
}
assert tuple(WORKLOAD_SCHEMAS) == WORKLOAD_KINDS


#: ``workload_from_node``'s results by content: an environment builds its workload every
#: episode, and the schema merge costs ~20 ms (a sixth of a 120-step episode); the dataclasses
#: are frozen, so a repeat of the same node shares the checked object.
_CHECKED: dict[tuple[str, str], "WorkloadBase"] = {}


def workload_from_node(node: Any, where: str = "workload") -> WorkloadBase:
    """The dataclass of ``node``'s kind, built from a composed node or a mapping: merged into the
    kind's schema (an unknown key, a wrong type or a missing key raises naming ``<where>.<key>``),
    then its domain checks. Raises ``WorkloadConfigError``."""
    try:
        data = plain(node)
    except TypeError:
        raise WorkloadConfigError(f"{where} config must be a mapping, got {type(node).__name__}") from None
    key = (json.dumps(data, sort_keys=True, default=repr), where)
    hit = _CHECKED.get(key)
    if hit is not None:
        return hit
    kind = data.get("kind")
    cls = WORKLOAD_SCHEMAS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WorkloadConfigError(f"{where}.kind: must be one of {WORKLOAD_KINDS}, got {kind!r}")
    try:
        conf = OmegaConf.merge(schema_node(cls), data)
    except (ConfigKeyError, ValidationError) as exc:
        msg = str(exc.msg).splitlines()[0]
        raise WorkloadConfigError(f"{where}.{exc.full_key}: {msg}") from None
    missing = sorted(OmegaConf.missing_keys(conf))
    if missing:
        raise WorkloadConfigError(f"{where}.{missing[0]}: missing (kind {kind!r} needs it)")
    cfg: WorkloadBase = OmegaConf.to_object(conf)  # type: ignore[assignment]
    cfg.check(where)
    if len(_CHECKED) >= 256:
        _CHECKED.clear()
    _CHECKED[key] = cfg
    return cfg
