"""What a live run reads from vLLM's and the gateway's ``/metrics``: the engine sampled while a
run goes (``VllmSampler``: peak KV usage, running count), whether it is idle, and the counters
read before and after a run (preemptions, iterations, queue waits).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Mapping, Sequence

import httpx

from batchpilot.prom import metric_values

log = logging.getLogger(__name__)


def prom_values(text: str, names: Sequence[str]) -> dict[str, float]:
    """Each named sample of a Prometheus text page aggregated over its label sets as every
    scrape is (``batchpilot.prom``: summed, a fraction such as KV-cache usage averaged over
    engines); 0.0 for a name the page does not expose (a counter this vLLM lacks, an error page)."""
    return {n: 0.0 for n in names} | metric_values(text, names)


VLLM_METRICS = ("vllm:num_preemptions_total", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                "vllm:num_requests_waiting")


class VllmSampler:
    """Samples vLLM's /metrics in a thread while a run goes: peak KV usage, peak and mean
    running count (the engine's concurrency, which sets its speed on a shared CPU).

    A page that cannot be read as Prometheus text (``ValueError`` from the parser) is counted
    (``bad_pages``, ``last_error``) and logged once, and sampling goes on: the thread used to end
    on it silently, leaving a run's peaks at what they were when it died. A page that is not
    reached (``httpx.HTTPError``: vLLM restarting) is skipped, as before."""

    def __init__(self, vllm_url: str, interval_s: float = 0.5) -> None:
        self.url, self.interval_s = vllm_url, interval_s
        self.peak_kv = 0.0
        self.peak_running = 0.0
        #: Pages read, and those that were not Prometheus text (the last one's error).
        self.pages = 0
        self.bad_pages = 0
        self.last_error = ""
        self._running: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(timeout=5) as c:
            while not self._stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    self._sample(c.get(f"{self.url}/metrics").text)
                self._stop.wait(self.interval_s)

    def _sample(self, text: str) -> None:
        """One page into the peaks; a malformed one counted and said, not raised."""
        self.pages += 1
        try:
            m = prom_values(text, VLLM_METRICS)
        except ValueError as e:
            self.bad_pages += 1
            if not self.last_error:
                log.warning("vLLM /metrics at %s: %s (sampling goes on; later ones are counted)", self.url, e)
            self.last_error = " ".join(str(e).split())[:300]
            return
        self.peak_kv = max(self.peak_kv, m["vllm:kv_cache_usage_perc"])
        self.peak_running = max(self.peak_running, m["vllm:num_requests_running"])
        self._running.append(m["vllm:num_requests_running"])

    def problem(self) -> str:
        """What went wrong reading the pages, on one line ('' when nothing did)."""
        if not self.bad_pages:
            return ""
        return (f"{self.bad_pages} of {self.pages} /metrics pages of {self.url} were not Prometheus text "
                f"(peaks from the others); last: {self.last_error}")

    @property
    def mean_running(self) -> float:
        return sum(self._running) / len(self._running) if self._running else math.nan

    def __enter__(self) -> VllmSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def engine_idle(vllm_url: str) -> bool:
    m = prom_values(httpx.get(f"{vllm_url}/metrics", timeout=5).text, VLLM_METRICS)
    return m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


#: vLLM's counters a run reads before and after: preemptions, its iterations and the tokens they
#: carried, and the time requests waited in its own queue (what the twin's engine is compared on).
ENGINE_COUNTERS = ("vllm:num_preemptions_total", "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum",
                   "vllm:request_queue_time_seconds_count", "vllm:request_queue_time_seconds_sum",
                   "vllm:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_sum",
                   "vllm:admission_rejections_total")


#: The gateway's: the wait in its admission queue (a gateway run's TTFT = this + the engine's + the trips).
GATEWAY_COUNTERS = ("batchpilot:admission_wait_seconds_count", "batchpilot:admission_wait_seconds_sum")


def engine_counters(vllm_url: str) -> dict[str, float]:
    return prom_values(httpx.get(f"{vllm_url}/metrics", timeout=5).text, ENGINE_COUNTERS)


def gateway_counters(gateway_url: str) -> dict[str, float]:
    return prom_values(httpx.get(f"{gateway_url}/metrics", timeout=5).text, GATEWAY_COUNTERS)


def _mean_of(d: Mapping[str, float], name: str, scale: float = 1.0) -> float:
    """A histogram's mean over a run from its ``_sum`` and ``_count`` deltas (NaN: none observed)."""
    n = d[f"{name}_count"]
    return scale * d[f"{name}_sum"] / n if n > 0 else math.nan


def engine_row_fields(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """A run's engine-side figures from vLLM's counters before and after it (``ENGINE_COUNTERS``),
    and the gateway's when given (``GATEWAY_COUNTERS``): preemptions, the iterations it ran,
    their mean tokens (prefill and decode), the mean wait in vLLM's own queue, vLLM's own mean
    TTFT (from its API server's arrival), the mean wait in the gateway's admission queue, the
    requests vLLM's queue limits refused (``engine_refusals``)."""
    # A counter lower after than before was reset (vLLM restarted, e.g. for a KV switch): count
    # from the reset, as Prometheus's increase() does.
    d = {k: after[k] - before[k] if after[k] >= before[k] else after[k] for k in before}
    iters = d["vllm:iteration_tokens_total_count"]
    out = {"preemptions": d["vllm:num_preemptions_total"], "engine_iterations": iters,
           "mean_iteration_tokens": _mean_of(d, "vllm:iteration_tokens_total"),
           "mean_engine_queue_ms": _mean_of(d, "vllm:request_queue_time_seconds", 1e3),
           "mean_engine_ttft_ms": _mean_of(d, "vllm:time_to_first_token_seconds", 1e3),
           "mean_admission_wait_ms": math.nan,
           # requests vLLM's API server refused (503) at --max-num-queued-reqs / -tokens
           "engine_refusals": d.get("vllm:admission_rejections_total", 0.0)}
    if "batchpilot:admission_wait_seconds_count" in d:
        out["mean_admission_wait_ms"] = _mean_of(d, "batchpilot:admission_wait_seconds", 1e3)
    return out


__all__ = ["ENGINE_COUNTERS", "GATEWAY_COUNTERS", "VLLM_METRICS", "VllmSampler", "engine_counters", "engine_idle",
           "engine_row_fields", "gateway_counters", "prom_values"]
