"""The one place metric names live and aggregate metrics are computed.

Names and definitions follow ``vllm bench serve`` so our numbers can be put next to its:
throughputs over the run's duration; TTFT and E2E latency per request; TPOT per request with
more than one output token; ITL per output token (from per-token timings when the engine
recorded them, else each request's TPOT stands for each of its ``output_len - 1`` gaps);
``request_goodput`` = completed requests/s meeting every SLO, as ``--goodput``.

Also the Prometheus names vLLM exposes on ``/metrics`` (new and old spellings) and a parser
that maps them onto canonical keys, so a scraper never hard-codes a vLLM version's names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from batchpilot.core.engine import FinishedRequest
from batchpilot.core.telemetry import SLO

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
)


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


def summarize(
    finished: Sequence[FinishedRequest],
    duration_s: float,
    slo: SLO,
    *,
    num_rejected: int = 0,
    extra: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Aggregate a run's finished requests into ``SUMMARY_KEYS`` (latencies in ms).

    - Throughputs and goodput divide by ``duration_s`` (the run's length on the engine clock).
    - ``slo_attainment`` = requests meeting every SLO / (completed + rejected): a rejected
      request is a miss, so shedding load cannot raise attainment. NaN when there were none.
    - Latency statistics are NaN when nothing qualified (no requests; no output > 1 token for
      TPOT and ITL), never a made-up 0.
    - ``extra`` entries are appended; they may not overwrite a canonical key.
    """
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    if num_rejected < 0:
        raise ValueError(f"num_rejected must be >= 0, got {num_rejected!r}")
    n = len(finished)
    prompt = np.fromiter((r.prompt_len for r in finished), np.int64, n)
    output = np.fromiter((r.output_len for r in finished), np.int64, n)
    ttft = np.fromiter((r.ttft for r in finished), np.float64, n)
    tpot = np.fromiter((r.tpot for r in finished), np.float64, n)
    e2el = np.fromiter((r.e2el for r in finished), np.float64, n)
    good = sum(1 for row in zip(ttft.tolist(), tpot.tolist(), e2el.tolist()) if slo.met(*row))

    out: dict[str, float] = {
        "duration_s": float(duration_s),
        "completed": float(n),
        "rejected": float(num_rejected),
        "total_input_tokens": float(prompt.sum()),
        "total_output_tokens": float(output.sum()),
        "request_throughput": n / duration_s,
        "output_throughput": float(output.sum()) / duration_s,
        "total_token_throughput": float(prompt.sum() + output.sum()) / duration_s,
        "request_goodput": good / duration_s,
        "slo_attainment": good / (n + num_rejected) if n + num_rejected else math.nan,
    }

    multi = output > 1
    itl_vals: list[np.ndarray] = []
    itl_counts: list[np.ndarray] = []
    for r in finished:
        if r.itl is not None:
            itl_vals.append(np.asarray(r.itl, dtype=np.float64))
            itl_counts.append(np.ones(len(r.itl), np.int64))
    no_itl = np.fromiter((r.itl is None for r in finished), bool, n) & multi
    itl_vals.append(tpot[no_itl])
    itl_counts.append(output[no_itl] - 1)

    samples = {
        "ttft": (ttft, np.ones(n, np.int64)),
        "tpot": (tpot[multi], np.ones(int(multi.sum()), np.int64)),
        "itl": (np.concatenate(itl_vals), np.concatenate(itl_counts)),
        "e2el": (e2el, np.ones(n, np.int64)),
    }
    for name in LATENCY_METRICS:
        vals, counts = samples[name]
        mean, median, p99 = _weighted_stats(vals * 1e3, counts)
        out[f"mean_{name}_ms"], out[f"median_{name}_ms"], out[f"p99_{name}_ms"] = mean, median, p99

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
#: Keys averaged over label sets (one per engine / data-parallel rank); the rest are summed.
_MEAN_KEYS = frozenset({"kv_cache_usage"})


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Read vLLM's ``/metrics`` text into canonical keys (``VLLM_GAUGES``, ``VLLM_COUNTERS``,
    ``<histogram>_sum`` / ``_count``). Old and new names are both accepted, the new one winning
    when both appear; samples of several engines are summed (``kv_cache_usage`` averaged).
    A metric the server does not expose is absent from the result, not 0.
    Raises ``ValueError`` on text that is not Prometheus exposition format."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if "le" in s.labels or "quantile" in s.labels:
                    continue  # histogram buckets and summary quantiles: not used
                samples.setdefault(s.name, []).append(float(s.value))
    except ValueError as e:
        raise ValueError(f"not Prometheus text exposition format: {e}") from e

    out: dict[str, float] = {}
    for key, names in (VLLM_GAUGES | VLLM_COUNTERS).items():
        for name in names:
            if name in samples:
                vals = samples[name]
                out[key] = float(np.mean(vals)) if key in _MEAN_KEYS else float(np.sum(vals))
                break
    for key, names in VLLM_HISTOGRAMS.items():
        for name in names:
            if f"{name}_count" in samples:
                out[f"{key}_sum"] = float(np.sum(samples.get(f"{name}_sum", [0.0])))
                out[f"{key}_count"] = float(np.sum(samples[f"{name}_count"]))
                break
    return out
#: All of the above in one mapping, canonical key -> accepted names (newest first).
VLLM_METRIC_NAMES: dict[str, tuple[str, ...]] = VLLM_GAUGES | VLLM_COUNTERS | VLLM_HISTOGRAMS
#: The samples behind them as vLLM exposes them (histograms: ``_sum`` and ``_count``, no
#: buckets): a scrape asks only for these (``/metrics?name[]=...``, prometheus_client's
#: restricted registry), so vLLM renders ~30 lines instead of its whole registry (~600).
VLLM_SAMPLE_NAMES: tuple[str, ...] = (
    *(n for names in (VLLM_GAUGES | VLLM_COUNTERS).values() for n in names),
    *(f"{n}_{part}" for names in VLLM_HISTOGRAMS.values() for n in names for part in ("sum", "count")),
)
