"""The gateway's configuration as validated dataclasses (``conf/serve/default.yaml``).

Built once from the Hydra node with ``ServeConfig.from_cfg``; unknown keys and out-of-range
values raise with the key, the value and the fix, so a typo never starts a half-configured
gateway.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from batchpilot.config import config_fields
from batchpilot.core.admission import AdmissionConfig

ControlMode = Literal["policy", "pid", "static", "shadow"]
CONTROL_MODES: tuple[str, ...] = ("policy", "pid", "static", "shadow")
TOKENIZER_MODES: tuple[str, ...] = ("auto", "local", "upstream", "chars")


def _read_secret(path: str | None, key: str) -> str | None:
    """The stripped text of a secret file, or None without a path; a clear error otherwise."""
    if not path:
        return None
    try:
        return open(path, encoding="utf-8").read().strip() or None
    except OSError as exc:
        raise ValueError(f"{key}={path!r} cannot be read: {exc.strerror}") from None


def _build(cls: type, node: Any, where: str) -> Any:
    """Dataclass ``cls`` from a mapping; unknown keys raise naming the section."""
    return cls(**config_fields(cls, node, where))


@dataclass(slots=True)
class ControlConfig:
    """The control loop."""

    #: policy: the exported PPO policy acts; pid / static: the baseline acts; shadow: PID acts and
    #: the policy's decisions are only logged and compared.
    mode: str = "pid"
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

    def __post_init__(self) -> None:
        if self.mode not in CONTROL_MODES:
            raise ValueError(f"serve.control.mode={self.mode!r}; one of {CONTROL_MODES}")
        if not self.interval_s > 0:
            raise ValueError(f"serve.control.interval_s must be > 0, got {self.interval_s}")
        if not 0.0 <= self.canary_share <= 1.0:
            raise ValueError(f"serve.control.canary_share must be in [0, 1], got {self.canary_share}")
        if not 0.0 < self.canary_max_drop < 1.0:
            raise ValueError(f"serve.control.canary_max_drop must be in (0, 1), got {self.canary_max_drop}")
        if self.initial_batch_cap < 1:
            raise ValueError(f"serve.control.initial_batch_cap must be >= 1, got {self.initial_batch_cap}")
        if self.stale_limit < 1 or self.safe_batch_cap < 1:
            raise ValueError("serve.control.stale_limit and serve.control.safe_batch_cap must be >= 1, got "
                             f"{self.stale_limit}, {self.safe_batch_cap}")


@dataclass(slots=True)
class BreakerConfig:
    """What the gateway does at each breaker level (level 1's shrink is the shield's)."""

    #: Level 2: share of low-priority arrivals rejected ("shed_low_priority").
    shed_fraction: float = 0.5
    #: Level 3: restart a managed upstream (queued core requests wait for it).
    restart: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.shed_fraction <= 1.0:
            raise ValueError(f"serve.breaker.shed_fraction must be in [0, 1], got {self.shed_fraction}")


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
    """The gateway (``serve`` node)."""

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
    kv_cache_space_gib: int = 1
    kv_dtype: str = "auto"
    kv8_dtype: str = "fp8"
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
    request_timeout_s: float = 60.0
    retry_after_s: int = 1
    #: Request bodies above this are refused with 413 (before they are read when declared).
    max_body_bytes: int = 8 * 1024 * 1024
    #: A request body must arrive within this (else 408); headers within ``header_timeout_s``
    #: (else the connection is closed).
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
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
    #: Folder for the managed engines' logs; None = a private temporary folder (mode 0700).
    log_dir: str | None = None
    log_level: str = "info"
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    quality_guard: QualityGuardConfig = field(default_factory=QualityGuardConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    #: Secrets, read in ``__post_init__`` from the environment or the files above; never config.
    admin_token: str | None = field(default=None, repr=False)
    trusted_keys: tuple[str, ...] = field(default=(), repr=False)

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
        self.upstreams = [u.rstrip("/") for u in self.upstreams]
        for u in self.upstreams:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"serve.upstreams entry {u!r} must start with http:// or https://")
        for name in ("health_timeout_s", "health_grace_s", "body_timeout_s", "header_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"serve.{name} must be > 0, got {getattr(self, name)}")
        if self.health_failures < 1:
            raise ValueError(f"serve.health_failures must be >= 1, got {self.health_failures}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"serve.max_body_bytes must be >= 1024, got {self.max_body_bytes}")
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

    def is_trusted(self, key: str | None) -> bool:
        """Whether ``key`` is one of the trusted keys (compared in constant time)."""
        if not key:
            return False
        given = key.encode()
        return any(hmac.compare_digest(given, k.encode()) for k in self.trusted_keys)

    @classmethod
    def from_cfg(cls, node: Any) -> "ServeConfig":
        """From the ``serve`` config node (DictConfig or mapping)."""
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(node, DictConfig):
                node = OmegaConf.to_container(node, resolve=True)
        except ImportError:  # pragma: no cover - omegaconf is a dependency
            pass
        data = dict(node or {})
        if "admin_token" in data or "trusted_keys" in data:
            raise ValueError(
                "serve.admin_token / serve.trusted_keys are not read from the config: config values land in "
                "Hydra's config dump and on the command line. Export BATCHPILOT_ADMIN_TOKEN / "
                "BATCHPILOT_TRUSTED_KEYS, or set serve.admin_token_file / serve.trusted_keys_file")
        sub = {
            "admission": lambda n: AdmissionConfig.from_cfg(n),
            "control": lambda n: _build(ControlConfig, n, "serve.control"),
            "breaker": lambda n: _build(BreakerConfig, n, "serve.breaker"),
            "quality_guard": lambda n: _build(QualityGuardConfig, n, "serve.quality_guard"),
            "warmup": lambda n: _build(WarmupConfig, n, "serve.warmup"),
        }
        for key, make in sub.items():
            if key in data:
                data[key] = make(data[key])
        for key in ("upstreams", "extra_vllm_args", "upstream_kv_dtypes"):
            if key in data and data[key] is not None:
                data[key] = [str(x) for x in data[key]]
        return _build(cls, data, "serve")
