"""Structured-config schemas (batchpilot/schemas.py): a group file that extends its schema is
checked at compose time, so a mistyped key or a value of the wrong type in YAML fails before
anything runs, with Hydra's message naming the key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException

from batchpilot.config import CONF_DIR, load_config
from batchpilot.core.admission import AdmissionConfig
from batchpilot.core.shield import ShieldConfig
from batchpilot.core.telemetry import SLO
from batchpilot.envs.serving_env import slo_from_cfg
from batchpilot.schemas import SCHEMAS, LoggerConfig, RewardConfig, TrainConfig

#: (file under conf/, config to compose, line as shipped, its mistyped-key and wrong-type
#: versions, the node the key lives in).
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
]


def _compose_edited(tmp_path: Path, rel: str, config: str, old: str, new: str) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    path = conf / rel
    text = path.read_text()
    assert old in text, f"{rel} no longer contains {old!r}: update this test"
    path.write_text(text.replace(old, new, 1))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        compose(config_name=config)


@pytest.mark.parametrize("rel,config,old,typo,wrong_type,key", CASES, ids=[c[0] + ":" + c[2].split(":")[0] for c in CASES])
def test_a_mistyped_key_fails_at_compose(tmp_path, rel, config, old, typo, wrong_type, key) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        _compose_edited(tmp_path, rel, config, old, typo)
    msg = str(info.value)
    assert f"Key '{typo.split(':')[0]}' not in" in msg and f"full_key: {key}.{typo.split(':')[0]}" in msg, msg


@pytest.mark.parametrize("rel,config,old,typo,wrong_type,key", CASES, ids=[c[0] + ":" + c[2].split(":")[0] for c in CASES])
def test_a_wrong_type_fails_at_compose(tmp_path, rel, config, old, typo, wrong_type, key) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        _compose_edited(tmp_path, rel, config, old, wrong_type)
    msg = str(info.value)
    assert "ValidationError" in msg and f"full_key: {key}.{wrong_type.split(':')[0]}" in msg, msg


def test_a_wrong_type_on_the_command_line_fails_naming_the_key() -> None:
    with pytest.raises(ConfigCompositionException, match="shield.max_step_frac"):
        load_config(["shield.max_step_frac=abc"])
    with pytest.raises(ConfigCompositionException, match="env.admission.max_queue_len"):
        load_config(["env.admission.max_queue_len=many"])


def test_a_key_added_on_the_command_line_fails_when_built() -> None:
    """``+shield.x=1`` is Hydra's explicit "add this key" (struct mode lets it through); building
    the object merges into the schema again and names it."""
    cfg = load_config(["+shield.max_step=0.3"])
    with pytest.raises(ValueError, match="Key 'max_step' not in 'ShieldConfig'"):
        ShieldConfig.from_cfg(cfg.shield)


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


def test_env_and_serve_spell_admission_alike() -> None:
    """One AdmissionConfig schema for training and serving: the same keys, the same settings."""
    env = load_config().env.admission
    serve = load_config(config_name="serve_app").serve.admission
    assert set(env) == set(serve)
    assert AdmissionConfig.from_cfg(env) == AdmissionConfig.from_cfg(serve)


def test_every_schema_is_extended_by_its_group() -> None:
    """Each stored schema is used: a group schema by every file of the group."""
    for group, name, _cls in SCHEMAS:
        if group == "schema":
            users = [p for p in CONF_DIR.rglob("*.yaml") if f"/schema/{name}@" in p.read_text()]
            assert users, f"no config extends schema/{name}"
        else:
            for path in sorted((CONF_DIR / group).glob("*.yaml")):
                assert f"- {name}\n" in path.read_text(), f"{path} does not extend {group}/{name}"
