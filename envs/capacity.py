"""How many requests/s a simulated deployment finishes, saturated or within the SLO.

``saturated_rate`` sizes a load per deployment: the evaluation runs a workload at the same
share of every deployment's capacity, and training's deployment randomisation
(``env.deployments``) does the same per episode. Saturated, not at the SLO: ``2 * max_num_seqs``
requests are kept waiting or running, FIFO, the engine's own KV dtype, no shield.

``slo_rate`` and ``capacity_bound`` give the evaluation's capacity bound per cell: the most
SLO-met requests/s the engine finishes of the workload's own requests at a fixed concurrency
(per prompt-length octave), and Σ over the window of min(arrivals, that rate) per interval, the
engine's time going to the octave it serves fastest first (docs/evaluation.md, "Metrics").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from batchpilot.core.engine import Engine, Request
from batchpilot.core.telemetry import SLO


class CapacityProbeError(RuntimeError):
    """The probe could not measure a rate (no requests, or an engine that makes no progress)."""


def saturated_rate(
    engine: Engine, requests: Sequence[Request], max_num_seqs: int, completions: int = 300,
    *, limit_s: float = 1e6,
) -> float:
    """Requests/s ``engine`` finishes with ``2 * max_num_seqs`` of ``requests`` (cycled) kept
    waiting or running, measured over ``completions`` finishes after as many again to fill it.
    The engine is used up (the caller closes it)."""
    if not requests:
        raise CapacityProbeError("no requests to probe the capacity with")
    engine.set_max_active(max_num_seqs)
    depth = 2 * max_num_seqs
    n_sent = n_done = 0
    t0 = math.nan

    def top_up(outstanding: int) -> int:
        nonlocal n_sent
        for _ in range(depth - outstanding):
            r = requests[n_sent % len(requests)]
            engine.add_request(Request(
                f"probe{n_sent}", engine.now, r.prompt_len, r.output_len,
                prefix_hashes=r.prefix_hashes, prefix_block_tokens=r.prefix_block_tokens,
            ))
            n_sent += 1
        return depth

    outstanding = top_up(0)
    while n_done < 2 * completions:
        res = engine.advance_until(engine.now + 1.0, stop_on_finish=True)
        done = len(res.finished)
        if done:
            if n_done < completions <= n_done + done:
                t0 = res.finished[completions - n_done - 1].finish_time
            n_done += done
            outstanding = top_up(outstanding - done)
        if engine.now > limit_s:  # engine seconds: a deployment this slow is broken, not saturated
            raise CapacityProbeError(f"the capacity probe made no progress in {limit_s:g} engine seconds")
    return completions / max(engine.now - t0, 1e-9)


#: Concurrencies ``slo_rate`` tries: doubling from 1 up to the engine's ``max_num_seqs``.
def _ladder(max_num_seqs: int) -> list[int]:
    out, c = [], 1
    while c < max_num_seqs:
        out.append(c)
        c *= 2
    return [*out, max_num_seqs]


def closed_loop_goodput(
    engine: Engine, requests: Sequence[Request], concurrency: int, slo: SLO, completions: int,
    *, limit_s: float = 1e6,
) -> float:
    """SLO-met requests/s ``engine`` finishes with exactly ``concurrency`` of ``requests``
    (cycled, in order) in it at all times: each added when a slot frees, its arrival the moment
    it is added (no queue in front). Measured over ``completions`` finishes after as many again
    (at most ``concurrency``) to fill it. The engine is used up (the caller closes it)."""
    if not requests:
        raise CapacityProbeError("no requests to probe the capacity with")
    engine.set_max_active(concurrency)
    n_sent = n_done = n_good = 0
    warm = min(concurrency, completions)
    t0 = math.nan

    def add(k: int) -> None:
        nonlocal n_sent
        for _ in range(k):
            r = requests[n_sent % len(requests)]
            # ``replace`` keeps whatever else a request carries (priority, prefix blocks, ...).
            engine.add_request(dataclasses.replace(r, request_id=f"slo{n_sent}", arrival_time=engine.now))
            n_sent += 1

    add(concurrency)
    while n_done < warm + completions:
        res = engine.advance_until(engine.now + 1.0, stop_on_finish=True)
        for fr in res.finished:
            n_done += 1
            if n_done == warm:
                t0 = fr.finish_time
            elif n_done > warm and n_done <= warm + completions:
                n_good += slo.for_priority(fr.priority).met(fr.ttft, fr.tpot, fr.e2el)  # by its class's SLO
        add(len(res.finished))
        if engine.now > limit_s:
            raise CapacityProbeError(f"the SLO capacity probe made no progress in {limit_s:g} engine seconds")
    if math.isnan(t0):  # warm == 0 cannot happen (concurrency >= 1); kept for clarity
        raise CapacityProbeError("the SLO capacity probe finished nothing")
    return n_good / max(engine.now - t0, 1e-9)


def slo_rate(
    new_engine: Callable[[], Engine], requests: Sequence[Request], max_num_seqs: int, slo: SLO,
    completions: int = 400,
) -> tuple[float, int]:
    """Capacity at the SLO: the most SLO-met requests/s a fresh engine from ``new_engine``
    finishes of ``requests`` at any fixed concurrency (``closed_loop_goodput`` at 1, 2, 4, ...
    up to ``max_num_seqs``, then √2 either side of the best), and that concurrency. Stops
    climbing once a step serves less than half the best so far (past the knee, more in flight
    only breaks the SLO more). Deterministic on the simulator: every controller of a cell gets
    the same figure."""
    top = max(1, int(max_num_seqs))

    def at(c: int) -> float:
        engine = new_engine()
        try:
            return closed_loop_goodput(engine, requests, c, slo, completions)
        finally:
            engine.close()

    rates: dict[int, float] = {}
    for c in _ladder(top):
        rates[c] = at(c)
        if rates[c] < 0.5 * max(rates.values()):
            break
    best_c = max(rates, key=lambda c: (rates[c], -c))
    # One refinement either side of the best doubling step (√2 apart), where not yet tried.
    for c in {min(top, round(best_c * math.sqrt(2))), max(1, round(best_c / math.sqrt(2)))} - rates.keys():
        rates[c] = at(c)
    best_c = max(rates, key=lambda c: (rates[c], -c))
    return rates[best_c], best_c


def capacity_bound(
    arrival_s: np.ndarray, window_s: float, interval_s: float, capacity: float | Sequence[float],
    classes: np.ndarray | None = None,
) -> float:
    """Σ over the window's intervals of min(arrivals in the interval, ``capacity`` × interval):
    the SLO-met requests a controller could at most serve at steady capacity without carrying
    a burst's excess over into the next interval. ``arrival_s`` in seconds from the window's
    start; arrivals at or past ``window_s`` are not counted; the last interval may be shorter.

    With ``classes`` (a class index per arrival, e.g. its prompt bucket) ``capacity`` holds one
    rate per class, each the engine's whole capacity spent on that class: per interval the
    engine's time goes to the classes with the highest rate first (a request of class c costs
    1 / capacity[c] seconds), as far as each class's arrivals go. One class is the plain sum."""
    if not (math.isfinite(window_s) and window_s > 0 and interval_s > 0):
        raise ValueError(f"need window_s > 0 and interval_s > 0, got {window_s!r}, {interval_s!r}")
    caps = np.atleast_1d(np.asarray(capacity, np.float64))
    if caps.ndim != 1 or not np.all(np.isfinite(caps)) or np.any(caps < 0):
        raise ValueError(f"capacity must be finite rates >= 0, got {capacity!r}")
    t = np.asarray(arrival_s, np.float64)
    cls = np.zeros(t.size, np.int64) if classes is None else np.asarray(classes, np.int64)
    if cls.shape != t.shape or (cls.size and (cls.min() < 0 or cls.max() >= caps.size)):
        raise ValueError(f"classes must give each of the {t.size} arrivals an index below {caps.size}")
    n = max(1, math.ceil(window_s / interval_s - 1e-9))
    edges = np.minimum(np.arange(n + 1, dtype=np.float64) * interval_s, window_s)
    inside = t < window_s  # np.histogram's last bin is closed: an arrival at window_s is outside
    counts = np.stack([np.histogram(t[inside & (cls == c)], bins=edges)[0] for c in range(caps.size)])
    budget = np.diff(edges)  # engine seconds left per interval
    served = 0.0
    for c in np.argsort(-caps, kind="stable"):
        if caps[c] <= 0:
            continue
        x = np.minimum(counts[c], budget * caps[c])
        served += float(x.sum())
        budget = np.maximum(budget - x / caps[c], 0.0)
    return served
