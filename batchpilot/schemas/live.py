"""The live evaluation's configs: the ``live_scenario`` group (``conf/live_scenario/*.yaml``, a
schema only) and ``scripts/live_evaluate.py``'s top config (``conf/live_evaluate.yaml``:
``LiveEvaluateApp`` and its nodes), read by ``evaluation/live.py`` and its helpers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LiveScenarioConfig:
    """``conf/live_scenario/<name>.yaml``: the trace window a live evaluation replays
    (``evaluation/live_window.py scenario_trace``, ``evaluation/live_twin.py``). A schema only:
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
