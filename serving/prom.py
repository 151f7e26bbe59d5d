"""The gateway's own Prometheus metrics (``GET /metrics`` of the gateway).

A private registry per gateway, so tests can build several apps in one process. Names start
with ``batchpilot:`` in vLLM's style; the upstream's own vLLM metrics are mirrored only where
the dashboard needs them next to ours (KV use, prefix-cache hit rate).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: Latency buckets (seconds): sub-millisecond to a minute.
_LAT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BUCKET_NAMES: tuple[str, ...] = ("short", "medium", "long")

CONTENT_TYPE = CONTENT_TYPE_LATEST


def bucket_name(i: int) -> str:
    return BUCKET_NAMES[i] if i < len(BUCKET_NAMES) else f"b{i}"


class GatewayMetrics:
    """Every metric the gateway exports, on one registry."""

    def __init__(self) -> None:
        # One helper per kind of metric; the order of the calls is the order /metrics lists them in.
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._add_request_metrics(r)
        self._add_knob_metrics(r)
        self._add_safety_metrics(r)
        self._add_upstream_metrics(r)
        self._add_latency_metrics(r)
        self._add_control_metrics(r)

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """Requests answered and refused, and where the admitted ones wait: the gateway's traffic."""
        self.requests = Counter(
            "batchpilot:requests", "Requests answered, by route and HTTP status.", ["route", "status"], registry=r
        )
        self.rejected = Counter(
            "batchpilot:requests_rejected",
            "Requests refused or ended by the gateway, by reason.",
            ["reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "batchpilot:queue_depth", "Requests waiting in admission.", ["upstream", "bucket"], registry=r
        )
        self.in_flight = Gauge("batchpilot:in_flight", "Requests inside the upstream.", ["upstream"], registry=r)

    def _add_knob_metrics(self, r: CollectorRegistry) -> None:
        """The knobs in force (and a KV dtype recommended but not applied): what the controller set."""
        self.batch_cap = Gauge("batchpilot:knob_batch_cap", "In-flight cap in force.", ["upstream"], registry=r)
        self.bucketing = Gauge(
            "batchpilot:knob_bucketing", "1 for the bucketing mode in force.", ["upstream", "mode"], registry=r
        )
        self.kv_8bit = Gauge("batchpilot:knob_kv_8bit", "1 when the upstream runs 8-bit KV.", ["upstream"], registry=r)
        self.kv_recommendation = Gauge(
            "batchpilot:kv_dtype_recommended",
            "1 for a KV dtype the controller recommends but the gateway cannot apply (unmanaged upstream).",
            ["upstream", "dtype"],
            registry=r,
        )

    def _add_safety_metrics(self, r: CollectorRegistry) -> None:
        """What the shield and the breaker did: the safety layer's interventions."""
        self.shield_interventions = Counter(
            "batchpilot:shield_interventions", "Shield interventions, by kind.", ["kind"], registry=r
        )
        self.breaker_level = Gauge(
            "batchpilot:breaker_level", "Circuit-breaker level (0 closed .. 3 restart).", ["upstream"], registry=r
        )
        self.alerts = Counter("batchpilot:alerts", "Shield alerts raised.", registry=r)

    def _add_upstream_metrics(self, r: CollectorRegistry) -> None:
        """The upstream engines' health, restarts, memory and mirrored vLLM figures."""
        self.upstream_up = Gauge("batchpilot:upstream_up", "1 when the upstream answers /health.", ["upstream"], registry=r)
        self.upstream_restarts = Counter(
            "batchpilot:upstream_restarts", "Upstream restarts, by cause.", ["upstream", "cause"], registry=r
        )
        self.upstream_kv_usage = Gauge(
            "batchpilot:upstream_kv_cache_usage", "Upstream KV blocks in use (0..1).", ["upstream"], registry=r
        )
        self.upstream_oom = Counter(
            "batchpilot:upstream_oom",
            "Upstream out-of-memory reports fed to the breaker, by kind (error_answer: an error answer naming "
            "out-of-memory; engine_exit: the managed engine process exited).",
            ["upstream", "kind"], registry=r,
        )
        self.memory_model_known = Gauge(
            "batchpilot:memory_model_known",
            "1: the shield predicts this upstream's memory from the model's KV formula and the engine's KV pool; "
            "0.5: from the KV pool alone (no model config: weights not counted); 0: budget unknown, the cap is "
            "held at serve.control.safe_batch_cap.",
            ["upstream"], registry=r,
        )
        self.upstream_prefix_hit_rate = Gauge(
            "batchpilot:upstream_prefix_cache_hit_rate",
            "Upstream prefix-cache hit rate over the last interval (0..1).",
            ["upstream"],
            registry=r,
        )

    def _add_latency_metrics(self, r: CollectorRegistry) -> None:
        """Latency as the client sees it and the SLO figures the controller reads."""
        self.admission_wait = Histogram(
            "batchpilot:admission_wait_seconds", "Time a request waited in the gateway's admission queue.",
            ["bucket"], buckets=_LAT_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "batchpilot:ttft_seconds", "Time to first token as the client sees it.", ["bucket"],
            buckets=_LAT_BUCKETS, registry=r,
        )
        self.e2el = Histogram(
            "batchpilot:e2e_latency_seconds", "End-to-end latency as the client sees it.", ["bucket"],
            buckets=_LAT_BUCKETS, registry=r,
        )
        self.goodput = Gauge("batchpilot:request_goodput", "Finished requests/s meeting the SLO.", ["upstream"], registry=r)
        self.p99_ttft = Gauge("batchpilot:ttft_p99_ms", "p99 TTFT over the telemetry window.", ["upstream"], registry=r)

    def _add_control_metrics(self, r: CollectorRegistry) -> None:
        """The control side: quality guard, acting controller, operator overrides, policy
        fallbacks, shadow and canary state, and the cost of one control decision."""
        self.output_diff_rate = Gauge(
            "batchpilot:output_diff_rate", "Share of sampled 8-bit-KV outputs that differ from the 16-bit reference.",
            registry=r,
        )
        self.quality_samples = Counter("batchpilot:quality_samples", "Quality-guard replays, by outcome.", ["outcome"], registry=r)
        self.controller = Gauge(
            "batchpilot:controller_active", "1 for the controller acting now.", ["mode", "acting"], registry=r
        )
        self.admin_overrides = Counter(
            "batchpilot:admin_overrides", "Operator actions forced past the shield (force: true), by kind.", ["kind"],
            registry=r)
        self.policy_fallbacks = Counter(
            "batchpilot:policy_fallbacks", "Times the policy was replaced by PID, by reason.", ["reason"], registry=r
        )
        self.shadow_agreement = Gauge(
            "batchpilot:shadow_batch_agreement",
            "Shadow mode: share of recent decisions where the policy's batch direction matched PID's.",
            registry=r,
        )
        self.canary = Gauge("batchpilot:canary_state", "0 none, 1 evaluating, 2 promoted, 3 rolled back.", registry=r)
        self.control_tick = Histogram(
            "batchpilot:control_tick_seconds", "Time one control decision takes.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1), registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
