"""The reward: the guide's objective ``0.6*throughput + 0.3*(1/latency) + 0.1*memory_efficiency``,
each term normalised, minus penalties. Every weight comes from ``conf/env/*.yaml``."""

from __future__ import annotations

import math

from batchpilot.core.telemetry import SLO, Snapshot
from batchpilot.schemas.env import RewardConfig

__all__ = ["reward_terms"]


def reward_terms(snap: Snapshot, slo: SLO, cfg: RewardConfig, *, rate_scale: float,
                 on_8bit_frac: float) -> dict[str, float]:
    """The reward's parts for one interval (positive terms and penalties), for logging."""
    ttft_ref = slo.ttft_ref_ms
    throughput = min(snap.request_goodput / rate_scale, 2.0)
    inv_latency = 1.0 / (1.0 + snap.ttft_p99_ms / ttft_ref)
    memory = snap.kv_cache_usage
    finished = snap.request_throughput * snap.interval_s
    miss = 0.0 if finished <= 0 else 1.0 - snap.request_goodput / max(snap.request_throughput, 1e-9)
    return {
        "throughput": cfg.w_throughput * throughput,
        "latency": cfg.w_latency * inv_latency,
        "memory": cfg.w_memory * memory,
        "slo_miss": -cfg.penalty_slo_miss * miss,
        "preemption": -cfg.penalty_preemption * math.log1p(snap.preemptions),
        "shield": -cfg.penalty_shield * snap.shield_interventions,
        "rejected": -cfg.penalty_rejected * snap.rejected / rate_scale,
        "queue": -cfg.penalty_queue * math.log1p(snap.queue_total) / math.log1p(1024.0),
        "quality_8bit": -cfg.quality_cost_8bit * on_8bit_frac,
    }

