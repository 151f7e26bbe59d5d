"""``scripts/calibrate.py``'s workloads as the command line meant them: Hydra merges a dict given
there into conf/calibrate.yaml's, so ``workloads={}`` used to run both default workloads (minutes
of vLLM each); it is refused before anything starts, with how to drop workloads, and so is a
report with no workload left or a load_vs_capacity naming a dropped one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchpilot.config import REPO_ROOT, load_config
from batchpilot.evaluation.calibration import CalibrationError, check_workloads

SCRIPT = REPO_ROOT / "scripts" / "calibrate.py"


def _cfg(*overrides: str):
    return load_config(["report=true", *overrides], config_name="calibrate")


def test_an_empty_workloads_dict_merges_into_the_defaults_and_is_refused() -> None:
    cfg = _cfg("workloads={}")
    assert sorted(cfg.workloads) == ["azure_conv", "burst"]  # what Hydra makes of it: nothing changed
    with pytest.raises(CalibrationError, match=r"^'workloads=\{\}' keeps the default workloads \['azure_conv', "
                                               r"'burst'\] .*to drop one: ~workloads.burst"):
        check_workloads(cfg, ["report=true", "workloads={}"])
    with pytest.raises(CalibrationError, match=r"keeps the default workloads"):
        check_workloads(cfg, ["workloads= {}"])


def test_fewer_workloads_the_ways_the_error_names() -> None:
    cfg = _cfg("~workloads.burst")
    check_workloads(cfg, ["report=true", "~workloads.burst"])
    assert list(cfg.workloads) == ["azure_conv"]
    ov = ["~workloads", "~load_vs_capacity", '+workloads={mine:["workload=azure_conv"]}']
    cfg = _cfg(*ov)
    check_workloads(cfg, ov)
    assert list(cfg.workloads) == ["mine"]
    check_workloads(_cfg(), [])  # the defaults


@pytest.mark.parametrize("overrides,needle", [
    (["~workloads"], r"report=true needs at least one workload, got none"),
    (["~workloads.azure_conv"], r"load_vs_capacity names \['azure_conv'\], not among the workloads \['burst'\]; "
                                r"drop them too \(~load_vs_capacity.azure_conv\)"),
])
def test_a_report_without_its_workloads_is_refused(overrides: list[str], needle: str) -> None:
    with pytest.raises(CalibrationError, match=needle):
        check_workloads(_cfg(*overrides), overrides)
    check_workloads(load_config(["report=false", *overrides], config_name="calibrate"), overrides)  # a fit only


def test_the_script_refuses_in_one_line_before_anything_starts() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "fit=false", "report=true", "workloads={}"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("calibrate: error: 'workloads={}' keeps the default workloads")
    assert "warm" not in r.stdout.lower()  # no engine was started
