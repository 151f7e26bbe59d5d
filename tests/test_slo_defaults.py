"""One source for the default SLO (issue 54): ``DEFAULT_TTFT_MS`` / ``DEFAULT_TPOT_MS`` beside the
``SLO`` dataclass in ``batchpilot/core/telemetry.py``. ``conf/slo/default.yaml`` extends the
``slo/schema`` (that dataclass) and restates none of them, so Hydra composes the dataclass's. The gateway builds its SLO with
``SLO.from_mapping`` and sizes its telemetry from the admission buckets, as ``ServingEnv`` does."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from batchpilot.config import CONF_DIR, load_config
from batchpilot.core.pid import PIDConfig
from batchpilot.core.telemetry import DEFAULT_TPOT_MS, DEFAULT_TTFT_MS, SLO
from batchpilot.schemas.policy import AIMDConfig


def test_the_slo_yaml_leaves_the_defaults_to_the_dataclass() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(SLO)}
    assert defaults == {"ttft_ms": DEFAULT_TTFT_MS, "tpot_ms": DEFAULT_TPOT_MS, "e2el_ms": None}
    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "slo" / "default.yaml"))
    assert not set(raw) & set(defaults), f"conf/slo/default.yaml restates {sorted(set(raw) & set(defaults))}"
    for app in ("config", "serve_app"):  # and as the apps compose it
        assert SLO.from_mapping(OmegaConf.to_container(load_config(config_name=app).slo)) == SLO(), app


def test_from_mapping_keeps_defaults_and_refuses_unknown_keys() -> None:
    assert SLO.from_mapping(None) == SLO.from_mapping({}) == SLO()
    assert SLO.from_mapping({"tpot_ms": 50}) == SLO(ttft_ms=DEFAULT_TTFT_MS, tpot_ms=50)
    off = SLO.from_mapping({"ttft_ms": None, "e2el_ms": 9000.0})
    assert off.ttft_ms is None and off.ttft_ref_ms == DEFAULT_TTFT_MS and off.e2el_ms == 9000.0
    with pytest.raises(ValueError, match=r"slo: unknown key\(s\) \['ttft'\]"):
        SLO.from_mapping({"ttft": 500})
    with pytest.raises(ValueError, match="slo.tpot_ms must be a positive number"):
        SLO.from_mapping({"tpot_ms": -1})


def test_the_controllers_unfilled_slos_are_the_default() -> None:
    for cfg in (PIDConfig(), AIMDConfig()):
        assert cfg.slo_ms == DEFAULT_TTFT_MS and cfg.tpot_slo_ms == DEFAULT_TPOT_MS, cfg


def test_the_gateway_reads_its_slo_and_bucket_count_from_its_config() -> None:
    from batchpilot.serving.gateway import AppSettings, Gateway

    cfg = load_config(["slo.tpot_ms=40", "serve.upstreams=[http://127.0.0.1:9]", "serve.tokenizer=chars",
                       "serve.admission.boundaries=[256,1024,8192]", "serve.admission.weights=[0.4,0.3,0.2,0.1]"],
                      config_name="serve_app")
    settings = AppSettings.from_cfg(cfg)
    assert settings.slo == SLO(ttft_ms=DEFAULT_TTFT_MS, tpot_ms=40.0)
    gw = Gateway(settings)
    try:
        lane = gw.lanes[0]
        assert lane.telemetry.num_buckets == len(lane.admission.cfg.boundaries) + 1 == 4
        assert lane.telemetry.slo is settings.slo
    finally:
        gw.lanes[0].upstream.pool.close()
