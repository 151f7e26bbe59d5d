"""Structured-config schemas: the config dataclasses registered with Hydra's ``ConfigStore``.

A group file extends its schema (``defaults: [schema, _self_]``), so composing checks every
key and type against the dataclass (OmegaConf's structured configs): a mistyped key or a value
of the wrong type fails at compose time with Hydra's message naming the key. The dataclass is
the one declaration of each group's fields and types; domain checks (ranges, names) stay in its
``__post_init__`` / ``check`` and run when ``from_node`` builds the object.

One module per job, each imported from where it is declared (no re-exports here):
``control`` (``ControlLoopConfig``: the control loop's interval, window and start knobs, shared by
the simulator and the gateway), ``env`` (``EnvNode``, ``RewardConfig``), ``train`` (``TrainConfig``, ``LoggerConfig``), ``engine``
(the simulated and the vLLM engine, its warm-up), ``policy`` (the controllers' settings and the
``conf/policy`` schemas), ``serve`` (``ServeConfig`` and its parts, ``ServeApp``), ``launcher``,
``evaluate`` (``EvaluateApp``, ``BestStaticConfig``, ``LoadConfig``), ``calibrate``
(``CalibrateApp``, ``Grid``, ``StateProbe``), ``live`` (``LiveScenarioConfig``,
``LiveEvaluateApp``), ``export`` (``ExportApp``) and ``bench`` (``BenchApp``, the gateway and
client benchmarks). This package holds only the registration and ``check_app``.

Registered (``register()``; ``batchpilot.config.load_config``, ``compose_eval`` in
evaluation/plan.py and every ``@hydra.main`` app in ``scripts/`` import this package, which
calls it, before composing):

==============================  ================================================  ==================================
store entry                     dataclass                                         extended by
==============================  ================================================  ==================================
``shield/schema``               ``batchpilot.core.shield.ShieldConfig``           conf/shield/*.yaml
``slo/schema``                  ``batchpilot.core.telemetry.SLO``                 conf/slo/*.yaml
``control/schema``              ``control.ControlLoopConfig``                     conf/control/default.yaml
``env/schema``                  ``env.EnvNode`` (a schema: ``admission`` is       conf/env/default.yaml
                                ``core.admission.AdmissionConfig``, ``reward``
                                ``env.RewardConfig``)
``train/schema``                ``train.TrainConfig``                             conf/train/*.yaml
``logger/schema``               ``train.LoggerConfig``                            conf/logger/*.yaml
``hardware/schema``             ``batchpilot.core.specs.HardwareSpec``            conf/hardware/*.yaml
``model/schema``                ``batchpilot.core.specs.ModelSpec``               conf/model/*.yaml
``engine/schema_sim``           ``engine.SimEngineConfig``                        conf/engine/sim.yaml
``schema/vllm_engine``          ``engine.VLLMEngineNode``: ``VLLMEngineConfig``   conf/engine/vllm.yaml ``engine``
                                + kind, warmup (``EngineWarmupConfig``)
``policy/schema_pid``           ``policy.PIDPolicyNode``: ``core.pid.PIDConfig``  conf/policy/pid.yaml
                                + kind
``policy/schema_aimd``          ``policy.AIMDPolicyNode``: ``AIMDConfig`` + kind  conf/policy/aimd.yaml
``policy/schema_static``        ``policy.StaticPolicyNode``: ``StaticConfig`` +   conf/policy/static.yaml,
                                kind, name                                        vllm_default.yaml
``policy/schema_ppo``           ``policy.PPOPolicyNode``: ``PPOPolicyConfig`` +   conf/policy/ppo.yaml
                                kind
``policy/schema_lookahead``     ``policy.LookaheadPolicyNode``:                   conf/policy/lookahead.yaml
                                ``LookaheadConfig`` + kind
``policy/schema_vllm_tuned``    ``policy.VllmTunedPolicyNode``:                   conf/policy/vllm_tuned.yaml
                                ``VllmTunedConfig`` + kind, name
``serve/schema``                ``serve.ServeNode``: ``ServeConfig`` less its     conf/serve/default.yaml
                                secrets
``schema/gateway_bench``        ``bench.GatewayBenchConfig``                      conf/bench.yaml ``gateway_bench``
``schema/client_bench``         ``bench.ClientBenchConfig``                       conf/bench.yaml ``client_bench``
``launcher/schema``             ``launcher.LauncherConfig``                       conf/launcher/*.yaml
``live_scenario/schema``        ``live.LiveScenarioConfig`` (a schema only)       conf/live_scenario/*.yaml
``workload/schema_<kind>``      ``batchpilot.workload_config``: one per kind      conf/workload/*.yaml (by kind)
                                (``PoissonWorkload``, ``OnOffWorkload``, ...)
``schema/evaluate``             ``evaluate.EvaluateApp`` (``best_static``:        conf/evaluate.yaml (and
                                ``BestStaticConfig``, ``load``: ``LoadConfig``)   evaluate_matrix.yaml through it)
``schema/calibrate``            ``calibrate.CalibrateApp`` (``grid``: ``Grid``,   conf/calibrate.yaml
                                ``warmup``: ``engine.EngineWarmupConfig``,
                                ``base``: ``CalibrationBase``)
``schema/live_evaluate``        ``live.LiveEvaluateApp``                          conf/live_evaluate.yaml
``schema/export``               ``export.ExportApp``                              conf/export.yaml
``schema/bench``                ``bench.BenchApp``                                conf/bench.yaml
``schema/serve_app``            ``serve.ServeApp`` (groups only)                  conf/serve_app.yaml
==============================  ================================================  ==================================

The apps' top configs list their schema first (``- /schema/<app>@_here_``): the top-level keys
are checked like a group's, so a mistyped key in the file, ``seedz=[1]`` or ``seeds=abc`` on the
command line fail at compose naming the key. Their fields are required (no default, so none can
disagree with the file); the groups they compose are ``Any`` there (each has its own schema).
A key added with ``+key=...`` passes compose; ``check_app`` names it where an app reads its
config (``EvalConfig.from_cfg``, the calibration's ``run_fit`` / ``run_report``, the live
evaluation's ``_check``).

``VLLMEngineNode``, the ``...PolicyNode`` schemas and ``ServeNode`` are derived from their dataclass
by ``batchpilot.nodes.node_schema`` (the
dataclass's fields, types and defaults, plus the keys that select the class, ``kind`` / ``name``,
or that its caller reads, the vLLM engine's ``warmup``); PID's and AIMD's leave out ``slo_ms`` and
``tpot_slo_ms``, PPO's its served ``slo``, which ``build_controller`` fills from the top config's ``slo``. The objects
are built from the dataclass itself with ``from_node(cls, node, drop=(...))``. ``EnvNode`` and
``LiveScenarioConfig`` are schemas only (their readers take the composed node); their
top-level keys are required, so they hold no default that could disagree with the file.

"""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from batchpilot.core.shield import ShieldConfig
from batchpilot.core.specs import HardwareSpec, ModelSpec
from batchpilot.core.telemetry import SLO
from batchpilot.nodes import ConfigError, schema_node
from batchpilot.schemas.bench import BenchApp, ClientBenchConfig, GatewayBenchConfig
from batchpilot.schemas.calibrate import CalibrateApp
from batchpilot.schemas.control import ControlLoopConfig
from batchpilot.schemas.engine import SimEngineConfig, VLLMEngineNode
from batchpilot.schemas.env import EnvNode
from batchpilot.schemas.evaluate import EvaluateApp
from batchpilot.schemas.export import ExportApp
from batchpilot.schemas.launcher import LauncherConfig
from batchpilot.schemas.live import LiveEvaluateApp, LiveScenarioConfig
from batchpilot.schemas.policy import (
    AIMDPolicyNode,
    LookaheadPolicyNode,
    PIDPolicyNode,
    PPOPolicyNode,
    StaticPolicyNode,
    VllmTunedPolicyNode,
)
from batchpilot.schemas.serve import ServeApp, ServeNode
from batchpilot.schemas.train import LoggerConfig, TrainConfig
from batchpilot.workload_config import WORKLOAD_SCHEMAS


def check_app(cls: type, cfg: Any) -> None:
    """Check a composed top config against its app schema ``cls`` again: the keys and types
    were checked at compose time, but a key added with ``+key=...`` gets through; this names
    it (``batchpilot.nodes.ConfigError``, a ``ValueError``). Nothing is resolved or built."""
    # A plain container: merged as a config of the schema's own type, an added key would pass.
    data = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else dict(cfg)
    try:
        OmegaConf.merge(schema_node(cls), data)
    except (ConfigKeyError, ValidationError) as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None


# --- registration ---------------------------------------------------------------------------
#: (group, name, dataclass) of every stored schema.
SCHEMAS: tuple[tuple[str, str, type], ...] = (
    ("shield", "schema", ShieldConfig),
    ("slo", "schema", SLO),
    ("control", "schema", ControlLoopConfig),
    ("env", "schema", EnvNode),
    ("train", "schema", TrainConfig),
    ("logger", "schema", LoggerConfig),
    ("hardware", "schema", HardwareSpec),
    ("model", "schema", ModelSpec),
    ("engine", "schema_sim", SimEngineConfig),
    ("schema", "vllm_engine", VLLMEngineNode),
    ("policy", "schema_pid", PIDPolicyNode),
    ("policy", "schema_aimd", AIMDPolicyNode),
    ("policy", "schema_static", StaticPolicyNode),
    ("policy", "schema_ppo", PPOPolicyNode),
    ("policy", "schema_lookahead", LookaheadPolicyNode),
    ("policy", "schema_vllm_tuned", VllmTunedPolicyNode),
    ("serve", "schema", ServeNode),
    ("schema", "gateway_bench", GatewayBenchConfig),
    ("schema", "client_bench", ClientBenchConfig),
    ("launcher", "schema", LauncherConfig),
    ("live_scenario", "schema", LiveScenarioConfig),
    # The apps' top configs (conf/<app>.yaml: ``- /schema/<app>@_here_``).
    ("schema", "evaluate", EvaluateApp),
    ("schema", "calibrate", CalibrateApp),
    ("schema", "live_evaluate", LiveEvaluateApp),
    ("schema", "export", ExportApp),
    ("schema", "bench", BenchApp),
    ("schema", "serve_app", ServeApp),
    # One per workload kind (batchpilot/workload_config.py): workload/schema_poisson, ...
    *(("workload", f"schema_{kind}", cls) for kind, cls in WORKLOAD_SCHEMAS.items()),
)


def register() -> None:
    """Store every schema in Hydra's ``ConfigStore`` (idempotent: storing again replaces)."""
    cs = ConfigStore.instance()
    for group, name, cls in SCHEMAS:
        cs.store(group=group, name=name, node=schema_node(cls))


register()
