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
    defaults = {f.name: f.default for f in dataclasses.fields(SLO) if f.name != "classes"}
    assert defaults == {"ttft_ms": DEFAULT_TTFT_MS, "tpot_ms": DEFAULT_TPOT_MS, "e2el_ms": None}
    assert SLO().classes == {}  # one class unless configured (conf/slo/two_class.yaml)
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


def test_the_slo_answers_for_each_metric_and_names_an_unknown_one() -> None:
    """``SLO.for_metric`` is the one lookup from a metric to its objective (PID's setpoints, the
    shield's breach limits, a residual policy's PID); ``from_metrics`` / ``by_metric`` are the
    metric-keyed form a served policy's ``slo`` uses, both ways."""
    slo = SLO(ttft_ms=500.0, tpot_ms=None, e2el_ms=9000.0)
    assert [slo.for_metric(m) for m in ("ttft", "tpot", "e2el")] == [500.0, None, 9000.0]
    with pytest.raises(ValueError, match=r"unknown latency metric 'itl'; choices: \['ttft', 'tpot', 'e2el'\]"):
        slo.for_metric("itl")
    assert SLO.from_metrics(slo.by_metric()) == slo
    assert SLO.from_metrics({"tpot": 40.0}) == SLO(ttft_ms=None, tpot_ms=40.0, e2el_ms=None)  # left out: none
    with pytest.raises(ValueError, match=r"unknown metric\(s\) \['ttft_ms'\]"):
        SLO.from_metrics({"ttft_ms": 500.0})


def test_pid_setpoints_come_from_the_slo_of_its_metric() -> None:
    """A PID or AIMD built with an SLO steers at the objective of its own metric, TPOT for the
    queue-aware switch; a metric without an objective keeps the config's own setpoint."""
    from batchpilot.policies.controllers import build_controller

    slo = SLO(ttft_ms=500.0, tpot_ms=40.0, e2el_ms=None)
    for node, want in (({"kind": "pid", "metric": "ttft"}, 500.0), ({"kind": "pid", "metric": "tpot"}, 40.0),
                       ({"kind": "aimd", "metric": "tpot"}, 40.0), ({"kind": "pid", "metric": "e2el"}, DEFAULT_TTFT_MS)):
        cfg = build_controller(node, 256, slo).cfg  # type: ignore[attr-defined]
        assert (cfg.slo_ms, cfg.tpot_slo_ms) == (want, 40.0), node
    # A node that names no metric steers on its dataclass's (PID: TPOT, AIMD: TTFT) and at that
    # metric's objective: the gateway's fallback PID ({"kind": "pid"}) steered TPOT at the TTFT
    # objective (1000 ms against the evaluation PID's 100 ms) before.
    assert build_controller({"kind": "pid"}, 256, slo).cfg.slo_ms == 40.0  # type: ignore[attr-defined]
    assert build_controller({"kind": "aimd"}, 256, slo).cfg.slo_ms == 500.0  # type: ignore[attr-defined]
    # The one SLO type: the metric-keyed form a policy's served slo uses is no SLO here.
    with pytest.raises(TypeError, match="slo must be an SLO"):
        build_controller({"kind": "pid"}, 256, slo.by_metric())  # type: ignore[arg-type]
