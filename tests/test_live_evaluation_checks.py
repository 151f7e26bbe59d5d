"""Live evaluation: what is checked before vLLM starts (client headers and concurrency, gateway
overrides the evaluation owns, broken policy folders, an out_dir holding a run, where a relative
trace is looked for), timeouts said in one line with the gateway log's last lines, results without
a baseline, a re-sorted trace said in its summary, an empty window said with the trace's span,
Ctrl-C's partial results; and one live check that a SIGTERM to ``scripts/live_evaluate.py`` leaves
no gateway or vLLM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchpilot.config import REPO_ROOT, load_config
from batchpilot.envs.timed_trace import TimedTraceOptions, convert_trace
from batchpilot.envs.traces import TraceOptions, read_trace
from batchpilot.evaluation.live import _check, live_evaluate
from batchpilot.evaluation.live_checks import check_out_dir
from batchpilot.evaluation.live_client import row_from_result
from batchpilot.evaluation.live_errors import LiveEvaluationError, wait_until
from batchpilot.evaluation.live_results import write_results
from batchpilot.evaluation.live_window import resolve_trace_path
from batchpilot.policies.ppo_controller import PRETRAINED_DIR

SCRIPT = REPO_ROOT / "scripts" / "live_evaluate.py"


def _cfg(*overrides: str):
    return load_config([*overrides, "out_dir=/tmp/x"], config_name="live_evaluate")


# --- B1: timeouts are one line, with the gateway log's tail ----------------------------------------
def test_a_timeout_is_a_live_evaluation_error_with_the_logs_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    log.write_text("starting\n" + "x" * 500 + "\n\nERROR: port 1234 already in use\n")
    t0 = time.monotonic()
    with pytest.raises(LiveEvaluationError) as e:
        wait_until(lambda: False, 0.3, "the gateway's /readyz", poll_s=0.05, log=log)
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert "the gateway's /readyz: not reached after 0.3 s" in msg and str(log) in msg
    assert msg.endswith("ERROR: port 1234 already in use") and "\n" not in msg
    assert "x" * 201 not in msg  # long lines are cut
    with pytest.raises(LiveEvaluationError, match=r"while waiting for vLLM idle: it exited; last lines .*in use$"):
        wait_until(lambda: False, 60, "vLLM idle", alive=lambda: "it exited", log=log)
    with pytest.raises(LiveEvaluationError, match=r"^x: not reached after 0.1 s$"):  # no log: no tail
        wait_until(lambda: False, 0.1, "x", poll_s=0.05, log=tmp_path / "none.log")


# --- B2, B3: client and gateway settings checked before anything starts ----------------------------
@pytest.mark.parametrize("override,needle", [
    ('client.headers=["x-priority"]', r"client.headers: 'x-priority' is not KEY=VALUE"),
    ('client.headers=["=1"]', r"client.headers: '=1' is not KEY=VALUE"),
    ('client.headers=["x-priority=high"]', r"x-priority must be an integer"),
    ("client.max_concurrency=0", r"client.max_concurrency must be null .* got 0"),
    ("client.max_concurrency=-3", r"client.max_concurrency must be null .* got -3"),
    ('gateway.overrides=["serve.port=8123"]', r"'serve.port=8123' sets serve.port, .*drop it"),
    ('gateway.overrides=["+serve.managed=false"]', r"sets serve.managed"),
    ('gateway.overrides=["serve.model=/m"]', r"sets serve.model, .*set gateway.model instead"),
    ('gateway.overrides=["serve.served_model_name=m"]', r"set gateway.served_model_name instead"),
    ('gateway.overrides=["serve.max_model_len=512"]', r"set live_scenario.max_model_len instead"),
    ('gateway.overrides=["serve.kv_cache_space_gib=4"]', r"set gateway.kv_cache_space_gib instead"),
    ('gateway.overrides=["serve.extra_vllm_args=[]"]', r"set gateway.extra_vllm_args or live_scenario.vllm_args"),
    ('gateway.overrides=["serve.control.mode=pid"]', r"sets serve.control.mode"),
    ('gateway.overrides=["slo.ttft_ms=5"]', r"set live_evaluate's slo.ttft_ms instead"),
    ("slo=two_class", r"slo.classes=.*replays one class and scores it with one objective"),
    ('gateway.overrides=["serve=other"]', r"sets serve \(which holds serve.managed\)"),
])
def test_bad_client_and_gateway_settings_are_refused(override: str, needle: str) -> None:
    with pytest.raises(LiveEvaluationError, match=needle):
        _check(_cfg(override))


def test_good_client_and_gateway_settings_pass() -> None:
    cfg = _cfg('client.headers=["x-priority=1","x-trace=a=b"]', "client.max_concurrency=4",
               'gateway.overrides=["control.interval_s=0.5","shield.max_batch=4","+serve.admission.x=1"]',
               "paths=[vllm_direct,pid]")
    assert _check(cfg) == ["vllm_direct", "pid"]


# --- B4: a broken policy folder is named before the gateway starts ---------------------------------
def _broken_policy(tmp_path: Path, how: str) -> Path:
    d = tmp_path / how
    shutil.copytree(PRETRAINED_DIR, d)
    manifest = d / "manifest.json"
    if how == "not_json":
        manifest.write_text("{not json")
    elif how == "no_weights":  # a manifest alone is not a policy
        (d / "policy.safetensors").unlink()
    return d


@pytest.mark.parametrize("how,needle", [("not_json", "manifest.json is not valid JSON"),
                                        ("no_weights", "missing weights file policy.safetensors")])
def test_a_broken_policy_folder_fails_before_anything_starts(tmp_path: Path, how: str, needle: str) -> None:
    bad = _broken_policy(tmp_path, how)
    out = tmp_path / "never"
    cfg = load_config([f"+policies.mine={bad}", "paths=[vllm_direct,mine]", f"out_dir={out}"],
                      config_name="live_evaluate")
    with pytest.raises(LiveEvaluationError, match=rf"policies.mine: policy artifact {bad}: .*{needle}"):
        live_evaluate(cfg)
    assert not out.exists()


def test_the_script_says_a_bad_setting_in_one_line_and_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "never"
    r = subprocess.run([sys.executable, str(SCRIPT), 'client.headers=["x-priority"]', f"out_dir={out}"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "live_evaluate: error: client.headers: 'x-priority' is not KEY=VALUE"
    assert not out.exists()  # a refused run leaves nothing behind (not even Hydra's .hydra/)


# --- R6, R4: nothing to compare, a re-sorted trace ------------------------------------------------
def test_results_without_the_baseline_have_no_paired_table(tmp_path: Path) -> None:
    rows = []
    for rnd in range(2):
        for pos, path in enumerate(("pid", "static")):
            row = row_from_result({"completed": 10, "failed": 0, "duration": 10.0, "request_goodput": 1.0 + rnd},
                                  scenario="steady", path=path, rnd=rnd, position=pos, requests=10)
            row.update(preemptions=0.0, peak_kv_usage=0.1, peak_running=3, acting=path, kv_dtype="auto",
                       engine_restarts=0, wall_s=10.0)
            rows.append(row)
    files = write_results(rows, tmp_path, plots=False)
    md = files["md"].read_text()
    assert "| steady | pid | 2 |" in md
    assert "difference to vllm_direct" not in md and "(paired)" not in md
    assert json.loads(files["json"].read_text())["paired_differences"] == []


def test_a_resorted_trace_says_so_in_its_summary(tmp_path: Path) -> None:
    p = tmp_path / "unsorted.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.0,300,20\n"
                 "2023-11-16 18:15:46.0,200,10\n2023-11-16 18:15:48.0,100,5\n")
    tr = read_trace(p, "azure", TraceOptions())
    assert tr.report.resorted and "re-sorted by arrival time" in tr.report.summary()
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,200,10\n"
                 "2023-11-16 18:15:47.0,300,20\n")
    assert "re-sorted" not in read_trace(p, "azure", TraceOptions()).report.summary()


# --- R3: an empty window says where the trace's requests are --------------------------------------
def test_an_empty_window_says_the_traces_span(tmp_path: Path) -> None:
    p = tmp_path / "small.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,200,10\n"
                 "2023-11-16 18:15:47.0,300,20\n2023-11-16 18:15:48.5,100,5\n")
    opts = TimedTraceOptions(trace=TraceOptions(start_s=100.0, duration_s=10.0, time_scale=2.0))
    with pytest.raises(ValueError, match=r"the window holds no request .*; the trace's requests arrive 0 s to 2.5 s "
                                         r"after its first timestamp \(start_s=100 and duration_s count from there\)$"):
        convert_trace(p, "azure", opts)


# --- R5: a relative trace path: the current folder first, then the repository ---------------------
def test_a_relative_trace_is_found_from_the_current_folder_then_the_repo(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.csv").write_text("x")
    assert resolve_trace_path("my.csv") == tmp_path / "my.csv"
    shipped = "data/traces/azure_llm_2023_conv.csv"
    assert resolve_trace_path(shipped) == REPO_ROOT / shipped  # not here: the repository's
    (tmp_path / "data" / "traces").mkdir(parents=True)
    (tmp_path / shipped).write_text("x")
    assert resolve_trace_path(shipped) == tmp_path / shipped  # here first
    out = tmp_path / "never"
    with pytest.raises(LiveEvaluationError, match=rf"^live_scenario 'steady': trace file not found: nope.csv "
                                                  rf"\(tried {tmp_path}/nope.csv and {REPO_ROOT}/nope.csv\)$"):
        live_evaluate(load_config(["live_scenario.trace=nope.csv", f"out_dir={out}"], config_name="live_evaluate"))
    assert not out.exists()


# --- R7: an out_dir holding a run is refused -------------------------------------------------------
@pytest.mark.parametrize("held", ["runs/r0_pid.log", "results.json"])
def test_an_out_dir_holding_a_run_is_refused_before_anything_starts(tmp_path: Path, held: str) -> None:
    out = tmp_path / "old"
    (out / held).parent.mkdir(parents=True, exist_ok=True)
    (out / held).write_text("old run")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    # A missing trace too: were the folder taken, the run would stop there, not start vLLM.
    cfg = load_config(["live_scenario.trace=/no/such/trace.csv", f"out_dir={out}"], config_name="live_evaluate")
    with pytest.raises(LiveEvaluationError, match=rf"^out_dir {out} already holds a run \({held.split('/')[0]}.*\); "
                                                  r"pick a new out_dir"):
        live_evaluate(cfg)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_an_out_dir_without_a_run_is_taken(tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()  # Hydra makes out_dir and writes its config there first
    (tmp_path / "runs").mkdir()  # an empty runs/ (a run stopped before its first client) holds nothing
    check_out_dir(tmp_path)
    check_out_dir(tmp_path / "new")


# --- R10: Ctrl-C leaves marked partial results, one line, exit 130 ---------------------------------
def _rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        row = row_from_result({"completed": 10, "failed": 0, "duration": 10.0, "request_goodput": 1.0},
                              scenario="steady", path=("vllm_direct", "pid")[i % 2], rnd=i // 2, position=i % 2,
                              requests=10)
        row.update(preemptions=0.0, peak_kv_usage=0.1, peak_running=3, wall_s=10.0)
        rows.append(row)
    return rows


def test_partial_results_say_they_are_partial(tmp_path: Path) -> None:
    def meta(done: int, interrupted: bool = False) -> dict:
        return {"complete": done == 4 and not interrupted, "runs_done": done, "runs_planned": 4,
                "interrupted": interrupted}

    files = write_results(_rows(3), tmp_path, meta=meta(3, interrupted=True), plots=False)
    assert files["md"].read_text().splitlines()[0] == "Interrupted after 3 of 4 runs: partial results."
    assert json.loads(files["json"].read_text())["meta"]["complete"] is False
    files = write_results(_rows(3), tmp_path, meta=meta(3), plots=False)  # a snapshot while the run goes on
    assert files["md"].read_text().startswith("Incomplete: 3 of 4 runs so far")
    files = write_results(_rows(4), tmp_path, meta=meta(4), plots=False)
    assert files["md"].read_text().startswith("# Live evaluation")
    assert json.loads(files["json"].read_text())["meta"]["complete"] is True


_INTERRUPTED_RUN = """
import contextlib, runpy, sys
import batchpilot.evaluation.live as le

@contextlib.contextmanager
def fake_gateway(*args, **kwargs):  # no vLLM: Ctrl-C comes while the first run waits on it
    class Gw:
        def upstream(self):
            raise KeyboardInterrupt
    try:
        yield Gw()
    finally:
        print("gateway stopped", flush=True)

le.running_gateway = fake_gateway
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ctrl_c_stops_the_gateway_marks_the_results_and_exits_130(tmp_path: Path) -> None:
    out = tmp_path / "cut"
    r = subprocess.run([sys.executable, "-c", _INTERRUPTED_RUN, str(SCRIPT), "paths=[vllm_direct,static]",
                        "rounds=2", f"gateway.model={tmp_path}", f"out_dir={out}"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip() == f"live_evaluate: interrupted after 0 of 4 runs; partial results in {out}"
    assert "gateway stopped" in r.stdout
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert (meta["complete"], meta["interrupted"], meta["runs_done"], meta["runs_planned"]) == (False, True, 0, 4)
    assert (out / "results.md").read_text().startswith("Interrupted after 0 of 4 runs")


# --- B5: SIGTERM ends the gateway and vLLM too -------------------------------------------------------
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _descendants(pid: int) -> dict[int, str]:
    """Every process under ``pid``, with its start time (so a reused pid is not taken for it)."""
    kids, out, todo = _children(), {}, [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            with_start = _start_time(c)
            if with_start is not None:
                out[c] = with_start
                todo.append(c)
    return out


def _start_time(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]  # a zombie has ended


def _mentioning(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().decode(errors="replace") and _start_time(int(d.name)):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_ends_the_gateway_and_vllm(tmp_path: Path, tiny_model_path: Path) -> None:
    """``timeout``, a CI cancel or ``kill`` send SIGTERM: the run stops (exit 143) and the
    gateway, its reaper and vLLM, with vLLM's engine processes, all end with it."""
    out = tmp_path / f"sigterm_{os.getpid()}_{time.monotonic_ns()}"
    log = tmp_path / "live_evaluate.log"
    cmd = [sys.executable, str(SCRIPT), "paths=[vllm_direct,static]", "rounds=2", "warmup.requests=0",
           "sim_twin=false", "plots=false", f"gateway.model={tiny_model_path}", f"out_dir={out}"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while "live_evaluate: gateway http" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "the gateway did not come up"
            time.sleep(0.2)
        tree = _descendants(proc.pid)
        assert len(tree) >= 3 and _mentioning(str(out))  # reaper, gateway, vLLM (+ its engine)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, log.read_text(errors="replace")[-2000:]
        deadline = time.monotonic() + 30
        while (left := [p for p, t in tree.items() if _start_time(p) == t] + _mentioning(str(out))):
            assert time.monotonic() < deadline, f"still running after SIGTERM: {left}"
            time.sleep(0.5)
        assert "SIGTERM: stopping the gateway" in log.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
