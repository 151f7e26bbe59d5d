"""Ray as the distributed engine, on a local 2-CPU cluster: the evaluation matrix gives the same
files (plots included) as the serial run and its progress advances once per finished cell, a
two-job training sweep exports (and logs its offline W&B runs) where a serial multirun does, and
a missing Ray reads as one line naming the fix. No Ray process outlives a test."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_training import TINY as TRAIN_TINY

from batchpilot.config import REPO_ROOT
from batchpilot.evaluation.matrix import evaluate
from batchpilot.evaluation.plan import EvaluationError, compose_eval

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


def wait_no_ray_processes(timeout_s: float = 120.0) -> None:
    """Wait until Ray's processes are gone (they exit after shutdown, not at once; later on a
    slow, busy machine)."""
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


def _progress_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every advance of the evaluation's progress bar, as (description, episodes), from now on."""
    from rich.progress import Progress

    steps: list[tuple[str, int]] = []
    update = Progress.update

    def counting(self: Progress, task_id: Any, **kw: Any) -> None:
        if kw.get("advance"):
            steps.append((str(kw.get("description")), int(kw["advance"])))
        update(self, task_id, **kw)

    monkeypatch.setattr(Progress, "update", counting)
    return steps


def test_matrix_on_ray_gives_the_serial_files(
    local_ray: object, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same results.json/csv (but ``wall_s``, a measured time that differs between two serial
    runs too), byte-identical results.md, timelines.json, best_static_search.json and plots
    (matplotlib's PNGs carry no date, so the same figure is the same bytes); the progress bar
    advances once per cell as it finishes, by that cell's episodes."""
    steps = _progress_steps(monkeypatch)
    serial, on_ray = tmp_path / "serial", tmp_path / "ray"
    _evaluate(serial, ["plots=true"])
    serial_steps = list(steps)
    steps.clear()
    _evaluate(on_ray, ["plots=true", "launcher=ray"])  # joins the fixture's cluster
    err = capfd.readouterr().err
    assert "Ray cluster: 2 CPUs, 24 cells to start" in err  # all but best_static's seeds

    # Per workload: pid and vllm_default 2 seeds each, best_static's 4 grid points on its tuning
    # seed and on the 2 scored seeds (hindsight), then its 2 seeds: 14 cells, 18 episodes.
    on_ray_steps = steps
    assert len(on_ray_steps) == 2 * 14 and len(set(on_ray_steps)) == len(on_ray_steps)  # each cell once
    assert sorted(on_ray_steps) == sorted(serial_steps)
    assert sum(n for _, n in on_ray_steps) == 2 * 18
    assert err.count("36/36") == 2  # the bar's last state, serial and on Ray

    for name in ("results.md", "timelines.json", "best_static_search.json"):
        assert (on_ray / name).read_bytes() == (serial / name).read_bytes(), name
    pngs = sorted(p.name for p in (serial / "plots").glob("*.png"))
    assert pngs == ["goodput_vs_slo.png", "timeline_bursty.png", "timeline_poisson.png"]
    assert sorted(p.name for p in (on_ray / "plots").iterdir()) == pngs
    for name in pngs:
        assert (on_ray / "plots" / name).read_bytes() == (serial / "plots" / name).read_bytes(), name
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
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
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
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


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


def _train_sweep(args: list[str], cwd: Path, logger: str = "none") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    tiny = [o for o in TINY if not o.startswith("logger=")]
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "train.py"), "-m", *tiny, f"logger={logger}", "seed=0,1", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=900,  # bounds a hang only
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


#: Parts of a file's path that name its run rather than what it is: the offline W&B run's folder
#: and history file (start time and run id) and TensorBoard's event file (time, host, pid).
RUN_SPECIFIC = (
    (re.compile(r"^offline-run-\d{8}_\d{6}-\w+$"), "offline-run-*"),
    (re.compile(r"^run-\w+\.wandb$"), "run-*.wandb"),
    (re.compile(r"^events\.out\.tfevents\..+$"), "events.out.tfevents.*"),
)


def _tree(root: Path) -> set[str]:
    """The files under ``root`` (but Hydra's ``.hydra/``), run-specific names as patterns."""

    def name(part: str) -> str:
        return next((sub for pat, sub in RUN_SPECIFIC if pat.match(part)), part)

    return {
        "/".join(name(part) for part in p.relative_to(root).parts)
        for p in root.rglob("*")
        if p.is_file() and ".hydra" not in p.parts
    }


@pytest.mark.slow
def test_training_sweep_on_ray_exports_where_serial_does(tmp_path: Path) -> None:
    """Two jobs as Ray tasks on a local 2-CPU cluster the sweep starts (and stops), logging to
    the real wandb library offline: each job's folder holds what a serial multirun's does
    (train.log, comparison.json, best model, the exported policy, TensorBoard events and the
    job's offline W&B run under ``wandb/``), and the exported weights are the serial run's."""
    from omegaconf import OmegaConf

    from batchpilot.policies.runtime import PolicyRuntime

    wait_no_ray_processes()
    ray_dir, serial_dir = tmp_path / "ray", tmp_path / "serial"
    on_ray = ["hydra/launcher=ray", "hydra.launcher.num_cpus=2", f"hydra.sweep.dir={ray_dir}"]
    proc = _train_sweep(on_ray, tmp_path, logger="wandb")
    wait_no_ray_processes()
    _train_sweep([f"hydra.sweep.dir={serial_dir}"], tmp_path, logger="wandb")

    assert _tree(ray_dir) == _tree(serial_dir)
    for job in ("0", "1"):
        weights = "policy/policy.safetensors"  # the same seed trains the same policy anywhere
        assert (ray_dir / job / weights).read_bytes() == (serial_dir / job / weights).read_bytes()
        rt = PolicyRuntime.from_dir(ray_dir / job / "policy")
        assert rt.n_features > 0
        rows = json.loads((ray_dir / job / "comparison.json").read_text())["rows"]
        assert {r["controller"] for r in rows} == {"pid", "ppo"}
        assert (ray_dir / job / ".hydra" / "overrides.yaml").read_text().count(f"seed={job}") == 1
        runs = list((ray_dir / job / "wandb").glob("offline-run-*"))  # the job's own W&B run
        assert len(runs) == 1, runs
        blob = b"".join(h.read_bytes() for h in runs[0].glob("run-*.wandb"))
        assert b"rollout/ep_rew_mean" in blob and b"eval/comparison" in blob  # curves, eval table
        # named "<job number>:<the job's overrides>": this job's run, not its sibling's
        overrides = OmegaConf.load(ray_dir / job / ".hydra" / "overrides.yaml")
        assert f"{job}:{','.join(map(str, overrides))}".encode() in blob
    assert "job #0 finished" in proc.stderr + proc.stdout and "job #1 finished" in proc.stderr + proc.stdout
