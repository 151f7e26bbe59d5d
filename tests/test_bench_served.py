"""``scripts/bench.py target=served_decode`` against a real ``vllm serve``: the figures' shape
and accounting (one row per concurrency, both sides positive, the fit reported), not their
values (a benchmark, not a timed test)."""

import json
import subprocess
import sys

import pytest

from batchpilot.config import REPO_ROOT

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(600)]


def test_served_decode_reports_each_concurrency_beside_the_simulator():
    out = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "bench.py"), "target=served_decode",
         "served_decode.concurrencies=[1,3]", "served_decode.warmup=[2]", "served_decode.repeats=1",
         "served_decode.max_tokens=8"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=540,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["target"] == "served_decode" and res["profile"] == "cpu_tiny"
    assert [r["n"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        assert r["served_ms_per_token"] > 0 and r["sim_step_ms"] > 0
        assert r["ratio"] == pytest.approx(r["served_ms_per_token"] / r["sim_step_ms"], rel=0.02)
    assert {"extra_ms_per_step", "extra_ms_per_sequence"} <= res.keys()



def test_served_round_trip_reports_the_wall_beside_the_simulated_iteration():
    out = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "bench.py"), "target=served_round_trip",
         "served_round_trip.requests=5", "served_round_trip.warmup=1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=540,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["target"] == "served_round_trip" and res["profile"] == "cpu_tiny_served"
    assert res["requests"] == 5 and res["prompt_tokens"] == 16
    assert 0 < res["p10_ms"] <= res["median_ms"] <= res["p90_ms"] and res["sim_iteration_ms"] > 0
    assert res["round_trip_ms"] == pytest.approx(res["median_ms"] - res["sim_iteration_ms"], abs=0.02)

def test_calibrate_writes_a_served_profile(tmp_path):
    """``scripts/calibrate.py fit=false served.enabled=true``: the committed profile plus the
    served path's measured extra, as a loadable hardware profile (never below the profile)."""
    from omegaconf import OmegaConf

    from batchpilot.config import load_config
    from batchpilot.core.specs import HardwareSpec

    out = tmp_path / "cpu_tiny_served_test.yaml"
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "calibrate.py"), "fit=false", "served.enabled=true",
         "served.concurrencies=[1,3]", "served.warmup=[2]", "served.repeats=1", "served.max_tokens=8",
         f"served.out={out}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=540,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    node = OmegaConf.load(out)
    fields = {k: v for k, v in OmegaConf.to_container(node).items() if k != "defaults"}
    served = HardwareSpec(**fields)
    base = HardwareSpec.from_cfg(load_config(["model=tiny_llama", "hardware=cpu_tiny"]).hardware)
    assert served.name == "cpu_tiny_served_test"
    assert served.per_step_overhead_s >= base.per_step_overhead_s
    assert served.per_request_overhead_s >= base.per_request_overhead_s
    assert served.compute_efficiency == base.compute_efficiency  # the rest is the profile's
