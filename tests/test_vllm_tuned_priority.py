"""``vllm_tuned``'s sweep tries ``--scheduling-policy priority`` where traffic has classes (vLLM's
docs list it, with a per-request ``priority``, among an operator's controls), and changes
nothing on a one-class workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchpilot.evaluation.matrix import evaluate
from batchpilot.evaluation.plan import EvalConfig, compose_eval, plan_workload
from batchpilot.evaluation.vllm_tuned import EngineGridPoint, tuned_config, vllm_tuned_grid

GRID = ["+policy_overrides.vllm_tuned.max_num_seqs=[64,256]",
        "+policy_overrides.vllm_tuned.max_num_batched_tokens=[8192]",
        "+policy_overrides.vllm_tuned.queued_tokens_ttft_factors=[0.25]"]


def _grid(workload: list[str], policies: list[str] | None = None) -> list[EngineGridPoint]:
    extra = [] if policies is None else [f"+policy_overrides.vllm_tuned.scheduling_policies=[{','.join(policies)}]"]
    overrides = [*workload, *GRID, *extra, "policies=[vllm_tuned]", "seeds=[0]", "best_static.tune_seeds=[3]"]
    cfg, _ = compose_eval(overrides)
    ecfg = EvalConfig.from_cfg(cfg)
    plan = plan_workload(overrides, None, ecfg)
    settings = tuned_config(dict(cfg.policy_overrides.vllm_tuned) | {"kind": "vllm_tuned"}, "vllm_tuned")
    return vllm_tuned_grid(settings, plan, 3)[0]


def test_a_one_class_workload_gets_the_fcfs_grid_point_for_point() -> None:
    wl = ["workload=poisson", "workload.duration_s=20"]
    default, fcfs = _grid(wl), _grid(wl, ["fcfs"])
    # 2 max_num_seqs x (no queued-tokens limit, the 0.25 rule)
    assert [p.engine() for p in default] == [p.engine() for p in fcfs] and len(default) == 4
    assert all("scheduling_policy" not in p.engine() and "scheduling" not in p.label for p in default)


@pytest.mark.parametrize("wl", [["workload=bursty", "workload.duration_s=20"],  # core + untagged, one objective
                                ["workload=two_class", "workload.duration_s=30"]])  # two priorities, no slo.classes
def test_priorities_that_share_one_objective_keep_the_fcfs_grid(wl: list[str]) -> None:
    """The matrix's ``bursty`` carries priorities 0 and 1 under one objective: its reference
    stays the one the published figures were measured against."""
    assert [p.engine() for p in _grid(wl)] == [p.engine() for p in _grid(wl, ["fcfs"])]


def test_two_classes_add_every_point_with_the_priority_policy() -> None:
    wl = ["workload=two_class", "slo=two_class", "workload.duration_s=30"]
    both, fcfs = _grid(wl), _grid(wl, ["fcfs"])
    assert len(fcfs) == 4 and len(both) == 8
    prio = [p for p in both if p.scheduling_policy == "priority"]
    assert [dict(p.engine(), scheduling_policy="fcfs") for p in prio] == [
        dict(p.engine(), scheduling_policy="fcfs") for p in fcfs]
    assert all(p.engine()["scheduling_policy"] == "priority" and p.label.endswith("--scheduling-policy priority")
               for p in prio)
    assert len(_grid(wl, ["priority"])) == 4


def test_an_unknown_scheduling_policy_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"vllm_tuned.scheduling_policies must list some of \('fcfs', 'priority'\)"):
        _grid(["workload=poisson", "workload.duration_s=20"], ["lifo"])


@pytest.mark.slow
def test_the_sweep_runs_priority_points_on_the_engine_and_reports_them(tmp_path: Path) -> None:
    """A short two-class evaluation: the priority points run on a SimEngine in priority mode
    (their scores differ from the fcfs twins'), the search file says which is which."""
    overrides = ["workload=two_class", "slo=two_class", "workload.duration_s=30", *GRID, "policies=[vllm_tuned]",
                 "seeds=[0]", "best_static.tune_seeds=[3]", "logger=none", "plots=false", f"out_dir={tmp_path}"]
    cfg, _ = compose_eval(overrides)
    rows = evaluate(cfg, overrides)
    assert {r["policy"] for r in rows} == {"vllm_tuned", "vllm_tuned_hindsight"}
    search = json.loads((tmp_path / "vllm_tuned_search.json").read_text())
    by = {(p["max_num_seqs"], p["ttft_factor"], p["scheduling_policy"]): p for p in search}
    assert len(by) == len(search) == 8 and {k[2] for k in by} == {"fcfs", "priority"}
    assert any(p["slo_attainment"] != by[(k[0], k[1], "fcfs")]["slo_attainment"]
               for k, p in by.items() if k[2] == "priority")
