"""Evaluation: rows, table, plots, determinism, best_static's objective, clear errors."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from batchpilot.config import REPO_ROOT
from batchpilot.evaluation import report as rep
from batchpilot.evaluation.matrix import GridPoint, evaluate, pick_best
from batchpilot.evaluation.plan import EvaluationError, compose_eval, workload_overrides

#: A short, loaded Poisson window: 2 controllers × 3 seeds finish in seconds.
SMALL = [
    "policies=[pid,vllm_default]",
    "workload=poisson",
    "workload.duration_s=20",
    "workload.rate=40",
    "seeds=[0,1,2]",
    "logger=none",
]


TRACE = ["policies=[pid]", "seeds=[0]", "logger=none", "workload=trace"]


def _run(tmp: Path, extra: list[str] = (), base: list[str] = SMALL) -> list[dict]:
    overrides = [*base, f"out_dir={tmp}", *extra]
    cfg, _ = compose_eval(overrides)
    return evaluate(cfg, overrides)


# --- statistics and objective ----------------------------------------------------------------
@pytest.mark.parametrize("df,expected", [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042)])
def test_t_quantile_matches_tables(df: int, expected: float) -> None:
    assert rep.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)


def test_mean_ci_uses_t_interval_and_ignores_nan() -> None:
    mean, half, n = rep.mean_ci([1.0, 2.0, 3.0, math.nan])
    assert (mean, n) == (2.0, 3)
    assert half == pytest.approx(4.303 * 1.0 / math.sqrt(3), rel=1e-3)
    assert math.isnan(rep.mean_ci([5.0])[1])


def test_best_static_objective_prefers_goodput_above_the_attainment_floor() -> None:
    pts = [
        GridPoint(256, "fifo", "auto", request_goodput=30.0, slo_attainment=0.80),
        GridPoint(64, "fifo", "auto", request_goodput=25.0, slo_attainment=0.95),
        GridPoint(32, "fifo", "auto", request_goodput=20.0, slo_attainment=0.99),
    ]
    assert pick_best(pts, 0.9).batch_cap == 64
    # Nobody reaches the floor: the most attaining point wins.
    assert pick_best(pts, 0.999).batch_cap == 32


def test_workload_overrides_user_groups_win_and_list_keys_are_dropped() -> None:
    user = ["workloads=[bursty,mooncake]", "workload=poisson", "model=llama3_70b", "seeds=[0]"]
    out = workload_overrides(user, "mooncake", ["model=deepseek_v3", "hardware=h200"])
    assert out == ["model=llama3_70b", "seeds=[0]", "workload=mooncake", "hardware=h200"]


# --- a small run -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("eval")
    return out, _run(out)


@pytest.mark.slow  # a whole evaluation run (the module's small_run)
def test_small_run_writes_rows_with_every_key(small_run: tuple[Path, list[dict]]) -> None:
    out, rows = small_run
    assert len(rows) == 2 * 3
    data = json.loads((out / "results.json").read_text())
    assert isinstance(data, list) and len(data) == 6
    for r in data:
        assert set(rep.ROW_KEYS) <= set(r)
        assert r["completed"] > 0 and r["request_throughput"] > 0
        assert 0.0 <= r["slo_attainment"] <= 1.0
        assert r["error"] == ""
    assert {(r["policy"], r["seed"]) for r in data} == {(p, s) for p in ("pid", "vllm_default") for s in (0, 1, 2)}
    with (out / "results.csv").open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == rep.ROW_KEYS
        assert len(list(reader)) == 6
    # Every request's fate is counted (evaluation drains): completed + rejected = arrivals.
    assert len({r["completed"] + r["rejected"] for r in data if r["seed"] == 0}) == 1


@pytest.mark.slow  # a whole evaluation run (the module's small_run)
def test_small_run_writes_the_table_and_plots(small_run: tuple[Path, list[dict]]) -> None:
    out, rows = small_run
    md = (out / "results.md").read_text()
    assert "| poisson | llama3_8b/h100 | pid | 3 |" in md and "| poisson | llama3_8b/h100 | vllm_default | 3 |" in md
    assert "±" in md and "request_goodput" in md
    assert rep.markdown_table(rows) in md
    for name in ("timeline_poisson.png", "goodput_vs_slo.png"):
        p = out / "plots" / name
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tl = json.loads((out / "timelines.json").read_text())
    assert {(t["policy"], t["seed"]) for t in tl} == {("pid", 0), ("vllm_default", 0)}  # the first seed
    assert all(len(t["batch_cap"]) == len(t["time"]) > 10 for t in tl)


@pytest.mark.slow  # an evaluation run
def test_timeline_seeds_keep_each_seeds_own_episode(tmp_path: Path) -> None:
    """``timeline_seeds`` names the episodes whose timelines are kept: each is that seed's own
    (seeds draw different arrivals), and every other seed's is not written."""
    _run(tmp_path, ["policies=[pid]", "timeline_seeds=[2,0]", "plots=false"])
    tl = {t["seed"]: t for t in json.loads((tmp_path / "timelines.json").read_text())}
    assert sorted(tl) == [0, 2]
    assert tl[0]["arrival_rate"] != tl[2]["arrival_rate"]
    again = tmp_path / "again"
    _run(again, ["policies=[pid]", "seeds=[2]", "plots=false"])
    assert json.loads((again / "timelines.json").read_text())[0]["arrival_rate"] == tl[2]["arrival_rate"]


@pytest.mark.parametrize("seeds,why", [("[3]", r"\[3\] not scored"), ("[]", r"got \[\]"), ("[1,1]", r"got \[1, 1\]")])
def test_timeline_seeds_must_be_scored_seeds(seeds: str, why: str) -> None:
    from batchpilot.evaluation.plan import EvalConfig

    cfg, _ = compose_eval([*SMALL, f"timeline_seeds={seeds}"])
    with pytest.raises(EvaluationError, match=r"timeline_seeds must be distinct seeds of seeds=\[0, 1, 2\].*" + why):
        EvalConfig.from_cfg(cfg)


@pytest.mark.slow  # a whole evaluation run (the module's small_run)
def test_rows_are_deterministic_by_seed(small_run: tuple[Path, list[dict]], tmp_path: Path) -> None:
    _, rows = small_run
    again = _run(tmp_path)

    def strip(rs: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "wall_s"} for r in rs]

    assert strip(again) == strip(rows)
    by_seed = {r["seed"]: r["completed"] for r in rows if r["policy"] == "pid"}
    assert len(set(by_seed.values())) > 1  # seeds really draw different workloads


@pytest.mark.slow
def test_pid_keeps_p99_ttft_nearer_target_than_vllm_default(tmp_path: Path) -> None:
    """Issue 3's bar, on the simulator (Llama-3-8B on H100): on bursty traffic PID serves more
    requests within the SLO than vLLM's default (goodput and attainment over offered requests,
    means over the seeds), both p99 TTFTs above the 1 s target (bursts exceed capacity). PID's
    p99 TTFT is no longer below vLLM's there: vLLM as shipped is first come, first served in its
    own queue (envs/server_env.py; its old stand-in ordered admission by priority, which left the
    low-priority third waiting past everyone), while PID's admission serves on-time requests first
    and lets the late ones wait (52 s against 11.5 s measured). On the Azure conversation trace both serve every request within the SLO; PID's
    p99 TTFT is no longer below vLLM's there: admission keeps predicted memory within the 80 %
    ceiling per request (issue 14), vLLM as shipped fills its 90 %, so at its peaks (~170 in
    flight) PID's requests wait a little (282 -> 362 ms measured, still far inside 1 s)."""
    rows = _run(
        tmp_path,
        base=["policies=[pid,vllm_default]", "workloads=[bursty,azure_conv]", "seeds=[0,1,2]",
              "logger=none", "plots=false"],
    )

    def mean(policy: str, workload: str, metric: str) -> float:
        vals = [r[metric] for r in rows if r["policy"] == policy and r["workload"] == workload]
        assert len(vals) == 3 and all(r["model"] == "llama3_8b" and r["hardware"] == "h100" for r in rows)
        return sum(vals) / len(vals)

    for metric in ("request_goodput", "slo_attainment"):
        assert mean("pid", "bursty", metric) > mean("vllm_default", "bursty", metric)
    assert 1000.0 < mean("pid", "bursty", "p99_ttft_ms") and 1000.0 < mean("vllm_default", "bursty", "p99_ttft_ms")
    for policy in ("pid", "vllm_default"):
        assert mean(policy, "azure_conv", "p99_ttft_ms") < 1000.0
        assert mean(policy, "azure_conv", "slo_attainment") == 1.0
    assert mean("pid", "azure_conv", "request_goodput") == pytest.approx(mean("vllm_default", "azure_conv", "request_goodput"), rel=0.01)


def test_best_static_searches_its_grid(tmp_path: Path) -> None:
    rows = _run(
        tmp_path,
        [
            "policies=[best_static]",
            "seeds=[0,1]",
            "best_static.batch_caps=[4,64]",
            "best_static.bucketing=[fifo]",
            "best_static.kv_dtypes=[auto]",
            "plots=false",
        ],
    )
    search = json.loads((tmp_path / "best_static_search.json").read_text())
    assert [p["batch_cap"] for p in search] == [4, 64]
    chosen = [p for p in search if p["chosen"]]
    assert len(chosen) == 1
    tuned = [r for r in rows if r["policy"] == "best_static"]
    assert len(tuned) == 2 and all(r["knobs"] == f"cap={chosen[0]['batch_cap']} fifo kv=auto" for r in tuned)
    # The winner is the grid's best by the objective on the tuning seed.
    best = max(search, key=lambda p: p["request_goodput"] if p["slo_attainment"] >= 0.9 else -1)
    assert chosen[0]["batch_cap"] == best["batch_cap"] or all(p["slo_attainment"] < 0.9 for p in search)
    # The hindsight bound: the grid's best on the scored seeds, its own rows, labelled.
    hind = [p for p in search if p["hindsight_chosen"]]
    assert len(hind) == 1 and all(math.isfinite(p["hindsight_goodput"]) for p in search)
    bound = [r for r in rows if r["policy"] == "best_static_hindsight"]
    assert [r["seed"] for r in bound] == [0, 1]
    assert all(r["knobs"] == f"cap={hind[0]['batch_cap']} fifo kv=auto" for r in bound)
    mean = sum(r["request_goodput"] for r in bound) / 2
    assert mean == pytest.approx(hind[0]["hindsight_goodput"])
    md = (tmp_path / "results.md").read_text()
    assert "best_static_hindsight" in md and "upper bound" in md


# --- errors ----------------------------------------------------------------------------------
def test_missing_trace_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    with pytest.raises(EvaluationError, match=r"trace file not found: .*nope\.csv"):
        _run(tmp_path, [f"workload.path={missing}", "workload.format=azure"], base=TRACE)


def test_malformed_trace_file_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,abc\n")
    with pytest.raises(EvaluationError, match=r"bad\.csv:2"):
        _run(tmp_path, [f"workload.path={bad}", "workload.format=azure"], base=TRACE)
    assert not (tmp_path / "results.json").exists()


def test_unknown_policy_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EvaluationError, match="unknown policy 'pdi'"):
        _run(tmp_path, ["policies=[pdi]"])


# --- the Hydra app ---------------------------------------------------------------------------
@pytest.mark.slow
def test_script_runs_and_logs_to_wandb_offline(tmp_path: Path) -> None:
    """The entry point end to end, with W&B offline: table printed, run folder written."""
    cmd = [
        sys.executable, str(REPO_ROOT / "scripts" / "evaluate.py"),
        *[o for o in SMALL if not o.startswith(("logger", "seeds"))],
        "seeds=[0,1,2]", "logger=wandb", "policies=[aimd]", "workload.duration_s=10", f"out_dir={tmp_path}",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| poisson | llama3_8b/h100 | aimd | 3 |" in proc.stdout
    assert (tmp_path / "results.json").is_file() and (tmp_path / ".hydra" / "overrides.yaml").is_file()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and any(runs[0].glob("*.wandb"))


def test_unloadable_ppo_policy_is_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "no_policy"
    empty.mkdir()
    with pytest.raises(EvaluationError, match=r"policy 'ppo' cannot be built: .*no_policy.*policy_overrides\.ppo\.path"):
        _run(tmp_path, ["policies=[ppo,pid]", f"policy_overrides.ppo.path={empty}"])
    assert not (tmp_path / "results.json").exists()


def test_script_reports_config_errors_in_one_line(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "evaluate.py"), *TRACE,
           f"workload.path={tmp_path / 'missing.csv'}", f"out_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 2
    assert "evaluate: error: workload 'trace:missing': trace file not found" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_deployment_the_shield_admits_nothing_on_is_named_before_any_episode(tmp_path: Path) -> None:
    # Llama-3-8B on a 24 GB card: weights and activations are 82 % of vLLM's 90 % share, above
    # the 80 % ceiling, so admission would refuse every request while the engine could serve.
    small_gpu = ["workload.duration_s=5", "hardware.memory_gb=24"]
    with pytest.raises(EvaluationError, match=r"policy 'pid': shield.memory_ceiling=0.8 leaves no room .*82%"):
        _run(tmp_path, small_gpu)
    assert not (tmp_path / "results.json").exists()
    rows = _run(tmp_path, [*small_gpu, "policies=[vllm_default]", "seeds=[0]"])  # no shield: it runs
    assert rows and rows[0]["completed"] > 0


def test_traces_users_bring_fail_before_any_episode_with_the_reason(tmp_path: Path) -> None:
    rows = "".join(f"2023-11-16 18:15:{i:02d}.0000000,100,10\n" for i in range(20))
    header = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    stray = tmp_path / "stray.csv"
    stray.write_text(header + rows + "2024-11-16 18:15:00.0000000,100,10\n")
    with pytest.raises(EvaluationError, match=r"21 requests over 31,6\d\d,\d{3} s, past max_episode_s=86400; "
                                              r"its longest gap .* \(a stray timestamp\?\)"):
        _run(tmp_path, ["workload.format=azure", f"workload.path={stray}"], base=TRACE)
    empty = tmp_path / "header_only.csv"
    empty.write_text(header)
    with pytest.raises(EvaluationError, match=r"'trace:header_only': no requests to replay .*0 rows read"):
        _run(tmp_path, ["workload.format=azure", f"workload.path={empty}"], base=TRACE)
    with pytest.raises(EvaluationError, match=r"workload=trace needs workload.path"):
        _run(tmp_path, [], base=TRACE)
    with pytest.raises(EvaluationError, match=r"workload 'poisson': model.num_layers=-4 is invalid"):
        _run(tmp_path, ["model.num_layers=-4"])
    assert not (tmp_path / "results.json").exists()


def test_model_and_hardware_files_from_a_search_path(tmp_path: Path) -> None:
    """A user's own deployment files outside conf/ (``hydra.searchpath``) reach every workload,
    which the evaluation composes again from the run's overrides."""
    conf = tmp_path / "conf"
    (conf / "hardware").mkdir(parents=True)
    h100 = (REPO_ROOT / "conf" / "hardware" / "h100.yaml").read_text()
    (conf / "hardware" / "my_gpu.yaml").write_text(h100.replace("name: h100", "name: my_gpu"))
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "evaluate.py"), "policies=[pid]", "seeds=[0]",
           "logger=none", "plots=false", "workload=poisson", "workload.duration_s=5",
           f"hydra.searchpath=[file://{conf}]", "hardware=my_gpu", f"out_dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| poisson | llama3_8b/my_gpu | pid | 1 |" in proc.stdout


def test_searchpath_files_are_names_the_lists_accept(tmp_path: Path) -> None:
    """``deployments=[...]`` and ``policies=[...]`` take a user's own files on
    ``hydra.searchpath`` as they take conf/'s (both were refused as unknown names), and a name
    found nowhere is refused with both folders' options."""
    conf = tmp_path / "conf"
    for group, src, name in (("hardware", "h100", "my_gpu"), ("policy", "pid", "my_pid")):
        (conf / group).mkdir(parents=True)
        text = (REPO_ROOT / "conf" / group / f"{src}.yaml").read_text()
        (conf / group / f"{name}.yaml").write_text(text.replace("name: h100", "name: my_gpu"))
    base = [sys.executable, str(REPO_ROOT / "scripts" / "evaluate.py"), "policies=[pid,my_pid]", "seeds=[0]",
            "logger=none", "plots=false", "workload=poisson", "workload.duration_s=5",
            f"hydra.searchpath=[file://{conf}]", f"out_dir={tmp_path / 'out'}"]
    proc = subprocess.run([*base, "deployments=[llama3_8b/my_gpu]"], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| poisson | llama3_8b/my_gpu | my_pid | 1 |" in proc.stdout
    proc = subprocess.run([*base, "deployments=[llama3_8b/nowhere]"], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 2
    assert "unknown hardware 'nowhere'" in proc.stderr and "'my_gpu'" in proc.stderr and "'h100'" in proc.stderr


def test_a_malformed_policy_file_is_one_error_naming_it(tmp_path: Path) -> None:
    """A user's policy file that is not a mapping, or not YAML, stops the run before any
    episode with the file named (it was an assertion / a YAML traceback through Hydra)."""
    conf = tmp_path / "conf" / "policy"
    conf.mkdir(parents=True)
    (conf / "listed.yaml").write_text("- pid\n- 1\n")
    (conf / "broken.yaml").write_text("kind: pid\n  target: [1\n")
    for name, why in (("listed", "a config file must hold a mapping"), ("broken", "not a readable config file")):
        proc = subprocess.run(
            [sys.executable, str(REPO_ROOT / "scripts" / "evaluate.py"), f"policies=[pid,{name}]", "seeds=[0]",
             "logger=none", "plots=false", "workload=poisson", "workload.duration_s=5",
             f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"out_dir={tmp_path / 'out'}"],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert re.search(f"evaluate: error: policy '{name}': .*policy/{name}.yaml: {why}", proc.stderr), proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.slow
def test_workloads_carry_their_model_and_hardware() -> None:
    from batchpilot.evaluation.plan import EvalConfig, plan_workload

    user = ["workloads=[poisson,mooncake]", "seeds=[0]", "logger=none", "best_static.tune_seeds=[3]"]
    ecfg = EvalConfig.from_cfg(compose_eval(user)[0])
    moon = plan_workload(user, "mooncake", ecfg)
    assert (moon.model, moon.hardware) == ("deepseek_v3", "h200")
    # 200 trace seconds at 0.3x (conf/evaluate.yaml), so the trace holds five windows.
    assert moon.num_requests > 500 and moon.episode_s >= 600
    assert moon.windows == {0: 0.0, 3: 600.0}
    assert (plan_workload(user, "poisson", ecfg).model) == "llama3_8b"
    # The single `workload=` group gets its overrides too; an explicit group on the command line wins.
    single = ["workload=mooncake", "model=llama3_70b", "seeds=[0]", "logger=none"]
    plan = plan_workload(single, None, EvalConfig.from_cfg(compose_eval(single)[0]))
    assert (plan.name, plan.model, plan.hardware) == ("mooncake", "llama3_70b", "h200")


def test_edited_model_or_hardware_fields_show_in_the_label() -> None:
    """A result on an H100 with 40 GB is not labelled as the 80 GB file it no longer matches."""
    from batchpilot.evaluation.plan import EvalConfig, plan_workload

    user = ["workload=poisson", "seeds=[0]", "logger=none", "hardware.memory_gb=40", "model.max_model_len=4096"]
    plan = plan_workload(user, None, EvalConfig.from_cfg(compose_eval(user)[0]))
    assert (plan.model, plan.hardware) == ("llama3_8b(max_model_len=4096)", "h100(memory_gb=40)")
    assert float(plan.cfg.hardware.memory_gb) == 40
    plain = ["workload=poisson", "seeds=[0]", "logger=none", "hardware=a100_80gb"]
    assert plan_workload(plain, None, EvalConfig.from_cfg(compose_eval(plain)[0])).hardware == "a100_80gb"


def test_live_engine_runs_its_own_model_not_the_workloads() -> None:
    from batchpilot.evaluation.plan import EvalConfig, extra_overrides

    user = ["engine=vllm", "workload=mooncake"]
    cfg, _ = compose_eval(user)
    ecfg = EvalConfig.from_cfg(cfg)
    assert cfg.engine.kind == "vllm" and cfg.model.name == "tiny_llama"
    assert extra_overrides(ecfg, "mooncake", "vllm") == ()
    assert extra_overrides(ecfg, "mooncake", "sim")[:2] == ("model=deepseek_v3", "hardware=h200")


# --- a matrix that tells controllers apart ---------------------------------------------------
@pytest.mark.slow
def test_trace_seeds_replay_distinct_windows(tmp_path: Path) -> None:
    """On a trace each seed is its own window (start_s + seed x duration_s), so the rows differ
    by seed and the CI is a real interval; a seed past the trace's end is a clear error."""
    base = ["policies=[pid]", "workload=azure_conv", "workload.duration_s=60", "seeds=[0,1,2]",
            "logger=none", "plots=false"]
    rows = _run(tmp_path, base=base)
    assert [r["window_start_s"] for r in rows] == [0.0, 60.0, 120.0]
    assert len({r["completed"] + r["rejected"] for r in rows}) == 3  # other requests, not a re-run
    assert len({r["request_goodput"] for r in rows}) > 1
    assert rep.mean_ci([r["request_goodput"] for r in rows])[1] > 0  # a real interval, not 0
    with pytest.raises(EvaluationError, match=r"seed 70 .*room for 58 windows of 60 s"):
        _run(tmp_path, ["seeds=[0,70]"], base=base)


def test_tune_seeds_must_not_overlap_scored_seeds(tmp_path: Path) -> None:
    from batchpilot.evaluation.plan import EvalConfig

    cfg, _ = compose_eval([*SMALL, "policies=[best_static]", "best_static.tune_seeds=[2,5]"])
    with pytest.raises(EvaluationError, match=r"tune_seeds \[2, 5\] overlap seeds \[0, 1, 2\] at \[2\]"):
        EvalConfig.from_cfg(cfg)
    # The old spelling is not a key of best_static (schema/evaluate: BestStaticConfig).
    cfg, _ = compose_eval([*SMALL, "policies=[best_static]", "+best_static.tune_seed=0"])
    with pytest.raises(EvaluationError, match=r"(?s)Key 'tune_seed' not in 'BestStaticConfig'.*full_key: best_static\.tune_seed"):
        EvalConfig.from_cfg(cfg)
    with pytest.raises(EvaluationError, match=r"config: Could not override 'best_static\.tune_seed'") as e:
        compose_eval([*SMALL, "policies=[best_static]", "best_static.tune_seed=0"])
    assert isinstance(e.value.__cause__, ConfigCompositionException)
    # Disjoint: fine, and the tuning seed's episodes are not among the rows.
    cfg, _ = compose_eval([*SMALL, "policies=[best_static]", "best_static.tune_seeds=[7]"])
    assert EvalConfig.from_cfg(cfg).all_seeds == (0, 1, 2, 7)


#: Overload with half the requests shed-able (priority 1): the shield's breaker sheds them.
OVERLOAD = [
    "workload=poisson", "workload.duration_s=30", "workload.rate=90", "workload.priorities=[0.5,0.5]",
    "seeds=[0]", "logger=none", "plots=false",
]


@pytest.mark.slow
def test_vllm_default_runs_as_shipped_never_shed_knobs_fixed(tmp_path: Path) -> None:
    rows = _run(tmp_path, ["policies=[vllm_default,pid]"], base=OVERLOAD)
    by = {r["policy"]: r for r in rows}
    assert by["vllm_default"]["rejected"] == 0 and by["vllm_default"]["shield_interventions"] == 0
    assert by["vllm_default"]["knobs"] == "cap=256 fifo kv=auto"
    tl = {t["policy"]: t for t in json.loads((tmp_path / "timelines.json").read_text())}
    assert set(tl["vllm_default"]["batch_cap"]) == {256.0}
    # The same policy behind the shield is shed and cut at this load: the test can tell.
    shielded = _run(
        tmp_path / "shielded", ["policies=[vllm_default]", "policy_overrides.vllm_default.as_shipped=false"],
        base=OVERLOAD,
    )[0]
    assert shielded["rejected"] > 0 and shielded["shield_interventions"] > 0


@pytest.mark.slow
def test_deployments_axis_gives_a_row_per_cell_with_its_load(tmp_path: Path) -> None:
    rows = _run(
        tmp_path,
        ["deployments=[llama3_8b/h100,tiny_llama/cpu_tiny]", "load.probe_completions=50"],
        base=["policies=[pid,vllm_default]", "workload=poisson", "workload.duration_s=10", "seeds=[0,1]",
              "logger=none", "plots=false"],
    )
    cells = [(r["model"], r["hardware"], r["policy"], r["seed"]) for r in rows]
    assert cells == [
        (m, h, p, s) for m, h in (("llama3_8b", "h100"), ("tiny_llama", "cpu_tiny"))
        for p in ("pid", "vllm_default") for s in (0, 1)
    ]
    mult = {r["hardware"]: r["rate_multiplier"] for r in rows}
    # Sized by the simulator's saturated capacity at these lengths, relative to llama3_8b/h100.
    assert mult["h100"] == 1.0 and mult["cpu_tiny"] > 0 and mult["cpu_tiny"] != 1.0
    n = {r["hardware"]: r["completed"] + r["rejected"] for r in rows if r["seed"] == 0}
    assert n["cpu_tiny"] == pytest.approx(n["h100"] * mult["cpu_tiny"], rel=0.25)
    md = (tmp_path / "results.md").read_text()
    assert "| poisson | tiny_llama/cpu_tiny | pid | 2 |" in md
    with pytest.raises(EvaluationError, match="drop \\['model'\\]"):
        _run(tmp_path, ["deployments=[llama3_8b/h100]", "model=qwen2_5_7b"])
    with pytest.raises(EvaluationError, match="unknown hardware 'h300'"):
        _run(tmp_path, ["deployments=[llama3_8b/h300]"])


def test_ppo_comparison_names_the_cells_where_ppo_loses() -> None:
    def r(pol: str, wl: str, good: float, att: float) -> dict:
        return {"policy": pol, "workload": wl, "model": "m", "hardware": "h", "request_goodput": good,
                "slo_attainment": att}

    rows = [r("ppo", "a", 10, 0.9), r("pid", "a", 5, 0.8), r("best_static", "a", 20, 0.95),
            r("ppo", "b", 4, 0.9), r("pid", "b", 5, 0.8)]
    table, summary = rep.ppo_comparison(rows)
    assert "| a | m/h | 10.00 | 5.00 | 20.00 | 2.00 | 0.500 | 0.900 | 0.800 | yes |" in table
    assert summary.startswith("PPO < PID (goodput at >= PID's SLO attainment, means over seeds, ties within 0.5%) "
                              "on 1 of 2 cells: b @ m/h (goodput")
    # A lost cell lists its episodes' ratios (seed by seed), so noise can be told from a loss.
    seeded = [{**x, "seed": 0} for x in rows] + [{**r("ppo", "b", 6, 0.9), "seed": 1}, {**r("pid", "b", 5, 0.8), "seed": 1}]
    assert "0 of 2 cells" in rep.ppo_comparison(seeded)[1]  # b's means: 5 vs 5, a tie
    lost = [*seeded, {**r("ppo", "b", 3, 0.9), "seed": 2}, {**r("pid", "b", 5, 0.8), "seed": 2}]
    assert "b @ m/h (goodput: 4.33 vs 5.00 req/s, 0.900 vs 0.800; per episode 0.800, 1.200, 0.600×)" in \
        rep.ppo_comparison(lost)[1]
    assert "0 of 1 cells." in rep.ppo_comparison([r("ppo", "a", 9.99, 0.8), r("pid", "a", 10.0, 0.8)])[1]
    # Geometric means over the cells with both (best_static ran on one); no pid_sf column without it.
    assert summary.endswith("Geometric means over the cells with both: PPO / pid 1.265× (2 cells), "
                            "PPO / best_static 0.500× (1 cells).")
    assert "pid_sf" not in table
    table, summary = rep.ppo_comparison([*rows, r("pid_sf", "a", 8, 0.85), r("pid_sf", "b", 0, 0.0)])
    assert "| a | m/h | 10.00 | 5.00 | 8.00 | 20.00 | 2.00 | 1.25 | 0.500 | 0.900 | 0.800 | yes |" in table
    assert "| b | m/h | 4.00 | 5.00 | 0.000 | – | 0.800 | – | – | 0.900 | 0.800 | **no** |" in table
    assert "PPO / pid_sf 1.250× (1 cells)" in summary  # a baseline that served nothing has no ratio


def test_episode_comparison_finds_the_worst_episode_behind_a_good_mean() -> None:
    """Means over seeds can hide one bad episode among good ones: the per-episode line names it."""
    def r(pol: str, seed: int, good: float, att: float, wl: str = "a") -> dict:
        return {**dict.fromkeys(rep.METRIC_KEYS, 1.0), "policy": pol, "workload": wl, "model": "m",
                "hardware": "h", "seed": seed, "request_goodput": good, "slo_attainment": att}

    rows = [r("ppo", 0, 20, 0.9), r("pid", 0, 10, 0.8), r("ppo", 1, 8, 0.5), r("pid", 1, 10, 0.6),
            r("ppo", 2, 5, 0.5), r("pid", 2, 5, 0.5), r("ppo", 3, 1, 0.1), r("pid", 3, 0, 0.0),
            r("ppo", 0, 3, 0.3, "b")]  # no pid on b: not compared
    (line,) = rep.episode_comparison(rows)
    logs = [math.log(2.0), math.log(0.8), 0.0]
    geo = math.exp(statistics.mean(logs))
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)  # t(0.975, 2 dof)
    lo, hi = geo / math.exp(half), geo * math.exp(half)
    assert line == (f"Per episode, PPO / pid: geometric mean {geo:.3f}× (95 % CI {lo:.3f}–{hi:.3f}×) over 3 "
                    "episodes (1 more where either served nothing within the SLO); below 0.95× in 1 (worst "
                    "0.800×: a @ m/h seed 1, 8.00 vs 10.00 req/s at 0.500 vs 0.600 attainment).")
    lines = rep.episode_comparison([*rows, r("pid_sf", 0, 20, 0.9), r("pid_sf", 1, 8, 0.5)])
    assert lines[1] == ("Per episode, PPO / pid_sf: geometric mean 1.000× (95 % CI 1.000–1.000×) over 2 episodes; "
                        "below 0.95× in 0.")
    one = rep.episode_comparison([r("ppo", 0, 2, 1), r("pid", 0, 1, 1)])  # one episode: no interval
    assert one == ["Per episode, PPO / pid: geometric mean 2.000× over 1 episodes; below 0.95× in 0."]
    assert rep.episode_comparison([r("pid", 0, 1, 1)]) == []
    md = rep.results_markdown(rows, [], [0, 1, 2, 3], [4])
    assert f"- {line}" in md


def test_the_per_episode_plot_pairs_the_same_episodes(tmp_path: Path) -> None:
    """``ppo_per_episode.png`` draws PPO against each baseline it ran beside, episode by episode
    (an episode where the baseline served nothing has no ratio and is left out, not an error);
    without PPO there is nothing to draw."""
    def r(pol: str, seed: int, good: float, wl: str = "a") -> dict:
        return {**dict.fromkeys(rep.METRIC_KEYS, 1.0), "policy": pol, "workload": wl, "model": "m",
                "hardware": "h", "seed": seed, "request_goodput": good}

    rows = [r("ppo", 0, 20), r("pid", 0, 10), r("ppo", 1, 8), r("pid", 1, 0), r("pid_sf", 1, 8), r("ppo", 2, 3, "b")]
    pairs = rep.episode_pairs(rows)
    assert {ref: [k for k, _, _ in ps] for ref, ps in pairs.items()} == {"pid": [("a", "m/h", 0), ("a", "m/h", 1)],
                                                                        "pid_sf": [("a", "m/h", 1)]}
    p = rep.plot_episode_ratios(rows, tmp_path)
    assert p == tmp_path / "ppo_per_episode.png" and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rep.plot_episode_ratios([r("pid", 0, 1), r("pid_sf", 0, 1)], tmp_path / "none") is None
    assert not (tmp_path / "none").exists()


def test_a_residual_policy_starts_where_the_pid_it_corrects_starts() -> None:
    """Factor 1 is PID, so the evaluation starts a residual policy at its PID's start cap, as it
    starts PID: started at the environment's default instead, it tracked PID's trajectory at
    half the cap (Mooncake @ Llama-3-70B/TP8: 2.10 vs 2.39 req/s, the same 2.39 from one start)."""
    from batchpilot.evaluation.matrix import make_controller, policy_config, start_knobs
    from batchpilot.evaluation.plan import EvalConfig, plan_workload

    user = ["seeds=[0]", "logger=none"]
    ecfg = EvalConfig.from_cfg(compose_eval(user)[0])
    plan = plan_workload(user, None, ecfg)
    pid_pol, ppo_pol = policy_config("pid", ecfg, plan), policy_config("ppo", ecfg, plan)
    ppo = make_controller(ppo_pol, plan)
    assert ppo.action_mode == "residual_pid"
    pid_start, ppo_start = start_knobs(pid_pol, plan), start_knobs(ppo_pol, plan, ppo)
    assert ppo_start is not None and pid_start is not None
    assert ppo_start.batch_cap == pid_start.batch_cap == min(128, plan.max_num_seqs)
    assert ppo_start.batch_cap != plan.cfg.control.initial_batch_cap  # not the environment's default
    # Without the controller (an absolute policy, or a caller that does not say), the environment's.
    assert start_knobs(ppo_pol, plan) is None


@pytest.mark.parametrize("deployment,memory_binds", [("deepseek_v3/h200", True), ("llama3_8b/h100", False)])
def test_kv_start_starts_8bit_only_where_memory_binds(deployment: str, memory_binds: bool) -> None:
    """``kv_start`` (on by default) starts a policy at 8-bit KV where the shield's memory
    ceiling holds fewer requests at 16 bits than the cap may reach: DeepSeek-V3 on an H200 (its
    weights take two thirds of the budget), not Llama-3-8B on an H100. PID starts as configured,
    and so does the policy with ``kv_start: false``."""
    from batchpilot.evaluation.matrix import make_controller, policy_config, start_knobs
    from batchpilot.evaluation.plan import EvalConfig, plan_workload

    user = ["seeds=[0]", "logger=none", f"deployments=[{deployment}]"]
    ecfg = EvalConfig.from_cfg(compose_eval(user)[0])
    plan = plan_workload(user, None, ecfg, ecfg.deployments[0])
    assert plan.kv_start == ("fp8" if memory_binds else "auto")
    ppo_pol = policy_config("ppo", ecfg, plan)
    assert ppo_pol["kv_start"] is True  # the default
    ppo = make_controller(ppo_pol, plan)
    started = start_knobs(ppo_pol, plan, ppo)
    assert started is not None and started.kv_dtype == plan.kv_start
    assert start_knobs({**ppo_pol, "kv_start": False}, plan, ppo).kv_dtype == "auto"  # type: ignore[union-attr]
    assert start_knobs(policy_config("pid", ecfg, plan), plan).kv_dtype == "auto"  # type: ignore[union-attr]
    # An explicit engine.kv_dtype is the user's choice for every controller, the policy's too.
    user8 = [*user, "engine.kv_dtype=fp8"]
    ecfg8 = EvalConfig.from_cfg(compose_eval(user8)[0])
    plan8 = plan_workload(user8, None, ecfg8, ecfg8.deployments[0])
    assert start_knobs(policy_config("ppo", ecfg8, plan8), plan8, ppo).kv_dtype == "fp8"  # type: ignore[union-attr]
