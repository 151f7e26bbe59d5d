"""The one reader of Prometheus text (``GET /metrics`` of vLLM, or of the gateway).

Every scrape in the project goes through here: the control loop (``parse_vllm_metrics`` in
``batchpilot/metrics.py``), the live evaluation's samplers and counters (``prom_values``) and the
gateway's reading of vLLM's cache configuration (``_cache_config``). They used to parse the text
three ways and disagreed on several engines (one averaged KV use over engines, one summed it).

Parsing is prometheus_client's. A scrape names the samples it wants; the lines of every other
metric are skipped unparsed, which keeps a scrape of vLLM's full page (~600 lines, histogram
buckets of every metric) cheap, and means a malformed line of a metric nobody asked for cannot
fail it. A malformed line of a wanted metric raises ``ValueError`` naming the line.

Aggregation over label sets (one per engine / data-parallel rank, per model name, ...), by kind:

- counters (``*_total``), histograms' ``_sum`` and ``_count``, and gauges that count things
  (``vllm:num_requests_running``, ``vllm:num_requests_waiting``): **summed**, the fleet's total;
- gauges that are a fraction of each engine's own capacity (``FRACTION_GAUGES``: KV-cache usage
  under its new and old names): **averaged**, the fleet's fraction when the engines' pools are
  equal (two engines half full are half full, not "1.0").

A metric not asked for, or asked for and not exposed, is absent from the result (not 0).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # prometheus_client itself is imported on the first parse: env workers never scrape
    from prometheus_client.samples import Sample

#: Gauges that are a fraction (0..1) of one engine's capacity: averaged over label sets, where
#: every other sample (counters, histogram sums and counts, count gauges) is summed.
FRACTION_GAUGES: frozenset[str] = frozenset({
    "vllm:kv_cache_usage_perc",  # vLLM >= ~0.10
    "vllm:gpu_cache_usage_perc",  # its older name
    "vllm:cpu_cache_usage_perc",  # V0's CPU swap space
})

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _wanted_lines(text: str, names: Collection[str]) -> list[str]:
    """The sample lines of ``names`` (comments and every other metric dropped)."""
    keep = []
    for line in text.splitlines():
        s = line.lstrip()
        if not s or s[0] == "#":
            continue
        m = _NAME.match(s)
        if m is not None and m.group() in names:
            keep.append(s)
    return keep


def read_samples(text: str, names: Collection[str]) -> dict[str, list[Sample]]:
    """The samples of each of ``names`` in a Prometheus text page, every label set, in page order
    (a name without samples is absent). Raises ``ValueError`` naming the first malformed line
    among the wanted ones."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = frozenset(names)
    lines = _wanted_lines(text, wanted)
    out: dict[str, list[Sample]] = {}
    if not lines:
        return out
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for s in family.samples:
                if s.name in wanted:
                    out.setdefault(s.name, []).append(s)
    except ValueError as e:
        raise ValueError(f"not Prometheus text exposition format: {_first_bad(lines) or e}") from e
    return out


def _first_bad(lines: Iterable[str]) -> str | None:
    """Which line the parser refused (only on the error path: one parse per line is slow)."""
    from prometheus_client.parser import text_string_to_metric_families

    for line in lines:
        try:
            list(text_string_to_metric_families(line + "\n"))
        except ValueError as e:
            return f"{line[:200]!r}: {e}"
    return None


def aggregate(name: str, values: Collection[float]) -> float:
    """One sample name's values over its label sets: the mean for ``FRACTION_GAUGES``, else the
    sum (see the module's docstring). ``values`` must not be empty."""
    if not values:
        raise ValueError(f"no samples of {name} to aggregate")
    total = float(sum(values))
    return total / len(values) if name in FRACTION_GAUGES else total


def metric_values(text: str, names: Collection[str]) -> dict[str, float]:
    """Each of ``names`` that the page exposes, aggregated over its label sets (``aggregate``).
    Names are sample names as written in the page: ``vllm:num_preemptions_total``,
    ``vllm:time_to_first_token_seconds_sum``. Raises ``ValueError`` as ``read_samples``."""
    return {n: aggregate(n, [s.value for s in samples]) for n, samples in read_samples(text, names).items()}


def info_labels(text: str, name: str) -> dict[str, str] | None:
    """The labels of an info-style metric (``vllm:cache_config_info``: a gauge of 1 whose labels
    carry the configuration); None when the page does not expose it. With several engines, the
    first one's (vLLM gives every engine of a server the same cache configuration)."""
    samples = read_samples(text, (name,)).get(name)
    return dict(samples[0].labels) if samples else None
