"""Telemetry: what happened in the last control interval, from signals a production gateway can
also see (its own request timings plus the engine's ``/metrics``), turned into a ``Snapshot``
and the policy's observation vector.

One implementation, used by the environment (sim and live engine) and by the gateway, so a
policy trained in simulation sees the same features in production.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchpilot.core.knobs import BUCKETING_MODES, Knobs

#: The project's default SLO (``conf/slo/default.yaml`` restates it for Hydra; a test keeps the
#: two equal). Also the scale latencies are normalised by where an objective is switched off
#: (``SLO.ttft_ref_ms``), so a policy's features and reward keep their meaning.
DEFAULT_TTFT_MS: float = 1000.0
DEFAULT_TPOT_MS: float = 100.0

#: The latency metrics an objective can be set on, each with its ``SLO`` field.
_SLO_FIELDS: dict[str, str] = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}
LATENCY_METRICS: tuple[str, ...] = tuple(_SLO_FIELDS)


def _check_ms(where: str, v: Any) -> None:
    """An objective is a positive, finite number of milliseconds, or None (no objective)."""
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                          or not math.isfinite(v) or v <= 0):
        raise ValueError(f"{where} must be a positive number of milliseconds or null, got {v!r}")


def _checked_classes(classes: Any) -> dict[int, dict[str, float | None]]:
    """``SLO.classes`` as plain ``{priority: {field: ms or None}}``, checked: a priority is an
    int >= 0 (a digit string from JSON is read as one), each override a mapping of known keys
    with positive millisecond values; an error names the key."""
    if classes is None:
        return {}
    if not isinstance(classes, Mapping):
        raise ValueError(f"slo.classes must map priority -> objectives, got {type(classes).__name__}")
    out: dict[int, dict[str, float | None]] = {}
    for p, overrides in classes.items():
        if isinstance(p, str) and p.strip().lstrip("-").isdigit():
            p = int(p)
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"slo.classes: a priority must be an integer >= 0 (0 = core), got {p!r}")
        if p in out:
            raise ValueError(f"slo.classes: priority {p} is given twice (as {p} and '{p}')")
        if not isinstance(overrides, Mapping):
            raise ValueError(f"slo.classes[{p}] must map objective -> ms, got {overrides!r}")
        o = dict(overrides)
        unknown = sorted(set(o) - set(_SLO_FIELDS.values()), key=str)
        if unknown:
            raise ValueError(f"slo.classes[{p}]: unknown key(s) {unknown}; expected {', '.join(_SLO_FIELDS.values())}")
        for key, v in o.items():
            _check_ms(f"slo.classes[{p}].{key}", v)
        out[p] = {key: (None if v is None else float(v)) for key, v in o.items()}
    return out


@dataclass
class SLO:
    """Per-request objectives in milliseconds; ``None`` = no objective on that metric.

    The one place the objectives are declared (``conf/slo`` composes into it): a controller
    that steers on a metric's objective reads it through ``for_metric``, not a field of its own
    looked up by hand, so a new metric or a renamed field cannot leave one reader behind.

    ``classes`` gives request classes their own objectives, as production mixes them
    (interactive traffic with a tight TTFT, batch traffic with a loose one): priority ->
    overrides of the base objectives (``{2: {"ttft_ms": 10000}}``); a priority not listed is
    judged by the base. Whatever judges one request (met or missed, its TTFT deadline, early
    refusal, lateness) reads ``for_priority(request.priority)``. Controllers' setpoints (PID's
    and AIMD's targets, the shield's breach factors, the observation's latency scales) stay on
    the base objectives: they steer on the window's percentiles, which mix the classes."""

    ttft_ms: float | None = DEFAULT_TTFT_MS
    tpot_ms: float | None = DEFAULT_TPOT_MS
    e2el_ms: float | None = None
    #: Priority -> overrides of the objectives above (keys ``ttft_ms``, ``tpot_ms``,
    #: ``e2el_ms``; null = no objective on that metric for the class). Empty: one class.
    classes: dict[Any, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in _SLO_FIELDS.values():
            _check_ms(f"slo.{key}", getattr(self, key))
        self.classes = _checked_classes(self.classes)
        # Each class's objectives, built once: ``for_priority`` runs per finished request.
        # Not a field: the schema, equality and ``asdict`` see ``classes`` only.
        base = {key: getattr(self, key) for key in _SLO_FIELDS.values()}
        self._by_priority: dict[int, SLO] = {p: SLO(**{**base, **o}) for p, o in self.classes.items()}

    def for_priority(self, priority: int) -> "SLO":
        """The objectives a request of ``priority`` is judged by: its class's (``classes``),
        or the base ones (this object) for a priority with no class of its own."""
        return self._by_priority.get(priority, self) if self._by_priority else self

    @property
    def priorities(self) -> tuple[int, ...]:
        """The priorities with objectives of their own (``classes``), ascending."""
        return tuple(sorted(self.classes))

    @classmethod
    def from_mapping(cls, node: Mapping[str, Any] | None) -> "SLO":
        """From an ``slo`` config node (``{"ttft_ms": .., "tpot_ms": .., "e2el_ms": ..,
        "classes": {priority: {..}}}``; None or a missing key keeps the default, a null value
        means no objective). An unknown key raises naming it, so a typo cannot leave the
        default SLO in force unnoticed."""
        d = dict(node or {})
        unknown = sorted(set(d) - set(_SLO_FIELDS.values()) - {"classes"})
        if unknown:
            raise ValueError(f"slo: unknown key(s) {unknown}; expected {', '.join(_SLO_FIELDS.values())}, classes")
        if d.get("classes") is None:
            d.pop("classes", None)
        return cls(**d)

    @classmethod
    def from_metrics(cls, node: Mapping[str, float | None]) -> "SLO":
        """From the metric-keyed form ``{"ttft": ms, "tpot": ms, "e2el": ms}`` (a served
        policy's ``slo`` in ``conf/policy``); a metric left out has no objective, as ``by_metric``
        writes every one. An unknown metric raises naming it."""
        unknown = sorted(set(node) - set(LATENCY_METRICS))
        if unknown:
            raise ValueError(f"slo: unknown metric(s) {unknown}; expected {list(LATENCY_METRICS)}")
        return cls(**{key: node.get(m) for m, key in _SLO_FIELDS.items()})

    def for_metric(self, metric: str) -> float | None:
        """The objective in ms on latency ``metric`` (``"ttft"``, ``"tpot"`` or ``"e2el"``);
        None = no objective there. An unknown metric raises naming it and the choices."""
        key = _SLO_FIELDS.get(metric)
        if key is None:
            raise ValueError(f"SLO.for_metric: unknown latency metric {metric!r}; choices: {list(LATENCY_METRICS)}")
        return getattr(self, key)

    def by_metric(self) -> dict[str, float | None]:
        """Every metric's objective, keyed by metric (the form ``from_metrics`` reads)."""
        return {m: self.for_metric(m) for m in LATENCY_METRICS}

    @property
    def ttft_ref_ms(self) -> float:
        """The TTFT that latency features are scaled by: the objective, or the default without one."""
        return self.ttft_ms or DEFAULT_TTFT_MS

    @property
    def tpot_ref_ms(self) -> float:
        """The TPOT that latency features are scaled by: the objective, or the default without one."""
        return self.tpot_ms or DEFAULT_TPOT_MS

    def met(self, ttft_s: float, tpot_s: float, e2el_s: float) -> bool:
        return (
            (self.ttft_ms is None or ttft_s * 1000.0 <= self.ttft_ms)
            and (self.tpot_ms is None or tpot_s * 1000.0 <= self.tpot_ms)
            and (self.e2el_ms is None or e2el_s * 1000.0 <= self.e2el_ms)
        )


@dataclass(slots=True)
class Snapshot:
    """One control interval as a gateway sees it. Latencies are over a sliding window of
    recent requests (``window_s``); rates and counts are over the last interval."""

    time: float
    interval_s: float
    arrival_rate: float  # requests/s that arrived
    mean_prompt_len: float  # of the requests that arrived in the window
    queue_depth: tuple[int, ...]  # waiting in admission, per bucket
    num_running: int  # in the engine
    num_waiting_engine: int  # inside the engine's own queue (preempted ones included)
    kv_cache_usage: float  # 0..1, as vllm:kv_cache_usage_perc
    request_throughput: float  # finished requests/s
    output_throughput: float  # output tokens/s
    request_goodput: float  # finished requests/s that met the SLO
    ttft_p50_ms: float  # from first tokens in the window (not only finished requests)
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    e2el_p50_ms: float
    e2el_p99_ms: float
    slo_attainment: float  # share of the window's finished requests that met the SLO (1 if none)
    preemptions: int  # in the interval
    rejected: int  # in the interval
    shield_interventions: int  # in the interval
    knobs: Knobs
    time_since_dtype_switch_s: float  # inf: no switch since start-up (the shield's dwell is met)
    prefix_cache_hit_rate: float = 0.0
    #: Waiting requests past their TTFT objective (admission's on-time-first books).
    num_late_waiting: int = 0

    @property
    def queue_total(self) -> int:
        return sum(self.queue_depth)


#: The observation vector, in order: (name, what it is, how it is normalised).
#: Written out in docs/observation.md; keep the two in step.
FEATURES: tuple[tuple[str, str, str], ...] = (
    ("arrival_rate", "requests/s arrived in the interval", "/ rate_scale"),
    ("mean_prompt_len", "mean prompt tokens of recent arrivals", "log1p / log1p(max_model_len)"),
    ("queue_short", "admission queue depth, short bucket", "log1p / log1p(1024)"),
    ("queue_medium", "admission queue depth, medium bucket", "log1p / log1p(1024)"),
    ("queue_long", "admission queue depth, long bucket", "log1p / log1p(1024)"),
    ("num_running", "requests in the engine", "/ max_num_seqs"),
    ("num_waiting_engine", "requests queued inside the engine", "/ max_num_seqs"),
    ("kv_cache_usage", "KV blocks in use (0..1)", "as is"),
    ("request_throughput", "finished requests/s", "/ rate_scale"),
    ("output_throughput", "output tokens/s", "/ token_rate_scale"),
    ("ttft_p50", "median TTFT", "/ SLO ttft, clipped at 10"),
    ("ttft_p99", "p99 TTFT", "/ SLO ttft, clipped at 10"),
    ("tpot_p50", "median TPOT", "/ SLO tpot, clipped at 10"),
    ("tpot_p99", "p99 TPOT", "/ SLO tpot, clipped at 10"),
    ("e2el_p50", "median E2E latency", "/ (SLO ttft + 256 * SLO tpot), clipped at 10"),
    ("e2el_p99", "p99 E2E latency", "/ (SLO ttft + 256 * SLO tpot), clipped at 10"),
    ("slo_attainment", "share of recent requests meeting the SLO", "as is"),
    ("preemptions", "preemptions in the interval", "log1p / log1p(100)"),
    ("batch_cap", "current in-flight cap", "/ max_num_seqs"),
    ("bucketing_fifo", "bucketing mode is FIFO", "one-hot"),
    ("bucketing_shortest_first", "bucketing mode is shortest-first", "one-hot"),
    ("bucketing_weighted", "bucketing mode is weighted", "one-hot"),
    ("kv_8bit", "KV cache runs an 8-bit dtype", "0/1"),
    ("time_since_dtype_switch", "seconds since the last KV dtype switch (none since start-up: 1)", "/ 600, clipped at 1"),
    ("shield_interventions", "shield interventions in the interval", "clipped at 1"),
)
FEATURE_NAMES: tuple[str, ...] = tuple(f[0] for f in FEATURES)
OBS_LOW, OBS_HIGH = 0.0, 10.0
#: The fixed scales of the log features (``FEATURES``), computed once.
_LOG1P_QUEUE = np.log1p(1024.0)
_LOG1P_PREEMPTIONS = np.log1p(100.0)
_KV_DTYPES_8BIT: Collection[str] | None = None  # core.engine's, imported at the first observation
#: ``np.log1p`` of the small counts the observation reads (queue depths, preemptions, the model
#: length), by value: the same numpy scalars, without a ufunc call each for the common values.
_LOG1P_CACHE: dict[int, np.floating] = {}


def _log1p_int(n: int) -> np.floating:
    """``np.log1p(n)`` (the very value), memoised for plain ints under 2**20."""
    if type(n) is int and 0 <= n < 1 << 20:
        v = _LOG1P_CACHE.get(n)
        if v is None:
            v = _LOG1P_CACHE[n] = np.log1p(n)
        return v
    return np.log1p(n)


def _p50_p99(values: Collection[float]) -> tuple[float, float]:
    """Median and p99 with numpy's default (linear) interpolation, sorting once in plain
    Python: this runs every control interval, thousands of times per second in training, on
    windows of a few hundred values where numpy's call overhead dominates."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    v = sorted(values)
    out = []
    for q in (0.50, 0.99):
        pos = q * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        out.append(float(v[lo] + (v[hi] - v[lo]) * (pos - lo)))
    return out[0], out[1]


@dataclass
class Telemetry:
    """Accumulates request events over a control interval and a sliding latency window."""

    slo: SLO
    num_buckets: int = 3
    window_s: float = 10.0
    max_num_seqs: int = 256
    max_model_len: int = 8192
    #: Scales that put rates near 1 for this model and hardware (from the workload config).
    rate_scale: float = 10.0
    token_rate_scale: float = 2000.0
    _arrivals: int = 0
    _preemptions: int = 0
    _rejected: int = 0
    _shield: int = 0
    _finished: int = 0
    _good: int = 0
    _out_tokens: int = 0
    # The sliding windows: when each value came (finished requests, arrivals, first tokens), and
    # beside those times the columns ``snapshot`` reads (latencies already in ms), popped
    # together: an interval's snapshot sorts the columns as they are, where rebuilding them from
    # rows every interval went over each request ~window_s / interval_s times.
    _finish_times: deque = field(default_factory=deque)
    _arrival_times: deque = field(default_factory=deque)
    _ttft_times: deque = field(default_factory=deque)
    _tpot_ms: deque = field(default_factory=deque)
    _e2el_ms: deque = field(default_factory=deque)
    _met: deque = field(default_factory=deque)
    _ttft_ms: deque = field(default_factory=deque)
    _prompt_lens: deque = field(default_factory=deque)
    #: Requests whose first token is recorded and that have not finished yet.
    _first_seen: set = field(default_factory=set)
    _last_time: float = 0.0
    #: When the KV dtype last switched; None = not since start-up (as the shield's dwell sees it).
    _last_dtype_switch: float | None = None

    def reset(self, now: float) -> None:
        self._arrivals = self._preemptions = self._rejected = self._shield = 0
        self._finished = self._good = self._out_tokens = 0
        for window in (self._finish_times, self._arrival_times, self._ttft_times,
                       self._tpot_ms, self._e2el_ms, self._met, self._ttft_ms, self._prompt_lens):
            window.clear()
        self._first_seen.clear()
        self._last_time = now  # the last KV switch stays: a reset of the windows is no switch

    # --- events --------------------------------------------------------------------------
    def on_arrival(self, t: float, prompt_len: int) -> None:
        self._arrivals += 1
        self._arrival_times.append(t)
        self._prompt_lens.append(prompt_len)

    def on_first_token(self, request_id: str, t: float, ttft_s: float) -> None:
        """TTFT counts when the first token comes out, not when the request ends, so a
        growing queue shows in the signal before the slow requests finish. Optional: a request
        whose first token was not reported is counted by ``on_finished``."""
        self._ttft_times.append(t)
        self._ttft_ms.append(ttft_s * 1e3)
        self._first_seen.add(request_id)

    def on_abandoned(self, request_id: str) -> None:
        """A request that will not finish (failed, client gone): forget its first token."""
        self._first_seen.discard(request_id)

    def on_output_tokens(self, n: int) -> None:
        self._out_tokens += n

    def on_finished(self, request_id: str, t: float, ttft_s: float, tpot_s: float, e2el_s: float,
                    priority: int | None = None) -> bool:
        """Record a finished request, its first token too unless ``on_first_token`` did as
        it came out (so no caller can record one half and forget the other); returns whether
        it met the SLO: its class's objectives (``SLO.for_priority``; None: the base ones)."""
        if request_id in self._first_seen:
            self._first_seen.discard(request_id)
        else:
            self._ttft_times.append(t)
            self._ttft_ms.append(ttft_s * 1e3)
        met = (self.slo if priority is None else self.slo.for_priority(priority)).met(ttft_s, tpot_s, e2el_s)
        self._finished += 1
        self._good += int(met)
        self._finish_times.append(t)
        self._tpot_ms.append(tpot_s * 1e3)
        self._e2el_ms.append(e2el_s * 1e3)
        self._met.append(met)
        return met

    def on_preemptions(self, n: int) -> None:
        self._preemptions += n

    def on_rejected(self, n: int = 1) -> None:
        self._rejected += n

    def on_shield_intervention(self, n: int = 1) -> None:
        self._shield += n

    def on_dtype_switch(self, t: float) -> None:
        self._last_dtype_switch = t

    # --- read-out ------------------------------------------------------------------------
    def snapshot(
        self,
        now: float,
        *,
        queue_depth: tuple[int, ...],
        num_running: int,
        num_waiting_engine: int,
        kv_cache_usage: float,
        knobs: Knobs,
        prefix_cache_hit_rate: float = 0.0,
        output_tokens: int | None = None,
        num_late_waiting: int = 0,
    ) -> Snapshot:
        """Close the interval that ended at ``now`` and start the next one. ``output_tokens``:
        the tokens the engine generated in the interval by its own counter, which counts them
        as they come out, as the simulator does (the shield reads the present time between
        tokens from it); None: the ones reported through ``on_output_tokens``."""
        interval = max(now - self._last_time, 1e-9)
        horizon = now - self.window_s
        while self._finish_times and self._finish_times[0] < horizon:
            self._finish_times.popleft()
            self._tpot_ms.popleft()
            self._e2el_ms.popleft()
            self._met.popleft()
        while self._arrival_times and self._arrival_times[0] < horizon:
            self._arrival_times.popleft()
            self._prompt_lens.popleft()
        while self._ttft_times and self._ttft_times[0] < horizon:
            self._ttft_times.popleft()
            self._ttft_ms.popleft()
        attainment = sum(self._met) / len(self._met) if self._met else 1.0
        mean_prompt = sum(self._prompt_lens) / len(self._prompt_lens) if self._prompt_lens else 0.0
        ttft_p, tpot_p, e2el_p = _p50_p99(self._ttft_ms), _p50_p99(self._tpot_ms), _p50_p99(self._e2el_ms)
        snap = Snapshot(
            time=now,
            interval_s=interval,
            arrival_rate=self._arrivals / interval,
            mean_prompt_len=mean_prompt,
            queue_depth=tuple(queue_depth),
            num_running=num_running,
            num_waiting_engine=num_waiting_engine,
            kv_cache_usage=float(kv_cache_usage),
            request_throughput=self._finished / interval,
            output_throughput=(self._out_tokens if output_tokens is None else output_tokens) / interval,
            request_goodput=self._good / interval,
            ttft_p50_ms=ttft_p[0],
            ttft_p99_ms=ttft_p[1],
            tpot_p50_ms=tpot_p[0],
            tpot_p99_ms=tpot_p[1],
            e2el_p50_ms=e2el_p[0],
            e2el_p99_ms=e2el_p[1],
            slo_attainment=attainment,
            preemptions=self._preemptions,
            rejected=self._rejected,
            shield_interventions=self._shield,
            knobs=knobs,
            time_since_dtype_switch_s=math.inf if self._last_dtype_switch is None else now - self._last_dtype_switch,
            prefix_cache_hit_rate=prefix_cache_hit_rate,
            num_late_waiting=num_late_waiting,
        )
        self._arrivals = self._preemptions = self._rejected = self._shield = 0
        self._finished = self._good = self._out_tokens = 0
        self._last_time = now
        return snap

    def observation(self, snap: Snapshot) -> np.ndarray:
        """The normalised feature vector (``FEATURES`` order), float32, inside [0, 10]."""
        return observation_from_snapshot(
            snap,
            self.slo,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            rate_scale=self.rate_scale,
            token_rate_scale=self.token_rate_scale,
        )


def observation_from_snapshot(
    snap: Snapshot,
    slo: SLO,
    *,
    max_num_seqs: int,
    max_model_len: int,
    rate_scale: float,
    token_rate_scale: float,
) -> np.ndarray:
    """Normalise a snapshot into the policy's observation (see ``FEATURES``)."""
    ttft_ref = slo.ttft_ref_ms
    tpot_ref = slo.tpot_ref_ms
    e2el_ref = slo.e2el_ms or (ttft_ref + 256 * tpot_ref)
    q = list(snap.queue_depth) + [0] * max(0, 3 - len(snap.queue_depth))
    onehot = [float(snap.knobs.bucketing == m) for m in BUCKETING_MODES]
    global _KV_DTYPES_8BIT
    if _KV_DTYPES_8BIT is None:
        from batchpilot.core.engine import KV_DTYPES_8BIT  # local: keeps this module light

        _KV_DTYPES_8BIT = KV_DTYPES_8BIT

    vec = [
        snap.arrival_rate / rate_scale,
        np.log1p(snap.mean_prompt_len) / _log1p_int(max_model_len),
        _log1p_int(q[0]) / _LOG1P_QUEUE,
        _log1p_int(q[1]) / _LOG1P_QUEUE,
        _log1p_int(sum(q[2:])) / _LOG1P_QUEUE,
        snap.num_running / max_num_seqs,
        snap.num_waiting_engine / max_num_seqs,
        snap.kv_cache_usage,
        snap.request_throughput / rate_scale,
        snap.output_throughput / token_rate_scale,
        snap.ttft_p50_ms / ttft_ref,
        snap.ttft_p99_ms / ttft_ref,
        snap.tpot_p50_ms / tpot_ref,
        snap.tpot_p99_ms / tpot_ref,
        snap.e2el_p50_ms / e2el_ref,
        snap.e2el_p99_ms / e2el_ref,
        snap.slo_attainment,
        _log1p_int(snap.preemptions) / _LOG1P_PREEMPTIONS,
        snap.knobs.batch_cap / max_num_seqs,
        *onehot,
        float(snap.knobs.kv_dtype in _KV_DTYPES_8BIT),
        min(snap.time_since_dtype_switch_s / 600.0, 1.0),
        min(float(snap.shield_interventions), 1.0),
    ]
    obs = np.asarray(vec, dtype=np.float32)
    # NaN reads 0; the clip sends +-inf to the bounds (what np.nan_to_num(posinf=OBS_HIGH,
    # neginf=OBS_LOW) did first, at twice the cost of the whole rest of this line).
    obs[np.isnan(obs)] = 0.0
    return obs.clip(OBS_LOW, OBS_HIGH)  # np.clip's own ufunc, without its dispatch layers
