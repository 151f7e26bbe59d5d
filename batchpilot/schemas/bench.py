"""``conf/bench.yaml``: the gateway and HTTP-client benchmarks' nodes (``schema/gateway_bench``,
``schema/client_bench``) and ``scripts/bench.py``'s top config (``BenchApp``) with its targets'
nodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchpilot.nodes import from_node
from batchpilot.schemas.calibrate import ServedDecodeSettings


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
    #: control loop and health probes and see what they cost: ``control.interval_s=3600``).
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
