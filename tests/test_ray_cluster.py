"""Ray as the distributed engine, on a local 2-CPU cluster: the evaluation matrix gives the same
files as the serial run, a two-job training sweep exports where a serial multirun does, and a
missing Ray reads as one line naming the fix. No Ray process outlives a test."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from test_training import TINY as TRAIN_TINY

from batchpilot.config import REPO_ROOT
from batchpilot.policies.evaluation import EvaluationError, compose_eval, evaluate

#: Ray's own processes (a local cluster: GCS, raylet, workers and helpers).
RAY_PROCESS_MARKS = ("raylet", "gcs_server", "ray::", "default_worker.py", "ray/dashboard", "ray/_private")

#: A small matrix with every kind of cell: two workloads, two controllers, a best_static grid
#: (its seeds run after its grid), two seeds.
MATRIX = [
    "policies=[pid,best_static,vllm_default]",
    "workloads=[poisson,bursty]",
    "workload.duration_s=15",
    "seeds=[0,1]",
    "best_static.batch_caps=[16,64]",
    "best_static.bucketing=[fifo,weighted]",
    "best_static.kv_dtypes=[auto]",
    "logger=none",
]

#: The tiny training run of tests/test_training.py, one rollout worker per job, no checkpoints.
TINY = [*(o for o in TRAIN_TINY if not o.startswith("train.checkpoint_freq=")),
        "train.checkpoint_freq=0", "train.n_envs=1", "logger=none"]

pytestmark = pytest.mark.slow  # a local Ray cluster per test: seconds each


def ray_processes() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        text = f"{p.info['name'] or ''} {' '.join(p.info['cmdline'] or [])}"
        if any(m in text for m in RAY_PROCESS_MARKS):
            out.append(p)
    return out


def wait_no_ray_processes(timeout_s: float = 60.0) -> None:
    """Wait until Ray's processes are gone (they exit after shutdown, not at once)."""
    deadline = time.monotonic() + timeout_s
    while (left := ray_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"Ray processes left behind: {[(p.pid, p.info['name']) for p in left]}"


@pytest.fixture
def local_ray() -> Iterator[object]:
    """A local Ray cluster of 2 CPUs for the test; shut down and waited out afterwards."""
    import ray

    wait_no_ray_processes()  # a clean start: the no-leftovers checks below mean something
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        wait_no_ray_processes()


def _evaluate(out: Path, extra: list[str]) -> None:
    overrides = [*MATRIX, f"out_dir={out}", *extra]
    cfg, _ = compose_eval(overrides)
    evaluate(cfg, overrides)


def _csv_without_wall(path: Path) -> list[dict[str, str]]:
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    for r in rows:
        r.pop("wall_s")
    return rows


def test_matrix_on_ray_gives_the_serial_files(
    local_ray: object, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Same results.json/csv (but ``wall_s``, a measured time that differs between two serial
    runs too), byte-identical results.md, timelines.json and best_static_search.json."""
    serial, on_ray = tmp_path / "serial", tmp_path / "ray"
    _evaluate(serial, ["plots=false"])
    _evaluate(on_ray, ["plots=false", "launcher=ray"])  # joins the fixture's cluster
    assert "Ray cluster: 2 CPUs" in capfd.readouterr().err

    for name in ("results.md", "timelines.json", "best_static_search.json"):
        assert (on_ray / name).read_bytes() == (serial / name).read_bytes(), name
    a, b = (json.loads((d / "results.json").read_text()) for d in (serial, on_ray))
    # 2 workloads x 2 seeds x (3 controllers + the best_static_hindsight bound)
    assert len(a) == 2 * 2 * 4 and {r["policy"] for r in a} == {"pid", "best_static", "vllm_default", "best_static_hindsight"}
    assert [{k: v for k, v in r.items() if k != "wall_s"} for r in b] == [
        {k: v for k, v in r.items() if k != "wall_s"} for r in a
    ]
    assert _csv_without_wall(on_ray / "results.csv") == _csv_without_wall(serial / "results.csv")
    assert local_ray.is_initialized()  # a session the caller started is left running


def test_evaluate_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(EvaluationError, match=r"launcher=ray needs Ray.*pip install -e '\.\[cluster\]'"):
        _evaluate(tmp_path, ["launcher=ray"])


def test_no_cluster_at_the_address_is_one_error(tmp_path: Path) -> None:
    wait_no_ray_processes()  # nothing for address=auto to find
    with pytest.raises(EvaluationError, match=r"could not join the Ray cluster at 'auto'"):
        _evaluate(tmp_path, ["launcher=ray", "launcher.address=auto"])
    args = ["-m", "hydra/launcher=ray", "hydra.launcher.address=auto", *TINY, "seed=0,1"]
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "train.py"), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("train: error: could not join the Ray cluster at 'auto'")
    assert "Traceback" not in proc.stderr


def _script(name: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<name>`` with ``import ray`` failing, as on a machine without the extra."""
    path = str(REPO_ROOT / "scripts" / name)
    boot = (
        "import runpy, sys; sys.modules['ray'] = None; "
        f"sys.argv = [{path!r}, *sys.argv[1:]]; runpy.run_path({path!r}, run_name='__main__')"
    )
    cmd = [sys.executable, "-c", boot, *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_scripts_without_ray_fail_in_one_line(tmp_path: Path) -> None:
    ev = _script("evaluate.py", [*MATRIX, "launcher=ray", f"out_dir={tmp_path}"], tmp_path)
    tr = _script("train.py", ["-m", "hydra/launcher=ray", *TINY, "seed=0,1"], tmp_path)
    for proc, start in ((ev, "evaluate: error: launcher=ray"), (tr, "train: error: hydra/launcher=ray")):
        assert proc.returncode == 2, proc.stderr[-3000:]
        err = [line for line in proc.stderr.splitlines() if line.strip()]
        assert err[-1].startswith(f"{start} needs Ray"), err[-1]
        assert "pip install -e '.[cluster]'" in err[-1]
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "multirun").exists()


def _train_sweep(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "train.py"), "-m", *TINY, "seed=0,1", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".hydra" not in p.parts}


@pytest.mark.slow
def test_training_sweep_on_ray_exports_where_serial_does(tmp_path: Path) -> None:
    """Two jobs as Ray tasks on a local 2-CPU cluster the sweep starts (and stops): each job's
    folder holds what a serial multirun's does (train.log, comparison.json, best model, the
    exported policy), and the exported weights are the serial run's."""
    from batchpilot.policies.runtime import PolicyRuntime

    wait_no_ray_processes()
    ray_dir, serial_dir = tmp_path / "ray", tmp_path / "serial"
    on_ray = ["hydra/launcher=ray", "hydra.launcher.num_cpus=2", f"hydra.sweep.dir={ray_dir}"]
    proc = _train_sweep(on_ray, tmp_path)
    wait_no_ray_processes()
    _train_sweep([f"hydra.sweep.dir={serial_dir}"], tmp_path)

    assert _tree(ray_dir) == _tree(serial_dir)
    for job in ("0", "1"):
        weights = "policy/policy.safetensors"  # the same seed trains the same policy anywhere
        assert (ray_dir / job / weights).read_bytes() == (serial_dir / job / weights).read_bytes()
        rt = PolicyRuntime.from_dir(ray_dir / job / "policy")
        assert rt.n_features > 0
        rows = json.loads((ray_dir / job / "comparison.json").read_text())["rows"]
        assert {r["controller"] for r in rows} == {"pid", "ppo"}
        assert (ray_dir / job / ".hydra" / "overrides.yaml").read_text().count(f"seed={job}") == 1
    assert "job #0 finished" in proc.stderr + proc.stdout and "job #1 finished" in proc.stderr + proc.stdout
