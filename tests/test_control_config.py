"""The ``control`` group (issue 54): the control loop's interval, latency window, start knobs and
observation scales are one config, composed by every app that runs the loop (training and the
evaluation's ``ServingEnv``, the gateway's ``serve_app``), so the simulator and the gateway read
the same values from the same node. The old homes (``env.interval_s``,
``serve.control.interval_s``, ...) fail at compose, naming the new one; a trained policy's
manifest written before the group still loads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from batchpilot.config import CONF_DIR, load_config
from batchpilot.envs.serving_env import ServingEnv
from batchpilot.evaluation.plan import EvaluationError, compose_eval
from batchpilot.nodes import ConfigError
from batchpilot.policies.ppo_controller import PRETRAINED_DIR, _scales
from batchpilot.schemas.control import MOVED_KEYS, ControlLoopConfig, moved_key_hint
from batchpilot.serving.gateway import AppSettings, Gateway

UPSTREAM = "serve.upstreams=[http://127.0.0.1:9]"
#: Values other than every default, for each of the six keys.
OTHER = {"interval_s": 0.5, "window_s": 4.0, "initial_batch_cap": 8, "initial_bucketing": "shortest_first",
         "rate_scale": 12.0, "token_rate_scale": 700.0}


def test_the_defaults_are_the_ones_env_and_serve_had() -> None:
    assert dataclasses.asdict(ControlLoopConfig()) == {
        "interval_s": 1.0, "window_s": 10.0, "initial_batch_cap": 64, "initial_bucketing": "fifo",
        "rate_scale": 30.0, "token_rate_scale": 6000.0}
    assert ControlLoopConfig.from_cfg(load_config().control) == ControlLoopConfig()


@pytest.mark.parametrize("key,value", [
    ("interval_s", 0.0), ("interval_s", float("nan")), ("window_s", -1.0), ("rate_scale", 0.0),
    ("token_rate_scale", float("inf")), ("initial_batch_cap", 0), ("initial_bucketing", "lifo"),
])
def test_a_value_out_of_range_names_its_key(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"control\.{key}"):
        ControlLoopConfig.from_cfg({key: value})


def test_an_unknown_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="interval"):
        ControlLoopConfig.from_cfg({"interval": 1.0})


def _app_configs() -> list[str]:
    """Every top config under conf/ whose defaults (or the one it extends) name env or serve."""
    out = []
    for path in sorted(CONF_DIR.glob("*.yaml")):
        text = path.read_text()
        if "- env: default" in text or "- serve: default" in text or "\n  - config\n" in text \
                or "\n  - evaluate\n" in text:
            out.append(path.stem)
    return out


def test_every_app_that_runs_the_loop_composes_the_control_group() -> None:
    apps = _app_configs()
    assert {"config", "evaluate", "evaluate_matrix", "serve_app", "train_kv"} <= set(apps)
    for name in apps:
        cfg = load_config([f"control.{k}={v}" for k, v in OTHER.items()], config_name=name)
        assert ControlLoopConfig.from_cfg(cfg.control) == ControlLoopConfig(**OTHER), name


def test_the_env_and_the_gateway_run_the_same_composed_values() -> None:
    overrides = [f"control.{k}={v}" for k, v in OTHER.items()]
    env = ServingEnv(cfg=load_config(["model=tiny_llama", "hardware=cpu_tiny", *overrides]))
    env.reset(seed=0)
    settings = AppSettings.from_cfg(load_config([UPSTREAM, *overrides], config_name="serve_app"))
    gw = Gateway(settings)
    try:
        assert env.control == settings.control == ControlLoopConfig(**OTHER)
        assert env.interval_s == 0.5 and env.max_steps == round(float(env.cfg.env.episode_s) / 0.5)
        lane = gw.lanes[0]
        for tel in (env.telemetry, lane.telemetry):
            assert (tel.window_s, tel.rate_scale, tel.token_rate_scale) == (4.0, 12.0, 700.0)
        for knobs in (env.knobs, lane.knobs):
            assert (knobs.batch_cap, knobs.bucketing) == (8, "shortest_first")
    finally:
        env.close()
        for ln in gw.lanes:
            ln.upstream.pool.close()


@pytest.mark.parametrize("config,override,new", [
    ("config", "env.interval_s=0.5", "control.interval_s"),
    ("config", "env.telemetry_window_s=5", "control.window_s"),
    ("config", "env.initial_bucketing=fifo", "control.initial_bucketing"),
    ("serve_app", "serve.control.interval_s=0.5", "control.interval_s"),
    ("serve_app", "serve.control.token_rate_scale=10", "control.token_rate_scale"),
])
def test_an_old_key_fails_at_compose_naming_its_new_home(config: str, override: str, new: str) -> None:
    old = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{old} is now {new}"):
        load_config([override], config_name=config)


def test_an_old_key_in_the_evaluation_fails_naming_its_new_home() -> None:
    with pytest.raises(EvaluationError, match=r"env\.rate_scale is now control\.rate_scale"):
        compose_eval(["env.rate_scale=3"])


def test_an_old_key_added_with_plus_is_refused_where_it_would_be_read() -> None:
    """``+env.interval_s=...`` passes compose (Hydra's own hint for the old key says to use it);
    nothing would read it, so the env and the gateway refuse it."""
    with pytest.raises(ConfigError, match=r"env\.interval_s is now control\.interval_s"):
        ServingEnv(cfg=load_config(["+env.interval_s=0.5"]))
    cfg = load_config([UPSTREAM, "+serve.control.window_s=3"], config_name="serve_app")
    with pytest.raises(ConfigError, match=r"serve\.control\.window_s is now control\.window_s"):
        AppSettings.from_cfg(cfg)


def test_the_hint_names_only_moved_keys() -> None:
    assert moved_key_hint("Could not override 'env.episode_s'") is None
    assert moved_key_hint("full_key: env.admission.max_queue_len") is None
    assert moved_key_hint("full_key: myenv.interval_s") is None
    assert set(MOVED_KEYS.values()) == {f"control.{f.name}" for f in dataclasses.fields(ControlLoopConfig)}


def test_the_gateway_settings_default_to_the_groups_defaults() -> None:
    """A gateway built in code without a ``control`` node (tests, library callers)."""
    settings = AppSettings.from_cfg({"serve": {"upstreams": ["http://127.0.0.1:9"]}})
    assert settings.control == ControlLoopConfig()


# --- saved artifacts -------------------------------------------------------------------------
def _manifest() -> dict[str, Any]:
    return json.loads((PRETRAINED_DIR / "manifest.json").read_text())


def test_the_shipped_policy_trained_before_the_group_still_gives_its_scales() -> None:
    m = _manifest()
    assert "control" not in m["training"]["config"]  # written before the control group
    s = _scales(m, PRETRAINED_DIR)
    assert (s["rate_scale"], s["token_rate_scale"]) == (30.0, 6000.0)


def test_scales_come_from_control_then_from_an_old_env_section(tmp_path: Path) -> None:
    m = _manifest()
    cfg = m["training"]["config"]
    cfg.pop("observation_scales")
    old = _scales(m, tmp_path)  # only the old env section: its scales
    assert (old["rate_scale"], old["token_rate_scale"]) == (cfg["env"]["rate_scale"], cfg["env"]["token_rate_scale"])
    cfg["control"] = {"rate_scale": 5.0, "token_rate_scale": 1000.0}
    for k in ("rate_scale", "token_rate_scale"):
        cfg["env"].pop(k)
    new = _scales(m, tmp_path)
    assert (new["rate_scale"], new["token_rate_scale"], new["kv8_dtype"]) == (5.0, 1000.0, cfg["env"]["kv8_dtype"])


def test_a_training_config_records_the_control_group() -> None:
    """What training saves (the composed config, resolved) carries ``control``: a later
    artifact's manifest has the interval and scales it was trained with."""
    cfg = load_config(["engine=vllm"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert plain["control"]["rate_scale"] == 5.0 and "rate_scale" not in plain["env"]
