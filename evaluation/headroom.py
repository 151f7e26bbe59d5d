"""The headroom table (issue 55, "the bound first"): what each lever is worth, cell by cell.

Several evaluation runs of the same matrix (same workloads, deployments and seeds: on a trace the
same windows) differ in one lever each, e.g. admission as configured and admission that refuses
requests past their TTFT objective. This module joins their rows, names each controller by its run
(``pid_sf`` in the run labelled ``refuse`` becomes ``pid_sf+refuse``) and sets every column
against the yardstick (``vllm_tuned``) and against the best hand-written controller per cell. A
bound (``lookahead``, ``*_hindsight``) is shown beside, never counted as a controller. Nothing here
runs an engine: it reads ``results.json`` files that ``scripts/evaluate.py`` wrote.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchpilot.evaluation.report import _fmt, _geomean, _ratio, aggregate


class HeadroomError(ValueError):
    """A run or column the table cannot use; the message names it."""


#: The label of the run whose controllers keep their plain names.
BASE = "base"


def column_name(policy: str, label: str) -> str:
    """A controller's column: its policy name, with ``+label`` for a run other than ``BASE``."""
    return policy if label == BASE else f"{policy}+{label}"


def load_runs(runs: Mapping[str, str | Path]) -> list[dict[str, Any]]:
    """Every row of every run (label -> directory holding ``results.json``, or the file), each
    row's ``policy`` renamed to its column (``column_name``)."""
    rows: list[dict[str, Any]] = []
    for label, where in runs.items():
        path = Path(where)
        path = path / "results.json" if path.is_dir() else path
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise HeadroomError(f"run {label!r}: cannot read {path}: {e}") from e
        run_rows = data["rows"] if isinstance(data, dict) else data
        if not isinstance(run_rows, list) or not all(isinstance(r, dict) and "policy" in r for r in run_rows):
            raise HeadroomError(f"run {label!r}: {path} holds no evaluation rows (a list of rows with a policy)")
        rows += [{**r, "policy": column_name(str(r["policy"]), str(label))} for r in run_rows]
    return rows


def headroom(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    reference: str = "vllm_tuned",
    hand_written: Sequence[str] = (),
    bounds: Sequence[str] = (),
) -> tuple[str, list[str]]:
    """The per-cell table of mean request goodput (over seeds) for ``columns`` and its ratio to
    ``reference``, then summary lines: each column's geometric-mean ratio to the reference and to
    the best of ``hand_written`` in the same cell (the per-cell best is a choice made with the
    scores, so it flatters the hand-written side), and how many cells fall below 0.98× it."""
    agg = aggregate(rows, ("request_goodput", "slo_attainment"))
    by: dict[tuple[str, str], dict[str, float]] = {}
    for e in agg:
        by.setdefault((e["workload"], e["deployment"]), {})[e["policy"]] = e["request_goodput"][0]
    seen = {p for v in by.values() for p in v}
    missing = [c for c in (*columns, reference, *hand_written, *bounds) if c not in seen]
    if missing:
        raise HeadroomError(f"no rows for {missing}; the runs hold {sorted(seen)}")
    shown = [c for c in (*columns, *bounds) if c != reference]
    head = ["workload", "deployment", reference, *(f"{c} (/ ref)" for c in shown), "best hand-written"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    to_ref: dict[str, list[float]] = {}
    to_hand: dict[str, list[float]] = {}
    for (wl, dep), v in by.items():
        ref = v.get(reference, math.nan)
        hands = {h: v[h] for h in hand_written if h in v}
        best_h = max(hands, key=lambda h: hands[h]) if hands else ""
        cells = []
        for c in shown:
            x = v.get(c, math.nan)
            to_ref.setdefault(c, []).append(_ratio(x, ref))
            to_hand.setdefault(c, []).append(_ratio(x, hands[best_h]) if best_h else math.nan)
            cells.append(f"{_fmt(x)} ({_fmt(_ratio(x, ref))}×)")
        lines.append("| " + " | ".join([wl, dep, _fmt(ref), *cells, best_h or "–"]) + " |")
    summary = []
    for c in shown:
        gr, n = _geomean(to_ref[c])
        gh, m = _geomean(to_hand[c])
        below = sum(1 for x in to_hand[c] if math.isfinite(x) and x < 0.98)
        kind = " (a bound)" if c in bounds else ""
        summary.append(f"{c}{kind}: {gr:.3f}× {reference} ({n} cells), {gh:.3f}× the best hand-written per cell "
                       f"({m} cells, {below} below 0.98×)")
    return "\n".join(lines), summary


@dataclass
class HeadroomConfig:
    """``conf/headroom.yaml``: which runs to join and which columns to show."""

    #: The runs' directories (or their results.json files) ...
    runs: list[str] = field(default_factory=list)
    #: ... and their labels, one per run; ``base`` names the run whose controllers keep their
    #: plain names.
    labels: list[str] = field(default_factory=list)
    #: Controllers to show, as ``column_name`` gives them (``pid_sf+refuse``).
    columns: list[str] = field(default_factory=list)
    reference: str = "vllm_tuned"
    hand_written: list[str] = field(default_factory=list)
    bounds: list[str] = field(default_factory=list)
    #: Where the table goes (markdown); null = print only.
    out: str | None = None


def write_headroom(cfg: HeadroomConfig) -> str:
    """The table and its summary as markdown, written to ``cfg.out`` when set."""
    if not cfg.runs or len(cfg.labels) != len(cfg.runs) or len(set(cfg.labels)) != len(cfg.labels):
        raise HeadroomError(f"runs and labels must name the same number of runs, labels distinct, e.g. "
                            f"runs=[DIR_A,DIR_B] labels=[base,refuse]; got runs={cfg.runs} labels={cfg.labels}")
    runs_by_label = dict(zip(cfg.labels, cfg.runs))
    table, summary = headroom(load_runs(runs_by_label), cfg.columns, cfg.reference, cfg.hand_written, cfg.bounds)
    runs = ", ".join(f"{label}: {where}" for label, where in runs_by_label.items())
    text = "\n".join(["Mean request goodput over seeds (req/s) and its ratio to the reference.", "",
                      f"Runs: {runs}.", "", table, "", *(f"- {s}" for s in summary), ""])
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(text)
    return text
