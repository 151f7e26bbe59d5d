"""The gateway's settings: the ``serve`` group (``conf/serve/default.yaml``: ``ServeConfig`` with
its control loop, quality guard and warm-up) and ``scripts/serve.py``'s top config (``ServeApp``,
``conf/serve_app.yaml``). ``serving/gateway.py`` and the gateway's parts import them from here."""

from __future__ import annotations

import hmac
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from batchpilot.core.admission import AdmissionConfig
from batchpilot.nodes import from_node, node_schema, plain

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
    """The gateway's own control-loop settings (``serve.control``). The interval, latency window,
    start knobs and observation scales are the ``control`` group's, shared with training
    (``batchpilot.schemas.control.ControlLoopConfig``; ``AppSettings.control``)."""

    #: policy: the exported PPO policy acts; pid / static: the baseline acts; shadow: PID acts and
    #: the policy's decisions are only logged and compared. None: ``policy`` when ``policy_dir``
    #: is given (serving a policy is what naming one asks for), else ``pid``.
    mode: str | None = None
    #: Exported policy folder; None = ``policies/pretrained`` when it exists.
    policy_dir: str | None = None
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
        if not 0.0 <= self.canary_share <= 1.0:
            raise ValueError(f"serve.control.canary_share must be in [0, 1], got {self.canary_share}")
        if not 0.0 < self.canary_max_drop < 1.0:
            raise ValueError(f"serve.control.canary_max_drop must be in (0, 1), got {self.canary_max_drop}")
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


def _scheduling_policy(args: list[str] | None) -> str | None:
    """The ``--scheduling-policy`` value in ``vllm serve`` arguments (None: not given)."""
    args = list(args or ())
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag.replace("_", "-") != "--scheduling-policy":  # vLLM takes either spelling
            continue
        if eq:
            return value
        if i + 1 < len(args):
            return args[i + 1]
    return None


def managed_engine_args(cfg: "ServeConfig") -> list[str]:
    """``serve.extra_vllm_args`` for the managed engines, with ``--scheduling-policy priority``
    added when the gateway forwards priorities (``forward_priority``) and they do not say it."""
    args = list(cfg.extra_vllm_args or ())
    if cfg.forward_priority and _scheduling_policy(args) is None:
        args += ["--scheduling-policy", "priority"]
    return args


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
    #: Put each request's priority (its ``priority_header``, else ``default_priority``) in the
    #: forwarded body's ``priority`` field, which vLLM reads when it runs ``--scheduling-policy
    #: priority`` (smaller first; on a KV shortage the largest number is preempted first). A
    #: client's own ``priority`` field is kept, but one smaller (more important) than its class
    #: needs a trusted key, as the header does. Managed engines then start with
    #: ``--scheduling-policy priority``; unmanaged ones must run it themselves: vLLM 0.32 on
    #: ``fcfs`` takes the field and ignores it (its API docs say a non-zero priority is an
    #: error there; the code has no such check). The simulator's equivalent is
    #: ``engine.scheduling_policy=priority`` (every simulated request carries its class).
    forward_priority: bool = False
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
        policy = _scheduling_policy(self.extra_vllm_args)
        if self.managed and self.forward_priority and policy not in (None, "priority"):
            raise ValueError(f"serve.forward_priority=true with --scheduling-policy {policy} in serve.extra_vllm_args: "
                             "the managed engines would ignore the priorities; drop the flag (the gateway adds "
                             "--scheduling-policy priority) or set serve.forward_priority=false")
        if self.managed and not self.forward_priority and policy == "priority":
            raise ValueError("serve.extra_vllm_args starts the managed engines with --scheduling-policy priority but "
                             "serve.forward_priority=false: every request would reach vLLM at its default priority 0 "
                             "(the most important); set serve.forward_priority=true")
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


@dataclass(slots=True)
class ServeApp:
    """``conf/serve_app.yaml`` (``scripts/serve.py``): only groups, each checked by its own
    schema; this one rejects any other top-level key."""

    serve: Any
    control: Any
    slo: Any
    shield: Any
    policy: Any
