"""Structured-config schemas (batchpilot/schemas/): a group file that extends its schema is
checked at compose time, so a mistyped key or a value of the wrong type in YAML fails before
anything runs, with Hydra's message naming the key."""

from __future__ import annotations

import shutil
import typing
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from param_sweeps import sweep
from yaml import safe_load

from batchpilot.config import CONF_DIR, load_config, load_group_file
from batchpilot.core.admission import AdmissionConfig
from batchpilot.core.shield import ShieldConfig
from batchpilot.core.specs import HardwareSpec, ModelSpec
from batchpilot.core.telemetry import SLO
from batchpilot.envs.serving_env import slo_from_cfg
from batchpilot.envs.sim_engine import SimEngine
from batchpilot.envs.workloads import build_workload
from batchpilot.nodes import ConfigError, from_node, plain
from batchpilot.policies.callbacks import validation_cfg
from batchpilot.policies.controllers import build_controller
from batchpilot.schemas import SCHEMAS
from batchpilot.schemas.bench import ClientBenchConfig, GatewayBenchConfig
from batchpilot.schemas.engine import EngineWarmupConfig, SimEngineConfig, VLLMEngineConfig
from batchpilot.schemas.env import RewardConfig
from batchpilot.schemas.launcher import LauncherConfig
from batchpilot.schemas.live import LiveScenarioConfig
from batchpilot.schemas.policy import AIMDConfig, LookaheadConfig, PPOPolicyConfig, StaticConfig
from batchpilot.schemas.serve import ServeConfig
from batchpilot.schemas.train import LoggerConfig, TrainConfig
from batchpilot.workload_config import WORKLOAD_SCHEMAS, WorkloadConfigError, workload_from_node

#: (file under conf/, config to compose (name, or (name, overrides)), line as shipped, its
#: mistyped-key and wrong-type versions, the node the key lives in).
CASES = [
    ("shield/default.yaml", "config", "min_step: 1", "min_stepp: 1", "min_step: one", "shield"),
    ("slo/default.yaml", "config", "ttft_ms: 1000.0", "ttft_mss: 1000.0", "ttft_ms: fast", "slo"),
    ("env/default.yaml", "config", "max_num_long: 32", "max_num_lng: 32", "max_num_long: lots",
     "env.admission"),
    ("env/default.yaml", "config", "w_latency: 0.3", "w_latncy: 0.3", "w_latency: high", "env.reward"),
    ("serve/default.yaml", "serve_app", "max_queue_len: 4096", "max_queue_length: 4096", "max_queue_len: many",
     "serve.admission"),
    ("train/ppo.yaml", "config", "n_epochs: 10", "n_epoch: 10", "n_epochs: ten", "train"),
    ("logger/wandb.yaml", "config", "tensorboard: true", "tensorbord: true", "tensorboard: maybe",
     "logger"),
    ("env/default.yaml", "config", "episode_s: 120.0", "episode_sec: 120.0", "episode_s: long", "env"),
    ("env/default.yaml", "config", "memory_admission: true", "memory_admision: true", "memory_admission: often",
     "env"),
    ("hardware/h100.yaml", "config", "peak_tflops: 989.0", "peak_tflop: 989.0", "peak_tflops: fast", "hardware"),
    ("hardware/cpu_tiny.yaml", ("config", ["engine=vllm"]), "roofline_p: 1", "rooflinep: 1", "roofline_p: soft",
     "hardware"),
    ("model/llama3_8b.yaml", "config", "num_layers: 32", "num_layer: 32", "num_layers: many", "model"),
    ("model/deepseek_v3.yaml", ("evaluate", ["model=deepseek_v3"]), "kv_latent_dim: 576", "kv_latent: 576",
     "kv_latent_dim: mla", "model"),
    ("engine/sim.yaml", "config", "block_size: 16", "block_sz: 16", "block_size: big", "engine"),
    ("engine/vllm.yaml", ("config", ["engine=vllm"]), "max_num_seqs: 256", "max_num_seq: 256",
     "max_num_seqs: lots", "engine"),
    ("engine/vllm.yaml", ("evaluate", ["engine=vllm"]), "seconds: 60", "second: 60", "seconds: long",
     "engine.warmup"),
    ("policy/pid.yaml", "config", "kp: 1.0", "kpp: 1.0", "kp: strong", "policy"),
    ("policy/aimd.yaml", ("config", ["policy=aimd"]), "additive_increase: 4", "additive_inc: 4",
     "additive_increase: four", "policy"),
    ("policy/static.yaml", ("config", ["policy=static"]), "batch_cap: 64", "batch_capp: 64", "batch_cap: big",
     "policy"),
    ("policy/vllm_default.yaml", ("config", ["policy=vllm_default"]), "batch_cap: null", "batchcap: null",
     "batch_cap: all", "policy"),
    ("policy/ppo.yaml", ("config", ["policy=ppo"]), "ood_margin: 0.25", "ood_margn: 0.25", "ood_margin: wide",
     "policy"),
    ("serve/default.yaml", "serve_app", "port: 8000", "prot: 8000", "port: http", "serve"),
    ("serve/default.yaml", "serve_app", "stale_limit: 3", "stale_limits: 3", "stale_limit: soon",
     "serve.control"),
    ("control/default.yaml", "serve_app", "interval_s: 1.0", "interval_sec: 1.0", "interval_s: soon", "control"),
    ("control/default.yaml", "config", "window_s: 10.0", "window: 10.0", "window_s: long", "control"),
    ("serve/default.yaml", "serve_app", "min_samples: 20", "min_sample: 20", "min_samples: few",
     "serve.quality_guard"),
    ("serve/default.yaml", "serve_app", "prompts: []", "prompt: []", "prompts: 5", "serve.warmup"),
    ("bench.yaml", "bench", "num_pairs: 1500", "num_pair: 1500", "num_pairs: many", "gateway_bench"),
    ("bench.yaml", "bench", "calls_per_round: 200", "calls_per_rnd: 200", "calls_per_round: lots",
     "client_bench"),
    ("launcher/ray.yaml", ("evaluate", ["launcher=ray"]), "cpus_per_cell: 1", "cpus_per_cel: 1",
     "cpus_per_cell: one", "launcher"),
    ("live_scenario/kv_tight.yaml", ("live_evaluate", ["live_scenario=kv_tight"]), "time_scale: 2.0",
     "timescale: 2.0", "time_scale: fast", "live_scenario"),
    # workload: one schema per kind (workload/schema_<kind>); `randomized` is the default group.
    ("workload/randomized.yaml", "config", "onoff_prob: 0.4", "onoff_prb: 0.4", "onoff_prob: often", "workload"),
    ("workload/randomized.yaml", "config", "rate: [5.0, 110.0]", "rates: [5.0, 110.0]", "rate: 5.0", "workload"),
    ("workload/poisson.yaml", ("config", ["workload=poisson"]), "rate: 30.0", "ratee: 30.0", "rate: fast", "workload"),
    ("workload/bursty.yaml", ("evaluate", []), "on_s: 10.0", "on_sec: 10.0", "on_s: long", "workload"),
    ("workload/bursty.yaml", ("evaluate", []), "prompt_mean: 1000", "prompt_meen: 1000", "prompt_mean: big",
     "workload.lengths"),
    ("workload/ramp.yaml", ("config", ["workload=ramp"]), "ramp_end_s: 110.0", "ramp_stop_s: 110.0",
     "ramp_end_s: late", "workload"),
    ("workload/diurnal.yaml", ("config", ["workload=diurnal"]), "amplitude: 0.6", "amplitud: 0.6",
     "amplitude: high", "workload"),
    ("workload/azure_conv.yaml", ("config", ["workload=azure_conv"]), "time_scale: 3.0", "timescale: 3.0",
     "time_scale: fast", "workload"),
    ("workload/code_completion.yaml", ("evaluate", ["workload=code_completion"]), "start_on: false",
     "starts_on: false", "start_on: sometimes", "workload"),
]


#: The cases ``make test-fast`` keeps (one per kind of schema: a plain group, a nested node, a
#: default-swapped group, the serve app, a policy, a workload kind); ``make test`` runs them all.
CASE_PARAMS = sweep(CASES, [c[0] + ":" + c[2].split(":")[0] for c in CASES],
                    fast={"shield/default.yaml:min_step", "env/default.yaml:max_num_long",
                          "hardware/cpu_tiny.yaml:roofline_p", "control/default.yaml:interval_s",
                          "policy/ppo.yaml:ood_margin", "workload/bursty.yaml:prompt_mean"})


def _compose_edited(tmp_path: Path, rel: str, config: str | tuple[str, list[str]], old: str, new: str,
                    node: str) -> None:
    name, overrides = (config, []) if isinstance(config, str) else config
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    path = conf / rel
    text = path.read_text()
    if old in text:
        path.write_text(text.replace(old, new, 1))
    else:  # the file leaves the key at its dataclass default (tests/test_one_default.py): add it
        _set_in_file(path, rel, node, new)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        compose(config_name=name, overrides=overrides)


def _set_in_file(path: Path, rel: str, node: str, line: str) -> None:
    """``line`` (``key: value``) set in ``node`` (its full key, ``env.admission``) of the file:
    a group file holds its group's node (``shield``), a ``# @package _global_`` or app file the
    full key."""
    text = path.read_text()
    header = "".join(x for x in text.splitlines(keepends=True) if x.startswith("# @package"))
    inner = node if header or "/" not in rel else node.partition(".")[2]
    key, _, value = line.partition(":")
    cfg = OmegaConf.load(path)
    OmegaConf.update(cfg, f"{inner}.{key}" if inner else key, safe_load(value), merge=True)
    path.write_text(header + OmegaConf.to_yaml(cfg))


@pytest.mark.parametrize("rel,config,old,typo,wrong_type,key", CASE_PARAMS)
def test_a_mistyped_key_fails_at_compose(tmp_path, rel, config, old, typo, wrong_type, key) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        _compose_edited(tmp_path, rel, config, old, typo, key)
    msg = str(info.value)
    assert f"Key '{typo.split(':')[0]}' not in" in msg and f"full_key: {key}.{typo.split(':')[0]}" in msg, msg


@pytest.mark.parametrize("rel,config,old,typo,wrong_type,key", CASE_PARAMS)
def test_a_wrong_type_fails_at_compose(tmp_path, rel, config, old, typo, wrong_type, key) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        _compose_edited(tmp_path, rel, config, old, wrong_type, key)
    msg = str(info.value)
    assert "ValidationError" in msg and f"full_key: {key}.{wrong_type.split(':')[0]}" in msg, msg


def test_a_wrong_type_on_the_command_line_fails_naming_the_key() -> None:
    with pytest.raises(ConfigCompositionException, match="shield.max_step_frac"):
        load_config(["shield.max_step_frac=abc"])
    with pytest.raises(ConfigCompositionException, match="env.admission.max_queue_len"):
        load_config(["env.admission.max_queue_len=many"])


@pytest.mark.parametrize("config,overrides,key", [
    ("config", ["control.interval_s=soon"], "control.interval_s"),
    ("evaluate", ["control.initial_batch_cap=many"], "control.initial_batch_cap"),
    ("config", ["hardware.memory_gb=lots"], "hardware.memory_gb"),
    ("config", ["model.tensor_parallel=two"], "model.tensor_parallel"),
    ("config", ["engine.max_num_seqs=all"], "engine.max_num_seqs"),
    ("config", ["engine=vllm", "engine.kv_cache_space_gib=big"], "engine.kv_cache_space_gib"),
    ("config", ["engine=vllm", "engine.warmup.max_batch=big"], "engine.warmup.max_batch"),
    ("config", ["policy.settle_s=soon"], "policy.settle_s"),
    ("serve_app", ["policy=ppo", "policy.ood_margin=wide"], "policy.ood_margin"),
    ("serve_app", ["control.window_s=soon"], "control.window_s"),
    ("serve_app", ["serve.control.stale_limit=soon"], "serve.control.stale_limit"),
    ("serve_app", ["serve.quality_guard.enabled=perhaps"], "serve.quality_guard.enabled"),
    ("serve_app", ["serve.port=http"], "serve.port"),
    ("bench", ["gateway_bench.rate=fast"], "gateway_bench.rate"),
    ("bench", ["client_bench.rounds=many"], "client_bench.rounds"),
    ("evaluate", ["launcher=ray", "launcher.num_cpus=all"], "launcher.num_cpus"),
    ("live_evaluate", ["live_scenario.max_model_len=long"], "live_scenario.max_model_len"),
    ("config", ["workload.rate_scale=fast"], "workload.rate_scale"),
    ("config", ["workload.num_phases=2"], "workload.num_phases"),  # a range is [low, high]: [2,2]
    ("config", ["workload=poisson", "workload.lengths.prompt_mean=big"], "workload.lengths.prompt_mean"),
    ("evaluate", ["workload=mooncake", "workload.duration_s=all"], "workload.duration_s"),
    ("config", ["engine=vllm", "workload=ramp", "workload.seed_offset=x"], "workload.seed_offset"),
])
def test_a_wrong_type_on_the_command_line_fails_in_every_group(config, overrides, key) -> None:
    with pytest.raises(ConfigCompositionException, match=key.replace(".", r"\.")):
        load_config(overrides, config_name=config)


@pytest.mark.parametrize("config,overrides,key", [
    ("config", ["hardware.memory_gbb=80"], "hardware"),
    ("config", ["engine=vllm", "engine.max_seqs=8"], "engine"),
    ("config", ["policy.kpp=1.0"], "policy"),
    ("serve_app", ["serve.control.intervals=1.0"], "serve.control"),
    ("bench", ["gateway_bench.pairs=10"], "gateway_bench"),
    ("config", ["workload.rate_scal=1.0"], r"workload\.rate_scal"),
    ("config", ["workload=poisson", "workload.burstiness=0.5"], r"workload\.burstiness"),  # poisson has none
    ("evaluate", ["workload=azure_conv", "workload.lengths.prompt_mean=10"], r"workload\.lengths"),
])
def test_a_mistyped_key_on_the_command_line_fails_in_every_group(config, overrides, key) -> None:
    with pytest.raises(ConfigCompositionException, match=f"{key}"):
        load_config(overrides, config_name=config)


def test_a_key_added_on_the_command_line_fails_when_built() -> None:
    """``+shield.x=1`` is Hydra's explicit "add this key" (struct mode lets it through); building
    the object merges into the schema again and names it."""
    cfg = load_config(["+shield.max_step=0.3"])
    with pytest.raises(ValueError, match="Key 'max_step' not in 'ShieldConfig'"):
        ShieldConfig.from_cfg(cfg.shield)


def test_a_workload_key_added_on_the_command_line_fails_when_built() -> None:
    cfg = load_config(["workload=poisson", "+workload.burstiness=0.5"])
    with pytest.raises(WorkloadConfigError, match="workload.burstiness: Key 'burstiness' not in 'PoissonWorkload'"):
        build_workload(cfg.workload, np.random.default_rng(0), 8192)


@pytest.mark.slow
def test_every_shipped_workload_composes_and_builds() -> None:
    """Each conf/workload file extends its kind's schema and builds (``trace`` needs a path),
    also under engine=vllm, which sets workload.rate_scale for every kind."""
    for path in sorted((CONF_DIR / "workload").glob("*.yaml")):
        kind = OmegaConf.load(path).kind
        assert f"- schema_{kind}\n" in path.read_text(), f"{path} does not extend workload/schema_{kind}"
        for extra in ([], ["engine=vllm"]):
            node = load_config([f"workload={path.stem}", *extra]).workload
            if path.stem == "trace":
                assert OmegaConf.missing_keys(node) == {"workload.path"}
                with pytest.raises(WorkloadConfigError, match="workload.path: missing"):
                    build_workload(node, np.random.default_rng(0), 8192)
                continue
            wc = workload_from_node(node)
            assert isinstance(wc, WORKLOAD_SCHEMAS[kind]) and wc.rate_scale == (0.15 if extra else 1.0)


@pytest.mark.parametrize("config,overrides", [
    # tests/test_env.py, tests/test_residual.py, tests/test_live_env.py, tests/test_evaluate.py
    ("config", ["workload=poisson", "workload.lengths.prompt_mean=4000", "workload.duration_s=300"]),
    ("config", ["workload=bursty", "workload.rate_scale=1.5", "workload.duration_s=60"]),
    ("config", ["engine=vllm", "workload=poisson", "workload.rate=40", "workload.duration_s=20",
                "workload.lengths.prompt_mean=200", "workload.lengths.output_mean=24"]),
    ("evaluate", ["workload=poisson", "workload.duration_s=30", "workload.rate=90", "workload.priorities=[0.5,0.5]"]),
    # conf/calibrate.yaml's sim-to-real workloads, conf/evaluate.yaml's workload_overrides
    ("config", ["workload=bursty", "workload.duration_s=40", "workload.on_rate=40", "workload.off_rate=8",
                   "workload.on_s=8", "workload.off_s=12", "workload.lengths.prompt_mean=400",
                   "workload.lengths.output_mean=120"]),
    ("config", ["workload=azure_conv", "workload.time_scale=3.0", "workload.duration_s=120",
                   "workload.overflow=clip"]),
    ("evaluate", ["workload=mooncake", "model=deepseek_v3", "hardware=h200", "workload.duration_s=200"]),
    # scripts/bench.py, evaluation/live_twin.py, the generic trace group
    ("config", ["workload=poisson", "workload.rate=15.0"]),
    ("config", ["workload=trace", "workload.path=data/traces/azure_llm_2023_conv.csv", "workload.format=azure",
                "workload.start_s=30.0", "workload.time_scale=2.0", "workload.duration_s=null"]),
    ("config", ["workload=randomized", "workload.seed_offset=5000", "workload.num_phases=[2,2]"]),
])
def test_the_workload_overrides_used_in_the_code_base_compose_and_build(config, overrides) -> None:
    node = load_config(overrides, config_name=config).workload
    if node.kind == "trace":
        node.start_s = 10.0  # evaluation/plan.py sets a trace window's start
    node.rate_scale = float(node.rate_scale) * 2  # and scales the load (load.mode, per-deployment)
    assert len(build_workload(node, np.random.default_rng(0), 2048)) > 0


def test_the_validation_workloads_build() -> None:
    """conf/train/ppo.yaml's validation workloads: a group file plus overrides, checked against the
    kind's schema by policies/callbacks.py validation_cfg."""
    base = load_config()
    for name, v in base.train.validation.workloads.items():
        wl = validation_cfg(base, v.group, v.get("overrides") or {}).workload
        assert "defaults" not in wl
        assert len(build_workload(wl, np.random.default_rng(1000), 8192)) > 0, name
    with pytest.raises(WorkloadConfigError, match=r"workload\.on_rat: Key 'on_rat' not in 'OnOffWorkload'"):
        validation_cfg(base, "bursty", {"on_rat": 3.0})
    with pytest.raises(WorkloadConfigError, match=r"workload\.seed_offset: Value 'x'"):
        validation_cfg(base, "randomized", {"seed_offset": "x"})


def test_the_shipped_configs_build_their_objects() -> None:
    cfg = load_config()
    assert ShieldConfig.from_cfg(cfg.shield).dtype_restart_s == cfg.model.restart_base_s
    assert slo_from_cfg(cfg.slo) == SLO(1000.0, 100.0, None)
    rc = RewardConfig.from_cfg(cfg.env.reward, model_quality_cost=0.03)
    assert rc.quality_cost_8bit == 0.03  # null in the yaml = the model's prior
    TrainConfig.from_cfg(cfg.train)
    for logger in ("none", "tensorboard", "wandb"):
        LoggerConfig.from_cfg(load_config([f"logger={logger}"]).logger)
    serve = load_config(config_name="serve_app")
    assert ShieldConfig.from_cfg(serve.shield).breaker_shrink == 0.8


@pytest.mark.slow  # every shipped file of two groups composed
@pytest.mark.parametrize("group", ["hardware", "model"])
def test_every_shipped_hardware_and_model_composes_and_builds(group) -> None:
    cls = {"hardware": HardwareSpec, "model": ModelSpec}[group]
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        spec = cls.from_cfg(load_config([f"{group}={path.stem}"])[group])
        assert spec.name == path.stem


@pytest.mark.slow
def test_the_shipped_engines_policies_serve_and_bench_configs_build() -> None:
    cfg = load_config()
    assert not OmegaConf.missing_keys(cfg.env)  # env/schema's top-level keys are required
    assert SimEngine.from_cfg(cfg).cfg == SimEngineConfig()
    live = load_config(["engine=vllm"])
    assert (live.model.name, live.hardware.name) == ("tiny_llama", "cpu_tiny")
    assert from_node(VLLMEngineConfig, live.engine, drop=("kind", "warmup")) == VLLMEngineConfig()
    assert from_node(EngineWarmupConfig, live.engine.warmup).seconds == 60
    slo = SLO(ttft_ms=1000.0, tpot_ms=100.0, e2el_ms=None)
    for name in ("pid", "pid_sf", "aimd", "static", "vllm_default", "ppo", "lookahead"):
        node = load_config([f"policy={name}"]).policy
        assert build_controller(node, 256, slo) is not None
    pid = build_controller(load_config().policy, 256, SLO(ttft_ms=500.0, tpot_ms=40.0, e2el_ms=None))
    assert (pid.cfg.slo_ms, pid.cfg.tpot_slo_ms) == (40.0, 40.0)  # the SLO still comes from the slo group
    serve = ServeConfig.from_cfg(load_config(["serve.managed=true"], config_name="serve_app").serve)
    assert serve.control.stale_limit == 3 and serve.admission.max_queue_len == 4096
    bench = load_config(config_name="bench")
    assert GatewayBenchConfig.from_cfg(bench) == GatewayBenchConfig()
    assert ClientBenchConfig.from_cfg(bench.client_bench) == ClientBenchConfig()
    for name in ("evaluate", "evaluate_matrix", "calibrate", "live_evaluate"):
        load_config(config_name=name)
    for path in sorted((CONF_DIR / "live_scenario").glob("*.yaml")):
        node = load_config([f"live_scenario={path.stem}"], config_name="live_evaluate").live_scenario
        assert not OmegaConf.missing_keys(node), f"{path} leaves out {OmegaConf.missing_keys(node)}"
        assert from_node(LiveScenarioConfig, node).name == path.stem
    for kind in ("serial", "ray"):
        assert LauncherConfig.from_cfg(load_config([f"launcher={kind}"], config_name="evaluate").launcher).kind == kind


def _file_keys(path: Path, node: str | None = None) -> dict:
    data = OmegaConf.to_container(OmegaConf.load(path))
    data.pop("defaults", None)
    return data.get(node, {}) if node else data  # a node left at its defaults is not in the file


def _agree(yaml: dict, cls: type, where: str) -> None:
    defaults = OmegaConf.to_container(OmegaConf.structured(cls))
    for key, value in yaml.items():
        assert key in defaults, f"{where}.{key} is not a field of {cls.__name__}"
        if isinstance(value, dict) and isinstance(defaults[key], dict):
            _agree(value, typing.get_type_hints(cls)[key], f"{where}.{key}")
        else:
            assert defaults[key] == value, f"{where}.{key}: {value!r} in the YAML, {defaults[key]!r} in {cls.__name__}"


def test_the_shipped_defaults_are_the_dataclass_defaults() -> None:
    """One source for every default: where a group file spells out the settings a dataclass
    defaults to (the gateway's fallback PID, an engine built in code, ServeConfig.from_cfg({...}))
    the two agree."""
    vllm = _file_keys(CONF_DIR / "engine" / "vllm.yaml", "engine")
    warmup = vllm.pop("warmup", {})
    vllm.pop("kind")
    cases = [
        (_file_keys(CONF_DIR / "engine" / "sim.yaml"), SimEngineConfig, "engine"),
        (vllm, VLLMEngineConfig, "engine"),
        (warmup, EngineWarmupConfig, "engine.warmup"),
        ({k: v for k, v in _file_keys(CONF_DIR / "policy" / "aimd.yaml").items() if k != "kind"}, AIMDConfig, "policy"),
        ({k: v for k, v in _file_keys(CONF_DIR / "policy" / "static.yaml").items() if k not in ("kind", "name")},
         StaticConfig, "policy"),
        ({k: v for k, v in _file_keys(CONF_DIR / "policy" / "ppo.yaml").items() if k != "kind"}, PPOPolicyConfig,
         "policy"),
        ({k: v for k, v in _file_keys(CONF_DIR / "policy" / "lookahead.yaml").items() if k != "kind"},
         LookaheadConfig, "policy"),
        (_file_keys(CONF_DIR / "serve" / "default.yaml"), ServeConfig, "serve"),
        (_file_keys(CONF_DIR / "bench.yaml", "gateway_bench"), GatewayBenchConfig, "gateway_bench"),
        (_file_keys(CONF_DIR / "bench.yaml", "client_bench"), ClientBenchConfig, "client_bench"),
        (_file_keys(CONF_DIR / "env" / "default.yaml", "admission"), AdmissionConfig, "env.admission"),
        (_file_keys(CONF_DIR / "launcher" / "serial.yaml"), LauncherConfig, "launcher"),
    ]
    for yaml, cls, where in cases:
        _agree(yaml, cls, where)


def test_env_and_serve_spell_admission_alike() -> None:
    """One AdmissionConfig schema for training and serving: the same keys, the same settings."""
    env = load_config().env.admission
    serve = load_config(config_name="serve_app").serve.admission
    assert set(env) == set(serve)
    assert AdmissionConfig.from_cfg(env) == AdmissionConfig.from_cfg(serve)


#: Workload kinds no shipped file uses (the tests build them from mappings); stored so a file of
#: one can extend its schema.
UNSHIPPED_SCHEMAS = {("workload", "schema_gamma"), ("workload", "schema_mixture")}


def test_every_schema_is_extended_by_its_group() -> None:
    """Each stored schema is used, and every file of a group with a schema extends one: its own
    group's (``- schema``, ``- schema_<kind>``), a ``/schema/...@`` node, or another file of the
    group that does (``train/finetune_live`` extends ``ppo``)."""
    for group, name, _cls in SCHEMAS:
        if (group, name) in UNSHIPPED_SCHEMAS:
            continue
        if group == "schema":
            users = [p for p in CONF_DIR.rglob("*.yaml") if f"/schema/{name}@" in p.read_text()]
            assert users, f"no config extends schema/{name}"
        else:
            users = [p for p in (CONF_DIR / group).glob("*.yaml") if f"- {name}\n" in p.read_text()]
            assert users, f"no config extends {group}/{name}"
    for group in sorted({g for g, _, _ in SCHEMAS if g != "schema"}):
        files = sorted((CONF_DIR / group).glob("*.yaml"))
        for path in files:
            entries = OmegaConf.load(path).get("defaults") or []
            names = [str(e) for e in entries]
            ok = any(e.startswith("schema") or e.startswith("/schema/") or e in {f.stem for f in files}
                     for e in names)
            assert ok, f"{path} extends no schema (defaults: {names})"


def test_a_group_file_read_without_hydra_is_what_hydra_composes() -> None:
    """The evaluation and training read policy files without Hydra: a variant that extends
    another file of its group (``pid_sf`` extends ``pid``) must come out whole, as composed."""
    for path in sorted((CONF_DIR / "policy").glob("*.yaml")):
        composed = plain(load_config([f"policy={path.stem}"]).policy)
        read = plain(load_group_file("policy", path.stem))
        assert {k: composed[k] for k in read} == read, path.stem  # the schema adds unset keys
    sf = load_group_file("policy", "pid_sf")
    assert set(plain(load_group_file("policy", "pid"))) <= set(plain(sf))  # the parent's keys, and its own
    assert (sf.bucketing, sf.kind) == ("shortest_first", "pid") and list(sf.defaults) == ["schema_pid", "_self_"]


def test_a_group_file_that_extends_itself_or_nothing_or_is_malformed_is_one_error(tmp_path: Path) -> None:
    """A cycle, a missing parent and a malformed file (not a mapping, not YAML) are each one
    ``ConfigError`` naming the file, not an assertion or a bare YAML traceback."""
    (tmp_path / "policy").mkdir()
    cases = {
        "a": ("defaults:\n  - b\n  - _self_\nkind: pid\n", r"policy/a.yaml: its defaults come back to itself \(a -> b -> a\)"),
        "b": ("defaults:\n  - a\nkind: pid\n", None),
        "c": ("defaults:\n  - gone\nkind: pid\n", r"policy/gone.yaml not found .*known: \['a', 'b', 'c', 'd', 'e'\]"),
        "d": ("- pid\n- 1\n", r"policy/d.yaml: a config file must hold a mapping .*ListConfig"),
        "e": ("kind: pid\n  target: [1\n", r"policy/e.yaml: not a readable config file"),
    }
    for name, (text, _) in cases.items():
        (tmp_path / "policy" / f"{name}.yaml").write_text(text)
    for name, (_, says) in cases.items():
        if says is not None:
            with pytest.raises(ConfigError, match=says):
                load_group_file("policy", name, [tmp_path])


def test_the_secrets_are_not_config_keys() -> None:
    """serve.admin_token / serve.trusted_keys stay out of the serve schema (read from the
    environment or files), so setting one fails at compose time."""
    with pytest.raises(ConfigCompositionException, match="admin_token"):
        load_config(["serve.admin_token=x"], config_name="serve_app")
