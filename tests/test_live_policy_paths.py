"""Extra policy paths in the live evaluation (issue 16: the live fine-tune against the shipped
policy): config checks, the paired difference to ``ppo`` in the results, and the simulated twin
running an exported policy folder as its own path. No vLLM."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from batchpilot.config import REPO_ROOT, load_config
from batchpilot.evaluation.live import _check
from batchpilot.evaluation.live_checks import policy_dirs
from batchpilot.evaluation.live_client import row_from_result
from batchpilot.evaluation.live_errors import LiveEvaluationError
from batchpilot.evaluation.live_results import write_results
from batchpilot.evaluation.live_twin import run_twin
from batchpilot.evaluation.live_window import scenario_trace
from batchpilot.policies.ppo_controller import PRETRAINED_DIR

FT = ["+policies.ppo_finetuned=policies/pretrained", "out_dir=/tmp/x"]


def test_policy_paths_are_checked() -> None:
    cfg = load_config(["paths=[vllm_direct,ppo,ppo_finetuned]", *FT], config_name="live_evaluate")
    assert _check(cfg) == ["vllm_direct", "ppo", "ppo_finetuned"]
    dirs = policy_dirs(cfg)
    assert dirs["ppo"] == str(PRETRAINED_DIR) and Path(dirs["ppo_finetuned"]).is_absolute()
    assert policy_dirs(load_config(["out_dir=/tmp/x"], config_name="live_evaluate")) == {}
    for bad in (["+policies.pid=policies/pretrained"], ["+policies.mine=/nowhere/at/all"]):
        with pytest.raises(LiveEvaluationError):
            policy_dirs(load_config([*bad, "out_dir=/tmp/x"], config_name="live_evaluate"))
    with pytest.raises(LiveEvaluationError, match="paths must be distinct names"):
        _check(load_config(["paths=[ppo,ppo_other]", *FT], config_name="live_evaluate"))


def test_results_pair_extra_policies_with_ppo(tmp_path: Path) -> None:
    rows = []
    for rnd, gs in enumerate([(1.0, 1.2, 1.5), (2.0, 2.1, 2.5), (1.5, 1.4, 1.9)]):
        for pos, (path, g) in enumerate(zip(("vllm_direct", "ppo", "ppo_finetuned"), gs)):
            row = row_from_result({"completed": 10, "failed": 0, "duration": 10.0, "request_goodput": g},
                                  scenario="kv_tight", path=path, rnd=rnd, position=pos, requests=10)
            row.update(preemptions=0.0, peak_kv_usage=0.5, peak_running=3, acting="policy", kv_dtype="auto",
                       engine_restarts=0, wall_s=10.0)
            rows.append(row)
    files = write_results(rows, tmp_path, plots=False)
    data = json.loads(files["json"].read_text())
    (d,) = data["paired_to_ppo"]
    assert d["path"] == "ppo_finetuned" and d["n"] == 3
    assert d["mean_diff"] == pytest.approx((0.3 + 0.4 + 0.5) / 3)
    assert {x["path"] for x in data["paired_differences"]} == {"ppo", "ppo_finetuned"}
    assert "− ppo (paired)" in files["md"].read_text()


def test_twin_runs_a_policy_folder_as_its_own_path() -> None:
    sc = OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "conf" / "live_scenario" / "kv_tight.yaml"))
    assert isinstance(sc, dict)
    sc["max_requests"] = 12
    tf = scenario_trace(OmegaConf.create(sc))
    slo = {"ttft_ms": 1000.0, "tpot_ms": 100.0}
    rows = run_twin(tf, sc, slo, paths=["ppo", "ppo_same"], vllm_args=sc["vllm_args"],
                    policy_dirs={"ppo_same": str(PRETRAINED_DIR)}, log=lambda m: None)
    assert [r["path"] for r in rows] == ["ppo", "ppo_same"]
    a, b = rows
    assert math.isfinite(a["request_goodput"]) and a["request_goodput"] == b["request_goodput"]  # same policy
