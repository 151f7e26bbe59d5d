"""A live evaluation's results: the paths its rows carry, the columns of results.json and
results.csv, results.md's tables (mean ± 95 % CI per path, paired per-round differences to
``vllm_direct``, to ``vllm_tuned`` and to ``ppo``) and the goodput plot.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from batchpilot.evaluation.live_tuned import TUNED
from batchpilot.evaluation.report import _fmt, mean_ci

#: The paths a run can take (more: ``policies``, each an exported policy).
PATHS: tuple[str, ...] = ("vllm_direct", TUNED, "static", "pid", "ppo")
#: The path every other is paired to: vLLM as shipped.
BASELINE = "vllm_direct"
#: Columns of results.json / results.csv, in order.
LIVE_ROW_KEYS: tuple[str, ...] = (
    "scenario", "path", "round", "position", "requests", "completed", "failed", "refused", "engine_refusals",
    "accounted",
    "request_goodput", "slo_attainment", "request_throughput", "output_throughput",
    "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "p99_e2el_ms", "duration_s",
    "preemptions", "peak_kv_usage", "peak_running", "mean_running", "mean_batch_cap", "acting", "kv_dtype",
    "engine_restarts", "engine_iterations", "mean_iteration_tokens", "mean_engine_queue_ms", "mean_engine_ttft_ms",
    "mean_admission_wait_ms", "first_error", "wall_s",
)


#: Metrics of the table (mean ± 95 % CI per path).
TABLE_KEYS: tuple[str, ...] = (
    "request_goodput", "slo_attainment", "request_throughput", "p99_ttft_ms", "p99_tpot_ms",
    "preemptions", "peak_kv_usage", "failed", "refused",
)


def finite_or_none(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def paired_differences(rows: Sequence[Mapping[str, Any]], key: str = "request_goodput",
                       baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Per scenario and path: the mean and 95 % CI of ``path - baseline`` over the rounds both
    ran (paired by round), and the same relative to the baseline's mean. Nothing for a scenario
    whose baseline did not run (no round to pair: results.md would show an empty table)."""
    out = []
    for sc in dict.fromkeys(r["scenario"] for r in rows):
        rs = [r for r in rows if r["scenario"] == sc]
        base = {r["round"]: float(r[key]) for r in rs if r["path"] == baseline}
        if not base:
            continue
        for path in dict.fromkeys(r["path"] for r in rs):
            if path == baseline:
                continue
            diffs = [float(r[key]) - base[r["round"]] for r in rs if r["path"] == path and r["round"] in base]
            mean, half, n = mean_ci(diffs)
            bmean = mean_ci(list(base.values()))[0]
            out.append({"scenario": sc, "path": path, "metric": key, "mean_diff": mean, "ci_half": half, "n": n,
                        "rel_diff": mean / bmean if bmean else math.nan,
                        "significant": bool(math.isfinite(half) and abs(mean) > half)})
    return out


def summary_table(rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = TABLE_KEYS) -> str:
    head = ["scenario", "path", "n", *keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * len(keys)) + "|"]
    for sc in dict.fromkeys(r["scenario"] for r in rows):
        for path in dict.fromkeys(r["path"] for r in rows if r["scenario"] == sc):
            rs = [r for r in rows if r["scenario"] == sc and r["path"] == path]
            cells = [str(sc), str(path), str(len(rs))]
            for k in keys:
                mean, half, _ = mean_ci([float(r[k]) for r in rs])
                cells.append(_fmt(mean) if not math.isfinite(half) else f"{_fmt(mean)} ± {_fmt(half)}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def diff_table(diffs: Sequence[Mapping[str, Any]], baseline: str = BASELINE) -> str:
    lines = [f"| scenario | path | n | {diffs[0]['metric'] if diffs else 'goodput'} − {baseline} (paired) "
             "| relative | 95 % CI excludes 0 |", "|---|---|---:|---:|---:|:-:|"]
    for d in diffs:
        m, h = d["mean_diff"], d["ci_half"]
        cell = _fmt(m) if not math.isfinite(h) else f"{_fmt(m)} ± {_fmt(h)}"
        rel = f"{100 * d['rel_diff']:+.1f} %" if math.isfinite(d["rel_diff"]) else "–"
        lines.append(f"| {d['scenario']} | {d['path']} | {d['n']} | {cell} | {rel} | "
                     f"{'yes' if d['significant'] else 'no'} |")
    return "\n".join(lines)


def plot_goodput(rows: Sequence[Mapping[str, Any]], out_dir: Path) -> Path:
    """Goodput per path: each round's value (dots) and the mean with its 95 % CI (bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.8 * len(scenarios), 3.8), squeeze=False)
    for ax, sc in zip(axes[0], scenarios):
        paths = list(dict.fromkeys(r["path"] for r in rows if r["scenario"] == sc))
        for i, path in enumerate(paths):
            vals = [float(r["request_goodput"]) for r in rows if r["scenario"] == sc and r["path"] == path]
            mean, half, _ = mean_ci(vals)
            ax.bar(i, mean, yerr=None if not math.isfinite(half) else half, capsize=4, color=f"C{i}", alpha=0.6)
            ax.plot([i] * len(vals), vals, "k.", ms=4)
        ax.set_xticks(range(len(paths)), paths)
        ax.set_title(f"{sc}\ngoodput (mean ± 95 % CI, dots = rounds)", fontsize=8)
        ax.set_ylabel("request goodput (req/s)")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    p = out_dir / "goodput.png"
    fig.savefig(p, dpi=80)
    plt.close(fig)
    return p


def _incomplete_note(meta: Mapping[str, Any]) -> list[str]:
    """results.md's first lines when not every planned run is in (none when meta says nothing)."""
    if meta.get("complete", True):
        return []
    done, total = meta.get("runs_done"), meta.get("runs_planned")
    if meta.get("interrupted"):
        return [f"Interrupted after {done} of {total} runs: partial results.", ""]
    return [f"Incomplete: {done} of {total} runs so far (the run is going on, or ended before finishing).", ""]


def tuned_markdown(tuned: Mapping[str, Any]) -> list[str]:
    """results.md's vllm_tuned section: the flags it ran with and every sweep point."""
    chosen = tuned.get("chosen") or {}
    how = ("given (vllm_tuned.flags), no sweep" if tuned.get("given") else
           f"the best goodput of {len(tuned.get('points') or [])} settings on the tuning window "
           f"{tuned.get('tuning_window')} ({tuned.get('tuning_requests')} requests), SLO attainment floor "
           f"{tuned.get('attainment_floor')}" + ("" if chosen.get("met_floor", True) else ": none reached it"))
    out = [f"## {TUNED}", "", f"- flags: `{chosen.get('flags', '?')}`: {how}"]
    if tuned.get("prefill_tok_s"):
        out.append(f"- prefill throughput measured: {float(tuned['prefill_tok_s']):.0f} tokens/s "
                   "(max_num_queued_tokens=slo: the TTFT objective x this)")
    if tuned.get("points"):
        out += ["", "| flags | goodput | SLO attainment | refused | failed | p99 TTFT ms | chosen |",
                "|---|---:|---:|---:|---:|---:|:-:|"]
        for p in tuned["points"]:
            out.append(f"| `{p['flags']}` | {_fmt(_num(p.get('request_goodput')))} | "
                       f"{_fmt(_num(p.get('slo_attainment')))} | {p.get('refused')} | {p.get('failed')} | "
                       f"{_fmt(_num(p.get('p99_ttft_ms')))} | {'yes' if p['setting'] == chosen.get('setting') else ''} |")
    return [*out, ""]


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


def write_results(rows: Sequence[Mapping[str, Any]], out_dir: Path, *, meta: Mapping[str, Any] | None = None,
                  plots: bool = True) -> dict[str, Path]:
    """results.json ({"meta", "rows", "paired_differences"}), results.csv, results.md, goodput.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    clean = [{k: finite_or_none(r.get(k)) for k in LIVE_ROW_KEYS} for r in rows]
    diffs = paired_differences(rows)
    # Policy paths beyond the shipped one (``policies``): also paired to ``ppo``.
    extra = [p for p in dict.fromkeys(r["path"] for r in rows) if p not in PATHS]
    to_ppo = ([d for d in paired_differences(rows, baseline="ppo") if d["path"] in extra]
              if extra and any(r["path"] == "ppo" for r in rows) else [])
    to_tuned = paired_differences(rows, baseline=TUNED)  # every path against vLLM with its own limits
    files = {"json": out_dir / "results.json", "csv": out_dir / "results.csv", "md": out_dir / "results.md"}
    files["json"].write_text(json.dumps({"meta": dict(meta or {}), "rows": clean,
                                         "paired_differences": [{k: finite_or_none(v) for k, v in d.items()} for d in diffs],
                                         "paired_to_ppo": [{k: finite_or_none(v) for k, v in d.items()} for d in to_ppo],
                                         "paired_to_vllm_tuned": [{k: finite_or_none(v) for k, v in d.items()}
                                                                  for d in to_tuned]},
                                        indent=1) + "\n")
    with files["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(LIVE_ROW_KEYS))
        w.writeheader()
        for r in clean:
            w.writerow({k: "" if v is None else v for k, v in r.items()})
    md = [*_incomplete_note(meta or {}), "# Live evaluation", ""]
    if meta:
        md += [f"- trace: {meta.get('trace')}", f"- requests per run: {meta.get('requests_per_run')}, "
               f"window {float(meta.get('window_s', 0)):.1f} s; SLO {meta.get('slo')}; order {meta.get('order')}", ""]
    md += ["Mean ± 95 % CI over rounds (t-interval):", "", summary_table(rows), ""]
    if diffs:
        md += ["Paired per-round difference to vllm_direct (request goodput, req/s):", "", diff_table(diffs), ""]
    if to_ppo:
        md += ["Paired per-round difference to ppo, the shipped policy (request goodput, req/s):", "",
               diff_table(to_ppo, baseline="ppo"), ""]
    if to_tuned:
        md += [f"Paired per-round difference to {TUNED}, vLLM with its own limits (request goodput, req/s):", "",
               diff_table(to_tuned, baseline=TUNED), ""]
    if meta and meta.get("vllm_tuned"):
        md += tuned_markdown(meta["vllm_tuned"])
    files["md"].write_text("\n".join(md))
    if plots and rows:
        files["plot"] = plot_goodput(rows, out_dir)
    return files


__all__ = ["BASELINE", "LIVE_ROW_KEYS", "PATHS", "TABLE_KEYS", "diff_table", "finite_or_none", "paired_differences",
           "plot_goodput", "summary_table", "tuned_markdown", "write_results"]
