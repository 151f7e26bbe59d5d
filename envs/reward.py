"""The reward: the guide's objective ``0.6*throughput + 0.3*(1/latency) + 0.1*memory_efficiency``,
each term normalised, minus penalties. Every weight comes from ``conf/env/*.yaml``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchpilot.config import config_fields
from batchpilot.core.telemetry import SLO, Snapshot


@dataclass(frozen=True, slots=True)
class RewardConfig:
    w_throughput: float = 0.6
    w_latency: float = 0.3
    w_memory: float = 0.1
    penalty_slo_miss: float = 1.0
    penalty_preemption: float = 0.05
    penalty_shield: float = 0.05
    penalty_rejected: float = 0.5
    penalty_queue: float = 0.1
    quality_cost_8bit: float = 0.0
    engine_failure: float = 10.0

    @classmethod
    def from_cfg(cls, node: object, model_quality_cost: float = 0.0) -> "RewardConfig":
        d = config_fields(cls, node, "env.reward")
        if d.get("quality_cost_8bit") is None:
            d["quality_cost_8bit"] = model_quality_cost
        for k, v in d.items():
            if not isinstance(v, (int, float)) or math.isnan(float(v)) or float(v) < 0:
                raise ValueError(f"env.reward.{k} must be a non-negative number, got {v!r}")
        return cls(**{k: float(v) for k, v in d.items()})


def reward_terms(snap: Snapshot, slo: SLO, cfg: RewardConfig, *, rate_scale: float,
                 on_8bit_frac: float) -> dict[str, float]:
    """The reward's parts for one interval (positive terms and penalties), for logging."""
    ttft_ref = slo.ttft_ms or 1000.0
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

