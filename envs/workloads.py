"""Where requests come from: synthetic arrival processes and trace replay, handed to the
environment as a ``RequestStream``.

Arrivals are a renewal process run on a rate curve. A curve ``r(t)`` (constant, ramp,
diurnal, on/off, piecewise phases) defines the cumulative intensity ``Λ(t) = ∫ r``; unit-mean
gamma inter-arrival gaps with shape ``burstiness`` are laid out on the ``Λ`` axis and mapped
back through ``Λ⁻¹`` (time rescaling). With burstiness 1 this is exactly a non-homogeneous
Poisson process (the same law as thinning, without rejected draws); with a constant rate it
is exactly ``vllm bench serve --burstiness`` (gamma, shape = burstiness, scale =
1/(rate*burstiness)). Rescaling instead of thinning keeps the gaps' coefficient of variation
at 1/sqrt(burstiness) under any curve, where thinning a gamma process would wash its
burstiness out towards Poisson.

All rates are requests/s on the engine's clock; ``rate_scale`` multiplies every synthetic
rate (and speeds up trace replay) so one workload fits a large GPU model or a tiny CPU one.
A stream is a pure function of the config and the ``np.random.Generator`` it is given.

Every request carries the ``max_tokens`` its client sent (``workload.max_tokens``, see
``MaxTokensConfig``; ``client_max_tokens``): what a gateway, and so admission, knows of its
output before it runs. Its ``output_len`` (the trace's, or the drawn one, cut to the cap) is what
the engine generates.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from batchpilot.core.engine import Request
from batchpilot.envs.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TRACE_FORMATS,
    TraceOptions,
    clip_lengths,
    read_trace,
)
from batchpilot.workload_config import (
    DiurnalWorkload,
    GammaWorkload,
    LengthsConfig,
    MaxTokensConfig,
    MixtureWorkload,
    OnOffWorkload,
    PoissonWorkload,
    RampWorkload,
    RandomizedWorkload,
    TraceWorkload,
    WorkloadBase,
    WorkloadConfigError,
    as_range,
    workload_from_node,
)


# --- rate curves -------------------------------------------------------------------------------
def _check_rate(name: str, v: float) -> None:
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be a finite rate >= 0 requests/s, got {v!r}")


@dataclass(frozen=True, slots=True)
class ConstantRate:
    """``rate`` requests/s throughout."""

    rate: float

    def __post_init__(self) -> None:
        _check_rate("rate", self.rate)

    def __call__(self, t: np.ndarray) -> np.ndarray:
        return np.full_like(t, self.rate, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class RampRate:
    """``start_rate`` until ``ramp_start_s``, linear to ``end_rate`` at ``ramp_end_s``, then
    flat."""

    start_rate: float
    end_rate: float
    ramp_start_s: float
    ramp_end_s: float

    def __post_init__(self) -> None:
        _check_rate("start_rate", self.start_rate)
        _check_rate("end_rate", self.end_rate)
        if not (0 <= self.ramp_start_s < self.ramp_end_s):
            raise ValueError(
                "need 0 <= ramp_start_s < ramp_end_s, got "
                f"{self.ramp_start_s} and {self.ramp_end_s}"
            )

    def __call__(self, t: np.ndarray) -> np.ndarray:
        return np.interp(
            t, [self.ramp_start_s, self.ramp_end_s], [self.start_rate, self.end_rate]
        )


@dataclass(frozen=True, slots=True)
class DiurnalRate:
    """``mean_rate * (1 + amplitude * sin(2π (t - phase_s) / period_s))``: a day compressed
    into ``period_s``."""

    mean_rate: float
    amplitude: float
    period_s: float
    phase_s: float = 0.0

    def __post_init__(self) -> None:
        _check_rate("mean_rate", self.mean_rate)
        if not 0 <= self.amplitude <= 1:
            raise ValueError(
                f"amplitude must be in [0, 1] (rate never negative), got {self.amplitude}"
            )
        if not self.period_s > 0:
            raise ValueError(f"period_s must be > 0, got {self.period_s}")

    def __call__(self, t: np.ndarray) -> np.ndarray:
        return self.mean_rate * (
            1.0 + self.amplitude * np.sin(2 * np.pi * (t - self.phase_s) / self.period_s)
        )


@dataclass(frozen=True, slots=True)
class OnOffRate:
    """Alternating bursts: ``on_rate`` for ``on_s`` seconds, ``off_rate`` for ``off_s``."""

    on_rate: float
    off_rate: float
    on_s: float
    off_s: float
    start_on: bool = True

    def __post_init__(self) -> None:
        _check_rate("on_rate", self.on_rate)
        _check_rate("off_rate", self.off_rate)
        if not (self.on_s > 0 and self.off_s > 0):
            raise ValueError(f"on_s and off_s must be > 0, got {self.on_s} and {self.off_s}")

    def __call__(self, t: np.ndarray) -> np.ndarray:
        period = self.on_s + self.off_s
        shift = 0.0 if self.start_on else self.on_s
        on = np.mod(t + shift, period) < self.on_s
        return np.where(on, self.on_rate, self.off_rate).astype(np.float64)


@dataclass(frozen=True, slots=True)
class PiecewiseRate:
    """``rates[i]`` between ``change_s[i-1]`` and ``change_s[i]`` (phases of an episode)."""

    change_s: tuple[float, ...]
    rates: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.rates) != len(self.change_s) + 1:
            raise ValueError(
                f"need one more rate than change times, got {len(self.rates)} rates and "
                f"{len(self.change_s)} change times"
            )
        if any(b <= a for a, b in zip(self.change_s, self.change_s[1:])):
            raise ValueError(f"change_s must be strictly increasing, got {self.change_s}")
        for r in self.rates:
            _check_rate("rates[i]", r)

    def __call__(self, t: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(np.asarray(self.change_s), t, side="right")
        return np.asarray(self.rates, dtype=np.float64)[idx]


class RateCurve(Protocol):
    def __call__(self, t: np.ndarray) -> np.ndarray: ...


def arrival_times(
    rng: np.random.Generator,
    rate: RateCurve,
    duration_s: float,
    burstiness: float = 1.0,
    grid_dt_s: float = 0.01,
) -> np.ndarray:
    """Arrival times in ``[0, duration_s)`` of a gamma renewal process (shape ``burstiness``;
    1 = Poisson) run on the curve ``rate`` by time rescaling (see the module docstring).
    ``Λ`` is integrated on a ``grid_dt_s`` grid, so a jump in the rate is smeared over one cell."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be > 0, got {burstiness!r}")
    n_grid = int(min(max(math.ceil(duration_s / grid_dt_s), 1000), 2_000_000)) + 1
    grid = np.linspace(0.0, duration_s, n_grid)
    r = np.asarray(rate(grid), dtype=np.float64)
    if not np.all(np.isfinite(r)) or np.any(r < 0):
        raise ValueError("rate curve returned a negative or non-finite rate")
    cum = np.concatenate([[0.0], np.cumsum(0.5 * (r[1:] + r[:-1]) * np.diff(grid))])
    total = float(cum[-1])
    if total <= 0:
        return np.empty(0, dtype=np.float64)
    # Unit-mean gaps on the Λ axis; draw in chunks until past the end.
    gaps: list[np.ndarray] = []
    reached = 0.0
    chunk = int(total + 6 * math.sqrt(total / burstiness) + 16)
    while reached < total:
        g = rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=chunk)
        gaps.append(g)
        reached += float(g.sum())
    s = np.cumsum(np.concatenate(gaps))
    s = s[s < total]
    t = np.interp(s, cum, grid)
    return t[t < duration_s]


# --- length distributions ----------------------------------------------------------------------
class LengthDist(Protocol):
    """Samples ``n`` (prompt_len, output_len) pairs, both int64 >= 1."""

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]: ...


def _check_len(name: str, v: float) -> None:
    if not (math.isfinite(v) and v >= 1):
        raise ValueError(f"{name} must be >= 1 token, got {v!r}")


@dataclass(frozen=True, slots=True)
class FixedLengths:
    """Every request has the same prompt and output length (``vllm bench`` random, range 0)."""

    prompt: int
    output: int

    def __post_init__(self) -> None:
        _check_len("prompt", self.prompt)
        _check_len("output", self.output)

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        return np.full(n, int(self.prompt), np.int64), np.full(n, int(self.output), np.int64)


@dataclass(frozen=True, slots=True)
class UniformLengths:
    """Integer lengths uniform on the closed ranges ``[min, max]``."""

    prompt_min: int
    prompt_max: int
    output_min: int
    output_max: int

    def __post_init__(self) -> None:
        for name in ("prompt_min", "prompt_max", "output_min", "output_max"):
            _check_len(name, getattr(self, name))
        if self.prompt_min > self.prompt_max or self.output_min > self.output_max:
            raise ValueError(f"need min <= max, got {self}")

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        p = rng.integers(int(self.prompt_min), int(self.prompt_max) + 1, size=n, dtype=np.int64)
        o = rng.integers(int(self.output_min), int(self.output_max) + 1, size=n, dtype=np.int64)
        return p, o


@dataclass(frozen=True, slots=True)
class LognormalLengths:
    """Lognormal lengths with the given means (in tokens) and log-space sigmas; rounded,
    at least 1 token. The long right tail is what real chat traces look like."""

    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float

    def __post_init__(self) -> None:
        _check_len("prompt_mean", self.prompt_mean)
        _check_len("output_mean", self.output_mean)
        for name in ("prompt_sigma", "output_sigma"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0 <= v <= 4):
                raise ValueError(f"{name} must be in [0, 4] (log-space), got {v!r}")

    @staticmethod
    def _draw(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
        mu = math.log(mean) - 0.5 * sigma * sigma  # so that E[X] = mean
        return np.maximum(np.rint(rng.lognormal(mu, sigma, size=n)), 1).astype(np.int64)

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        p = self._draw(rng, self.prompt_mean, self.prompt_sigma, n)
        o = self._draw(rng, self.output_mean, self.output_sigma, n)
        return p, o


@dataclass(frozen=True, slots=True, eq=False)
class EmpiricalLengths:
    """(prompt, output) pairs drawn jointly, with replacement, from a trace, so their
    correlation survives."""

    prompt: np.ndarray
    output: np.ndarray

    def __post_init__(self) -> None:
        if self.prompt.shape != self.output.shape or self.prompt.ndim != 1 or self.prompt.size == 0:
            raise ValueError("empirical lengths need two equal-length, non-empty 1-D arrays")
        if self.prompt.min() < 1 or self.output.min() < 1:
            raise ValueError("empirical lengths must all be >= 1 token")

    @classmethod
    def from_trace(cls, path: str | Path, format: str) -> "EmpiricalLengths":
        tr = read_trace(path, format)
        if not len(tr):
            raise ValueError(f"empirical lengths: no requests in {tr.report.summary()}")
        return cls(tr.prompt_len, tr.output_len)

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        idx = rng.integers(0, self.prompt.size, size=n)
        return self.prompt[idx].astype(np.int64), self.output[idx].astype(np.int64)


def _side_rng(rng: np.random.Generator) -> np.random.Generator:
    """A generator for draws that must leave ``rng``'s own sequence as it was (a workload that
    declares several caps keeps the arrivals, lengths and priorities it drew without them):
    spawned from ``rng``'s seed sequence, else seeded from one draw of it."""
    try:
        return rng.spawn(1)[0]
    except (TypeError, ValueError, AttributeError):  # no seed sequence to spawn from
        return np.random.default_rng(int(rng.integers(2**63)))


def client_max_tokens(
    mc: MaxTokensConfig, rng: np.random.Generator, prompt: np.ndarray, output: np.ndarray, max_model_len: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Each request's ``max_tokens`` as the gateway resolves it, its output cut to it, and how
    many outputs were cut. A cap is drawn per request from ``mc`` (no draw for a single cap),
    null meaning the client sent none: vLLM then allows ``max_model_len - prompt`` (its chat
    default); a cap is cut to that room too. ``output`` must already fit the room
    (``clip_lengths``); vLLM stops generating at ``max_tokens``, so an output above its
    request's cap is cut to the cap."""
    p = np.asarray(prompt, dtype=np.int64)
    o = np.asarray(output, dtype=np.int64)
    room = np.maximum(max_model_len - p, 1)
    vals = np.array([-1 if c is None else int(c) for c in mc.caps], dtype=np.int64)
    if vals.size == 1:
        cap = np.full(p.size, vals[0], np.int64)
    else:
        cap = vals[_side_rng(rng).choice(vals.size, size=p.size, p=np.asarray(mc.shares))]
    mt = np.where(cap < 0, room, np.minimum(cap, room))
    o2 = np.minimum(o, mt)
    return mt, o2, int((o2 < o).sum())


def _max_tokens_info(mc: MaxTokensConfig, clipped: int) -> dict[str, Any]:
    return {"caps": list(mc.caps), "shares": mc.shares, "clipped": clipped}


def sample_priorities(rng: np.random.Generator, shares: Sequence[float], n: int) -> np.ndarray:
    """Priority classes 0..len(shares)-1 drawn with the given shares (0 = core)."""
    w = np.asarray(shares, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(
            f"priority shares must be non-negative with a positive sum, got {list(shares)}"
        )
    if np.count_nonzero(w) == 1:  # one class: no draw, so the other streams stay as they were
        return np.full(n, int(np.flatnonzero(w)[0]), dtype=np.int64)
    return rng.choice(w.size, size=n, p=w / w.sum()).astype(np.int64)


# --- the stream ----------------------------------------------------------------------------------
class RequestStream:
    """Requests in arrival order, handed out lazily as ``Request`` objects.

    Built from arrays (``arrival_s`` ascending, in seconds from the episode start). The
    environment calls ``pop_until(now)`` each step and looks at ``next_arrival_time`` to know
    when to wake up. ``info`` holds what produced the stream (sampled parameters, trace report).
    ``max_tokens`` is each request's cap as the gateway would see it (``client_max_tokens``;
    every output at most its cap); None: not known, the requests carry none (admission then
    charges their prompts alone).
    """

    def __init__(
        self,
        arrival_s: np.ndarray,
        prompt_len: np.ndarray,
        output_len: np.ndarray,
        *,
        duration_s: float,
        priority: np.ndarray | None = None,
        prefix_hashes: Sequence[tuple[int, ...]] | None = None,
        prefix_block_tokens: int = MOONCAKE_BLOCK_TOKENS,
        id_prefix: str = "r",
        info: Mapping[str, Any] | None = None,
        max_tokens: np.ndarray | None = None,
    ) -> None:
        t = np.asarray(arrival_s, dtype=np.float64)
        p = np.asarray(prompt_len, dtype=np.int64)
        o = np.asarray(output_len, dtype=np.int64)
        pr = np.zeros(t.size, np.int64) if priority is None else np.asarray(priority, np.int64)
        n = t.size
        if t.ndim != 1 or p.shape != (n,) or o.shape != (n,) or pr.shape != (n,):
            raise ValueError(
                f"arrival_s, prompt_len, output_len, priority must be 1-D of one length, got "
                f"{t.shape}, {p.shape}, {o.shape}, {pr.shape}"
            )
        if prefix_hashes is not None and len(prefix_hashes) != n:
            raise ValueError(f"prefix_hashes has {len(prefix_hashes)} entries for {n} requests")
        if n and (not np.all(np.isfinite(t)) or t[0] < 0 or np.any(np.diff(t) < 0)):
            raise ValueError("arrival_s must be finite, >= 0 and ascending")
        if n and (p.min() < 1 or o.min() < 1):
            raise ValueError("prompt_len and output_len must be >= 1 token")
        if n and pr.min() < 0:
            raise ValueError("priority must be >= 0 (0 = core)")
        if not (math.isfinite(duration_s) and duration_s >= 0):
            raise ValueError(f"duration_s must be finite and >= 0, got {duration_s!r}")
        mt = None if max_tokens is None else _check_max_tokens(max_tokens, o)
        self.arrival_s, self.prompt_len, self.output_len, self.priority = t, p, o, pr
        self.max_tokens = mt
        for a in (t, p, o, pr) + (() if mt is None else (mt,)):
            a.setflags(write=False)
        # Plain-Python copies for the per-arrival hot path (pop_until runs thousands of times
        # per second in training; numpy scalar calls cost more than the work).
        self._t_list: list[float] = t.tolist()
        caps = [None] * n if mt is None else mt.tolist()
        self._rows = list(zip(p.tolist(), o.tolist(), pr.tolist(), caps))
        self.prefix_hashes = tuple(prefix_hashes) if prefix_hashes is not None else None
        self.prefix_block_tokens = prefix_block_tokens
        self.id_prefix = id_prefix
        self.info: dict[str, Any] = dict(info or {})
        self._duration_s = float(duration_s)
        self._next = 0

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    @property
    def duration_s(self) -> float:
        """The episode length this stream was made for (arrivals all lie before it, for
        synthetic streams)."""
        return self._duration_s

    @property
    def num_remaining(self) -> int:
        return len(self) - self._next

    @property
    def next_arrival_time(self) -> float:
        """Arrival time of the next request not yet popped; ``inf`` when exhausted."""
        return self._t_list[self._next] if self._next < len(self._t_list) else math.inf

    def pop_until(self, t: float) -> list[Request]:
        """All not-yet-popped requests arriving at or before ``t``, in arrival order."""
        if self.next_arrival_time > t:  # the common case in a busy loop: nothing new yet
            return []
        t_list = self._t_list
        end = max(bisect.bisect_right(t_list, t), self._next)
        # ``_request``, inline (one call less per request).
        rows, prefix, hashes, block_tokens = self._rows, self.id_prefix, self.prefix_hashes, self.prefix_block_tokens
        out = []
        for i in range(self._next, end):
            prompt_len, output_len, priority, max_tokens = rows[i]
            out.append(Request(f"{prefix}{i}", t_list[i], prompt_len, output_len, priority,
                               hashes[i] if hashes is not None else (), block_tokens, 1, True, max_tokens))
        self._next = end
        return out

    def reset(self) -> None:
        """Rewind to the first request (replay the same stream)."""
        self._next = 0

    def _request(self, i: int) -> Request:
        prompt_len, output_len, priority, max_tokens = self._rows[i]
        # Positional, in Request's field order (request_id, arrival_time, prompt_len,
        # output_len, priority, prefix_hashes, prefix_block_tokens, num_seqs,
        # reports_first_token, max_tokens): cheaper than keywords.
        return Request(f"{self.id_prefix}{i}", self._t_list[i], prompt_len, output_len, priority,
                       self.prefix_hashes[i] if self.prefix_hashes is not None else (),
                       self.prefix_block_tokens, 1, True, max_tokens)

    @classmethod
    def merge(cls, streams: Sequence["RequestStream"], **kwargs: Any) -> "RequestStream":
        """Superpose streams (a mixture): arrivals merged in time order, stable by stream."""
        if not streams:
            raise ValueError("merge needs at least one stream")
        t = np.concatenate([s.arrival_s for s in streams])
        order = np.argsort(t, kind="stable")
        hashes = None
        if any(s.prefix_hashes is not None for s in streams):
            flat = [h for s in streams for h in (s.prefix_hashes or ((),) * len(s))]
            hashes = [flat[i] for i in order]
        kwargs.setdefault("duration_s", max(s.duration_s for s in streams))
        known = [s.max_tokens is not None for s in streams]
        if any(known) and not all(known):
            raise ValueError("merge: some streams carry max_tokens and some do not; give all of them caps "
                             "(client_max_tokens) or none")
        if all(known):
            kwargs.setdefault("max_tokens", np.concatenate([s.max_tokens for s in streams])[order])
        return cls(
            t[order],
            np.concatenate([s.prompt_len for s in streams])[order],
            np.concatenate([s.output_len for s in streams])[order],
            priority=np.concatenate([s.priority for s in streams])[order],
            prefix_hashes=hashes,
            prefix_block_tokens=streams[0].prefix_block_tokens,
            **kwargs,
        )


def _check_max_tokens(max_tokens: np.ndarray, output: np.ndarray) -> np.ndarray:
    """``max_tokens`` as int64, checked against the outputs: one per request, each >= 1 and at
    least its output (the engine stops at the cap: an output above it could not happen)."""
    mt = np.asarray(max_tokens, dtype=np.int64)
    if mt.shape != output.shape:
        raise ValueError(f"max_tokens must have one cap per request ({output.shape}), got {mt.shape}")
    if mt.size and mt.min() < 1:
        raise ValueError(f"max_tokens must be >= 1 token, got {int(mt.min())} at request {int(mt.argmin())}")
    over = np.flatnonzero(output > mt)
    if over.size:
        i = int(over[0])
        raise ValueError(f"request {i}: output_len {int(output[i])} exceeds its max_tokens {int(mt[i])} "
                         f"({over.size} such); vLLM stops at max_tokens, so cut outputs to their caps "
                         "(envs/workloads.py client_max_tokens)")
    return mt


# --- config -> stream -----------------------------------------------------------------------------
# Each kind's keys, types and defaults are its dataclass in batchpilot/workload_config.py
# (the workload group's schemas); ``workload_from_node`` checks a node against it.


def _resolve_path(p: str) -> Path:
    from batchpilot.config import REPO_ROOT

    path = Path(p).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def _check_format(where: str, fmt: Any) -> str:
    if fmt not in TRACE_FORMATS:
        raise WorkloadConfigError(f"{where}.format: must be one of {TRACE_FORMATS}, got {fmt!r}")
    return str(fmt)


def _lengths(lc: LengthsConfig, where: str) -> LengthDist:
    """The length distribution of a checked ``lengths`` node (``where``: its full key)."""
    try:
        if lc.kind == "fixed":
            dist: LengthDist = FixedLengths(int(lc.prompt), int(lc.output))
        elif lc.kind == "uniform":
            pa, pb = as_range(where, "prompt", lc.prompt, lo=1, number_ok=True)
            oa, ob = as_range(where, "output", lc.output, lo=1, number_ok=True)
            dist = UniformLengths(int(pa), int(pb), int(oa), int(ob))
        elif lc.kind == "lognormal":
            dist = LognormalLengths(
                float(lc.prompt_mean), float(lc.prompt_sigma),  # type: ignore[arg-type]
                float(lc.output_mean), float(lc.output_sigma),  # type: ignore[arg-type]
            )
        else:  # empirical
            fmt = _check_format(where, lc.format)
            dist = EmpiricalLengths.from_trace(_resolve_path(str(lc.path)), fmt)
    except ValueError as e:
        if isinstance(e, WorkloadConfigError):
            raise
        raise WorkloadConfigError(f"{where}: {e}") from e
    return dist


def _synthetic(
    wc: WorkloadBase, rng: np.random.Generator, max_model_len: int, curve: RateCurve, burstiness: float,
    lengths: LengthDist, duration: float, info: dict[str, Any],
) -> RequestStream:
    t = arrival_times(rng, curve, duration, burstiness)
    p, o = lengths.sample(rng, t.size)
    p, o, clipped = clip_lengths(p, o, max_model_len)
    pr = sample_priorities(rng, wc.priorities, t.size)
    mt, o, capped = client_max_tokens(wc.max_tokens, rng, p, o, max_model_len)
    info.update(clipped=clipped, max_tokens=_max_tokens_info(wc.max_tokens, capped))
    return RequestStream(t, p, o, priority=pr, duration_s=duration, info=info, max_tokens=mt)


def _loguniform(rng: np.random.Generator, lo_hi: tuple[float, float]) -> float:
    a, b = lo_hi
    return float(math.exp(rng.uniform(math.log(a), math.log(b)))) if b > a else a


def _random_onoff(wc: RandomizedWorkload, rng: np.random.Generator) -> "OnOffRate | None":
    """With probability ``onoff_prob``, an on/off multiplier on the rate: ``onoff_on_factor``
    x during bursts of ``onoff_on_s``, ``onoff_off_factor`` x for ``onoff_off_s`` between them.
    No draw at all when the probability is 0 (episodes stay as they were)."""
    prob = float(wc.onoff_prob)
    if prob == 0.0:
        return None
    on_f, off_f, on_s, off_s = (
        wc.range(key) for key in ("onoff_on_factor", "onoff_off_factor", "onoff_on_s", "onoff_off_s")
    )
    if rng.uniform() >= prob:
        return None
    return OnOffRate(
        _loguniform(rng, on_f), _loguniform(rng, off_f), _loguniform(rng, on_s), _loguniform(rng, off_s),
        start_on=bool(rng.integers(2)),
    )


def _randomized(
    wc: RandomizedWorkload, rng: np.random.Generator, max_model_len: int, duration: float, scale: float
) -> RequestStream:
    """Domain randomisation: a fresh rate, burstiness, length mix and 0..N phase changes
    (rate and length shifts at random times) for every episode."""
    rate = _loguniform(rng, wc.range("rate")) * scale
    burst = _loguniform(rng, wc.range("burstiness"))
    base = LognormalLengths(
        _loguniform(rng, wc.range("prompt_mean")),
        float(rng.uniform(*wc.range("prompt_sigma"))),
        _loguniform(rng, wc.range("output_mean")),
        float(rng.uniform(*wc.range("output_sigma"))),
    )
    lo_n, hi_n = wc.range("num_phases")
    n_changes = int(rng.integers(int(lo_n), int(hi_n) + 1))
    window = wc.range("phase_window")
    rate_f = wc.range("phase_rate_factor")
    len_f = wc.range("phase_length_factor")
    change_s = tuple(sorted(float(x) for x in rng.uniform(*window, size=n_changes) * duration))
    rates, dists = [rate], [base]
    for _ in range(n_changes):
        rates.append(rates[-1] * _loguniform(rng, rate_f))
        f_p, f_o = _loguniform(rng, len_f), _loguniform(rng, len_f)
        prev = dists[-1]
        dists.append(LognormalLengths(
            max(prev.prompt_mean * f_p, 1.0), prev.prompt_sigma,
            max(prev.output_mean * f_o, 1.0), prev.output_sigma,
        ))
    curve: RateCurve = PiecewiseRate(change_s, tuple(rates))
    onoff = _random_onoff(wc, rng)
    if onoff is not None:  # heavy on/off bursts on top of the phases (code completion, agents)
        phases = curve
        curve = lambda t: phases(t) * onoff(t)  # noqa: E731
    t = arrival_times(rng, curve, duration, burst)
    phase = np.searchsorted(np.asarray(change_s), t, side="right")
    p = np.empty(t.size, np.int64)
    o = np.empty(t.size, np.int64)
    for i, dist in enumerate(dists):
        sel = phase == i
        p[sel], o[sel] = dist.sample(rng, int(sel.sum()))
    p, o, clipped = clip_lengths(p, o, max_model_len)
    pr = sample_priorities(rng, wc.priorities, t.size)
    mt, o, capped = client_max_tokens(wc.max_tokens, rng, p, o, max_model_len)
    info = {
        "kind": "randomized", "rate": rate, "burstiness": burst, "change_s": list(change_s),
        "rates": rates, "onoff": None if onoff is None else dataclasses.asdict(onoff),
        "lengths": [
            (d.prompt_mean, d.prompt_sigma, d.output_mean, d.output_sigma) for d in dists
        ],
        "clipped": clipped,
        "max_tokens": _max_tokens_info(wc.max_tokens, capped),
    }
    return RequestStream(t, p, o, priority=pr, duration_s=duration, info=info, max_tokens=mt)


def _check_max_model_len(max_model_len: Any) -> int:
    """``max_model_len`` as an int, refused (``ValueError``) unless a whole number >= 2: a bool or
    float from a hand-built config would otherwise size every request wrong."""
    if (
        isinstance(max_model_len, bool)
        or not isinstance(max_model_len, numbers.Integral)
        or max_model_len < 2
    ):
        raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
    return int(max_model_len)


def _trace_stream(
    wc: TraceWorkload, rng: np.random.Generator, max_model_len: int, scale: float, where: str
) -> RequestStream:
    """A trace replayed (``read_trace``, ``rate_scale`` folded into its time scale), with the
    priorities and client ``max_tokens`` the workload draws for it."""
    fmt = _check_format(where, wc.format)
    try:
        opts = TraceOptions(
            time_scale=float(wc.time_scale) * scale,
            start_s=float(wc.start_s),
            duration_s=None if wc.duration_s is None else float(wc.duration_s),
            max_model_len=max_model_len,
            overflow=wc.overflow,  # type: ignore[arg-type]
            spread_quantum_s=None if wc.spread_quantum_s is None else float(wc.spread_quantum_s),
            model=wc.model,
        )
    except ValueError as e:
        raise WorkloadConfigError(f"{where}: {e}") from e
    tr = read_trace(_resolve_path(str(wc.path)), fmt, opts)
    pr = sample_priorities(rng, wc.priorities, len(tr))
    mt, out, capped = client_max_tokens(wc.max_tokens, rng, tr.prompt_len, tr.output_len, max_model_len)
    return RequestStream(
        tr.arrival_s, tr.prompt_len, out, priority=pr, duration_s=tr.duration_s,
        prefix_hashes=tr.prefix_hashes, prefix_block_tokens=tr.prefix_block_tokens,
        info={"kind": "trace", "report": tr.report, "max_tokens": _max_tokens_info(wc.max_tokens, capped)},
        max_tokens=mt,
    )


def _mixture_stream(
    wc: MixtureWorkload, rng: np.random.Generator, max_model_len: int, duration: float, scale: float,
    where: str,
) -> RequestStream:
    """Each component built as a workload of its own (the mixture's duration, clients and
    ``rate_scale`` unless it sets its own), then merged by arrival time."""
    streams = []
    for i, c in enumerate(wc.components):
        sub = dict(c) if isinstance(c, Mapping) else c
        if isinstance(sub, dict):
            if sub.get("kind") == "mixture":
                raise WorkloadConfigError(
                    f"{where}.components[{i}]: a mixture cannot nest a mixture"
                )
            sub.setdefault("duration_s", duration)
            # A component that declares no caps takes the mixture's clients'.
            sub.setdefault("max_tokens", dataclasses.asdict(wc.max_tokens))
            sub["rate_scale"] = float(sub.get("rate_scale", 1.0)) * scale
        streams.append(
            build_workload(sub, rng, max_model_len, where=f"{where}.components[{i}]")
        )
    return RequestStream.merge(
        streams,
        duration_s=duration,
        info={"kind": "mixture", "components": [s.info for s in streams]},
    )


def _rate_curve(wc: Any, scale: float, duration: float, where: str) -> RateCurve:
    """The arrival-rate curve of a synthetic workload (Poisson, gamma, on/off, ramp, diurnal),
    its rates multiplied by ``rate_scale``; a curve the config cannot make is a
    ``WorkloadConfigError`` naming ``where``."""
    try:
        if isinstance(wc, (PoissonWorkload, GammaWorkload)):
            return ConstantRate(float(wc.rate) * scale)
        if isinstance(wc, OnOffWorkload):
            return OnOffRate(
                float(wc.on_rate) * scale, float(wc.off_rate) * scale,
                float(wc.on_s), float(wc.off_s), bool(wc.start_on),
            )
        if isinstance(wc, RampWorkload):
            return RampRate(
                float(wc.start_rate) * scale, float(wc.end_rate) * scale, float(wc.ramp_start_s),
                duration if wc.ramp_end_s is None else float(wc.ramp_end_s),
            )
        assert isinstance(wc, DiurnalWorkload)
        return DiurnalRate(
            float(wc.mean_rate) * scale, float(wc.amplitude),
            duration if wc.period_s is None else float(wc.period_s), float(wc.phase_s),
        )
    except ValueError as e:
        raise WorkloadConfigError(f"{where}: {e}") from e


def build_workload(
    cfg_workload: Any, rng: np.random.Generator, max_model_len: int, *, where: str = "workload"
) -> RequestStream:
    """Build one episode's request stream from the ``workload`` config group.

    ``cfg.kind`` picks the process (``WORKLOAD_KINDS``) and its schema (``WORKLOAD_SCHEMAS``,
    see ``conf/workload/*.yaml``); the node (composed, or a mapping built in code) is checked
    against it by ``workload_from_node``: unknown, mistyped or missing keys and values out of
    range raise ``WorkloadConfigError`` naming them (``workload.rate``).
    """
    wc = workload_from_node(cfg_workload, where)
    max_model_len = _check_max_model_len(max_model_len)
    scale = float(wc.rate_scale)
    if isinstance(wc, TraceWorkload):
        return _trace_stream(wc, rng, max_model_len, scale, where)
    duration = float(wc.duration_s)
    if isinstance(wc, MixtureWorkload):
        return _mixture_stream(wc, rng, max_model_len, duration, scale, where)
    if isinstance(wc, RandomizedWorkload):
        return _randomized(wc, rng, max_model_len, duration, scale)
    # Poisson has no burstiness key (it is gamma with burstiness 1).
    burst = 1.0 if isinstance(wc, PoissonWorkload) else float(wc.burstiness)  # type: ignore[attr-defined]
    curve = _rate_curve(wc, scale, duration, where)
    lengths = _lengths(wc.lengths, f"{where}.lengths")  # type: ignore[attr-defined]
    info = {"kind": wc.kind, "curve": curve, "burstiness": burst}
    return _synthetic(wc, rng, max_model_len, curve, burst, lengths, duration, info)
