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
