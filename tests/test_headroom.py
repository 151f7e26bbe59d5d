"""The headroom table joins runs that differ in one lever and sets each column against the
yardstick and the best hand-written controller per cell (evaluation/headroom.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchpilot.evaluation.headroom import HeadroomConfig, HeadroomError, headroom, load_runs, write_headroom

ROOT = Path(__file__).resolve().parents[1]


def _rows(policy_goodput: dict[str, list[float]], workload: str = "bursty") -> list[dict]:
    return [{"policy": p, "workload": workload, "model": "m", "hardware": "h", "seed": s,
             "request_goodput": g, "slo_attainment": 0.5}
            for p, gs in policy_goodput.items() for s, g in enumerate(gs)]


def _write(path: Path, rows: list[dict], wrapped: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps({"rows": rows} if wrapped else rows))
    return path


def test_runs_are_joined_and_each_column_is_set_against_the_reference_and_the_best_rule(tmp_path: Path) -> None:
    base = _write(tmp_path / "a", _rows({"vllm_tuned": [2.0, 2.0], "pid_sf": [1.0, 3.0]})
                  + _rows({"vllm_tuned": [1.0], "pid_sf": [1.0]}, workload="ramp"))
    refuse = _write(tmp_path / "b", _rows({"pid_sf": [3.0, 3.0]}) + _rows({"pid_sf": [0.5]}, workload="ramp"),
                    wrapped=True)
    rows = load_runs({"base": base, "refuse": refuse})
    assert {r["policy"] for r in rows} == {"vllm_tuned", "pid_sf", "pid_sf+refuse"}
    table, summary = headroom(rows, ["pid_sf", "pid_sf+refuse"], hand_written=["pid_sf", "pid_sf+refuse"])
    assert "| bursty | m/h | 2.00 | 2.00 (1.00×) | 3.00 (1.50×) | pid_sf+refuse |" in table
    assert "| ramp | m/h | 1.00 | 1.00 (1.00×) | 0.500 (0.500×) | pid_sf |" in table
    # pid_sf: 1.0x and 1.0x the reference; against the best rule per cell 2/3 and 1 -> geomean sqrt(2/3)
    assert summary[0].startswith("pid_sf: 1.000× vllm_tuned (2 cells), 0.816× the best hand-written per cell "
                                 "(2 cells, 1 below 0.98×)")
    assert summary[1].startswith("pid_sf+refuse: 0.866× vllm_tuned (2 cells)")


def test_a_missing_column_or_an_unreadable_run_is_one_clear_error(tmp_path: Path) -> None:
    run = _write(tmp_path / "a", _rows({"vllm_tuned": [1.0], "pid_sf": [1.0]}))
    with pytest.raises(HeadroomError, match=r"no rows for \['ppo'\]; the runs hold \['pid_sf', 'vllm_tuned'\]"):
        headroom(load_runs({"base": run}), ["ppo"])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.json").write_text("{not json")
    with pytest.raises(HeadroomError, match="run 'x': cannot read .*bad/results.json"):
        load_runs({"x": tmp_path / "bad"})
    (tmp_path / "bad" / "results.json").write_text('{"rows": [1, 2]}')
    with pytest.raises(HeadroomError, match="run 'x': .* holds no evaluation rows"):
        load_runs({"x": tmp_path / "bad"})
    with pytest.raises(HeadroomError, match="runs and labels must name the same number of runs"):
        write_headroom(HeadroomConfig())
    with pytest.raises(HeadroomError, match="labels distinct"):
        write_headroom(HeadroomConfig(runs=[str(run), str(run)], labels=["base", "base"]))


def test_the_script_writes_the_table(tmp_path: Path) -> None:
    run = _write(tmp_path / "a", _rows({"vllm_tuned": [1.0], "pid_sf": [2.0]}))
    out = tmp_path / "t.md"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "headroom.py"), f"runs=[{run}]", "labels=[base]",
                           "columns=[pid_sf]", "hand_written=[pid_sf]", "bounds=[]", f"out={out}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pid_sf: 2.000× vllm_tuned (1 cells)" in out.read_text()
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "headroom.py"), f"runs=[{run}]", "labels=[base]",
                          "columns=[ppo]"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "headroom: error: no rows for ['ppo'" in bad.stderr
