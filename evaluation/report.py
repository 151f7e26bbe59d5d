"""Evaluation results out: rows to JSON/CSV, the mean ± 95 % CI table, plots, and W&B.

Input is what ``batchpilot.evaluation.matrix`` produces: one row per (controller, workload,
deployment, seed) with the ``ROW_KEYS`` below, and per (controller, workload [@ deployment]) a
``Timeline`` of the first seed's episode (one point per control interval). Nothing here runs an engine.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.metrics import class_keys_in

#: Identity columns of a row. ``window_start_s``: the trace window the seed replayed (NaN/null
#: for a synthetic workload); ``rate_multiplier``: what the workload's rates were multiplied by
#: for this deployment (1 on the workload's own).
ID_KEYS: tuple[str, ...] = (
    "policy", "workload", "seed", "model", "hardware", "engine", "window_start_s", "rate_multiplier",
)
#: Metric columns of a row (``vllm bench serve`` names plus the controller's footprint). As users
#: read them (``batchpilot.metrics``, docs/evaluation.md "Metrics"): ``request_goodput`` over the
#: arrival window, ``slo_attainment`` over the offered requests (refused = missed),
#: ``refusal_rate`` beside them, attainment per prompt bucket and token-weighted, and the
#: capacity bound (``slo_capacity``, ``capacity_bound``, ``share_of_bound``: goodput as a share
#: of Σ min(arrivals, capacity at the SLO) per interval). ``request_goodput_run`` (drain in the
#: denominator, as ``vllm bench serve``) and ``slo_attainment_completed`` (completed requests
#: only) are the old views, kept to show how far the new ones move.
METRIC_KEYS: tuple[str, ...] = (
    "request_throughput",
    "output_throughput",
    "request_goodput",
    "slo_attainment",
    "refusal_rate",
    "share_of_bound",
    "capacity_bound",
    "slo_capacity",
    "slo_attainment_short",
    "slo_attainment_medium",
    "slo_attainment_long",
    "slo_attainment_tokens",
    "request_goodput_run",
    "slo_attainment_completed",
    "offered",
    "window_s",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "p99_e2el_ms",
    "peak_kv_usage",
    "preemptions",
    "shield_interventions",
    "dtype_switches",
    "rejected",
    "completed",
)
#: Every column of results.json / results.csv, in order. ``knobs`` is the fixed setting a
#: static controller ran (best_static's pick), ``wall_s`` the episode's wall time, ``error``
#: the engine failure that ended an episode early ("" when none).
ROW_KEYS: tuple[str, ...] = (*ID_KEYS, *METRIC_KEYS, "knobs", "wall_s", "error")
#: The compact table for the README: the headline metrics.
HEADLINE_KEYS: tuple[str, ...] = (
    "request_goodput",
    "slo_attainment",
    "refusal_rate",
    "share_of_bound",
    "slo_attainment_tokens",
    "request_throughput",
    "output_throughput",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "peak_kv_usage",
    "preemptions",
    "shield_interventions",
    "rejected",
)


@dataclass(slots=True)
class Timeline:
    """One episode over time, a point per control interval (what the plots draw)."""

    time: list[float] = field(default_factory=list)
    arrival_rate: list[float] = field(default_factory=list)
    queue_depth: list[float] = field(default_factory=list)
    batch_cap: list[float] = field(default_factory=list)
    kv_cache_usage: list[float] = field(default_factory=list)
    p99_ttft_ms: list[float] = field(default_factory=list)

    def add(self, info: Mapping[str, Any]) -> None:
        m = info["metrics"]
        self.time.append(float(m["time"]))
        self.arrival_rate.append(float(m["arrival_rate"]))
        self.queue_depth.append(float(m["queue_depth"]))
        self.batch_cap.append(float(info["knobs"]["batch_cap"]))
        self.kv_cache_usage.append(float(m["kv_cache_usage"]))
        self.p99_ttft_ms.append(float(m["p99_ttft_ms"]))


# --- statistics ------------------------------------------------------------------------------
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (``p`` in [0.5, 1)) of Student's t with ``df`` degrees of freedom
    (the CI's multiplier; scipy's)."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"need 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    from scipy.stats import t

    return float(t.ppf(p, df))


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float, int]:
    """(mean, half-width of the ``level`` t-interval, n) over the finite values.
    The half-width is NaN with fewer than two values."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    n = int(v.size)
    if n == 0:
        return math.nan, math.nan, 0
    mean = float(v.mean())
    if n < 2:
        return mean, math.nan, n
    half = t_quantile(0.5 + level / 2, n - 1) * float(v.std(ddof=1)) / math.sqrt(n)
    return mean, half, n


def deployment(r: Mapping[str, Any]) -> str:
    """A row's deployment, ``model/hardware``."""
    return f"{r.get('model', '?')}/{r.get('hardware', '?')}"


def aggregate(rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = METRIC_KEYS) -> list[dict[str, Any]]:
    """Per (workload, deployment, policy), in first-seen order: ``{key: (mean, ci_half, n)}``
    over seeds."""
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r["workload"]), deployment(r), str(r["policy"])), []).append(r)
    out = []
    for (wl, dep, pol), rs in groups.items():
        entry: dict[str, Any] = {"workload": wl, "deployment": dep, "policy": pol, "seeds": len(rs)}
        for k in keys:
            entry[k] = mean_ci([float(r.get(k, math.nan)) for r in rs])  # per-class keys: some rows only
        out.append(entry)
    return out


# --- table -----------------------------------------------------------------------------------
def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return "–"
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def markdown_table(rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = METRIC_KEYS) -> str:
    """Mean ± 95 % CI (t-distribution, over seeds) per workload, deployment and controller."""
    agg = aggregate(rows, keys)
    head = ["workload", "deployment", "policy", "n", *keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 4 + ["---:"] * len(keys)) + "|"]
    for e in agg:
        cells = [e["workload"], e["deployment"], e["policy"], str(e["seeds"])]
        for k in keys:
            mean, half, _ = e[k]
            cells.append(_fmt(mean) if not math.isfinite(half) else f"{_fmt(mean)} ± {_fmt(half)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def class_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``markdown_table`` of the per-class columns (``batchpilot.metrics.class_keys``) over the
    rows that have them (workloads with more than one priority class); "" when none has."""
    keys = class_keys_in({k for r in rows for k in r})
    with_classes = [r for r in rows if any(k in r for k in keys)]
    return markdown_table(with_classes, keys) if with_classes else ""


def _ratio(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.nan
    if b == 0:
        return math.inf if a > 0 else math.nan
    return a / b


#: Relative difference below which two means count as a tie in ``ppo_comparison``.
TIE_REL = 0.005


#: The controllers PPO's goodput is set against per cell, in column order; ``pid_sf`` (PID with
#: shortest-first order, the learnt policy's starting point) only where the run has it.
COMPARED = ("pid", "pid_sf", "best_static")


def ppo_comparison(rows: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """PPO against PID, best_static (and PID with shortest-first order, where it ran) per
    workload × deployment cell: a table (goodput means, PPO's goodput ratio to each, SLO
    attainments), the summary line naming the cells where PPO misses the bar "goodput >= PID's
    at >= PID's SLO attainment" (means over the scored seeds; within ``TIE_REL`` relative counts
    as equal; each with its per-episode ratios), and PPO's geometric-mean ratio to each over the
    cells. Empty strings when the rows have no ppo or no pid."""
    agg = aggregate(rows, ("request_goodput", "slo_attainment"))
    by: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for e in agg:
        by.setdefault((e["workload"], e["deployment"]), {})[e["policy"]] = e
    cells = [(k, v) for k, v in by.items() if "ppo" in v and "pid" in v]
    if not cells:
        return "", ""
    refs = [c for c in COMPARED if c != "pid_sf" or any(c in v for _, v in cells)]
    head = ["workload", "deployment", "ppo goodput", *(f"{c} goodput" for c in refs),
            *(f"ppo / {c}" for c in refs), "ppo attainment", "pid attainment", "ppo >= pid"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 3) + ["---"]) + "|"]
    losses, ratios = [], {c: [] for c in refs}
    per_episode: dict[tuple[str, str], list[float]] = {}
    for (wl, dep, _), a, b in episode_pairs(rows).get("pid", []):
        per_episode.setdefault((wl, dep), []).append(goodput_ratio(a, b))
    for (wl, dep), v in cells:
        g = {p: v[p]["request_goodput"][0] for p in v}
        a = {p: v[p]["slo_attainment"][0] for p in v}
        lost_g = g["ppo"] < g["pid"] * (1 - TIE_REL)
        lost_a = a["ppo"] < a["pid"] * (1 - TIE_REL)
        ok = not (lost_g or lost_a)
        if not ok:
            why = " and ".join(w for w, lost in (("goodput", lost_g), ("attainment", lost_a)) if lost)
            # Episode by episode, so a loss can be told from the spread one decision makes.
            eps = ", ".join(f"{x:.3f}" for x in per_episode.get((wl, dep), []))
            losses.append(f"{wl} @ {dep} ({why}: {_fmt(g['ppo'])} vs {_fmt(g['pid'])} req/s, "
                          f"{_fmt(a['ppo'])} vs {_fmt(a['pid'])}" + (f"; per episode {eps}×" if eps else "") + ")")
        cell_ratios = {c: _ratio(g["ppo"], g.get(c, math.nan)) for c in refs}
        for c, x in cell_ratios.items():
            ratios[c].append(x)
        lines.append("| " + " | ".join([
            wl, dep, _fmt(g["ppo"]), *(_fmt(g.get(c, math.nan)) for c in refs),
            *(_fmt(cell_ratios[c]) for c in refs), _fmt(a["ppo"]), _fmt(a["pid"]), "yes" if ok else "**no**",
        ]) + " |")
    summary = (
        f"PPO < PID (goodput at >= PID's SLO attainment, means over seeds, ties within "
        f"{TIE_REL:.1%}) on {len(losses)} of {len(cells)} cells"
        + (": " + "; ".join(losses) + "." if losses else ".")
    )
    means = [f"PPO / {c} {m:.3f}× ({n} cells)" for c in refs for m, n in [_geomean(ratios[c])] if n]
    if means:
        summary += " Geometric means over the cells with both: " + ", ".join(means) + "."
    return "\n".join(lines), summary


#: The reference every controller's goodput is divided by in ``reference_comparison``: vLLM
#: tuned with its own flags where the run has it, else vLLM as shipped (a weaker yardstick).
REFERENCES = ("vllm_tuned", "vllm_default")


def reference_comparison(rows: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """Every controller against the reference (``REFERENCES``: ``vllm_tuned``, else
    ``vllm_default``, named in the output) per workload × deployment cell: goodput, its ratio to
    the reference's, SLO attainment over offered requests, refusal rate and share of the
    capacity bound (means over the scored seeds); then each controller's geometric-mean ratio
    over the cells where both ran. Empty strings when neither reference ran."""
    names = {str(r["policy"]) for r in rows}
    ref = next((c for c in REFERENCES if c in names), None)
    if ref is None:
        return "", ""
    keys = ("request_goodput", "slo_attainment", "refusal_rate", "share_of_bound")
    by: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for e in aggregate(rows, keys):
        by.setdefault((e["workload"], e["deployment"]), {})[e["policy"]] = e
    head = ["workload", "deployment", "policy", "goodput", f"/ {ref}", "attainment", "refusal rate", "share of bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|"]
    ratios: dict[str, list[float]] = {}
    for (wl, dep), v in by.items():
        ref_g = v[ref]["request_goodput"][0] if ref in v else math.nan
        for pol, e in v.items():
            x = _ratio(e["request_goodput"][0], ref_g)
            if pol != ref:
                ratios.setdefault(pol, []).append(x)
            lines.append("| " + " | ".join([wl, dep, pol, *(_fmt(e[k][0]) for k in keys[:1]), _fmt(x),
                                             *(_fmt(e[k][0]) for k in keys[1:])]) + " |")
    order = sorted(ratios, key=lambda p: p != "ppo")  # PPO's first: the figure the issue asks for
    means = [f"{p} / {ref} {m:.3f}× ({n} cells)" for p in order for m, n in [_geomean(ratios[p])] if n]
    why = "" if ref == "vllm_tuned" else " (vllm_tuned did not run: vLLM as shipped is the reference)"
    summary = f"Reference: {ref}{why}."
    if means:
        summary += " Geometric means of the goodput ratio over the cells with both: " + ", ".join(means) + "."
    return "\n".join(lines), summary


#: Per episode, PPO below this fraction of a baseline's goodput counts as "much worse" in
#: ``episode_comparison`` (means over seeds can hide one bad episode in many good ones).
EPISODE_FLOOR = 0.95


#: The baselines PPO is compared with episode by episode.
EPISODE_BASELINES = ("pid", "pid_sf")
Pair = tuple[tuple[str, str, Any], Mapping[str, Any], Mapping[str, Any]]


def episode_pairs(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Pair]]:
    """Baseline -> ((workload, deployment, seed), PPO's row, the baseline's row) for every
    episode both ran; only the baselines that ran beside PPO."""
    by: dict[tuple[str, str, Any], dict[str, Mapping[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["workload"], deployment(r), r.get("seed")), {})[r["policy"]] = r
    out = {ref: [(k, v["ppo"], v[ref]) for k, v in by.items() if "ppo" in v and ref in v] for ref in EPISODE_BASELINES}
    return {ref: pairs for ref, pairs in out.items() if pairs}


def goodput_ratio(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """Row ``a``'s request goodput over row ``b``'s (NaN/inf where ``b`` served nothing)."""
    return _ratio(float(a["request_goodput"]), float(b["request_goodput"]))


def episode_comparison(rows: Sequence[Mapping[str, Any]], floor: float = EPISODE_FLOOR) -> list[str]:
    """PPO against PID (and PID with shortest-first order, where it ran) episode by episode:
    the same workload, deployment and seed (on a trace, the same window). One line per baseline:
    the geometric mean of the goodput ratios with its 95 % interval (one flipped decision moves a
    low-goodput episode by ±10 %, docs/evaluation.md), how many episodes fall below ``floor`` ×
    the baseline and the worst of them with both attainments, so "never much worse than PID
    anywhere" is read off the run, not off means. Episodes where either served nothing have no
    ratio and are counted apart. Empty when the rows have no ppo."""
    lines = []
    for ref, pairs in episode_pairs(rows).items():
        scored = [(goodput_ratio(a, b), k, a, b) for k, a, b in pairs]
        ok = [s for s in scored if math.isfinite(s[0]) and s[0] > 0]
        if not ok:
            lines.append(f"Per episode, PPO / {ref}: no episode where both served a request within the SLO "
                         f"({len(pairs)} compared).")
            continue
        mean, half, n = mean_ci([math.log(s[0]) for s in ok])
        below = sorted((s for s in ok if s[0] < floor), key=lambda s: s[0])
        line = f"Per episode, PPO / {ref}: geometric mean {math.exp(mean):.3f}×"
        if math.isfinite(half):  # the t-interval of the mean log ratio, back on the ratio scale
            line += f" (95 % CI {math.exp(mean - half):.3f}–{math.exp(mean + half):.3f}×)"
        line += f" over {n} episodes"
        if len(pairs) > n:
            line += f" ({len(pairs) - n} more where either served nothing within the SLO)"
        line += f"; below {floor:g}× in {len(below)}"
        if below:
            x, (wl, dep, seed), a, b = below[0]
            line += (f" (worst {x:.3f}×: {wl} @ {dep} seed {seed}, {_fmt(float(a['request_goodput']))} vs "
                     f"{_fmt(float(b['request_goodput']))} req/s at {_fmt(float(a['slo_attainment']))} vs "
                     f"{_fmt(float(b['slo_attainment']))} attainment)")
        lines.append(line + ".")
    return lines


def _geomean(xs: Sequence[float]) -> tuple[float, int]:
    """Geometric mean of the finite, positive ratios and how many there were (a cell where a
    baseline served nothing, or did not run, has no ratio)."""
    ok = [x for x in xs if math.isfinite(x) and x > 0]
    return (math.exp(sum(math.log(x) for x in ok) / len(ok)), len(ok)) if ok else (math.nan, 0)


def results_markdown(
    rows: Sequence[Mapping[str, Any]],
    search: Sequence[Mapping[str, Any]],
    seeds: Sequence[int],
    tune_seeds: Sequence[int],
) -> str:
    """results.md: the full table, the headline table, PPO's ratios and summary line, the
    best_static picks (tuned, and the hindsight bound)."""
    parts = [
        f"Mean ± 95 % CI (t-distribution) over seeds {list(seeds)} (on a trace, each seed its own "
        f"window). best_static is tuned on seeds {list(tune_seeds)}; best_static_hindsight is the "
        f"grid's best on the scored seeds themselves — an upper bound no setting chosen beforehand "
        f"reaches, not a baseline.\n",
        markdown_table(rows),
        "\nHeadline:\n",
        markdown_table(rows, HEADLINE_KEYS),
    ]
    per_class = class_table(rows)
    if per_class:
        parts += ["\nPer request class (priority p; each request judged by its class's objectives, `slo.classes`; "
                  "attainment over the class's offered requests, goodput over the arrival window in req/s):\n",
                  per_class]
    ref_table, ref_summary = reference_comparison(rows)
    if ref_table:
        parts += ["\nEvery controller against the reference (goodput over the arrival window in req/s, attainment "
                  "over offered requests, share of the capacity bound; means over the scored seeds):\n",
                  ref_table, f"\n**{ref_summary}**"]
    comp, summary = ppo_comparison(rows)
    if comp:
        parts += ["\nPPO against the baselines (goodput in req/s, means over the scored seeds):\n", comp,
                  f"\n**{summary}**"]
    episodes = episode_comparison(rows)
    if episodes:
        parts += ["", *(f"- {line}" for line in episodes)]
    picks = []
    for p in search:
        n = sum(q["workload"] == p["workload"] and q.get("deployment") == p.get("deployment") for q in search)
        where = f"{p['workload']} @ {p.get('deployment', '?')}"
        knobs = f"cap={p['batch_cap']} {p['bucketing']} kv={p['kv_dtype']}"
        if p["chosen"]:
            picks.append(
                f"- best_static on {where}: {knobs} (tuning seeds {list(tune_seeds)}: goodput "
                f"{_fmt(p['request_goodput'])} req/s, attainment {_fmt(p['slo_attainment'])}; {n} grid points)"
            )
        if p.get("hindsight_chosen"):
            picks.append(
                f"- best_static_hindsight on {where}: {knobs} (scored seeds: goodput "
                f"{_fmt(p['hindsight_goodput'])} req/s, attainment {_fmt(p['hindsight_attainment'])})"
            )
    if picks:
        parts += ["", *picks]
    return "\n".join(parts) + "\n"


# --- files -----------------------------------------------------------------------------------
def jsonable(v: Any) -> Any:
    """``v`` with NaN/inf as None, numpy scalars as Python ones, recursively."""
    if isinstance(v, Mapping):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    return _jsonable(v)



def write_rows(rows: Sequence[Mapping[str, Any]], out_dir: Path) -> tuple[Path, Path]:
    """results.json (a list of row objects) and results.csv (``ROW_KEYS`` columns, then the
    per-class ones where a workload has several priority classes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, cpath = out_dir / "results.json", out_dir / "results.csv"
    keys = (*ROW_KEYS, *class_keys_in({k for r in rows for k in r}))
    clean = [{k: _jsonable(r.get(k)) for k in keys if k in ROW_KEYS or k in r} for r in rows]
    jpath.write_text(json.dumps(clean, indent=1) + "\n")
    with cpath.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(keys), restval="")
        w.writeheader()
        for r in clean:
            w.writerow({k: "" if v is None else v for k, v in r.items()})
    return jpath, cpath


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null reads back as "not measured"
    if isinstance(v, (np.floating, np.integer)):
        return _jsonable(v.item())
    return v


def write_timelines(timelines: Mapping[tuple[str, str, int], Timeline], out_dir: Path) -> Path:
    path = out_dir / "timelines.json"
    data = [{"workload": wl, "policy": pol, "seed": seed, **asdict(tl)} for (wl, pol, seed), tl in timelines.items()]
    path.write_text(json.dumps(data) + "\n")
    return path


# --- plots -----------------------------------------------------------------------------------
def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _save(fig: Any, path: Path) -> Path:
    """Lay out, write and release a figure (pyplot keeps every open figure otherwise)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_timelines(
    timelines: Mapping[tuple[str, str], Timeline], out_dir: Path, slo_ttft_ms: float | None, seed: int
) -> list[Path]:
    """Per workload: load (arrival rate, admission queue), each controller's batch cap, KV
    usage and p99 TTFT over time, in the episodes of ``seed``. One PNG per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    by_wl: dict[str, dict[str, Timeline]] = {}
    for (wl, pol), tl in timelines.items():
        by_wl.setdefault(wl, {})[pol] = tl
    paths = []
    for wl, tls in by_wl.items():
        fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
        first = next(iter(tls.values()))
        ax = axes[0]
        ax.plot(first.time, first.arrival_rate, color="k", lw=1.2, label="arrivals/s")
        ax.set_ylabel("arrivals (req/s)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{wl}: load and each controller's knobs (seed {seed}; drain not shown)", fontsize=10)
        queue = ax.twinx()
        queue.set_ylabel("admission queue (dotted)")
        for i, (pol, tl) in enumerate(tls.items()):
            color = f"C{i % 10}"
            queue.plot(tl.time, tl.queue_depth, lw=0.8, ls=":", color=color)
            axes[1].plot(tl.time, tl.batch_cap, lw=1.0, color=color, label=pol)
            axes[2].plot(tl.time, tl.kv_cache_usage, lw=1.0, color=color, label=pol)
            axes[3].plot(tl.time, tl.p99_ttft_ms, lw=1.0, color=color, label=pol)
        queue.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper left")
        axes[1].set_ylabel("batch cap")
        axes[1].legend(fontsize=7, ncol=3, loc="upper right")
        axes[2].set_ylabel("KV usage")
        axes[2].set_ylim(0, 1.05)
        axes[3].set_ylabel("p99 TTFT (ms)")
        axes[3].set_yscale("symlog", linthresh=100)
        axes[3].set_ylim(bottom=0)
        if slo_ttft_ms is not None:
            axes[3].axhline(slo_ttft_ms, color="r", ls="--", lw=0.8)
            axes[3].annotate("SLO", (0.005, slo_ttft_ms), xycoords=("axes fraction", "data"), color="r", fontsize=7)
        axes[3].set_xlabel("engine time (s)")
        paths.append(_save(fig, out_dir / f"timeline_{_safe(wl)}.png"))
    return paths


def plot_goodput_vs_slo(rows: Sequence[Mapping[str, Any]], out_dir: Path) -> Path:
    """Request goodput against SLO attainment, one panel per workload, a point per controller
    (mean over seeds, 95 % CI bars; its refusal rate in the legend), the cell's capacity bound
    as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    agg = aggregate(rows, ("request_goodput", "slo_attainment", "refusal_rate", "capacity_bound"))
    panels = list(dict.fromkeys((e["workload"], e["deployment"]) for e in agg))
    multi = len({d for _, d in panels}) > 1
    policies = list(dict.fromkeys(e["policy"] for e in agg))
    colors = {p: f"C{i % 10}" for i, p in enumerate(policies)}
    ncol = min(len(panels), 5)
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.8 * nrow), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (wl, dep) in zip(axes.flat, panels):
        for e in (e for e in agg if (e["workload"], e["deployment"]) == (wl, dep)):
            (gx, gh, _), (sx, sh, _) = e["request_goodput"], e["slo_attainment"]
            ref = e["refusal_rate"][0]
            ax.errorbar(
                sx, gx, xerr=None if math.isnan(sh) else sh, yerr=None if math.isnan(gh) else gh,
                fmt="o", color=colors[e["policy"]], capsize=3,
                label=e["policy"] + (f" (refused {ref:.0%})" if math.isfinite(ref) else ""),
            )
        bound = [e["capacity_bound"][0] for e in agg if (e["workload"], e["deployment"]) == (wl, dep)]
        if bound and math.isfinite(bound[0]):  # the same for every controller of the cell
            ax.axhline(bound[0], color="k", ls=":", lw=0.8)
            ax.annotate("capacity bound", (0.01, bound[0]), xycoords=("axes fraction", "data"), fontsize=7)
        ax.set_title(f"{wl} @ {dep}" if multi else wl, fontsize=9)
        ax.set_xlabel("SLO attainment (of offered requests)")
        ax.set_ylabel("goodput (req/s over the arrival window)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out_dir / "goodput_vs_slo.png")


def plot_episode_ratios(rows: Sequence[Mapping[str, Any]], out_dir: Path, floor: float = EPISODE_FLOOR) -> Path | None:
    """``ppo_per_episode.png``: every episode's PPO / baseline goodput against the baseline's
    goodput, one panel per baseline (PID, PID with shortest-first order), a colour per
    deployment, lines at 1× and ``floor``×: where PPO is much worse, and at what load, at a
    glance. None when PPO did not run beside a baseline."""
    pairs = episode_pairs(rows)
    if not pairs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    out_dir.mkdir(parents=True, exist_ok=True)
    deps = list(dict.fromkeys(k[1] for ps in pairs.values() for k, _, _ in ps))
    colors = {d: f"C{i % 10}" for i, d in enumerate(deps)}
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.2 * len(pairs), 4.2), squeeze=False)
    for ax, (ref, ps) in zip(axes.flat, pairs.items()):
        for dep in deps:
            pts = [(float(b["request_goodput"]), goodput_ratio(a, b)) for k, a, b in ps if k[1] == dep]
            pts = [(x, y) for x, y in pts if x > 0 and math.isfinite(y) and y > 0]  # both served something
            if pts:
                ax.scatter(*zip(*pts), s=14, color=colors[dep], label=dep, alpha=0.8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(floor, color="r", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(FixedLocator([0.25, 0.5, 0.75, floor, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}×"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"{ref} goodput (req/s)")
        ax.set_ylabel(f"PPO / {ref} (same episode)")
        ax.set_title(f"PPO / {ref} per episode (dashed: {floor:g}×)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return _save(fig, out_dir / "ppo_per_episode.png")


# --- Weights & Biases ------------------------------------------------------------------------
def log_to_wandb(
    logger_cfg: Mapping[str, Any],
    run_config: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    table_md: str,
    plots: Sequence[Path],
    out_dir: Path,
) -> Path | None:
    """Rows, the aggregated table and the plots to a W&B run (``conf/logger``: offline by
    default; the ``WANDB_MODE`` environment variable wins). Returns the run folder, or None
    when the logger has W&B off."""
    if not logger_cfg.get("wandb", False):
        return None
    import wandb

    mode = os.environ.get("WANDB_MODE", str(logger_cfg.get("mode", "offline")))
    if mode not in ("offline", "online", "disabled"):
        raise ValueError(f"logger.mode (or WANDB_MODE) must be offline, online or disabled, got {mode!r}")
    run = wandb.init(
        project=str(logger_cfg.get("project", "batchpilot")),
        entity=logger_cfg.get("entity"),
        group=logger_cfg.get("group") or "evaluate",
        tags=list(logger_cfg.get("tags") or []),
        mode=mode,  # type: ignore[arg-type]
        dir=str(out_dir),
        job_type="evaluate",
        config=dict(run_config),
        reinit="finish_previous",
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
    )
    try:
        run.log({"results": wandb.Table(columns=list(ROW_KEYS), data=[[_jsonable(r.get(k)) for k in ROW_KEYS] for r in rows])})
        agg = aggregate(rows)
        cols = ["workload", "deployment", "policy", "seeds"] + [f"{k}_{s}" for k in METRIC_KEYS for s in ("mean", "ci95")]
        data = [
            [e["workload"], e["deployment"], e["policy"], e["seeds"]] + [_jsonable(x) for k in METRIC_KEYS for x in e[k][:2]]
            for e in agg
        ]
        run.log({"summary": wandb.Table(columns=cols, data=data)})
        run.log({"summary_markdown": wandb.Html(f"<pre>{table_md}</pre>")})
        run.log({f"plots/{p.stem}": wandb.Image(str(p)) for p in plots})
        return Path(run.dir).parent
    finally:
        run.finish()
