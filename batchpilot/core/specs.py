"""Validated descriptions of a GPU (``HardwareSpec``) and a model (``ModelSpec``), built from
the Hydra ``hardware`` and ``model`` groups. The step-time model and the simulator read only
these, so every number that shapes simulated timing or memory lives in ``conf/``.

Declared in the core so that ``batchpilot/schemas/``
can store them as the ``hardware/schema`` and ``model/schema`` structured configs: a mistyped
key or a wrong type in ``conf/hardware/*.yaml`` / ``conf/model/*.yaml`` fails at compose time;
the range checks below run when ``from_cfg`` builds the object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from batchpilot.core.engine import KV_DTYPES_8BIT, KV_DTYPES_16BIT, ModelMemory
from batchpilot.nodes import from_node

__all__ = ["HardwareSpec", "ModelSpec", "is_8bit"]


def _check(cond: bool, spec: str, name: str, value: object, fix: str) -> None:
    if not cond:
        raise ValueError(f"{spec}.{name}={value!r} is invalid: {fix}")


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One accelerator (per tensor-parallel rank) and the fitted factors of the step-time model.

    Efficiencies are fractions of datasheet peak actually reached by the linear layers; the
    overheads are the launch/CPU costs a roofline misses (Vidur/BLIS style)."""

    name: str
    peak_tflops: float  # dense bf16 TFLOP/s
    hbm_tb_s: float  # HBM bandwidth, TB/s
    memory_gb: float  # device memory, GB (1e9 bytes)
    #: Fraction of peak compute / HBM bandwidth the GEMMs reach (fitted to Vidur profiles).
    compute_efficiency: float = 0.75
    memory_efficiency: float = 0.75
    #: Exponent of the soft roofline (C^p + M^p)^(1/p); large p approaches max(C, M).
    roofline_p: float = 2.0
    #: GEMM compute time uses tokens rounded up to this tile (kernel tile quantisation).
    gemm_token_tile: int = 1
    #: Fraction of peak bandwidth / compute the attention kernels reach.
    attn_memory_efficiency: float = 0.7
    attn_compute_efficiency: float = 0.5
    #: Fraction of HBM bandwidth the element-wise kernels (norms, rope, act, add) reach.
    elementwise_efficiency: float = 0.5
    #: Launch cost of one GEMM (4 per layer: qkv, o, gate/up, down), seconds.
    gemm_overhead_s: float = 5e-6
    #: Fixed per-layer cost besides the GEMMs (element-wise and attention launches), seconds.
    per_layer_overhead_s: float = 2e-5
    #: Fixed per-iteration cost (scheduler, input prep, sampling launch), seconds.
    per_step_overhead_s: float = 2e-3
    #: Extra per scheduled request per iteration (input prep, sampling), seconds.
    per_request_overhead_s: float = 1e-5
    #: Extra fixed cost of an iteration that prefills anything (prefill attention path and
    #: new-request set-up), seconds. 0 = none (the GPU profiles); fitted for CPU profiles.
    prefill_step_overhead_s: float = 0.0
    #: Tensor-parallel interconnect bandwidth per GPU (GB/s) and all-reduce latency (s).
    interconnect_gb_s: float = 300.0
    allreduce_latency_s: float = 1e-5
    #: KV-read time with 8-bit KV relative to the 16-bit read time of the same context
    #: (1.0 = no gain despite half the bytes; >1 = dequantisation makes it slower).
    kv8_speed_factor: float = 1.0
    #: 8-bit KV-cache dtypes vLLM can run on this device.
    kv8_dtypes: tuple[str, ...] = ("int8_per_token_head",)
    #: Why each missing 8-bit dtype is unavailable (shown to users); optional.
    kv8_unavailable_reason: str = "not supported on this hardware"
    #: Every iteration takes this many times the modelled time: the same machine under other
    #: conditions than the fit's (e.g. the live twin matched to its reference run,
    #: evaluation/live_twin.py). 1 = the profile as fitted.
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv8_dtypes", tuple(self.kv8_dtypes))
        n = "hardware"
        for name in ("peak_tflops", "hbm_tb_s", "memory_gb", "interconnect_gb_s", "roofline_p"):
            v = getattr(self, name)
            _check(v > 0, n, name, v, "must be > 0 (datasheet value)")
        for name in ("compute_efficiency", "memory_efficiency", "attn_memory_efficiency",
                     "attn_compute_efficiency", "elementwise_efficiency"):
            v = getattr(self, name)
            _check(0 < v <= 1, n, name, v, "must be a fraction of peak in (0, 1]")
        for name in ("gemm_overhead_s", "per_layer_overhead_s", "per_step_overhead_s",
                     "per_request_overhead_s", "prefill_step_overhead_s", "allreduce_latency_s"):
            v = getattr(self, name)
            _check(0 <= v < 1, n, name, v, "must be seconds in [0, 1)")
        _check(isinstance(self.gemm_token_tile, int) and self.gemm_token_tile >= 1, n, "gemm_token_tile",
               self.gemm_token_tile, "must be a positive integer number of tokens")
        _check(0 < self.slowdown < 1e3, n, "slowdown", self.slowdown,
               "must be a factor in (0, 1000) (1.0 = the fitted speed)")
        _check(self.kv8_speed_factor > 0, n, "kv8_speed_factor", self.kv8_speed_factor,
               "must be > 0 (1.0 = same KV-read time as 16-bit)")
        for d in self.kv8_dtypes:
            _check(d in KV_DTYPES_8BIT, n, "kv8_dtypes", self.kv8_dtypes, f"each entry must be one of {KV_DTYPES_8BIT}")

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any] | Any) -> "HardwareSpec":
        """Build from the Hydra ``hardware`` node (or a mapping: unknown keys and wrong types raise)."""
        return from_node(cls, cfg)

    def kv_dtype_reason(self, kv_dtype: str) -> str | None:
        """``None`` when ``kv_dtype`` can run here, else a human reason."""
        if kv_dtype in KV_DTYPES_16BIT:
            return None
        if kv_dtype not in KV_DTYPES_8BIT:
            return f"unknown KV-cache dtype {kv_dtype!r}; known: {KV_DTYPES_16BIT + KV_DTYPES_8BIT}"
        if kv_dtype in self.kv8_dtypes:
            return None
        return f"{kv_dtype} KV cache on {self.name}: {self.kv8_unavailable_reason}"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A served model as the step-time and memory models see it (per tensor-parallel group)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    total_params: float  # all parameters (MoE: every expert)
    active_params: float  # parameters used per token (dense: == total_params)
    bytes_per_param: float = 2.0
    tensor_parallel: int = 1
    #: MLA: elements of the compressed KV latent per token per layer (replicated on every TP
    #: rank). 0 means ordinary K/V heads.
    kv_latent_dim: int = 0
    max_model_len: int = 8192
    #: Seconds to restart the engine (e.g. to change the KV dtype): load weights, profile, graphs.
    restart_base_s: float = 30.0
    #: Prior quality penalty of 8-bit KV for the reward (fraction, e.g. 0.03).
    kv8_quality_cost: float = 0.03
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        n = "model"
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "tensor_parallel", "max_model_len"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 1, n, name, v, "must be a positive integer")
        _check(self.num_heads % self.num_kv_heads == 0, n, "num_kv_heads", self.num_kv_heads,
               f"must divide num_heads={self.num_heads}")
        _check(self.num_heads % self.tensor_parallel == 0, n, "tensor_parallel", self.tensor_parallel,
               f"must divide num_heads={self.num_heads}")
        _check(self.total_params > 0, n, "total_params", self.total_params, "must be > 0")
        _check(0 < self.active_params <= self.total_params, n, "active_params", self.active_params,
               f"must be in (0, total_params={self.total_params}]")
        _check(self.bytes_per_param > 0, n, "bytes_per_param", self.bytes_per_param, "must be > 0 (2 for bf16, 1 for fp8)")
        _check(self.kv_latent_dim >= 0, n, "kv_latent_dim", self.kv_latent_dim, "must be >= 0 (0 = no MLA)")
        _check(self.restart_base_s >= 0, n, "restart_base_s", self.restart_base_s, "must be >= 0 seconds")
        _check(0 <= self.kv8_quality_cost < 1, n, "kv8_quality_cost", self.kv8_quality_cost, "must be a fraction in [0, 1)")
        if not self.is_moe:
            derived = self.num_layers * self.dense_layer_params + self.embedding_params
            _check(abs(derived - self.total_params) <= 0.05 * self.total_params, n, "total_params",
                   self.total_params, f"dense dims give {derived:.4g} parameters; fix the dims or the count")

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any] | Any) -> "ModelSpec":
        """Build from the Hydra ``model`` node (or a mapping: unknown keys and wrong types raise)."""
        return from_node(cls, cfg)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.active_params < self.total_params

    @property
    def is_mla(self) -> bool:
        return self.kv_latent_dim > 0

    @property
    def embedding_params(self) -> float:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def dense_layer_params(self) -> float:
        """Linear-layer parameters of one dense transformer layer (qkv, o, gate+up, down)."""
        h, hd = self.hidden_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * hd
        o = self.num_heads * hd * h
        mlp = 3 * h * self.intermediate_size
        return float(qkv + o + mlp)

    @property
    def layer_params_active(self) -> float:
        """Linear parameters one token touches in one layer (whole TP group)."""
        if self.is_moe:
            return (self.active_params - self.embedding_params) / self.num_layers
        return self.dense_layer_params

    @property
    def layer_params_total(self) -> float:
        if self.is_moe:
            return (self.total_params - self.embedding_params) / self.num_layers
        return self.dense_layer_params

    @property
    def weights_bytes_per_rank(self) -> float:
        return self.total_params * self.bytes_per_param / self.tensor_parallel

    @property
    def kv_heads_per_rank(self) -> int:
        """K/V heads stored on one rank (replicated when TP exceeds the KV-head count)."""
        return max(1, self.num_kv_heads // self.tensor_parallel)

    def memory(self, activation_bytes: float = 0.0) -> ModelMemory:
        """This model in the core's one memory model (``core.engine.ModelMemory``)."""
        return ModelMemory(num_layers=self.num_layers, kv_heads=self.kv_heads_per_rank, head_dim=self.head_dim,
                           kv_latent_dim=self.kv_latent_dim, auto_elem_bytes=2,
                           weights_bytes=self.weights_bytes_per_rank, activation_bytes=activation_bytes)

    def kv_bytes_per_token_layer(self, kv_dtype: str) -> float:
        """KV bytes of one token in one layer on one rank, scales included (the core's formula)."""
        return self.memory().kv_bytes_per_token_layer(kv_dtype)

    def kv_bytes_per_token(self, kv_dtype: str) -> float:
        """KV bytes of one token over all layers on one rank."""
        return self.num_layers * self.kv_bytes_per_token_layer(kv_dtype)

    def kv_block_bytes(self, kv_dtype: str, block_size: int) -> float:
        return block_size * self.kv_bytes_per_token(kv_dtype)


def is_8bit(kv_dtype: str) -> bool:
    return kv_dtype in KV_DTYPES_8BIT

