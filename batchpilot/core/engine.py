"""The engine interface: the one contract shared by the simulator, the live vLLM engine and
everything above them (admission, environment, evaluation).

An engine owns requests from ``add_request`` until they finish; it never drops one. Time is
the engine's own clock: virtual seconds for the simulator, wall seconds for the live engine.
All times in this module are seconds on that clock.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Literal

#: KV-cache dtypes as vLLM names them. "auto" means the model's 16-bit dtype.
KVDtype = Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head"]
KV_DTYPES_16BIT: tuple[str, ...] = ("auto", "bfloat16", "float16")
KV_DTYPES_8BIT: tuple[str, ...] = ("fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head")
KV_DTYPES_ALL: tuple[str, ...] = KV_DTYPES_16BIT + KV_DTYPES_8BIT


class EngineError(RuntimeError):
    """An engine failed in a way the caller may recover from (restart, fall back)."""


class RequestRejected(ValueError):
    """A request the engine cannot run at all (e.g. prompt longer than ``max_model_len``).

    ``reason`` is a short machine-readable slug (``prompt_too_long``, ...), ``str(exc)`` the
    human message.
    """

    def __init__(self, request_id: str, reason: str, message: str) -> None:
        super().__init__(f"request {request_id!r} rejected ({reason}): {message}")
        self.request_id = request_id
        self.reason = reason


class DtypeUnavailable(EngineError):
    """The engine cannot run the asked-for KV-cache dtype on this machine; the message says why."""


@dataclass(slots=True)
class Request:
    """One inference request as the workload produced it. Everything in front of the engine
    (admission, the shield, telemetry, controllers) reads only ``prompt_len``, ``max_tokens``,
    ``priority`` and ``num_seqs``; ``output_len`` is for the engine and the finished-request
    metrics (tests/test_no_oracle.py holds admission to it)."""

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    #: 0 is the most important ("core"); larger numbers are less important and shed first.
    priority: int = 0
    #: Ids of shared prompt-prefix blocks (Mooncake ``hash_ids``), each ``prefix_block_tokens`` long.
    prefix_hashes: tuple[int, ...] = ()
    prefix_block_tokens: int = 512
    #: Sequences it runs at once (``n``/``best_of`` x prompts of one HTTP request); admission
    #: counts these against the batch cap, not requests.
    num_seqs: int = 1
    #: Whether its first token will be reported (``Admission.on_first_token``): a gateway does not
    #: see it in an answer that is not streamed, and admission's prefill backlog skips those.
    reports_first_token: bool = True
    #: The most tokens it may generate, as a gateway knows it before it runs: the client's
    #: ``max_tokens`` at most ``max_model_len - prompt_len``, or vLLM's default when the client
    #: sent none (the rest of the context for chat). Admission's memory check charges this,
    #: never ``output_len``: ``output_len`` is what the model will produce (it stands for the
    #: model reaching its end of sequence), which no one in front of the engine can know.
    #: Whoever builds a request keeps ``output_len <= max_tokens`` (vLLM stops at the cap).
    #: None: not known; admission then charges the prompt alone.
    max_tokens: int | None = None


@dataclass(slots=True)
class FinishedRequest:
    """A request that produced all its output tokens. TTFT and E2E count from ``arrival_time``
    (so queueing in admission is included, as a client sees it)."""

    request_id: str
    arrival_time: float
    first_token_time: float
    finish_time: float
    prompt_len: int
    output_len: int
    priority: int = 0
    num_preemptions: int = 0
    #: Inter-token latencies, when the engine records them per token (the live engine does);
    #: ``None`` means only the mean (TPOT) is known.
    itl: tuple[float, ...] | None = None

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def e2el(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for single-token outputs)."""
        if self.output_len <= 1:
            return 0.0
        return (self.finish_time - self.first_token_time) / (self.output_len - 1)


@dataclass(slots=True)
class StepResult:
    """What one or more engine iterations produced. ``step`` returns one iteration;
    ``advance_until`` may return many, aggregated."""

    start_time: float
    duration: float
    num_iterations: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    #: (request_id, arrival_time, first_token_time) for requests whose first token came out.
    first_tokens: list[tuple[str, float, float]] = field(default_factory=list)
    #: Output tokens produced (first tokens included).
    num_output_tokens: int = 0
    finished: list[FinishedRequest] = field(default_factory=list)
    #: Ids of requests preempted (by recompute) during these iterations.
    preempted: list[str] = field(default_factory=list)

    def __init__(self, start_time: float, duration: float, num_iterations: int = 0, num_prefill_tokens: int = 0,
                 num_decode_tokens: int = 0, first_tokens: list[tuple[str, float, float]] | None = None,
                 num_output_tokens: int = 0, finished: list[FinishedRequest] | None = None,
                 preempted: list[str] | None = None) -> None:
        # Written out (the dataclass keeps it): the simulator makes one per ``advance_until``
        # call, and the generated one's default factories cost a call each.
        self.start_time = start_time
        self.duration = duration
        self.num_iterations = num_iterations
        self.num_prefill_tokens = num_prefill_tokens
        self.num_decode_tokens = num_decode_tokens
        self.first_tokens = [] if first_tokens is None else first_tokens
        self.num_output_tokens = num_output_tokens
        self.finished = [] if finished is None else finished
        self.preempted = [] if preempted is None else preempted


@dataclass(frozen=True, slots=True)
class IterationShape:
    """What one engine iteration computed, in the step-time model's aggregates, and how long
    it took: the live engine's own iterations priced by a profile
    (``StepTimeModel.iteration_time``) say how fast the engine ran against that profile during
    a run, whatever the workload, where a probe before and after only samples the host."""

    num_prefill_tokens: int
    #: Sum over prefill chunks of query-key pairs, ``c * prior + c (c + 1) / 2``.
    prefill_pairs: float
    #: Sum over prefill chunks of their ``prior + c`` context tokens.
    prefill_ctx: float
    num_decode: int
    #: Sum of the decoding sequences' context lengths.
    sum_decode_ctx: float
    num_seqs: int
    seconds: float


@dataclass(slots=True)
class EngineStats:
    """A cheap snapshot of the engine's state, as vLLM's scheduler / ``/metrics`` report it."""

    time: float
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    #: Fraction of KV blocks in use, as ``vllm:kv_cache_usage_perc`` (0..1).
    kv_cache_usage: float
    #: Cumulative counters since the engine was built.
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found


@dataclass(slots=True)
class MemoryModel:
    """What the shield needs to predict memory at a setting, in bytes.

    ``budget_bytes`` is the engine's share of device memory (``gpu_memory_utilization`` x
    device memory); weights and activation workspace are fixed; KV grows by blocks. Every
    engine builds it from ``ModelMemory`` (the one KV formula) and its real KV pool.
    """

    budget_bytes: float
    weights_bytes: float
    activation_bytes: float
    block_size: int
    #: Bytes of one KV block (all layers, K and V or MLA latent, scales included) per dtype.
    kv_block_bytes: dict[str, float]
    num_kv_blocks_total: int
    #: Where the numbers come from: "model" (a model's KV formula + the engine's KV pool),
    #: "kv_pool" (the engine's pool in blocks, no model known: weights not counted), or
    #: "unknown: <why>" (nothing known: the shield's memory checks cannot bind; callers hold a
    #: safe static cap instead).
    source: str = "model"

    @property
    def known(self) -> bool:
        return not self.source.startswith("unknown")


#: Bytes of one per-token-per-head scale for ``int8_per_token_head`` (fp32, as vLLM stores it).
INT8_SCALE_BYTES = 4


def kv_elem_bytes(kv_dtype: str, auto_bytes: int = 2) -> int:
    """Bytes per stored KV element: the model's for "auto", 2 for 16-bit, 1 for fp8
    (per-tensor scale, ~0) and int8."""
    if kv_dtype == "auto":
        return auto_bytes
    if kv_dtype in KV_DTYPES_16BIT:
        return 2
    if kv_dtype in KV_DTYPES_8BIT:
        return 1
    raise ValueError(f"kv_dtype={kv_dtype!r} is unknown: use one of {KV_DTYPES_16BIT + KV_DTYPES_8BIT}")


@dataclass(frozen=True, slots=True)
class ModelMemory:
    """A served model as the memory model sees it, per tensor-parallel rank: the one KV
    formula (ordinary K/V heads, or the MLA latent for DeepSeek-style models) that the
    simulator (``core.specs.ModelSpec``), the live engine (from vLLM's model config) and the
    gateway (from the deployment's ``config.json``) all use."""

    num_layers: int
    #: K/V heads stored on one rank (unused with MLA).
    kv_heads: int
    head_dim: int
    #: MLA: elements of the compressed KV latent per token per layer (0 = ordinary K/V heads).
    kv_latent_dim: int = 0
    #: Element bytes of the "auto" KV dtype (the model's dtype).
    auto_elem_bytes: int = 2
    weights_bytes: float = 0.0
    activation_bytes: float = 0.0

    def kv_bytes_per_token_layer(self, kv_dtype: str) -> float:
        """KV bytes of one token in one layer on one rank, scales included."""
        elem = kv_elem_bytes(kv_dtype, self.auto_elem_bytes)
        if self.kv_latent_dim > 0:
            scale = INT8_SCALE_BYTES if kv_dtype == "int8_per_token_head" else 0
            return self.kv_latent_dim * elem + scale
        scale = 2 * self.kv_heads * INT8_SCALE_BYTES if kv_dtype == "int8_per_token_head" else 0
        return 2 * self.kv_heads * self.head_dim * elem + scale

    def kv_block_bytes(self, kv_dtype: str, block_size: int) -> float:
        return float(block_size * self.num_layers * self.kv_bytes_per_token_layer(kv_dtype))

    def memory_model(self, *, block_size: int, num_blocks: int, kv_dtype: str,
                     budget_bytes: float | None = None) -> MemoryModel:
        """The shield's model for an engine running ``kv_dtype`` with ``num_blocks`` KV blocks
        of ``block_size`` tokens. The budget is weights + activations + that pool unless given
        (vLLM sizes the pool from what is left of its budget, so the two agree)."""
        per = {d: self.kv_block_bytes(d, block_size) for d in KV_DTYPES_ALL}
        if budget_bytes is None:
            budget_bytes = self.weights_bytes + self.activation_bytes + num_blocks * per[kv_dtype]
        return MemoryModel(budget_bytes=float(budget_bytes), weights_bytes=float(self.weights_bytes),
                           activation_bytes=float(self.activation_bytes), block_size=int(block_size),
                           kv_block_bytes=per, num_kv_blocks_total=int(num_blocks))

    @classmethod
    def from_hf_config(cls, config: dict, *, tensor_parallel: int = 1, weights_bytes: float = 0.0,
                       activation_bytes: float = 0.0) -> "ModelMemory":
        """From a Hugging Face ``config.json`` (the deployment's model): layers, K/V heads and
        head size, or the MLA latent (``kv_lora_rank + qk_rope_head_dim``) where the model has
        one. Raises ``ValueError`` naming what is missing."""
        cfg = config.get("text_config") or config
        try:
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"model config lacks {exc}: cannot size its KV cache") from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // heads)
        latent = 0
        if cfg.get("kv_lora_rank"):
            latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16")
        auto = 4 if dtype in ("float32", "float") else 2
        tp = max(1, int(tensor_parallel))
        return cls(num_layers=layers, kv_heads=max(1, kv_heads // tp), head_dim=head_dim, kv_latent_dim=latent,
                   auto_elem_bytes=auto, weights_bytes=weights_bytes, activation_bytes=activation_bytes)


@dataclass(slots=True)
class EngineCapabilities:
    """What an engine can do. ``kv_dtypes`` maps every dtype name to ``None`` when it can run,
    or to the reason it cannot (shown to users, so say what is missing)."""

    kv_dtypes: dict[str, str | None]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    #: True when ``set_max_active`` changes the engine's own scheduler limit (vLLM >= 0.32).
    supports_max_active: bool = False

    def can_run(self, kv_dtype: str) -> bool:
        return self.kv_dtypes.get(kv_dtype, "unknown dtype") is None

    def why_not(self, kv_dtype: str) -> str | None:
        return self.kv_dtypes.get(kv_dtype, f"unknown KV-cache dtype {kv_dtype!r}")


class Engine(abc.ABC):
    """A vLLM-like engine stepped by its caller, one iteration (or a span of them) at a time."""

    @property
    @abc.abstractmethod
    def now(self) -> float:
        """Current time on the engine's clock (virtual for the simulator)."""

    @property
    @abc.abstractmethod
    def kv_dtype(self) -> str:
        """The KV-cache dtype the engine runs now."""

    @abc.abstractmethod
    def capabilities(self) -> EngineCapabilities: ...

    @abc.abstractmethod
    def memory_model(self) -> MemoryModel: ...

    @abc.abstractmethod
    def add_request(self, request: Request) -> None:
        """Hand a request to the engine. Raises ``RequestRejected`` for requests it can never run."""

    @abc.abstractmethod
    def step(self) -> StepResult:
        """Run one engine iteration (an idle engine returns a zero-iteration result at once)."""

    def advance_until(self, t_end: float, stop_on_finish: bool = False, stop_on_first_token: bool = False) -> StepResult:
        """Run iterations until the clock reaches ``t_end`` (or the engine is idle, when the
        clock jumps to ``t_end``). An iteration that starts before ``t_end`` runs to its end, so
        the clock may pass ``t_end`` by less than one iteration. With ``stop_on_finish``, stop
        after the first iteration in which a request finished (so admission can refill the
        freed slot at the right time); with ``stop_on_first_token``, after the first in which a
        request produced its first token (its prompt left admission's prefill backlog).
        Subclasses may fast-forward in closed form; results must match stepping one iteration
        at a time."""
        agg = StepResult(start_time=self.now, duration=0.0)
        while self.now < t_end:
            r = self.step()
            if r.num_iterations == 0:
                self.idle_until(t_end)
                break
            merge_into(agg, r)
            if (stop_on_finish and r.finished) or (stop_on_first_token and r.first_tokens):
                break
        agg.duration = self.now - agg.start_time
        return agg

    @abc.abstractmethod
    def idle_until(self, t: float) -> None:
        """Let time pass with nothing to do (virtual clock jumps; live engine sleeps)."""

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    def set_max_active(self, n: int) -> bool:
        """Ask the engine's own scheduler to run at most ``n`` requests; False when it can't
        (admission gating still applies)."""
        return False

    def reset_prefix_cache(self) -> None:  # noqa: B027 (engines without a prefix cache keep it)
        """Forget every cached prompt block; call it with nothing in flight. Between episodes on
        one engine: prompts are deterministic per request id, so without it an episode's
        request ``i`` hits the blocks an earlier episode's request ``i`` left, a prefill the
        simulator (a fresh engine per episode) does not skip."""

    def record_iterations(self, log: list[IterationShape] | None) -> None:
        """Append every iteration's ``IterationShape`` to ``log`` from now on (None: stop).
        For pricing a live engine's own iterations against a profile; the simulator's are the
        profile's by construction, so only the live engine records them."""
        raise NotImplementedError(f"{type(self).__name__} does not record its iterations")

    @abc.abstractmethod
    def restart(self, kv_dtype: str | None = None) -> float:
        """Rebuild the engine (e.g. with a new KV dtype); returns the restart time in seconds.
        Requests in flight are kept (re-queued or drained, per config); none is lost. Raises
        ``DtypeUnavailable`` before touching anything when the dtype cannot run here."""

    def close(self) -> None:  # noqa: B027 (optional: engines without resources keep it)
        """Release resources (processes, memory)."""


def merge_into(agg: StepResult, r: StepResult) -> None:
    """Fold ``r`` (which started where ``agg`` ended) into ``agg``."""
    agg.duration += r.duration
    agg.num_iterations += r.num_iterations
    agg.num_prefill_tokens += r.num_prefill_tokens
    agg.num_decode_tokens += r.num_decode_tokens
    agg.num_output_tokens += r.num_output_tokens
    agg.first_tokens.extend(r.first_tokens)
    agg.finished.extend(r.finished)
    agg.preempted.extend(r.preempted)
