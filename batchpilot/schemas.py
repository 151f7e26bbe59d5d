"""Structured-config schemas: the config dataclasses registered with Hydra's ``ConfigStore``.

A group file extends its schema (``defaults: [schema, _self_]``), so composing checks every
key and type against the dataclass (OmegaConf's structured configs): a mistyped key or a value
of the wrong type fails at compose time with Hydra's message naming the key. The dataclass is
the one declaration of each group's fields and types; domain checks (ranges, names) stay in its
``__post_init__`` / ``check`` and run when ``from_node`` builds the object.

Registered (``register()``; ``batchpilot.config.load_config``, ``compose_eval`` in
evaluation/matrix.py and every ``@hydra.main`` app in ``scripts/`` import this module, which
calls it, before composing):

==============================  ================================================  ==================================
store entry                     dataclass                                         extended by
==============================  ================================================  ==================================
``shield/schema``               ``batchpilot.core.shield.ShieldConfig``           conf/shield/*.yaml
``slo/schema``                  ``batchpilot.core.telemetry.SLO``                 conf/slo/*.yaml
``env/schema``                  ``EnvNode`` (here; a schema: ``admission`` is     conf/env/default.yaml
                                ``core.admission.AdmissionConfig``, ``reward``
                                ``RewardConfig``)
``train/schema``                ``TrainConfig`` (here)                            conf/train/*.yaml
``logger/schema``               ``LoggerConfig`` (here)                           conf/logger/*.yaml
``hardware/schema``             ``batchpilot.core.specs.HardwareSpec``            conf/hardware/*.yaml
``model/schema``                ``batchpilot.core.specs.ModelSpec``               conf/model/*.yaml
``engine/schema_sim``           ``SimEngineConfig`` (here)                        conf/engine/sim.yaml
``schema/vllm_engine``          ``VLLMEngineNode``: ``VLLMEngineConfig`` + kind,  conf/engine/vllm.yaml ``engine``
                                warmup (``EngineWarmupConfig``)
``policy/schema_pid``           ``PIDPolicyNode``: ``core.pid.PIDConfig`` + kind  conf/policy/pid.yaml
``policy/schema_aimd``          ``AIMDPolicyNode``: ``AIMDConfig`` + kind         conf/policy/aimd.yaml
``policy/schema_static``        ``StaticPolicyNode``: ``StaticConfig`` + kind,    conf/policy/static.yaml,
                                name                                              vllm_default.yaml
``policy/schema_ppo``           ``PPOPolicyNode``: ``PPOPolicyConfig`` + kind     conf/policy/ppo.yaml
``policy/schema_lookahead``     ``LookaheadPolicyNode``: ``LookaheadConfig`` +    conf/policy/lookahead.yaml
                                kind
``policy/schema_vllm_tuned``    ``VllmTunedPolicyNode``: ``VllmTunedConfig`` +    conf/policy/vllm_tuned.yaml
                                kind, name
``serve/schema``                ``ServeNode``: ``ServeConfig`` less its secrets   conf/serve/default.yaml
``schema/gateway_bench``        ``GatewayBenchConfig`` (here)                     conf/bench.yaml ``gateway_bench``
``schema/client_bench``         ``ClientBenchConfig`` (here)                      conf/bench.yaml ``client_bench``
``launcher/schema``             ``LauncherConfig`` (here)                         conf/launcher/*.yaml
``live_scenario/schema``        ``LiveScenarioConfig`` (here; a schema only)      conf/live_scenario/*.yaml
``workload/schema_<kind>``      ``batchpilot.workload_config``: one per      conf/workload/*.yaml (by kind)
                                kind (``PoissonWorkload``, ``OnOffWorkload``, ...)
``schema/evaluate``             ``EvaluateApp`` (``best_static``:                 conf/evaluate.yaml (and
                                ``BestStaticConfig``, ``load``: ``LoadConfig``)   evaluate_matrix.yaml through it)
``schema/calibrate``            ``CalibrateApp`` (``grid``: ``Grid``, ``warmup``:  conf/calibrate.yaml
                                ``EngineWarmupConfig``, ``base``:
                                ``CalibrationBase``)
``schema/live_evaluate``        ``LiveEvaluateApp``                               conf/live_evaluate.yaml
``schema/export``               ``ExportApp``                                     conf/export.yaml
``schema/bench``                ``BenchApp``                                      conf/bench.yaml
``schema/serve_app``            ``ServeApp`` (groups only)                        conf/serve_app.yaml
==============================  ================================================  ==================================

The apps' top configs list their schema first (``- /schema/<app>@_here_``): the top-level keys
are checked like a group's; the groups they compose are ``Any`` there (each has its own schema).
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

import dataclasses
import hmac
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from batchpilot.core.admission import AdmissionConfig
from batchpilot.core.engine import KV_DTYPES_ALL
from batchpilot.core.knobs import BUCKETING_MODES
from batchpilot.core.pid import PIDConfig, check_common
from batchpilot.core.shield import ShieldConfig
from batchpilot.core.specs import HardwareSpec, ModelSpec
from batchpilot.core.telemetry import DEFAULT_TPOT_MS, DEFAULT_TTFT_MS, SLO
from batchpilot.nodes import ConfigError, from_node, node_schema, plain, schema_node
from batchpilot.workload_config import WORKLOAD_SCHEMAS


# --- dataclasses of groups read outside the core ---------------------------------------------
@dataclass(frozen=True, slots=True)
class RewardConfig:
    """``env.reward`` (conf/env/default.yaml): the reward's weights and penalties."""

    w_throughput: float = 0.6
    w_latency: float = 0.3
    w_memory: float = 0.1
    penalty_slo_miss: float = 1.0
    penalty_preemption: float = 0.05
    penalty_shield: float = 0.05
    penalty_rejected: float = 0.5
    penalty_queue: float = 0.1
    #: None (yaml ``null``) = the model's prior, ``model.kv8_quality_cost`` (``RewardConfig.from_cfg``).
    quality_cost_8bit: float | None = 0.0
    engine_failure: float = 10.0

    def __post_init__(self) -> None:
        for k in self.__dataclass_fields__:
            v = getattr(self, k)
            if v is None and k == "quality_cost_8bit":
                continue
            if not isinstance(v, (int, float)) or math.isnan(float(v)) or float(v) < 0:
                raise ValueError(f"env.reward.{k} must be a non-negative number, got {v!r}")
            object.__setattr__(self, k, float(v))

    @classmethod
    def from_cfg(cls, node: Any, model_quality_cost: float = 0.0) -> "RewardConfig":
        rc = from_node(cls, node)
        if rc.quality_cost_8bit is None:
            rc = dataclasses.replace(rc, quality_cost_8bit=float(model_quality_cost))
        return rc


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """``conf/train/ppo.yaml``; see the comments there for each key."""

    algo: str = "maskable_ppo"
    total_timesteps: int = 150000
    n_envs: int | None = 2
    torch_threads: int = 1
    device: str = "cpu"
    learning_rate: float = 3e-4
    n_steps: int = 512
    batch_size: int = 256
    n_epochs: int = 10
    gamma: float = 0.97
    gae_lambda: float = 0.95
    clip_range: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    net_arch: tuple[int, ...] = (64, 64)
    activation: str = "tanh"
    norm_obs: bool = True
    norm_reward: bool = True
    clip_obs: float = 10.0
    eval_freq: int = 20000
    eval_on_start: bool = False
    checkpoint_freq: int = 50000
    progress_bar: bool = True
    slo_tolerance: float = 0.0
    baseline_prior_logit: float = 2.0
    # The bucketing order the untrained actor leans to (the same logit), or None for no prior.
    bucketing_prior: str | None = None
    # Deployment randomisation: "model/hardware" pairs the training episodes draw from (set as
    # env.deployments on the training and validation environments); () = the config's own.
    deployments: tuple[str, ...] = ()
    # Warm start: an exported policy folder (or its manifest.json); the actor and the observation
    # normalisation are loaded from it, the critic and reward normalisation start fresh.
    init_from: str | None = None
    critic_warmup_steps: int = 0
    # Which model is exported: "best" (by validation) or "final" (the last one learnt).
    export_select: str = "best"
    validation: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "net_arch", tuple(int(x) for x in self.net_arch))
        object.__setattr__(self, "deployments", tuple(str(x) for x in self.deployments))

    @classmethod
    def from_cfg(cls, node: Any) -> "TrainConfig":
        tc = from_node(cls, node)
        tc.check()
        return tc

    def check(self) -> None:
        if self.algo != "maskable_ppo":
            raise ValueError(f"train.algo must be 'maskable_ppo', got {self.algo!r}")
        if self.total_timesteps < 1:
            raise ValueError(f"train.total_timesteps must be >= 1, got {self.total_timesteps}")
        if self.n_envs is not None and self.n_envs < 1:
            raise ValueError(f"train.n_envs must be >= 1 or null (= CPU cores), got {self.n_envs}")
        if self.activation not in ("tanh", "relu"):
            raise ValueError(f"train.activation must be tanh or relu, got {self.activation!r}")
        if not self.net_arch or min(self.net_arch) < 1:
            raise ValueError(f"train.net_arch must list positive layer widths, got {list(self.net_arch)}")
        if self.n_steps < 2 or self.batch_size < 2:
            raise ValueError(f"train.n_steps and train.batch_size must be >= 2, got {self.n_steps}, {self.batch_size}")
        if self.export_select not in ("best", "final"):
            raise ValueError(f"train.export_select must be best or final, got {self.export_select!r}")
        if self.bucketing_prior is not None and self.bucketing_prior not in BUCKETING_MODES:
            raise ValueError(f"train.bucketing_prior must be null or one of {BUCKETING_MODES}, got {self.bucketing_prior!r}")
        if self.critic_warmup_steps < 0:
            raise ValueError(f"train.critic_warmup_steps must be >= 0, got {self.critic_warmup_steps}")
        if "workloads" not in self.validation or "seeds" not in self.validation:
            raise ValueError("train.validation needs 'seeds' and 'workloads' (see conf/train/ppo.yaml)")
        for name in ("learning_rate", "clip_range", "max_grad_norm", "clip_obs"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"train.{name} must be a finite number > 0, got {v}")
        for name in ("gamma", "gae_lambda"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"train.{name} must be in (0, 1], got {v}")
        for name in ("ent_coef", "vf_coef"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"train.{name} must be a finite number >= 0, got {v}")
        if self.target_kl is not None and not (math.isfinite(self.target_kl) and self.target_kl > 0):
            raise ValueError(f"train.target_kl must be a finite number > 0 or null, got {self.target_kl}")

    def num_envs(self) -> int:
        return self.n_envs if self.n_envs is not None else max(1, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class LoggerConfig:
    """``conf/logger/*.yaml``."""

    wandb: bool = False
    tensorboard: bool = True
    mode: str = "offline"
    project: str = "batchpilot"
    entity: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()
    log_policy_artifact: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "tags", tuple(self.tags or ()))
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode must be offline, online or disabled, got {self.mode!r}")

    @classmethod
    def from_cfg(cls, node: Any) -> "LoggerConfig":
        return from_node(cls, node)



# --- env (conf/env) ----------------------------------------------------------------------------
@dataclass(slots=True)
class EnvNode:
    """``conf/env/default.yaml``: ``ServingEnv``'s settings (``envs/serving_env.py`` reads the
    node and checks the values; this is its schema). The top-level keys are required (no
    default here, so none can disagree with the file); ``admission`` and ``reward`` are their
    dataclasses, the same ``AdmissionConfig`` the gateway's ``serve.admission`` is."""

    #: Engine seconds per step (one control interval) and per episode (truncation).
    interval_s: float
    episode_s: float
    #: Sliding window of the latency percentiles.
    telemetry_window_s: float
    initial_batch_cap: int
    initial_bucketing: str
    #: What the actions "16-bit" and "8-bit" mean.
    kv16_dtype: str
    kv8_dtype: str
    #: residual_pid | absolute (``batchpilot.core.residual.ACTION_MODES``).
    action_mode: str
    #: Admit a request only if the memory model predicts it fits beside what is in flight.
    memory_admission: bool
    #: Observation scales: requests/s and output tokens/s.
    rate_scale: float
    token_rate_scale: float
    #: At the last step, let requests in flight finish (at most drain_timeout_s).
    drain_on_truncate: bool
    drain_timeout_s: float
    #: With drain_on_truncate: after the last step the episode goes on, the controller and the
    #: shield acting each interval, until every request is served (the gateway's loop runs until
    #: the client's last answer); false: drain at the last knobs.
    drain_controlled: bool
    #: The start KV dtype counts as a switch at t=0 for the shield's dwell (``kv_start``).
    start_dtype_dwell: bool
    #: false: no shield between the controller and the engine (vLLM as shipped: proposals pass
    #: unchecked, no breaker, no fail-safe rules), by construction (``PassThroughShield``).
    shielded: bool
    #: Deployment randomisation (training): "model/hardware" pairs an episode draws from; the
    #: workload's load is sized per deployment. Empty = the config's model and hardware.
    deployments: list[str]
    #: [low, high] or null: draw each episode's mean load as this share of the engine's capacity
    #: for the episode's own requests (a saturation probe per episode), log-uniformly.
    load_vs_capacity: list[float] | None
    #: [low, high] or null: draw each episode's engine ``gpu_memory_utilization`` (the KV
    #: budget) on a 0.05 grid; simulator only.
    memory_utilization: list[float] | None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

# --- engine ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    """Scheduler and memory settings of the simulated vLLM engine (``conf/engine/sim.yaml``)."""

    kind: str = "sim"
    #: Tokens per KV block (vLLM ``--block-size``).
    block_size: int = 16
    #: Most requests running at once (vLLM ``--max-num-seqs``).
    max_num_seqs: int = 256
    #: Token budget of one iteration (vLLM ``--max-num-batched-tokens``).
    max_num_batched_tokens: int = 8192
    #: Share of device memory for weights + activations + KV.
    gpu_memory_utilization: float = 0.9
    kv_dtype: str = "auto"
    enable_prefix_caching: bool = True
    #: Activation workspace per rank, GB; ``None`` = estimate from the token budget and model.
    activation_workspace_gb: float | None = None
    #: Cap on KV blocks, as vLLM's ``num_gpu_blocks_override``; ``None`` = from memory.
    num_gpu_blocks_override: int | None = None
    #: ``requeue``: restart preempts everything in flight by recompute; ``drain``: finish the
    #: running requests first (no admissions), then restart.
    restart_mode: str = "requeue"
    #: Engine seconds between adding a request and the scheduler seeing it (a live server's
    #: HTTP, tokenizer and engine-core queue); 0 = at once.
    ingress_latency_s: float = 0.0
    #: The simulator is deterministic; kept so runs record the seed they were made with.
    seed: int = 0
    #: vLLM's own admission, as ``vllm serve`` (0.32) applies it (``envs/api_server.py``):
    #: ``--max-num-active-seqs`` caps the running requests below ``max_num_seqs`` (None: no
    #: cap); ``--max-num-queued-reqs`` answers 503 while that many requests are unfinished
    #: (waiting + running); ``--max-num-queued-tokens`` answers 503 while the prompts of the
    #: requests without a first token add up to that many tokens. None: no limit.
    max_num_active_seqs: int | None = None
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, fix: str) -> ValueError:
            return ValueError(f"engine.{name}={getattr(self, name)!r} is invalid: {fix}")

        if self.kind != "sim":
            raise bad("kind", "must be 'sim' for SimEngine")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, "must be a positive integer")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise bad("max_num_batched_tokens", f"must be >= max_num_seqs={self.max_num_seqs} (as vLLM requires)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.kv_dtype not in KV_DTYPES_ALL:
            raise bad("kv_dtype", f"use one of {KV_DTYPES_ALL}")
        if self.activation_workspace_gb is not None and self.activation_workspace_gb < 0:
            raise bad("activation_workspace_gb", "must be >= 0 GB or null (estimate)")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise bad("num_gpu_blocks_override", "must be a positive block count or null")
        if self.restart_mode not in ("requeue", "drain"):
            raise bad("restart_mode", "use 'requeue' or 'drain'")
        if not (isinstance(self.ingress_latency_s, (int, float)) and 0 <= self.ingress_latency_s < math.inf):
            raise bad("ingress_latency_s", "must be a finite number of seconds >= 0")
        if self.max_num_active_seqs is not None and not 1 <= self.max_num_active_seqs <= self.max_num_seqs:
            raise bad("max_num_active_seqs", f"must be in [1, max_num_seqs={self.max_num_seqs}] or null (as vLLM requires)")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise bad(name, "must be >= 0 or null (no limit)")

    @classmethod
    def from_cfg(cls, cfg: Any) -> "SimEngineConfig":
        """Build from the Hydra ``engine`` node (or a mapping: unknown keys and wrong types raise)."""
        return from_node(cls, cfg)


@dataclass(slots=True)
class VLLMEngineConfig:
    """Settings of the live engine (``conf/engine/vllm.yaml``'s ``engine`` node, less ``kind`` and
    ``warmup``: ``VLLMEngineNode`` is that node's schema)."""

    #: Model folder or hub id; ``None`` builds and uses the tiny random Llama (no download).
    model: str | None = None
    #: The engine's own batch limit; keep it large and cap the batch with admission.
    max_num_seqs: int = 256
    #: Token budget per iteration (chunked prefill splits longer prompts).
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    #: Tokens per KV block. vLLM's CPU attention needs a multiple of 32.
    block_size: int = 32
    kv_dtype: str = "auto"
    #: Number of KV blocks (of ``kv_dtype``); ``None`` sizes the cache from memory.
    num_gpu_blocks_override: int | None = None
    #: CPU only: memory reserved for the KV cache (``VLLM_CPU_KVCACHE_SPACE`` wins when set).
    kv_cache_space_gib: float = 1.0
    #: GPU only: share of device memory vLLM may use.
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    #: What a restart does with requests in flight: finish them first, or move them over.
    on_restart: str = "requeue"
    seed: int = 0
    enforce_eager: bool = True
    #: Weights/activations dtype ("auto" = the model's).
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.on_restart not in ("drain", "requeue"):
            raise ValueError(f"engine.on_restart={self.on_restart!r}: use 'drain' or 'requeue'")
        if self.kv_dtype not in KV_DTYPES_ALL:
            raise ValueError(f"engine.kv_dtype={self.kv_dtype!r} is not one of {KV_DTYPES_ALL}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name}={getattr(self, name)} must be >= 1")
        if self.num_gpu_blocks_override is not None:
            need = -(-self.max_model_len // self.block_size) + 1  # one request + the null block
            if self.num_gpu_blocks_override < need:
                raise ValueError(
                    f"engine.num_gpu_blocks_override={self.num_gpu_blocks_override} cannot hold one "
                    f"request of max_model_len={self.max_model_len} "
                    f"(needs >= {need} blocks of {self.block_size}); raise it or lower "
                    "max_model_len"
                )


@dataclass(frozen=True, slots=True)
class EngineWarmupConfig:
    """``engine.warmup`` of ``conf/engine/vllm.yaml``: varied traffic before measuring
    (``envs.vllm_engine.warm_up``; a fresh vllm-cpu engine runs ~3x slower through its first
    minute). Read by the evaluation and the calibration, not by the engine."""

    seconds: float = 60.0
    max_batch: int = 64
    max_prompt_len: int = 1024
    max_output_len: int = 128

    def __post_init__(self) -> None:
        if self.seconds < 0:
            raise ValueError(f"engine.warmup.seconds must be >= 0, got {self.seconds}")
        for name in ("max_batch", "max_prompt_len", "max_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.warmup.{name} must be >= 1, got {getattr(self, name)}")


#: ``conf/engine/vllm.yaml``'s ``engine`` node: ``VLLMEngineConfig`` plus ``kind`` and ``warmup``.
VLLMEngineNode = node_schema(VLLMEngineConfig, "VLLMEngineNode", extra=[
    ("kind", str, "vllm"),
    ("warmup", EngineWarmupConfig, field(default_factory=EngineWarmupConfig)),
])


# --- policy: AIMD ------------------------------------------------------------------------------
@dataclass(slots=True)
class AIMDConfig:
    """Additive increase / multiplicative decrease on the cap (``conf/policy/aimd.yaml``)."""

    metric: str = "ttft"
    slo_ms: float = DEFAULT_TTFT_MS
    #: A breach is P99 above target_frac x SLO.
    target_frac: float = 1.0
    additive_increase: int = 4
    multiplicative_decrease: float = 0.75
    #: Treat preemptions in the interval as a breach too (memory pressure).
    decrease_on_preemption: bool = True
    #: As PIDConfig.queue_aware: judge the SLO on TPOT while the backlog exceeds the cap.
    queue_aware: bool = True
    tpot_slo_ms: float | None = DEFAULT_TPOT_MS
    initial_batch_cap: int = 32
    min_batch: int = 1
    max_batch: int = 256
    bucketing: str = "fifo"

    def __post_init__(self) -> None:
        check_common("aimd", {"metric": self.metric, "bucketing": self.bucketing})
        if self.additive_increase < 1 or not 0 < self.multiplicative_decrease < 1:
            raise ValueError(
                f"aimd: need additive_increase >= 1 and 0 < multiplicative_decrease < 1, got "
                f"{self.additive_increase}, {self.multiplicative_decrease}"
            )
        if not 1 <= self.min_batch <= self.initial_batch_cap <= self.max_batch:
            raise ValueError("aimd: need 1 <= min_batch <= initial_batch_cap <= max_batch")


# --- policy: static ----------------------------------------------------------------------------
@dataclass(slots=True)
class StaticConfig:
    """Fixed knobs (``conf/policy/static.yaml``; ``vllm_default.yaml`` = vLLM's defaults).
    ``batch_cap: null`` means the engine's ``max_num_seqs``."""

    batch_cap: int | None = 64
    bucketing: str = "fifo"
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_common("static", {"bucketing": self.bucketing})
        if self.batch_cap is not None and self.batch_cap < 1:
            raise ValueError(f"static.batch_cap must be >= 1 or null, got {self.batch_cap}")


@dataclass(frozen=True, slots=True)
class PPOPolicyConfig:
    """``conf/policy/ppo.yaml`` (``policies/ppo_controller.py build_ppo_controller``)."""

    #: Artifact folder; None = the shipped policy in policies/pretrained/.
    path: str | None = None
    #: KV dtypes the engine can run ({dtype: true/false}); None = only the 16-bit dtype.
    kv_runnable: dict[str, bool] | None = None
    #: The engine's max_model_len (normalises prompt lengths); None = the one recorded at training.
    max_model_len: int | None = None
    #: Widening of the training range beyond which an observation hands the interval to PID.
    ood_margin: float = 0.25
    #: Run the folder's KV-precision agent (``<path>/kv_agent``) when it has one.
    kv_agent: bool = True
    #: The engine's restart time for a KV switch, which the agent weighs (the shield's
    #: ``dtype_restart_s``); None: the KV agent is not run.
    kv_restart_s: float | None = None
    #: Start at the 8-bit KV dtype where the memory ceiling would bind at 16 bits
    #: (``Shield.start_kv_dtype``): before any traffic a switch costs no restart, and the
    #: shield's dwell then runs from the start (docs/evaluation.md, "A KV dtype chosen at start-up").
    kv_start: bool = True
    #: The SLO served, ``{"ttft": ms, "tpot": ms, "e2el": ms}`` (``build_controller`` fills it from
    #: the top config's ``slo``); None = the SLO the policy was trained at.
    slo: dict[str, float | None] | None = None


@dataclass(frozen=True, slots=True)
class LookaheadConfig:
    """``conf/policy/lookahead.yaml`` (``policies/lookahead.py``): an upper bound on what choosing
    among ``options`` every ``epoch_s`` could add over PID, found by trying each on a copy of the
    simulator. Not a controller to deploy: it sees the future."""

    #: How long a choice holds (engine seconds).
    epoch_s: float = 10.0
    #: How far each choice is judged: the option for ``epoch_s``, then ``1`` (PID's cap, the
    #: default order) for the rest.
    horizon_s: float = 40.0
    #: ``<cap>[/<bucketing>][/refuse[=<p>]|/keep][/early[=<slack>]|/early=off][/budget=<x>|none]``:
    #: the cap is a factor of the residual policy's action on PID's cap or ``max`` (the
    #: engine's max_num_seqs); the order defaults to ``bucketing``; the admission parts hold for
    #: the option's epoch only (``refuse``: ``ttft_deadline`` on above priority ``p``, default
    #: -1 = every request; ``keep``: off; ``early``: ``early_refusal`` on above -1; ``budget``:
    #: ``prefill_backlog_budgets``), the env's own admission configuration otherwise.
    options: list[str] = field(default_factory=lambda: ["0.7", "0.85", "1", "1.15", "1.3", "1/weighted",
                                                        "1/fifo", "max"])
    #: The order of ``1`` and of an option that names none (PID with shortest first: ``pid_sf``).
    bucketing: str = "shortest_first"
    #: The SLO served (``build_controller`` fills it from the top config's ``slo``).
    slo: dict[str, float | None] | None = None
    #: What the copies are fed: ``future`` (the episode's own arrivals: the bound) or ``recent``
    #: (the last ``horizon_s`` of arrivals, repeated: a forecast a deployed controller could make).
    arrivals: str = "future"


@dataclass(slots=True)
class VllmTunedConfig:
    """``conf/policy/vllm_tuned.yaml``: vLLM tuned with its own start-up flags, the yardstick an
    operator would deploy instead of batchpilot (``evaluation/matrix.py``). The grid is every
    combination of the lists; each point is a ``vllm serve`` started with those flags, scored on
    ``best_static.tune_seeds`` with best_static's objective (as vLLM's ``benchmarks/auto_tune``:
    restart per setting, keep the best that meets the latency objective)."""

    #: ``--max-num-seqs`` values (the running batch).
    max_num_seqs: list[int] = field(default_factory=lambda: [64, 128, 256])
    #: ``--max-num-batched-tokens`` values (the iteration's token budget); each must be >= the
    #: point's max_num_seqs, as vLLM requires (smaller pairs are skipped, said so).
    max_num_batched_tokens: list[int] = field(default_factory=lambda: [2048, 8192])
    #: ``--max-num-queued-tokens`` values, in tokens (null: no limit).
    max_num_queued_tokens: list[int | None] = field(default_factory=lambda: [None])
    #: ``--max-num-queued-tokens`` as factors of vLLM's docs' rule, the TTFT objective x the
    #: prefill throughput (measured at the point's max_num_seqs and token budget on the tuning
    #: seed's prompts); 1.0 is the docs' suggestion. Added to the values above.
    queued_tokens_ttft_factors: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5, 1.0])
    #: ``--max-num-queued-reqs`` values (null: no limit).
    max_num_queued_reqs: list[int | None] = field(default_factory=lambda: [None])
    #: ``--max-num-active-seqs`` for every point (null: max_num_seqs); at most each max_num_seqs.
    max_num_active_seqs: int | None = None
    #: Prompts of the tuning seed's requests the prefill throughput is measured with.
    prefill_probe_requests: int = 256

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_num_queued_tokens",
                     "queued_tokens_ttft_factors", "max_num_queued_reqs"):
            values = list(getattr(self, name))
            if len(set(values)) != len(values):
                raise ValueError(f"vllm_tuned.{name} lists a value twice: {values}")
        if not self.max_num_seqs or min(self.max_num_seqs) < 1:
            raise ValueError(f"vllm_tuned.max_num_seqs must be non-empty and >= 1, got {list(self.max_num_seqs)}")
        if not self.max_num_batched_tokens or min(self.max_num_batched_tokens) < 1:
            raise ValueError("vllm_tuned.max_num_batched_tokens must be non-empty and >= 1, got "
                             f"{list(self.max_num_batched_tokens)}")
        if not self.max_num_queued_tokens and not self.queued_tokens_ttft_factors:
            raise ValueError("vllm_tuned: max_num_queued_tokens and queued_tokens_ttft_factors are both empty; "
                             "list null in max_num_queued_tokens for no limit")
        if not self.max_num_queued_reqs:
            raise ValueError("vllm_tuned.max_num_queued_reqs is empty; [null] for no limit")
        for name in ("max_num_queued_tokens", "max_num_queued_reqs"):
            bad = [v for v in getattr(self, name) if v is not None and v < 0]
            if bad:
                raise ValueError(f"vllm_tuned.{name} must be >= 0 or null, got {bad}")
        bad_f = [f for f in self.queued_tokens_ttft_factors if not (f > 0 and math.isfinite(f))]
        if bad_f:
            raise ValueError(f"vllm_tuned.queued_tokens_ttft_factors must be > 0, got {bad_f}")
        if self.max_num_active_seqs is not None and self.max_num_active_seqs < 1:
            raise ValueError(f"vllm_tuned.max_num_active_seqs must be >= 1 or null, got {self.max_num_active_seqs}")
        if self.prefill_probe_requests < 1:
            raise ValueError(f"vllm_tuned.prefill_probe_requests must be >= 1, got {self.prefill_probe_requests}")


# The conf/policy files' schemas: the controller's dataclass plus ``kind``, which selects the
# builder (``policies/controllers.py build_controller``), and a static controller's ``name``.
# PID's, AIMD's and PPO's leave out the SLO fields: build_controller fills them from the top
# config's ``slo`` group, and a schema default there would hide the SLO.
_SLO_FILLED = ("slo_ms", "tpot_slo_ms")
PIDPolicyNode = node_schema(PIDConfig, "PIDPolicyNode", extra=[("kind", str, "pid")], exclude=_SLO_FILLED)
AIMDPolicyNode = node_schema(AIMDConfig, "AIMDPolicyNode", extra=[("kind", str, "aimd")], exclude=_SLO_FILLED)
StaticPolicyNode = node_schema(StaticConfig, "StaticPolicyNode", extra=[("kind", str, "static"), ("name", str, "static")])
PPOPolicyNode = node_schema(PPOPolicyConfig, "PPOPolicyNode", extra=[("kind", str, "ppo")], exclude=("slo",))
LookaheadPolicyNode = node_schema(LookaheadConfig, "LookaheadPolicyNode", extra=[("kind", str, "lookahead")],
                                  exclude=("slo",))
VllmTunedPolicyNode = node_schema(VllmTunedConfig, "VllmTunedPolicyNode",
                                  extra=[("kind", str, "vllm_tuned"), ("name", str, "vllm_tuned")])


# --- serve -----------------------------------------------------------------------------------
ControlMode = Literal["policy", "pid", "static", "shadow"]
CONTROL_MODES: tuple[str, ...] = ("policy", "pid", "static", "shadow")
TOKENIZER_MODES: tuple[str, ...] = ("auto", "local", "upstream", "chars")
#: uvicorn's levels (``serve.log_level``).
LOG_LEVELS: tuple[str, ...] = ("critical", "error", "warning", "info", "debug", "trace")


def _read_secret(path: str | None, key: str) -> str | None:
    """The stripped text of a secret file, or None without a path; a clear error otherwise."""
    if not path:
        return None
    try:
        return open(path, encoding="utf-8").read().strip() or None
    except OSError as exc:
        raise ValueError(f"{key}={path!r} cannot be read: {exc.strerror}") from None


@dataclass(slots=True)
class ControlConfig:
    """The control loop."""

    #: policy: the exported PPO policy acts; pid / static: the baseline acts; shadow: PID acts and
    #: the policy's decisions are only logged and compared. None: ``policy`` when ``policy_dir``
    #: is given (serving a policy is what naming one asks for), else ``pid``.
    mode: str | None = None
    #: Seconds between decisions.
    interval_s: float = 1.0
    #: Sliding window of the latency percentiles.
    window_s: float = 10.0
    #: Exported policy folder; None = ``policies/pretrained`` when it exists.
    policy_dir: str | None = None
    initial_batch_cap: int = 64
    initial_bucketing: str = "fifo"
    #: Observation scales (as in training: conf/env ``rate_scale`` / ``token_rate_scale``).
    rate_scale: float = 30.0
    token_rate_scale: float = 6000.0
    #: Share of traffic a canary policy drives: that share of upstreams, or with one upstream
    #: that share of control intervals.
    canary_share: float = 0.2
    #: Decisions by the canary before it is promoted.
    canary_min_intervals: int = 30
    #: And requests each side finished or refused before a verdict: a slow canary finishes few,
    #: and a verdict on its first two would miss the ones still queued behind them.
    canary_min_requests: int = 20
    #: Roll back when the canary's per-request SLO attainment (met / finished or refused) is below
    #: ``(1 - canary_max_drop)`` x the incumbent's.
    canary_max_drop: float = 0.10
    #: Intervals without the upstream's /metrics never raise the cap; after this many in a row
    #: the cap heads for ``safe_batch_cap`` (within the step limit) and an alert is raised.
    stale_limit: int = 3
    safe_batch_cap: int = 16
    #: Decisions kept for ``GET /admin/decisions`` (one per upstream and interval; 0 = none): what
    #: the loop saw and set, so a run can be compared interval by interval with its simulation.
    history_len: int = 3600
    #: In ``policy`` mode, start a managed engine launched at ``serve.kv_dtype: auto`` at
    #: ``serve.kv8_dtype`` where the shield's memory ceiling would hold fewer requests at 16 bits
    #: than ``shield.max_batch`` (``Shield.start_kv_dtype``, the policy's ``kv_start`` in the
    #: evaluation): one restart before the gateway serves, and the KV dwell runs from it.
    kv_start: bool = True
    #: The control loop itself failing (its task ended, or no decision completed for
    #: ``fail_open_after_s``): True = requests bypass admission and go straight to a live engine
    #: (vLLM's own scheduler queues them); False = admission keeps the last knobs.
    fail_open: bool = False
    fail_open_after_s: float = 10.0

    def __post_init__(self) -> None:
        if self.mode is None:
            self.mode = "policy" if self.policy_dir else "pid"
        if self.mode not in CONTROL_MODES:
            raise ValueError(f"serve.control.mode={self.mode!r}; one of {CONTROL_MODES} (null: policy when "
                             "serve.control.policy_dir is set, else pid)")
        if not self.interval_s > 0:
            raise ValueError(f"serve.control.interval_s must be > 0, got {self.interval_s}")
        if not 0.0 <= self.canary_share <= 1.0:
            raise ValueError(f"serve.control.canary_share must be in [0, 1], got {self.canary_share}")
        if not 0.0 < self.canary_max_drop < 1.0:
            raise ValueError(f"serve.control.canary_max_drop must be in (0, 1), got {self.canary_max_drop}")
        if self.initial_batch_cap < 1:
            raise ValueError(f"serve.control.initial_batch_cap must be >= 1, got {self.initial_batch_cap}")
        if self.history_len < 0:
            raise ValueError(f"serve.control.history_len must be >= 0, got {self.history_len}")
        if not self.fail_open_after_s > 0:
            raise ValueError(f"serve.control.fail_open_after_s must be > 0, got {self.fail_open_after_s}")
        if self.stale_limit < 1 or self.safe_batch_cap < 1:
            raise ValueError("serve.control.stale_limit and serve.control.safe_batch_cap must be >= 1, got "
                             f"{self.stale_limit}, {self.safe_batch_cap}")


@dataclass(slots=True)
class QualityGuardConfig:
    """The guide's QuantizationMonitor: replay a sample of requests on a 16-bit reference."""

    enabled: bool = True
    sample_share: float = 0.05
    #: Output-diff rate above which the gateway falls back to 16-bit KV.
    threshold: float = 0.05
    #: Samples needed before the rate is trusted.
    min_samples: int = 20
    #: Sliding window of samples.
    window: int = 200
    #: Greedy tokens compared per sample.
    max_tokens: int = 16
    #: A 16-bit vLLM server to replay on; None = no replay (the guard only reports).
    reference_url: str | None = None

    def __post_init__(self) -> None:
        for name in ("sample_share", "threshold"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"serve.quality_guard.{name} must be in [0, 1], got {v}")
        if self.min_samples < 1 or self.window < self.min_samples:
            raise ValueError(
                f"serve.quality_guard needs 1 <= min_samples <= window, got {self.min_samples}, {self.window}"
            )


@dataclass(slots=True)
class WarmupConfig:
    """Prompt prefixes sent after each (re)start so the prefix cache starts warm."""

    prompts: list[str] = field(default_factory=list)
    max_tokens: int = 1


@dataclass(slots=True)
class ServeConfig:
    """The gateway (``serve`` node; its schema, ``ServeNode``, leaves out the secrets)."""

    host: str = "127.0.0.1"
    port: int = 8000
    #: Start and own ``vllm serve`` processes (True) or use ``upstreams`` (False).
    managed: bool = False
    upstreams: list[str] = field(default_factory=list)
    num_managed: int = 1
    #: Model folder for managed engines; None = the built-in tiny model.
    model: str | None = None
    served_model_name: str | None = None
    #: First port of managed engines; 0 = free ports.
    managed_port_base: int = 0
    max_num_seqs: int = 256
    max_model_len: int = 2048
    #: The engines' token budget per iteration (vLLM's ``--max-num-batched-tokens``), which
    #: admission's prefill backlog counts in. Managed engines are started with it; for unmanaged
    #: ones it is what their operator set. None = ``--max-num-batched-tokens`` in
    #: ``extra_vllm_args``, else vLLM's server default on CPUs (2,048, or ``max_model_len`` if
    #: larger); GPU servers default to more (8,192 on H100/H200), so say it for them.
    max_num_batched_tokens: int | None = None
    kv_cache_space_gib: int = 1
    kv_dtype: str = "auto"
    kv8_dtype: str = "fp8"
    #: The engines' time to read 8-bit KV over 16-bit (``hardware.kv8_speed_factor``: 1.1 on an
    #: A100, which has no native fp8); above 1 ``control.kv_start`` keeps 16-bit.
    kv8_read_cost: float = 1.0
    #: KV dtypes the operator of unmanaged upstreams says they can be switched to (the gateway
    #: only recommends a switch there); None = only the dtype each upstream runs.
    upstream_kv_dtypes: list[str] | None = None
    extra_vllm_args: list[str] = field(default_factory=lambda: ["--enforce-eager"])
    #: Tensor-parallel ranks the model is split over (sizes the per-rank KV and weights of the
    #: memory model); None = ``--tensor-parallel-size`` in ``extra_vllm_args``, else 1.
    tensor_parallel: int | None = None
    startup_timeout_s: float = 300.0
    auto_restart: bool = True
    health_interval_s: float = 0.5
    #: One /health probe may take this long: a CPU engine busy generating starves the API
    #: server's process, and a 1 s limit declared a live, busy upstream dead.
    health_timeout_s: float = 5.0
    #: A managed upstream whose process is alive is restarted only after this many failed
    #: probes in a row spanning at least ``health_grace_s`` (a dead process: at once).
    health_failures: int = 3
    health_grace_s: float = 15.0
    #: Queueing plus the upstream until its answer (a stream: its first chunk) must fit in this;
    #: a stream then ends only after this long without a chunk.
    request_timeout_s: float = 60.0
    #: Seconds requests in flight get to finish once a stop is asked for (SIGTERM, Ctrl-C);
    #: then their upstream calls are closed and they end in the gateway's error form (503 /
    #: an SSE ``shutting_down`` event). 0: end them at once.
    drain_s: float = 4.0
    retry_after_s: int = 1
    #: Request bodies above this are refused with 413 (before they are read when declared).
    max_body_bytes: int = 8 * 1024 * 1024
    #: Worker processes that parse large request bodies (0: a thread of the gateway's, which
    #: holds the event loop for the parse).
    body_workers: int = 1
    #: A request body must arrive within this (else 408); headers within ``header_timeout_s``
    #: (else the connection is closed).
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    #: A request head (request line and headers) larger than this is answered 431 (JSON) and
    #: the connection closed; the gateway's HTTP parser otherwise kept 20 MB of headers.
    max_header_bytes: int = 64 * 1024
    #: JSON arrays and objects a request body may open (its ``[`` and ``{`` bytes, counted
    #: before the parse, an upper bound): 2.7 million empty arrays in one body cost 0.76 s to parse.
    max_json_containers: int = 100_000
    #: A top-level body field vLLM does not know (``request_body.KNOWN_FIELDS``) may hold this
    #: much JSON; a larger one is a 400 and never reaches vLLM (which would ignore it).
    max_unknown_field_bytes: int = 64 * 1024
    #: The longest a request waits for a lane that cannot serve (engine stopped, exited,
    #: restarting, unresponsive): past it 503 + Retry-After; what is queued on a lane down this
    #: long is refused, and new requests to it at once. None: wait up to ``request_timeout_s``.
    fail_fast_s: float | None = 1.0
    #: /health unanswered this long, across probes (each allowed ``health_timeout_s``), with no
    #: answer from the upstream meanwhile: the lane stops admitting until it answers again (a
    #: restart still needs ``health_failures``/``health_grace_s``). Longer than one probe's
    #: timeout: a busy CPU engine answers slowly, not never. None: off.
    unresponsive_s: float | None = 10.0
    priority_header: str = "x-priority"
    default_priority: int = 1
    #: Header carrying a trusted key; only requests with one may ask for a priority above the
    #: default (0 = core, never shed). Keys: ``$BATCHPILOT_TRUSTED_KEYS`` (comma-separated) or
    #: ``trusted_keys_file`` (one per line).
    trusted_key_header: str = "x-batchpilot-key"
    trusted_keys_file: str | None = None
    #: How prompt length is counted: a local tokenizer, the upstream's /tokenize, or chars / 4.
    tokenizer: str = "auto"
    #: File holding the admin API's bearer token (``$BATCHPILOT_ADMIN_TOKEN`` wins). Never the
    #: token itself: config values land in Hydra's config dump and on the command line.
    admin_token_file: str | None = None
    #: File holding the API key the upstream vLLM servers require (``vllm serve --api-key``;
    #: ``$VLLM_API_KEY``, vLLM's own variable, wins). The gateway sends it as the bearer token of
    #: every upstream call (clients' own ``Authorization`` is never forwarded), and managed
    #: engines are started with it. None and no variable: no key.
    upstream_api_key_file: str | None = None
    #: Folder for the managed engines' logs (``vllm-<port>.log``); None = ``engines/`` in the Hydra
    #: run's folder of ``scripts/serve.py`` (outside a Hydra app, ``<tmp>/batchpilot-engines-<uid>``),
    #: private (mode 0700; ``serving.gateway.default_engine_log_dir``).
    log_dir: str | None = None
    log_level: str = "info"
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    quality_guard: QualityGuardConfig = field(default_factory=QualityGuardConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    #: Secrets, read in ``__post_init__`` from the environment or the files above; never config.
    admin_token: str | None = field(default=None, repr=False)
    trusted_keys: tuple[str, ...] = field(default=(), repr=False)
    upstream_api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.managed and not self.upstreams:
            raise ValueError(
                "serve: no upstream. Set serve.managed=true (start vllm serve on the tiny model) "
                "or serve.upstreams=[http://127.0.0.1:8001,...]"
            )
        if self.managed and self.upstreams:
            raise ValueError("serve.managed=true and serve.upstreams are exclusive; set one of them")
        if self.num_managed < 1:
            raise ValueError(f"serve.num_managed must be >= 1, got {self.num_managed}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"serve.port={self.port} is not a port number")
        if self.tokenizer not in TOKENIZER_MODES:
            raise ValueError(f"serve.tokenizer={self.tokenizer!r}; one of {TOKENIZER_MODES}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"serve.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ValueError("serve.max_num_seqs and serve.max_model_len must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"serve.max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"serve.max_num_seqs={self.max_num_seqs} (as vLLM requires), or null")
        self.upstreams = [u.rstrip("/") for u in self.upstreams]
        for u in self.upstreams:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"serve.upstreams entry {u!r} must start with http:// or https://")
        for name in ("health_timeout_s", "health_grace_s", "body_timeout_s", "header_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"serve.{name} must be > 0, got {getattr(self, name)}")
        if not self.kv8_read_cost > 0:
            raise ValueError(f"serve.kv8_read_cost must be > 0 (8-bit over 16-bit read time), got {self.kv8_read_cost}")
        if not (math.isfinite(self.drain_s) and self.drain_s >= 0):
            raise ValueError(f"serve.drain_s must be a number of seconds >= 0 (how long requests in flight get to "
                             f"finish at a stop; 0 = end them at once), got {self.drain_s}")
        if self.retry_after_s < 0:
            raise ValueError(f"serve.retry_after_s must be >= 0 (seconds in Retry-After), got {self.retry_after_s}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"serve.log_level={self.log_level!r}; one of {LOG_LEVELS}")
        if self.health_failures < 1:
            raise ValueError(f"serve.health_failures must be >= 1, got {self.health_failures}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"serve.max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.body_workers < 0:
            raise ValueError(f"serve.body_workers must be >= 0, got {self.body_workers}")
        if self.max_header_bytes < 1024 or self.max_json_containers < 16 or self.max_unknown_field_bytes < 0:
            raise ValueError("serve.max_header_bytes must be >= 1024, serve.max_json_containers >= 16 and "
                             f"serve.max_unknown_field_bytes >= 0; got {self.max_header_bytes}, "
                             f"{self.max_json_containers}, {self.max_unknown_field_bytes}")
        for name in ("fail_fast_s", "unresponsive_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"serve.{name} must be a number of seconds > 0 or null, got {v}")
        if self.default_priority < 0:
            raise ValueError(f"serve.default_priority must be >= 0, got {self.default_priority}")
        self.priority_header = self.priority_header.lower()
        self.trusted_key_header = self.trusted_key_header.lower()
        self.admin_token = os.environ.get("BATCHPILOT_ADMIN_TOKEN") or _read_secret(self.admin_token_file,
                                                                                     "serve.admin_token_file")
        keys = os.environ.get("BATCHPILOT_TRUSTED_KEYS", "").split(",")
        if self.trusted_keys_file:
            keys += (_read_secret(self.trusted_keys_file, "serve.trusted_keys_file") or "").splitlines()
        self.trusted_keys = tuple(k.strip() for k in keys if k.strip())
        self.upstream_api_key = (os.environ.get("VLLM_API_KEY")
                                 or _read_secret(self.upstream_api_key_file, "serve.upstream_api_key_file") or None)

    def is_trusted(self, key: str | None) -> bool:
        """Whether ``key`` is one of the trusted keys (compared in constant time)."""
        if not key:
            return False
        given = key.encode()
        return any(hmac.compare_digest(given, k.encode()) for k in self.trusted_keys)

    @classmethod
    def from_cfg(cls, node: Any) -> "ServeConfig":
        """From the ``serve`` config node (DictConfig or mapping; unknown keys and wrong types raise)."""
        data = plain(node)
        if "admin_token" in data or "trusted_keys" in data or "upstream_api_key" in data:
            raise ValueError(
                "serve.admin_token / serve.trusted_keys / serve.upstream_api_key are not read from the config: "
                "config values land in Hydra's config dump and on the command line. Export "
                "BATCHPILOT_ADMIN_TOKEN / BATCHPILOT_TRUSTED_KEYS / VLLM_API_KEY, or set serve.admin_token_file / "
                "serve.trusted_keys_file / serve.upstream_api_key_file")
        return from_node(cls, data)


#: ``conf/serve/default.yaml``: ``ServeConfig`` without its secrets (``admin_token``, ``trusted_keys``,
#: ``upstream_api_key``), which
#: are read from the environment or files, never from the config.
ServeNode = node_schema(ServeConfig, "ServeNode", exclude=("admin_token", "trusted_keys", "upstream_api_key"))


# --- benchmarks (conf/bench.yaml) ------------------------------------------------------------
@dataclass(slots=True)
class GatewayBenchConfig:
    """The ``gateway_bench`` node of ``conf/bench.yaml`` (``scripts/bench.py target=gateway``)."""

    rate: float = 20.0  # pairs per second
    num_pairs: int = 1500
    warmup_pairs: int = 50
    max_tokens: int = 1
    prompt: str = "The quick brown fox jumps over the lazy dog."
    control_mode: str = "pid"
    #: Extra ``scripts/serve.py`` overrides for the gateway under test (e.g. to switch off the
    #: control loop and health probes and see what they cost: ``serve.control.interval_s=3600``).
    serve_overrides: list[str] = field(default_factory=list)

    @classmethod
    def from_cfg(cls, cfg: Any) -> "GatewayBenchConfig":
        return from_node(cls, cfg.get("gateway_bench") if hasattr(cfg, "get") else None)


@dataclass(slots=True)
class ClientBenchConfig:
    """The ``client_bench`` node of ``conf/bench.yaml`` (``scripts/bench.py target=http_client``)."""

    rounds: int = 20
    calls_per_round: int = 200
    warmup_calls: int = 200

    @classmethod
    def from_cfg(cls, node: Any) -> "ClientBenchConfig":
        return from_node(cls, node)



# --- evaluation launcher (conf/launcher) --------------------------------------------------------
LAUNCHERS = ("serial", "ray")


@dataclass(frozen=True, slots=True)
class LauncherConfig:
    """Where the evaluation's cells run (``conf/launcher/<kind>.yaml``; docs/scaling.md)."""

    kind: str = "serial"
    #: Ray cluster to join (``auto``, ``HOST:6379``, ``ray://HOST:10001``); None = start a
    #: local one for the run.
    address: str | None = None
    #: CPUs of a local cluster started for the run (None = all of this machine's).
    num_cpus: int | None = None
    #: CPUs Ray reserves per cell: a simulator episode is single-threaded.
    cpus_per_cell: float = 1.0
    #: Further ``ray.init`` keyword arguments (e.g. ``runtime_env``, ``object_store_memory``).
    init: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.address == "":
            object.__setattr__(self, "address", None)
        if self.kind not in LAUNCHERS:
            raise ValueError(f"launcher.kind must be one of {LAUNCHERS}, got {self.kind!r}")
        if self.cpus_per_cell <= 0:
            raise ValueError(f"launcher.cpus_per_cell must be > 0, got {self.cpus_per_cell}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"launcher.num_cpus must be >= 1 or null, got {self.num_cpus}")

    @classmethod
    def from_cfg(cls, node: Any) -> "LauncherConfig":
        return from_node(cls, node)


# --- live evaluation scenario (conf/live_scenario) ------------------------------------------
@dataclass(frozen=True, slots=True)
class LiveScenarioConfig:
    """``conf/live_scenario/<name>.yaml``: the trace window a live evaluation replays
    (``evaluation/live.py scenario_trace``, ``evaluation/live_twin.py``). A schema only:
    those read the composed node, and every field is required (no default), so each scenario
    file names every key and no default can disagree with one."""

    name: str
    #: Trace file, relative to the repository root; ``format``: azure | mooncake | burstgpt.
    trace: str
    format: str
    start_s: float
    duration_s: float | None
    time_scale: float
    spread_quantum_s: float | None
    max_requests: int | None
    max_prompt_len: int | None
    max_output_len: int | None
    max_model_len: int
    chunk_tokens: int
    #: Appended to the managed vLLM's arguments.
    vllm_args: list[str]
    #: Size the load to this machine: the window is replayed at this multiple of what vLLM
    #: serves here (a saturated probe of the same requests, straight to vLLM, after warm-up);
    #: ``time_scale`` then only picks the window's shape. null = the rate as written.
    load_multiple: float | None
    #: What vLLM serves here (req/s) to size ``load_multiple`` on, instead of probing: another
    #: run's ``load.capacity_req_s`` (results.json), to replay the very load it replayed (an A/B
    #: of one setting across two runs). null = the probe measures it.
    capacity_req_s: float | None

    def __post_init__(self) -> None:
        for name in ("load_multiple", "capacity_req_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"live_scenario.{name}={v} must be a positive number or null")
        if self.capacity_req_s is not None and self.load_multiple is None:
            raise ValueError("live_scenario.capacity_req_s sizes the load by load_multiple; set that too "
                             "(or capacity_req_s=null to replay the written rate)")

# --- app configs: the top-level keys of conf/<app>.yaml -------------------------------------
# Each app's top config lists its schema first (``- /schema/<app>@_here_``), so a mistyped
# top-level key in the file, ``seedz=[1]`` or ``seeds=abc`` on the command line fail at compose
# naming the key. The fields are required (no default here, so none can disagree with the
# file); the groups an app composes (``model``, ``env``, ...) are ``Any`` here and checked by
# their own schemas. A key added with Hydra's ``+key=...`` passes compose (struct mode lets it
# through); the apps that read their top config (evaluate, calibrate, live_evaluate) check it
# again with ``check_app`` and name it.


@dataclass(frozen=True, slots=True)
class BestStaticConfig:
    """``best_static`` of ``conf/evaluate.yaml``: the grid ``best_static`` searches and its
    objective (``evaluation/matrix.py``)."""

    #: Batch caps to try (values above the engine's max_num_seqs are clipped to it).
    batch_caps: tuple[int, ...]
    bucketing: tuple[str, ...]
    #: "auto" (16-bit) and/or 8-bit dtypes; ones the engine cannot run are skipped, said so.
    kv_dtypes: tuple[str, ...]
    #: Only grid points at or above this SLO attainment compete on goodput.
    min_slo_attainment: float
    #: Seeds (trace windows) the grid is scored on; must be disjoint from the scored ``seeds``.
    tune_seeds: tuple[int, ...]
    #: Also run the grid on the scored seeds and report their best point as
    #: ``best_static_hindsight``: an upper bound no static setting tuned beforehand can beat.
    hindsight: bool

    def __post_init__(self) -> None:
        for name in ("batch_caps", "bucketing", "kv_dtypes", "tune_seeds"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.batch_caps or min(self.batch_caps) < 1:
            raise ValueError(f"best_static.batch_caps must be non-empty and >= 1, got {list(self.batch_caps)}")
        bad = [b for b in self.bucketing if b not in BUCKETING_MODES]
        if not self.bucketing or bad:
            raise ValueError(f"best_static.bucketing must be a non-empty subset of {BUCKETING_MODES}, "
                             f"got {list(self.bucketing)}")
        if not self.kv_dtypes:
            raise ValueError("best_static.kv_dtypes must not be empty (e.g. [auto, fp8])")
        if not 0.0 <= self.min_slo_attainment <= 1.0:
            raise ValueError(f"best_static.min_slo_attainment must be in [0, 1], got {self.min_slo_attainment}")
        if not self.tune_seeds or len(set(self.tune_seeds)) != len(self.tune_seeds):
            raise ValueError(f"best_static.tune_seeds must be a non-empty list of distinct ints, "
                             f"got {list(self.tune_seeds)}")


LOAD_MODES = ("probe", "table", "none")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """``load`` of ``conf/evaluate.yaml``: how a workload's load is sized per deployment (its
    ``rate_scale`` is multiplied by capacity(deployment) / capacity(the workload's own
    deployment), so every deployment runs at the load the workload was written for)."""

    #: probe: measure each capacity on the simulator (saturated, the workload's own lengths);
    #: table: only ``table``; none: every deployment gets the workload's rates unchanged.
    mode: str
    #: "model/hardware" -> multiplier; wins over the probe for that deployment.
    table: dict[str, float]
    #: Completions the probe counts (after as many again to fill the engine).
    probe_completions: int

    def __post_init__(self) -> None:
        if self.mode not in LOAD_MODES:
            raise ValueError(f"load.mode must be one of {LOAD_MODES}, got {self.mode!r}")
        bad = {k: v for k, v in self.table.items() if not v > 0}
        if bad:
            raise ValueError(f"load.table: multipliers must be > 0, got {bad}")
        if self.probe_completions < 10:
            raise ValueError(f"load.probe_completions must be >= 10, got {self.probe_completions}")


@dataclass(slots=True)
class EvaluateApp:
    """``conf/evaluate.yaml`` (and ``evaluate_matrix.yaml``, built on it): see the comments
    there for each key; ``evaluation/plan.py EvalConfig.from_cfg`` reads them."""

    # Groups (their own schemas).
    hardware: Any
    model: Any
    workload: Any
    slo: Any
    env: Any
    shield: Any
    logger: Any
    engine: Any
    launcher: Any
    # Run-wide settings.
    policies: list[str]
    seeds: list[int]
    workloads: list[str] | None
    deployments: list[str] | None
    load: LoadConfig
    trace_windows: bool
    trace_window_stride_s: float | None
    max_episode_s: float
    workload_overrides: dict[str, list[str]]
    policy_overrides: dict[str, dict[str, Any]]
    best_static: BestStaticConfig
    timeline_seeds: list[int] | None
    plots: bool
    out_dir: str


@dataclass(frozen=True, slots=True)
class Grid:
    """``grid`` of ``conf/calibrate.yaml``: what the calibration measures
    (``evaluation/calibration.py``)."""

    #: Decode batch sizes x prompt (context) lengths; points with batch x context above
    #: ``max_decode_tokens`` are skipped (their prefill alone would take too long).
    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    #: Decode prompts drawn from ``context x [1 - s, 1 + s]`` (0 = all equal); see measure_decode.
    context_spread: float
    max_decode_tokens: int
    decode_steps: int
    #: Decode points with these batch sizes also measure mixed iterations: one fresh prompt of
    #: each of ``mixed_chunks`` tokens prefilled beside the decodes.
    mixed_batches: tuple[int, ...]
    mixed_chunks: tuple[int, ...]
    mixed_repeats: int
    #: Prefill chunk sizes x prior (prefix-cached) contexts x requests per iteration; points
    #: whose prompt reaches ``max_model_len`` or whose chunks exceed the token budget are skipped.
    chunks: tuple[int, ...]
    priors: tuple[int, ...]
    prefill_reqs: tuple[int, ...]
    prefill_repeats: int

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))


@dataclass(frozen=True, slots=True)
class StateProbe:
    """``state_probe`` of ``conf/calibrate.yaml``: a fixed reference iteration timed before and
    after every grid point and every live run, so measurements taken while other tenants slow
    the machine down are re-taken or set aside (``evaluation/calibration.py``, docs/sim_to_real.md)."""

    enabled: bool
    #: The reference: pure decode of ``batch`` sequences of ``context`` tokens (spread as the
    #: grid's), median of ``steps`` iterations.
    batch: int
    context: int
    steps: int
    #: A probe more than this over the fastest reference is the slow state.
    tolerance: float
    #: Grid points measured in the slow state are measured again up to this many times.
    retries: int
    #: Live runs attempted (at most) to get ``runs`` of them in the fast state.
    max_runs: int
    #: The fast state's reference: this quantile of the probes taken so far (0 = the fastest).
    #: Where the host's probe varies by itself, its single fastest time is an outlier that makes
    #: an idle host read as busy (docs/sim_to_real.md, "A third CPU").
    anchor_quantile: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.anchor_quantile) < 1.0:
            raise ValueError(f"state_probe.anchor_quantile: must be in [0, 1), got {self.anchor_quantile!r}")
        for name in ("batch", "context", "steps", "max_runs"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"state_probe.{name}: must be >= 1, got {getattr(self, name)!r}")
        if int(self.retries) < 0:
            raise ValueError(f"state_probe.retries: must be >= 0, got {self.retries!r}")
        if not (math.isfinite(float(self.tolerance)) and float(self.tolerance) > 0):
            raise ValueError(f"state_probe.tolerance: must be > 0, got {self.tolerance!r}")


#: ``base`` of ``conf/calibrate.yaml``: the nominal peaks a fitted profile is relative to, i.e.
#: ``HardwareSpec`` less ``name`` and ``memory_gb`` (filled by the calibration); what the file
#: leaves out is ``HardwareSpec``'s own default, as when the profile is built from it.
CalibrationBase = node_schema(HardwareSpec, "CalibrationBase", exclude=("name", "memory_gb"))


@dataclass(slots=True)
class ServedDecodeSettings:
    """What ``serving/served_decode.py`` measures: batches of ``concurrencies`` simultaneous
    requests of ``prompt_tokens`` + ``max_tokens``, best of ``repeats``, after ``warmup`` batches."""

    concurrencies: list[int]
    warmup: list[int]
    repeats: int
    prompt_tokens: int
    max_tokens: int


@dataclass(slots=True)
class ServedCalibrationNode(ServedDecodeSettings):
    """``served`` of ``conf/calibrate.yaml``: what ``vllm serve`` adds to the in-process profile."""

    enabled: bool
    out: str


@dataclass(slots=True)
class CalibrateApp:
    """``conf/calibrate.yaml`` (``evaluation/calibration.py``: the fit, ``evaluation/sim_to_real.py``:
    the report; see the comments there)."""

    fit: bool
    report: bool
    seed: int
    live_overrides: list[str]
    #: Read from the command line by ``scripts/calibrate.py`` before torch loads; here so the
    #: keys are known and typed.
    omp_wait_policy: str | None
    omp_num_threads: int | None
    warmup: EngineWarmupConfig
    profile: str
    out: str
    base: CalibrationBase  # type: ignore[valid-type]
    grid: Grid
    #: Seconds of varied traffic after the grid whose recorded iterations set the profile's
    #: level (``slowdown``): the grid fixes the shape, episodes' iterations the speed. 0 = off.
    level_seconds: float
    state_probe: StateProbe
    runs: int
    common_overrides: list[str]
    sim_overrides: list[str]
    live_report_overrides: list[str]
    report_rate_scale: float
    #: Workload name -> the Hydra overrides that make it.
    workloads: dict[str, list[str]]
    #: Workload name -> the share of the profile's simulated capacity its load is sized to
    #: (``capacity_scale``); a workload not named keeps its own rate.
    load_vs_capacity: dict[str, float]
    #: The served path (``scripts/calibrate.py served=true``): measured through ``vllm serve``,
    #: its extra over ``profile`` written as ``served.out``.
    served: ServedCalibrationNode


@dataclass(slots=True)
class LiveWarmupNode:
    """``warmup`` of ``conf/live_evaluate.yaml``."""

    requests: int


@dataclass(slots=True)
class LiveClientNode:
    """``client`` of ``conf/live_evaluate.yaml``: vLLM's benchmark client's settings."""

    temperature: float | None
    max_concurrency: int | None
    headers: list[str]


@dataclass(slots=True)
class LiveGatewayNode:
    """``gateway`` of ``conf/live_evaluate.yaml``: the gateway and the vLLM it manages."""

    model: str | None
    served_model_name: str
    kv_cache_space_gib: int
    extra_vllm_args: list[str]
    overrides: list[str]
    startup_timeout_s: float
    settle_timeout_s: float


@dataclass(slots=True)
class LiveTuningWindowNode:
    """``vllm_tuned.tuning``: the window of the scenario's trace the sweep replays (trace
    seconds, as ``live_scenario.start_s`` / ``duration_s``), disjoint from the scored one."""

    #: null = right after the scored window (as replayed: a sized scenario's grown window).
    start_s: float | None
    #: null = as long as the scored window.
    duration_s: float | None


@dataclass(slots=True)
class LiveTunedFlagsNode:
    """``vllm_tuned.flags``: vLLM's limits given (null = not given); any set skips the sweep.
    Each an integer, or ``slo`` for ``max_num_queued_tokens`` (checked in ``live_tuned``)."""

    max_num_seqs: Any
    max_num_batched_tokens: Any
    max_num_active_seqs: Any
    max_num_queued_reqs: Any
    max_num_queued_tokens: Any


@dataclass(slots=True)
class LiveVllmTunedNode:
    """``vllm_tuned`` of ``conf/live_evaluate.yaml``: the second managed ``vllm serve``, started
    with vLLM's own limits, either given (``flags``) or swept (``grid``) on a tuning window
    (``evaluation/live_tuned.py``)."""

    #: Fixed settings instead of the sweep (all null: sweep).
    flags: LiveTunedFlagsNode
    #: Each key's values; the sweep tries every combination (at most ``max_settings``).
    grid: dict[str, list[Any]]
    max_settings: int
    tuning: LiveTuningWindowNode
    #: A setting is kept only if its SLO attainment on the tuning window reaches this.
    attainment_floor: float
    #: Requests of the tuning window sent at once with one output token each to measure vLLM's
    #: prefill throughput (for a ``slo`` queued-tokens limit).
    prefill_probe_requests: int


@dataclass(slots=True)
class LiveEvaluateApp:
    """``conf/live_evaluate.yaml`` (``evaluation/live.py``; see the comments there)."""

    slo: Any
    live_scenario: Any
    paths: list[str]
    #: More policy paths: name -> an exported policy folder.
    policies: dict[str, str]
    rounds: int
    order: str
    seed: int
    warmup: LiveWarmupNode
    client: LiveClientNode
    gateway: LiveGatewayNode
    vllm_tuned: LiveVllmTunedNode
    plots: bool
    sim_twin: bool
    twin_match: bool
    twin_match_gateway: bool
    twin_ingress_latency_s: float
    twin_hardware: str
    twin_of: str | None
    twin_speed_of: str | None
    out_dir: str


@dataclass(slots=True)
class ExportApp:
    """``conf/export.yaml`` (``scripts/export.py``)."""

    shield: Any
    slo: Any
    model_path: str
    vecnorm_path: str | None
    out_dir: str
    train_config_path: str | None
    parity_samples: int


@dataclass(slots=True)
class SimBenchNode:
    """``sim`` of ``conf/bench.yaml`` (``scripts/bench.py target=sim``)."""

    wall_seconds: float
    arrival_rate_per_s: float
    prompt_mean: float
    output_mean: float
    length_sigma: float
    max_waiting: int


@dataclass(slots=True)
class EnvBenchNode:
    """``env_bench`` of ``conf/bench.yaml`` (``target=env``)."""

    wall_seconds: float
    workload: str
    rate: float
    interval_s: float
    #: Further overrides of the environment's config (``env.admission.on_time_first=false``),
    #: so one setting can be measured beside another.
    overrides: list[str]


@dataclass(slots=True)
class PolicyBenchNode:
    """``policy_bench`` of ``conf/bench.yaml`` (``target=policy``)."""

    path: str | None
    n_calls: int


@dataclass(slots=True)
class ServedDecodeBenchNode(ServedDecodeSettings):
    """``served_decode`` of ``conf/bench.yaml`` (``target=served_decode``)."""

    profile: str


@dataclass(slots=True)
class ServedRoundTripBenchNode:
    """``served_round_trip`` of ``conf/bench.yaml`` (``target=served_round_trip``)."""

    profile: str
    prompt_tokens: int
    requests: int
    warmup: int


@dataclass(slots=True)
class BenchApp:
    """``conf/bench.yaml`` (``scripts/bench.py``). ``gateway_bench`` / ``client_bench`` extend
    ``schema/gateway_bench`` / ``schema/client_bench`` in the file's defaults list."""

    hardware: Any
    model: Any
    engine: Any
    gateway_bench: Any
    client_bench: Any
    target: str
    seed: int
    sim: SimBenchNode
    hardware_name: str
    model_name: str
    env_bench: EnvBenchNode
    policy_bench: PolicyBenchNode
    served_decode: ServedDecodeBenchNode
    served_round_trip: ServedRoundTripBenchNode


@dataclass(slots=True)
class ServeApp:
    """``conf/serve_app.yaml`` (``scripts/serve.py``): only groups, each checked by its own
    schema; this one rejects any other top-level key."""

    serve: Any
    slo: Any
    shield: Any
    policy: Any


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
