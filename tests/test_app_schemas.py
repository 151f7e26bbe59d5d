"""The apps' top configs (conf/evaluate.yaml, evaluate_matrix.yaml, calibrate.yaml,
live_evaluate.yaml, export.yaml, bench.yaml, serve_app.yaml) extend their schema
(``/schema/<app>@_here_``; batchpilot/schemas/ ``EvaluateApp``, ``CalibrateApp``, ...): a
mistyped top-level key or a value of the wrong type, in the file or on the command line, fails at
compose time naming the key, as in the groups (tests/test_config_schemas.py). A key added with
Hydra's ``+key=...`` passes compose; the apps that read their top config name it when they do."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from param_sweeps import sweep

from batchpilot.config import CONF_DIR, load_config
from batchpilot.nodes import ConfigError, from_node
from batchpilot.schemas import SCHEMAS, check_app
from batchpilot.schemas.bench import BenchApp, EnvBenchNode, PolicyBenchNode, SimBenchNode
from batchpilot.schemas.calibrate import CalibrateApp, Grid
from batchpilot.schemas.engine import EngineWarmupConfig
from batchpilot.schemas.evaluate import BestStaticConfig, EvaluateApp, LoadConfig
from batchpilot.schemas.export import ExportApp
from batchpilot.schemas.live import LiveClientNode, LiveEvaluateApp, LiveGatewayNode, LiveWarmupNode
from batchpilot.schemas.serve import ServeApp

#: App config -> its schema.
APPS = {
    "evaluate": EvaluateApp,
    "evaluate_matrix": EvaluateApp,
    "calibrate": CalibrateApp,
    "live_evaluate": LiveEvaluateApp,
    "export": ExportApp,
    "bench": BenchApp,
    "serve_app": ServeApp,
}

#: (file under conf/, config to compose, line as shipped, its mistyped-key and wrong-type
#: versions, the node the key lives in ("" = top level)).
CASES = [
    ("evaluate.yaml", "evaluate", "plots: true", "plot: true", "plots: maybe", ""),
    ("evaluate.yaml", "evaluate", "trace_windows: true", "trace_window: true", "trace_windows: often", ""),
    ("evaluate.yaml", "evaluate", "seeds: [0, 1, 2]", "seedz: [0, 1, 2]", "seeds: abc", ""),
    ("evaluate.yaml", "evaluate", "probe_completions: 300", "probe_completion: 300", "probe_completions: many",
     "load"),
    ("evaluate.yaml", "evaluate", "min_slo_attainment: 0.9", "min_slo_attain: 0.9", "min_slo_attainment: high",
     "best_static"),
    ("evaluate_matrix.yaml", "evaluate_matrix", "seeds: [0, 1, 2]", "seedz: [0, 1, 2]", "seeds: abc", ""),
    ("evaluate_matrix.yaml", "evaluate_matrix", "hindsight: true", "hindsite: true", "hindsight: perhaps",
     "best_static"),
    ("calibrate.yaml", "calibrate", "runs: 3", "run: 3", "runs: three", ""),
    ("calibrate.yaml", "calibrate", "report_rate_scale: 1.0", "report_rate: 1.0", "report_rate_scale: fast", ""),
    ("calibrate.yaml", "calibrate", "decode_steps: 24", "decode_step: 24", "decode_steps: many", "grid"),
    ("calibrate.yaml", "calibrate", "seconds: 45", "second: 45", "seconds: long", "warmup"),
    ("calibrate.yaml", "calibrate", "hbm_tb_s: 0.05", "hbm_tbs: 0.05", "hbm_tb_s: fast", "base"),
    ("live_evaluate.yaml", "live_evaluate", "rounds: 5", "round: 5", "rounds: five", ""),
    ("live_evaluate.yaml", "live_evaluate", "sim_twin: true", "sim_twins: true", "sim_twin: sometimes", ""),
    ("live_evaluate.yaml", "live_evaluate", "requests: 60", "request: 60", "requests: many", "warmup"),
    ("live_evaluate.yaml", "live_evaluate", "temperature: 0.0", "temp: 0.0", "temperature: hot", "client"),
    ("live_evaluate.yaml", "live_evaluate", "startup_timeout_s: 300", "startup_timeout: 300",
     "startup_timeout_s: long", "gateway"),
    ("export.yaml", "export", "parity_samples: 4096", "parity_sample: 4096", "parity_samples: many", ""),
    ("bench.yaml", "bench", "seed: 0", "sed: 0", "seed: zero", ""),
    ("bench.yaml", "bench", "arrival_rate_per_s: 24.0", "arrival_rate: 24.0", "arrival_rate_per_s: fast", "sim"),
    ("bench.yaml", "bench", "interval_s: 1.0", "interval: 1.0", "interval_s: soon", "env_bench"),
    ("bench.yaml", "bench", "n_calls: 20000", "n_call: 20000", "n_calls: lots", "policy_bench"),
]
#: ``make test-fast`` keeps one case per app config; ``make test`` runs them all.
CASE_PARAMS = sweep(CASES, [f"{c[0]}:{c[5] + '.' if c[5] else ''}{c[2].split(':')[0]}" for c in CASES],
                    fast={"evaluate.yaml:load.probe_completions", "calibrate.yaml:grid.decode_steps",
                          "live_evaluate.yaml:client.temperature", "bench.yaml:sim.arrival_rate_per_s"})


def _full(node: str, key: str) -> str:
    return f"{node}.{key}" if node else key


def _compose_edited(tmp_path: Path, rel: str, config: str, old: str, new: str) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    path = conf / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{rel} no longer holds {old!r} once: update this test"
    path.write_text(text.replace(old, new, 1))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        compose(config_name=config)


@pytest.mark.parametrize("rel,config,old,typo,wrong_type,node", CASE_PARAMS)
def test_a_mistyped_top_config_key_fails_at_compose(tmp_path, rel, config, old, typo, wrong_type, node) -> None:
    key = typo.split(":")[0]
    with pytest.raises(ConfigCompositionException) as info:
        _compose_edited(tmp_path, rel, config, old, typo)
    msg = str(info.value)
    assert f"Key '{key}' not in" in msg and f"full_key: {_full(node, key)}\n" in msg, msg


@pytest.mark.parametrize("rel,config,old,typo,wrong_type,node", CASE_PARAMS)
def test_a_wrong_type_in_a_top_config_fails_at_compose(tmp_path, rel, config, old, typo, wrong_type, node) -> None:
    key = wrong_type.split(":")[0]
    with pytest.raises(ConfigCompositionException) as info:
        _compose_edited(tmp_path, rel, config, old, wrong_type)
    msg = str(info.value)
    assert "ValidationError" in msg and f"full_key: {_full(node, key)}\n" in msg, msg


def test_a_mistyped_group_in_serve_app_fails_at_compose(tmp_path) -> None:
    """serve_app.yaml holds only groups; any other top-level key (here a misspelt group node) fails."""
    with pytest.raises(ConfigCompositionException) as info:
        _compose_edited(tmp_path, "serve_app.yaml", "serve_app", "shield:\n  breaker_shrink", "shields:\n  breaker_shrink")
    assert "Key 'shields' not in 'ServeApp'" in str(info.value)


@pytest.mark.parametrize("config,override,key", [
    ("evaluate", "seedz=[1]", "seedz"),
    ("evaluate", "best_static.tune_seed=[3]", "best_static.tune_seed"),
    ("evaluate", "load.modes=table", "load.modes"),
    ("evaluate_matrix", "workload_override={}", "workload_override"),
    ("calibrate", "grid.chunk=[32]", "grid.chunk"),
    ("calibrate", "warmup.max_batches=8", "warmup.max_batches"),
    ("calibrate", "base.peak_tflop=1.0", "base.peak_tflop"),
    ("live_evaluate", "round=2", "round"),
    ("live_evaluate", "gateway.modell=x", "gateway.modell"),
    ("live_evaluate", "client.header=[]", "client.header"),
    ("export", "parity=1", "parity"),
    ("bench", "sim.wall_second=1", "sim.wall_second"),
    ("bench", "policy_bench.calls=1", "policy_bench.calls"),
    ("serve_app", "serv=1", "serv"),
])
def test_a_mistyped_top_config_key_on_the_command_line_fails(config, override, key) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        load_config([override], config_name=config)
    cause = str(info.value.__cause__)
    assert f"Could not override '{key}'" in str(info.value) and f"full_key: {key}\n" in cause, cause


@pytest.mark.parametrize("config,override,key", [
    ("evaluate", "seeds=abc", "seeds"),
    ("evaluate", "policies=null", "policies"),
    ("evaluate", "trace_window_stride_s=long", "trace_window_stride_s"),
    ("evaluate", "plots=maybe", "plots"),
    ("evaluate", "load.probe_completions=many", "load.probe_completions"),
    ("evaluate_matrix", "best_static.batch_caps=big", "best_static.batch_caps"),
    ("evaluate_matrix", "best_static.tune_seeds=[x]", "best_static.tune_seeds[0]"),
    ("calibrate", "runs=three", "runs"),
    ("calibrate", "fit=sometimes", "fit"),
    ("calibrate", "grid.decode_steps=x", "grid.decode_steps"),
    ("calibrate", "warmup.max_batch=x", "warmup.max_batch"),
    ("live_evaluate", "rounds=five", "rounds"),
    ("live_evaluate", "client.max_concurrency=lots", "client.max_concurrency"),
    ("live_evaluate", "gateway.kv_cache_space_gib=big", "gateway.kv_cache_space_gib"),
    ("export", "parity_samples=many", "parity_samples"),
    ("bench", "policy_bench.n_calls=lots", "policy_bench.n_calls"),
    ("bench", "sim.max_waiting=x", "sim.max_waiting"),
])
def test_a_wrong_type_on_the_command_line_fails_naming_the_key(config, override, key) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        load_config([override], config_name=config)
    cause = str(info.value.__cause__)
    assert f"full_key: {key}\n" in cause, cause


def test_a_top_level_key_added_with_plus_is_named_when_the_app_reads_its_config() -> None:
    """``+key=...`` is Hydra's explicit "add this key" (struct mode lets it through at compose);
    the evaluation, the calibration and the live evaluation check their config against the
    schema again when they read it."""
    from rich.console import Console

    from batchpilot.evaluation.calibration import run_fit
    from batchpilot.evaluation.live import _check
    from batchpilot.evaluation.live_errors import LiveEvaluationError
    from batchpilot.evaluation.plan import EvalConfig, EvaluationError, compose_eval
    from batchpilot.evaluation.sim_to_real import run_report

    cfg, _ = compose_eval(["+seedz=[1]"])
    with pytest.raises(EvaluationError, match=r"(?s)Key 'seedz' not in 'EvaluateApp'.*full_key: seedz\n"):
        EvalConfig.from_cfg(cfg)
    cfg, _ = compose_eval(["+load.modee=table"], "evaluate_matrix")
    with pytest.raises(EvaluationError, match=r"(?s)Key 'modee' not in 'LoadConfig'.*full_key: load\.modee\n"):
        EvalConfig.from_cfg(cfg)
    cfg = load_config(["+runz=2"], config_name="calibrate")
    for run in (run_fit, run_report):  # named before any engine starts
        with pytest.raises(ConfigError, match=r"(?s)Key 'runz' not in 'CalibrateApp'.*full_key: runz\n"):
            run(cfg, Console(quiet=True))
    cfg = load_config(["+grid.chunk=[32]"], config_name="calibrate")
    with pytest.raises(ConfigError, match=r"full_key: grid\.chunk\n"):
        check_app(CalibrateApp, cfg)
    cfg = load_config(["+roundz=2", "out_dir=/tmp/x"], config_name="live_evaluate")
    with pytest.raises(LiveEvaluationError, match=r"(?s)Key 'roundz' not in 'LiveEvaluateApp'.*full_key: roundz\n"):
        _check(cfg)
    for name in ("export", "bench", "serve_app"):
        with pytest.raises(ConfigError, match="full_key: nope"):
            check_app(APPS[name], load_config(["+nope=1"], config_name=name))


def test_every_app_config_extends_its_schema_and_sets_every_key() -> None:
    """The schema is first in each defaults list; the composed config leaves no key missing (the
    schema's fields are required, the file holds every value) but export's two paths."""
    stored = {(g, n) for g, n, _ in SCHEMAS}
    for name, cls in APPS.items():
        own = "evaluate" if name == "evaluate_matrix" else name
        assert ("schema", own) in stored and dict(((g, n), c) for g, n, c in SCHEMAS)[("schema", own)] is cls
        defaults = [str(d) for d in OmegaConf.load(CONF_DIR / f"{name}.yaml").defaults]
        assert defaults[0] == ("evaluate" if name == "evaluate_matrix" else f"/schema/{name}@_here_"), defaults
        cfg = load_config(config_name=name)
        missing = OmegaConf.missing_keys(cfg)
        assert missing == ({"model_path", "out_dir"} if name == "export" else set()), (name, missing)
        assert set(cfg) == {f.name for f in dataclasses.fields(cls)}, name
        check_app(cls, cfg)


def test_the_app_schemas_hold_no_defaults() -> None:
    """One source for every value: the app schemas and their own nodes only declare keys and
    types (required fields), so none can disagree with the file. ``calibrate.warmup`` reuses
    ``EngineWarmupConfig`` (which has defaults): the file spells every one of its keys."""
    for cls in (EvaluateApp, BestStaticConfig, LoadConfig, CalibrateApp, Grid, LiveEvaluateApp, LiveWarmupNode,
                LiveClientNode, LiveGatewayNode, ExportApp, BenchApp, SimBenchNode, EnvBenchNode, PolicyBenchNode,
                ServeApp):
        for f in dataclasses.fields(cls):
            assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, (cls, f.name)
    warmup = OmegaConf.load(CONF_DIR / "calibrate.yaml").warmup
    assert set(warmup) == {f.name for f in dataclasses.fields(EngineWarmupConfig)}


def test_the_shipped_app_configs_build_their_nodes() -> None:
    from batchpilot.evaluation.plan import EvalConfig, compose_eval

    for name in ("evaluate", "evaluate_matrix"):
        ecfg = EvalConfig.from_cfg(compose_eval([], name)[0])
        assert ecfg.best_static.tune_seeds == (3,) and ecfg.load.mode == "probe"
    cal = load_config(config_name="calibrate")
    grid = from_node(Grid, cal.grid)
    assert grid.batch_sizes[0] == 1 and isinstance(grid.chunks, tuple) and grid.max_decode_tokens == 32768
    assert from_node(EngineWarmupConfig, cal.warmup).seconds == 45.0
    assert cal.base.kv8_dtypes == ["fp8", "fp8_e4m3", "fp8_e5m2"] and cal.base.roofline_p == 2.0
    live = load_config(config_name="live_evaluate")
    assert live.gateway.kv_cache_space_gib == 1 and live.client.max_concurrency is None


@pytest.mark.parametrize("script, args", [
    ("export.py", ["model_path=nowhere.zip"]),
    ("bench.py", ["target=sim"]),
    ("serve.py", []),
])
def test_the_other_apps_name_a_key_added_with_plus(script: str, args: list[str]) -> None:
    """export, bench and serve re-check their top config where they read it, before any work."""
    import subprocess
    import sys

    root = CONF_DIR.parent
    out = subprocess.run([sys.executable, str(root / "scripts" / script), "+seedz=1", *args],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "Key 'seedz' not in" in out.stderr + out.stdout


@pytest.mark.parametrize("bad, says", [
    ("slo.tpot_ms=-5", "slo.tpot_ms must be a positive number of milliseconds or null, got -5.0"),
    ("slo.ttft_ms=nan", "slo.ttft_ms must be a positive number"),
    ("serve.log_level=bogus", "serve.log_level='bogus'; one of"),
    ("serve.startup_timeout_s=0", "serve.startup_timeout_s must be > 0"),
    ("shield.memory_ceiling=1.5", "shield.memory_ceiling must be in (0, 1]"),
])
def test_the_gateway_refuses_a_bad_value_in_one_line_before_it_starts(bad: str, says: str, tmp_path) -> None:
    """Values that used to surface after the upstream was healthy, inside a uvicorn traceback
    (a negative SLO), or never (a NaN SLO, an unknown log level)."""
    import subprocess
    import sys

    root = CONF_DIR.parent
    out = subprocess.run([sys.executable, str(root / "scripts" / "serve.py"), "serve.upstreams=[http://127.0.0.1:9]",
                          f"hydra.run.dir={tmp_path}", bad],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"serve: error: {says}" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("bad, says", [
    ("slo.ttft_ms=nan", "the training environment cannot be built: slo.ttft_ms must be a positive number"),
    ("shield.memory_ceiling=inf", "shield.memory_ceiling must be in (0, 1], got inf"),
    ("train.learning_rate=nan", "train.learning_rate must be a finite number > 0, got nan"),
    ("train.validation.baseline=nosuch", "train.validation.baseline='nosuch' is not in conf/policy"),
])
def test_training_refuses_a_bad_value_in_one_line_before_any_step(bad: str, says: str, tmp_path) -> None:
    """Values that used to train for the whole run and then fail at export (an infinite SLO),
    fail in torch (NaN), or surface as a worker's ConnectionResetError (a bad shield value)."""
    import subprocess
    import sys

    root = CONF_DIR.parent
    out = subprocess.run([sys.executable, str(root / "scripts" / "train.py"), "logger=none",
                          f"hydra.run.dir={tmp_path}", bad], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "train: error: " in out.stderr and says in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "best").exists() and not list(tmp_path.glob("*.zip"))


def test_training_names_a_malformed_baseline_file_before_any_step(tmp_path) -> None:
    """A user's baseline policy file that is not a mapping was read only after the run had
    started (W&B, workers), as an assertion."""
    import subprocess
    import sys

    root = CONF_DIR.parent
    (tmp_path / "conf" / "policy").mkdir(parents=True)
    (tmp_path / "conf" / "policy" / "listed.yaml").write_text("- pid\n")
    out = subprocess.run([sys.executable, str(root / "scripts" / "train.py"), "logger=none",
                          f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "train.validation.baseline=listed",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "train: error: train.validation.baseline='listed': " in out.stderr, out.stderr[-2000:]
    assert "policy/listed.yaml: a config file must hold a mapping" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("bad, says", [
    ("kv.test_seeds=[]", "kv.test_seeds is empty"),
    ("kv.counterfactual_episodes=1", "kv.counterfactual_episodes=1 is split over kv.n_envs=2 processes"),
    ("kv.epoch_s=0", "kv.epoch_s must be a finite number of engine seconds > 0"),
])
def test_the_kv_agents_training_refuses_a_bad_value_before_it_trains(bad: str, says: str, tmp_path) -> None:
    """An empty test-seed list used to fail after the whole ~17 min run, too few
    counterfactual episodes as an IndexError inside torch."""
    import subprocess
    import sys

    root = CONF_DIR.parent
    out = subprocess.run([sys.executable, str(root / "scripts" / "train_kv.py"), "logger=none",
                          f"hydra.run.dir={tmp_path}", bad], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"train_kv: error: {says}" in out.stderr and "Traceback" not in out.stderr


def test_bench_refuses_a_rate_or_wall_time_of_zero(tmp_path) -> None:
    import subprocess
    import sys

    root = CONF_DIR.parent
    for bad, says in (("sim.arrival_rate_per_s=0", "sim.arrival_rate_per_s must be a finite number > 0"),
                      ("sim.wall_seconds=0", "sim.wall_seconds must be a finite number > 0")):
        out = subprocess.run([sys.executable, str(root / "scripts" / "bench.py"), "target=sim", bad,
                              f"hydra.run.dir={tmp_path}"], cwd=root, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and f"bench: error: {says}" in out.stderr and "Traceback" not in out.stderr
