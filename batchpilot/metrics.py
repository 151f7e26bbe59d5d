"""The one place metric names live and aggregate metrics are computed.

Names and definitions follow ``vllm bench serve`` so our numbers can be put next to its:
throughputs over the run's duration; TTFT and E2E latency per request; TPOT per request with
more than one output token; ITL per output token (from per-token timings when the engine
recorded them, else each request's TPOT stands for each of its ``output_len - 1`` gaps);
``request_goodput`` = requests/s meeting every SLO, as ``--goodput``, but over the *arrival
window* when one is given (``window_s``; the end-of-run drain is outside the denominator, which
``vllm bench serve`` includes: its figure stays here as ``request_goodput_run``).

What users read next to it (``OFFERED_KEYS``; docs/evaluation.md, "Metrics"): SLO attainment
over the *offered* requests (a refused, shed, timed-out or unfinished request is a miss), the
refusal rate, attainment per prompt-length bucket (admission's bucket edges) and weighted by
each request's prompt + output tokens. ``slo_attainment_completed`` is the old view, over the
completed requests only: shedding raises it, so it is shown for diagnosis, never ranked on.

Each request is judged by its class's objectives (``SLO.for_priority``: ``slo.classes`` gives a
priority its own). When the offered requests carry more than one priority (``Offered.priority``),
the summary adds attainment and goodput per class (``class_keys``: ``slo_attainment_p2``,
``request_goodput_p2``, ...), so what a controller refused or served late shows per class; a
workload of one class gets exactly ``SUMMARY_KEYS``.

Also the Prometheus names vLLM exposes on ``/metrics`` (new and old spellings) and
``parse_vllm_metrics``, which maps them onto canonical keys (parsing and aggregation over
engines: ``batchpilot.prom``), so a scraper never hard-codes a vLLM version's names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchpilot.core.engine import FinishedRequest
from batchpilot.core.telemetry import SLO
from batchpilot.prom import metric_values

LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
LATENCY_STATS: tuple[str, ...] = ("mean", "median", "p99")
#: Every key ``summarize`` returns, in order (``extra`` keys come after).
SUMMARY_KEYS: tuple[str, ...] = (
    "duration_s",
    "completed",
    "rejected",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    "slo_attainment",
    *(f"{s}_{m}_ms" for m in LATENCY_METRICS for s in LATENCY_STATS),
    "window_s",
    "offered",
    "refusal_rate",
    "request_goodput_run",
    "slo_attainment_completed",
    "slo_attainment_tokens",
    "slo_attainment_short",
    "slo_attainment_medium",
    "slo_attainment_long",
)
#: The prompt-length buckets attainment is reported per: admission's first bucket, the ones
#: between (all of them together) and its last (``boundaries: [1024, 8192]``: < 1k, 1k-8k, >= 8k).
BUCKET_NAMES: tuple[str, ...] = ("short", "medium", "long")
#: The keys that read the offered requests (``summarize(offered=...)``); NaN without them.
OFFERED_KEYS: tuple[str, ...] = SUMMARY_KEYS[SUMMARY_KEYS.index("window_s"):]
#: The per-class metrics (``class_keys``): attainment over the class's offered requests and
#: goodput over the arrival window, each request judged by its class's objectives.
CLASS_METRICS: tuple[str, ...] = ("slo_attainment", "request_goodput")


def class_keys(priorities: Sequence[int]) -> tuple[str, ...]:
    """The summary keys of the per-class results for these priority classes, class by class
    (``slo_attainment_p1``, ``request_goodput_p1``, ``slo_attainment_p2``, ...)."""
    return tuple(f"{m}_p{int(p)}" for p in sorted(set(int(x) for x in priorities)) for m in CLASS_METRICS)


_CLASS_KEY = re.compile(rf"({'|'.join(CLASS_METRICS)})_p(\d+)")


def class_keys_in(keys: Iterable[str]) -> tuple[str, ...]:
    """The per-class keys among ``keys`` (a summary's, a results row's), in ``class_keys`` order."""
    found = {m.group(0): (int(m.group(2)), CLASS_METRICS.index(m.group(1)))
             for k in keys if (m := _CLASS_KEY.fullmatch(k))}
    return tuple(sorted(found, key=found.__getitem__))


@dataclass(frozen=True, slots=True)
class Offered:
    """Every request offered to the service in the run (served, refused or still open), as the
    workload made them: what attainment per bucket, per token and per priority class is over.
    ``priority``: each one's class (None: not known, no per-class results)."""

    prompt_len: np.ndarray
    output_len: np.ndarray
    priority: np.ndarray | None = None

    def __post_init__(self) -> None:
        p, o = np.asarray(self.prompt_len), np.asarray(self.output_len)
        if p.ndim != 1 or p.shape != o.shape:
            raise ValueError(f"offered prompt_len and output_len must be 1-D of one length, got {p.shape}, {o.shape}")
        if self.priority is not None and np.asarray(self.priority).shape != p.shape:
            raise ValueError(f"offered priority must be 1-D of the prompts' length {p.shape}, "
                             f"got {np.asarray(self.priority).shape}")

    def __len__(self) -> int:
        return int(np.asarray(self.prompt_len).size)


def length_buckets(prompt_len: np.ndarray, edges: Sequence[int]) -> np.ndarray:
    """``BUCKET_NAMES`` index per prompt: 0 below the first edge, 2 at or above the last, 1
    between (as ``Admission.bucket_of`` sorts them; several middle buckets count as one)."""
    if not edges:
        raise ValueError("bucket edges must name at least one prompt length (admission.boundaries)")
    idx = np.searchsorted(np.asarray(edges, np.int64), np.asarray(prompt_len, np.int64), side="right")
    return np.where(idx == 0, 0, np.where(idx >= len(edges), 2, 1))


def _weighted_stats(values: np.ndarray, counts: np.ndarray) -> tuple[float, float, float]:
    """(mean, median, p99) of ``values`` each repeated ``counts`` times: numpy's own statistics
    on the expanded array, with its default "linear" percentile (what ``vllm bench serve``
    reports). numpy's weighted percentile (``weights=``, numpy >= 2.0) supports only
    ``method="inverted_cdf"``, which does not interpolate and would shift every p99; expanding
    costs one float per output token, once per episode."""
    expanded = np.repeat(values, np.maximum(counts, 0))
    if expanded.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(expanded.mean())
    # The expanded array is ours and its order is no longer needed (the mean is taken): let the
    # median and the percentile partition it in place instead of each copying it first.
    median = float(np.median(expanded, overwrite_input=True))
    return mean, median, float(np.percentile(expanded, 99, overwrite_input=True))


def _share(a: float, b: float) -> float:
    return a / b if b else math.nan


def _offered_tail(
    tokens: np.ndarray, prompt: np.ndarray, met: np.ndarray, num_rejected: int, window_s: float,
    duration_s: float, num_offered: int, offered: Offered | None, bucket_edges: Sequence[int],
) -> dict[str, float]:
    """``OFFERED_KEYS`` of ``summarize`` (``tokens``, ``prompt``, ``met``: per completed request)."""
    good = int(met.sum())
    tail: dict[str, float] = {
        "window_s": window_s,
        "offered": float(num_offered),
        "refusal_rate": _share(num_rejected, num_offered),
        "request_goodput_run": good / duration_s,
        "slo_attainment_completed": _share(good, met.size),
        "slo_attainment_tokens": math.nan,
        **{f"slo_attainment_{b}": math.nan for b in BUCKET_NAMES},
    }
    if offered is not None:
        op, oo = np.asarray(offered.prompt_len, np.int64), np.asarray(offered.output_len, np.int64)
        tail["slo_attainment_tokens"] = _share(float(tokens[met].sum()), float((op + oo).sum()))
        met_b = np.bincount(length_buckets(prompt[met], bucket_edges), minlength=len(BUCKET_NAMES))
        off_b = np.bincount(length_buckets(op, bucket_edges), minlength=len(BUCKET_NAMES))
        for i, b in enumerate(BUCKET_NAMES):
            tail[f"slo_attainment_{b}"] = _share(float(met_b[i]), float(off_b[i]))
    return tail


@dataclass(frozen=True, slots=True)
class _PerRequest:
    """The completed requests as columns (one row per request), read once: every statistic of
    ``summarize`` is a numpy expression over these."""

    prompt: np.ndarray
    output: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    e2el: np.ndarray
    #: Whether the request met every objective of its class's SLO (``SLO.for_priority``).
    met: np.ndarray
    priority: np.ndarray

    @classmethod
    def of(cls, finished: Sequence[FinishedRequest], slo: SLO) -> "_PerRequest":
        n = len(finished)
        ttft = np.fromiter((r.ttft for r in finished), np.float64, n)
        tpot = np.fromiter((r.tpot for r in finished), np.float64, n)
        e2el = np.fromiter((r.e2el for r in finished), np.float64, n)
        priority = np.fromiter((r.priority for r in finished), np.int64, n)
        judge = slo.for_priority
        met = np.fromiter((judge(p).met(*row) for p, *row in zip(priority.tolist(), ttft.tolist(), tpot.tolist(),
                                                                 e2el.tolist())), bool, n)
        return cls(prompt=np.fromiter((r.prompt_len for r in finished), np.int64, n),
                   output=np.fromiter((r.output_len for r in finished), np.int64, n),
                   ttft=ttft, tpot=tpot, e2el=e2el, met=met, priority=priority)


def _per_class(req: _PerRequest, offered: Offered | None, window_s: float) -> dict[str, float]:
    """``class_keys`` of the offered priority classes when there are more than one (else
    none): per class, met / offered and met per second of the arrival window."""
    if offered is None or offered.priority is None:
        return {}
    op = np.asarray(offered.priority, np.int64)
    classes = np.unique(op)
    if classes.size < 2:
        return {}
    out: dict[str, float] = {}
    for p in classes.tolist():
        good = float(np.count_nonzero(req.met & (req.priority == p)))
        out[f"slo_attainment_p{p}"] = _share(good, float(np.count_nonzero(op == p)))
        out[f"request_goodput_p{p}"] = good / window_s
    return out


def _checked_run(n: int, duration_s: float, num_rejected: int, window_s: float | None,
                 offered: Offered | None) -> tuple[float, int]:
    """(window_s, offered count) of a run, refusing one whose figures cannot be divided by
    (a zero or infinite duration or window) or do not add up (more completed + rejected
    requests than were offered): a wrong summary would otherwise look like a result."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    if window_s is None:
        window_s = duration_s
    if not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"window_s must be > 0, got {window_s!r}")
    if num_rejected < 0:
        raise ValueError(f"num_rejected must be >= 0, got {num_rejected!r}")
    num_offered = n + num_rejected if offered is None else len(offered)
    if n + num_rejected > num_offered:
        raise ValueError(f"{n} completed + {num_rejected} rejected requests exceed the {num_offered} offered")
    return window_s, num_offered


def _totals(req: _PerRequest, duration_s: float, window_s: float, num_rejected: int,
            num_offered: int) -> dict[str, float]:
    """The counts, throughputs, goodput and attainment keys of ``SUMMARY_KEYS`` (up to the
    latencies), with ``vllm bench serve``'s denominators (see ``summarize``)."""
    n, good = req.met.size, int(req.met.sum())
    prompt, output = req.prompt, req.output
    return {
        "duration_s": float(duration_s),
        "completed": float(n),
        "rejected": float(num_rejected),
        "total_input_tokens": float(prompt.sum()),
        "total_output_tokens": float(output.sum()),
        "request_throughput": n / duration_s,
        "output_throughput": float(output.sum()) / duration_s,
        "total_token_throughput": float(prompt.sum() + output.sum()) / duration_s,
        "request_goodput": good / window_s,
        "slo_attainment": _share(good, num_offered),
    }


def _latencies(finished: Sequence[FinishedRequest], req: _PerRequest) -> dict[str, float]:
    """Mean, median and p99 (ms) of each of ``LATENCY_METRICS``. TPOT counts only requests
    with more than one output token; ITL is per output-token gap, from the engine's per-token
    timings where it recorded them, else each request's TPOT stands for its ``output_len - 1``
    gaps (weighted, not averaged per request, as ``vllm bench serve`` does)."""
    n = req.met.size
    multi = req.output > 1
    itl_vals: list[np.ndarray] = []
    itl_counts: list[np.ndarray] = []
    for r in finished:
        if r.itl is not None:
            itl_vals.append(np.asarray(r.itl, dtype=np.float64))
            itl_counts.append(np.ones(len(r.itl), np.int64))
    no_itl = np.fromiter((r.itl is None for r in finished), bool, n) & multi
    itl_vals.append(req.tpot[no_itl])
    itl_counts.append(req.output[no_itl] - 1)
    samples = {
        "ttft": (req.ttft, np.ones(n, np.int64)),
        "tpot": (req.tpot[multi], np.ones(int(multi.sum()), np.int64)),
        "itl": (np.concatenate(itl_vals), np.concatenate(itl_counts)),
        "e2el": (req.e2el, np.ones(n, np.int64)),
    }
    out: dict[str, float] = {}
    for name in LATENCY_METRICS:
        vals, counts = samples[name]
        mean, median, p99 = _weighted_stats(vals * 1e3, counts)
        out[f"mean_{name}_ms"], out[f"median_{name}_ms"], out[f"p99_{name}_ms"] = mean, median, p99
    return out


def summarize(
    finished: Sequence[FinishedRequest],
    duration_s: float,
    slo: SLO,
    *,
    num_rejected: int = 0,
    window_s: float | None = None,
    offered: Offered | None = None,
    bucket_edges: Sequence[int] = (1024, 8192),
    extra: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Aggregate a run's finished requests into ``SUMMARY_KEYS`` (latencies in ms).

    - Throughputs and ``request_goodput_run`` divide by ``duration_s`` (the run's length on the
      engine clock, drain included, as ``vllm bench serve``). ``request_goodput`` divides by
      ``window_s``, the arrival window (``duration_s`` when not given).
    - ``slo_attainment`` = requests meeting every SLO / offered requests, where offered is
      ``len(offered)`` when given, else completed + rejected: a refused, shed, timed-out or
      unfinished request is a miss, so shedding load cannot raise it. ``refusal_rate`` =
      ``num_rejected`` / offered. ``slo_attainment_completed`` = met / completed (the old view).
    - ``slo_attainment_{short,medium,long}`` (prompt buckets at ``bucket_edges``, admission's
      ``boundaries``) and ``slo_attainment_tokens`` (met / offered prompt + output tokens) need
      ``offered``: NaN without it, and a bucket nobody was offered in is NaN.
    - Latency statistics are NaN when nothing qualified (no requests; no output > 1 token for
      TPOT and ITL), never a made-up 0. Ratios over nothing are NaN.
    - Each request is judged by its class's objectives (``SLO.for_priority``); with more than
      one priority among ``offered.priority``, ``class_keys`` of them follow (attainment over
      the class's offered requests, goodput over ``window_s``).
    - ``extra`` entries are appended; they may not overwrite a canonical key.
    """
    window_s, num_offered = _checked_run(len(finished), duration_s, num_rejected, window_s, offered)
    req = _PerRequest.of(finished, slo)
    out = _totals(req, duration_s, window_s, num_rejected, num_offered)
    out.update(_latencies(finished, req))
    out.update(_offered_tail(req.prompt + req.output, req.prompt, req.met, num_rejected, float(window_s),
                             float(duration_s), num_offered, offered, bucket_edges))
    out.update(_per_class(req, offered, float(window_s)))
    for key, value in (extra or {}).items():
        if key in out:
            raise ValueError(f"extra key {key!r} would overwrite a summary metric")
        out[key] = float(value)
    return out


# --- vLLM's Prometheus metrics -----------------------------------------------------------------
#: Canonical key -> vLLM sample names, preferred (newest) first. Counters are listed with the
#: ``_total`` suffix their samples carry in the text exposition.
VLLM_GAUGES: dict[str, tuple[str, ...]] = {
    "num_running": ("vllm:num_requests_running",),
    "num_waiting": ("vllm:num_requests_waiting",),
    # A fraction 0..1 despite the name; the old name was used until vLLM ~0.10.
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
VLLM_COUNTERS: dict[str, tuple[str, ...]] = {
    "num_preemptions": ("vllm:num_preemptions_total",),
    # Tokens looked up in / found in the prefix cache (old names carried a "gpu_" prefix).
    "prefix_cache_queries": (
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries_total",
    ),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "num_requests_success": ("vllm:request_success_total",),
}
#: Histograms: the parser reports ``<key>_sum`` (seconds) and ``<key>_count``.
VLLM_HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft_seconds": ("vllm:time_to_first_token_seconds",),
    # Renamed when V1 separated ITL from request-level TPOT.
    "itl_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2el_seconds": ("vllm:e2e_request_latency_seconds",),
    "queue_seconds": ("vllm:request_queue_time_seconds",),
}
#: All of the above in one mapping, canonical key -> accepted names (newest first).
VLLM_METRIC_NAMES: dict[str, tuple[str, ...]] = VLLM_GAUGES | VLLM_COUNTERS | VLLM_HISTOGRAMS
#: The samples behind them as vLLM exposes them (histograms: ``_sum`` and ``_count``, no
#: buckets): a scrape asks only for these (``/metrics?name[]=...``, prometheus_client's
#: restricted registry), so vLLM renders ~30 lines instead of its whole registry (~600).
VLLM_SAMPLE_NAMES: tuple[str, ...] = (
    *(n for names in (VLLM_GAUGES | VLLM_COUNTERS).values() for n in names),
    *(f"{n}_{part}" for names in VLLM_HISTOGRAMS.values() for n in names for part in ("sum", "count")),
)


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Read vLLM's ``/metrics`` text into canonical keys (``VLLM_GAUGES``, ``VLLM_COUNTERS``,
    ``<histogram>_sum`` / ``_count``). Old and new names are both accepted, the new one winning
    when both appear. Several engines' samples are aggregated as ``batchpilot.prom`` does for
    every scrape: counters, histogram sums/counts and the request counts summed, the KV-cache
    usage (a fraction) averaged. A metric the server does not expose is absent from the result,
    not 0, and so is every metric of a page that has none of ours (e.g. an error page).
    Raises ``ValueError`` on a malformed line of one of our metrics."""
    values = metric_values(text, VLLM_SAMPLE_NAMES)
    out: dict[str, float] = {}
    for key, names in (VLLM_GAUGES | VLLM_COUNTERS).items():
        for name in names:
            if name in values:
                out[key] = values[name]
                break
    for key, names in VLLM_HISTOGRAMS.items():
        for name in names:
            if f"{name}_count" in values:
                out[f"{key}_sum"] = values.get(f"{name}_sum", 0.0)
                out[f"{key}_count"] = values[f"{name}_count"]
                break
    return out
