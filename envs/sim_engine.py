"""SimEngine: vLLM V1's scheduler on a virtual clock, fast enough to train on.

Each iteration (as ``vllm/v1/core/sched/scheduler.py``): a token budget
``max_num_batched_tokens``; the running requests go first in admission order (decodes take one
token each, the one partially prefilled request takes what is left of the budget for its next
chunk); then waiting requests are admitted in queue order with chunked prefill while the budget,
``max_num_seqs`` (and ``set_max_active``) and KV blocks allow. KV lives in paged blocks
allocated on demand; when a running request cannot get a block, the most recently admitted
running request is preempted by recompute (blocks freed, back to the front of the queue, its
generated tokens re-prefilled with the prompt) and no new request is admitted that iteration.
Prefix caching works on the requests' ``prefix_hashes`` (Mooncake 512-token blocks): a hit
skips those tokens and shares their blocks; unreferenced cached blocks are evicted LRU.

Speed: decoding requests are never visited one by one. They are kept as aggregates (count, sum
of context offsets, a histogram of block phases, a heap of finish iterations), so an iteration
costs O(events), and ``advance_until`` adds up whole pure-decode stretches (no prefill, no
finish, no admission possible, enough blocks) in closed form. Results equal stepping one
iteration at a time.

vLLM's own admission (``envs/api_server.py``): ``max_num_active_seqs`` caps the running
requests as vLLM's scheduler does; ``max_num_queued_reqs`` / ``max_num_queued_tokens`` refuse a
request at ``add_request`` (``RequestRejected`` with the flag's name as its reason) exactly when
``vllm serve``'s API server answers 503: unfinished requests (waiting + running) at the limit, or
the prompts still without a first token at or over the token limit.

Scheduling policy (``scheduling_policy``, vLLM's ``--scheduling-policy``): ``fcfs`` as above;
``priority`` as vLLM 0.32's ``PriorityRequestQueue`` and running loop: the waiting queue is a
heap on (request priority, arrival at the engine), smaller first, a preempted request going back
by its key (not to the front), and a request that cannot get a block preempts the running
request with the largest (priority, arrival), which may be one already scheduled this
iteration (its tokens and blocks given back) or itself, which ends the running loop: the
decoders after it run nothing in that iteration (vLLM's ``break``). Arrival ties keep the order
requests were added. ``tests/test_sim_priority.py`` checks the decisions against vLLM's own
scheduler on hand-built cases.

Ingress latency (``ingress_latency_s``, 0 by default): a request added now reaches the
scheduler that much engine time later, as a live request crosses the API server (HTTP, tokens,
the engine core's input queue) before its first iteration. It matters where admission feeds the
engine one request at a time: behind a gateway that admits the next prompt when the last one's
first token arrives, the engine runs decode-only iterations in between.

Simplifications (documented, deliberate): a preempted request's own KV is not found in the
prefix cache when it resumes (only ``prefix_hashes`` blocks are cached); cached-but-unreferenced
blocks are reused only after plain free blocks run out (vLLM mixes them in one LRU queue); the
clock charges the step time after scheduling (no CPU/GPU overlap).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict, deque
from heapq import heappop, heappush
from typing import Any

from batchpilot.core.engine import (
    KV_DTYPES_ALL,
    DtypeUnavailable,
    Engine,
    EngineCapabilities,
    EngineError,
    EngineStats,
    FinishedRequest,
    MemoryModel,
    Request,
    RequestRejected,
    StepResult,
)
from batchpilot.core.specs import HardwareSpec, ModelSpec
from batchpilot.envs.api_server import API_SERVER_503, QueueLimits
from batchpilot.envs.step_time import StepTimeModel
from batchpilot.schemas.engine import SimEngineConfig  # declared there (the engine/schema_sim schema)

#: Fixed CUDA-graph / NCCL / allocator reserve added to the activation estimate, bytes.
_RESERVE_BYTES = 0.5e9


@functools.lru_cache(maxsize=64)
def _step_time_model(hw: HardwareSpec, model: ModelSpec, kv_dtype: str, max_tokens: int,
                     max_seqs: int) -> StepTimeModel:
    """``StepTimeModel.build``, once per deployment and dtype (the specs and the model are frozen,
    so engines can share it): the environment builds a fresh engine every episode, and
    tabulating ~8k token counts again took ~2 ms of each reset."""
    return StepTimeModel.build(hw, model, kv_dtype, max_tokens, max_seqs)


class _Seq:
    """Book-keeping of one request inside the engine."""

    __slots__ = ("req", "rid", "prompt", "out", "gen", "computed", "held", "shared", "reg_done",
                 "first_token_time", "npre", "base", "phase", "epoch", "decoding", "key")

    def __init__(self, req: Request, out: int) -> None:
        self.req = req
        self.rid = req.request_id
        self.prompt = req.prompt_len
        self.out = out
        self.gen = 0  # output tokens produced so far
        self.computed = 0  # tokens with KV computed (prefill phase only; decoders are implicit)
        self.held = 0  # blocks held in prefill phase (shared ones included)
        self.shared: list[int] = []  # prefix-cache hashes this request references, in order
        self.reg_done = False  # stopped registering prefix blocks
        self.first_token_time = math.nan
        self.npre = 0
        self.base = 0  # decode: context at iteration j is base + j
        self.phase = 0  # decode: needs a new block at iteration j iff (phase + j) % bs == 0
        self.epoch = 0  # bumps when leaving the decode set, invalidating heap entries
        self.decoding = False
        self.key: tuple[int, int] = (0, 0)  # priority policy: (priority, arrival order)


class _PriorityWaiting:
    """vLLM's ``PriorityRequestQueue`` with the deque methods the engine uses: a heap on
    ``_Seq.key``; ``append`` and ``appendleft`` both push by key (vLLM's ``prepend_request``
    does too), ``[0]`` and ``popleft`` are the smallest key."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int], _Seq]] = []

    def append(self, seq: _Seq) -> None:
        heappush(self._heap, (seq.key, seq))

    appendleft = append

    def popleft(self) -> _Seq:
        return heappop(self._heap)[1]

    def __getitem__(self, i: int) -> _Seq:
        if i != 0:
            raise IndexError("a priority queue only shows its head")
        return self._heap[0][1]

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)


class SimEngine(Engine):
    """Simulated vLLM V1 engine (see module docstring)."""

    def __init__(self, hardware: HardwareSpec, model: ModelSpec, config: SimEngineConfig | None = None) -> None:
        self.hw = hardware
        self.model = model
        self.cfg = config or SimEngineConfig()
        reason = hardware.kv_dtype_reason(self.cfg.kv_dtype)
        if reason is not None:
            raise DtypeUnavailable(reason)
        self._now = 0.0
        self._down_until = 0.0
        self._it = 0  # global iteration counter
        #: ``--max-num-active-seqs``: the most requests running, whatever ``set_max_active`` asks.
        self._active_limit = self.cfg.max_num_active_seqs or self.cfg.max_num_seqs
        self._max_active = self._active_limit
        self._limits = QueueLimits(self.cfg.max_num_queued_reqs, self.cfg.max_num_queued_tokens)
        #: Prompt tokens of the requests without a first token (what ``max_num_queued_tokens`` counts).
        self._queued_tokens = 0
        self._draining = False
        self._pending: StepResult | None = None  # iterations run by a draining restart
        self._num_preemptions = 0
        self._pc_queries = 0
        self._pc_hits = 0
        self._ids: set[str] = set()
        #: ``--scheduling-policy priority``: waiting requests in a heap, preemption by key.
        self._prio = self.cfg.scheduling_policy == "priority"
        self._added = 0  # requests added so far: the arrival order of the priority key
        self._waiting: deque[_Seq] | _PriorityWaiting = _PriorityWaiting() if self._prio else deque()
        #: Requests on their way in (``ingress_latency_s``): (engine time they arrive, seq), in order.
        self._inbound: deque[tuple[float, _Seq]] = deque()
        self._running: dict[str, _Seq] = {}
        # The frozen config's values the hot paths read, as plain attributes.
        self._bs = self.cfg.block_size
        self._mnbt = self.cfg.max_num_batched_tokens
        self._pc = bool(self.cfg.enable_prefix_caching)
        self._mml = self.model.max_model_len
        self._configure(self.cfg.kv_dtype)

    @classmethod
    def from_cfg(cls, cfg: Any) -> "SimEngine":
        """Build from the full composed config (``cfg.hardware``, ``cfg.model``, ``cfg.engine``)."""
        return cls(HardwareSpec.from_cfg(cfg.hardware), ModelSpec.from_cfg(cfg.model),
                   SimEngineConfig.from_cfg(cfg.engine))

    # ---- memory ------------------------------------------------------------------------------
    def _activation_bytes(self) -> float:
        if self.cfg.activation_workspace_gb is not None:
            return self.cfg.activation_workspace_gb * 1e9
        m, tp = self.model, self.model.tensor_parallel
        per_token = 2.0 * (4 * m.hidden_size + 3 * m.intermediate_size / tp)
        logits = 4.0 * self.cfg.max_num_seqs * m.vocab_size / tp
        return self.cfg.max_num_batched_tokens * per_token + logits + _RESERVE_BYTES

    def _blocks_for(self, kv_dtype: str) -> int:
        budget = self.cfg.gpu_memory_utilization * self.hw.memory_gb * 1e9
        free = budget - self.model.weights_bytes_per_rank - self._activation_bytes()
        n = int(free // self.model.kv_block_bytes(kv_dtype, self.cfg.block_size))
        if self.cfg.num_gpu_blocks_override is not None:
            n = min(n, self.cfg.num_gpu_blocks_override) if n > 0 else self.cfg.num_gpu_blocks_override
        if n < 1:
            raise ValueError(
                f"{self.model.name} does not fit on {self.hw.name}: weights {self.model.weights_bytes_per_rank / 1e9:.1f} GB"
                f" + activations {self._activation_bytes() / 1e9:.1f} GB per rank exceed gpu_memory_utilization x memory"
                f" = {budget / 1e9:.1f} GB; raise model.tensor_parallel or use a larger GPU")
        return n

    def _configure(self, kv_dtype: str) -> None:
        """(Re)build capacity, the step-time model and an empty block pool for ``kv_dtype``."""
        self._kv_dtype = kv_dtype
        self._total_blocks = self._blocks_for(kv_dtype)
        self._free = self._total_blocks
        self._cache: dict[int, int] = {}  # hash -> refcount
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 hashes, LRU first
        self._st = _step_time_model(self.hw, self.model, kv_dtype, self.cfg.max_num_batched_tokens,
                                    self.cfg.max_num_seqs)
        bs = self.cfg.block_size
        self._bph = 512 // bs if 512 % bs == 0 else 0  # blocks per prefix hash (0 = caching off)
        self._n_dec = 0
        self._sum_base = 0
        self._cnt = [0] * bs
        self._heap: list[tuple[int, int, int, _Seq]] = []
        self._hseq = 0
        self._partial: _Seq | None = None
        #: Priority policy: decoders left out of the present iteration (``_skip_decoders``).
        self._skipped: list[_Seq] = []

    # ---- Engine API --------------------------------------------------------------------------
    @property
    def now(self) -> float:
        return self._now

    @property
    def kv_dtype(self) -> str:
        return self._kv_dtype

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._inbound)

    @property
    def num_kv_blocks_total(self) -> int:
        return self._total_blocks

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            kv_dtypes={d: self.hw.kv_dtype_reason(d) for d in KV_DTYPES_ALL},
            max_model_len=self.model.max_model_len, max_num_seqs=self.cfg.max_num_seqs,
            max_num_batched_tokens=self.cfg.max_num_batched_tokens, block_size=self.cfg.block_size,
            supports_max_active=True)

    def memory_model(self) -> MemoryModel:
        return MemoryModel(
            budget_bytes=self.cfg.gpu_memory_utilization * self.hw.memory_gb * 1e9,
            weights_bytes=self.model.weights_bytes_per_rank, activation_bytes=self._activation_bytes(),
            block_size=self.cfg.block_size,
            kv_block_bytes={d: self.model.kv_block_bytes(d, self.cfg.block_size) for d in KV_DTYPES_ALL},
            num_kv_blocks_total=self._total_blocks)

    @property
    def num_unfinished(self) -> int:
        """Requests added and not finished (waiting, running or on their way in)."""
        return len(self._ids)

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens of the unfinished requests without a first token (vLLM's
        ``get_num_queued_tokens``)."""
        return self._queued_tokens

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._ids:
            raise ValueError(f"request id {rid!r} is already in the engine; ids must be unique")
        if self._limits.active:  # vLLM's API server checks these before anything else (503)
            why = self._limits.refusal(len(self._ids), self._queued_tokens)
            if why is not None:
                raise RequestRejected(rid, why, f"HTTP 503: {API_SERVER_503[why]}")
        if request.prompt_len < 1 or request.output_len < 1:
            raise RequestRejected(rid, "invalid_length", f"prompt_len={request.prompt_len} and output_len="
                                  f"{request.output_len} must both be >= 1")
        mml = self._mml
        if request.prompt_len >= mml:  # as vLLM: a prompt must leave room for one output token
            raise RequestRejected(rid, "prompt_too_long", f"prompt_len={request.prompt_len} >= max_model_len={mml}")
        # vLLM stops a request at max_model_len: the output is clipped, not rejected.
        out = max(1, min(request.output_len, mml - request.prompt_len))
        need = -(-(request.prompt_len + out) // self._bs)
        if need > self._total_blocks:
            raise RequestRejected(rid, "exceeds_kv_capacity", f"needs {need} KV blocks, the cache has "
                                  f"{self._total_blocks}; use a smaller request or an 8-bit KV dtype")
        self._ids.add(rid)
        self._queued_tokens += request.prompt_len
        seq = _Seq(request, out)
        if self._prio:
            seq.key = (request.priority, self._added)
            self._added += 1
        lat = self.cfg.ingress_latency_s
        if lat > 0:
            self._inbound.append((self._now + lat, seq))
        else:
            self._waiting.append(seq)

    def set_max_active(self, n: int) -> bool:
        """Limit running requests (as vLLM's ``max_num_active_reqs``): stops admissions while
        ``n`` or more run; never preempts. Never above ``max_num_active_seqs``/``max_num_seqs``."""
        if n < 0:
            raise ValueError(f"set_max_active(n={n}): n must be >= 0")
        self._max_active = min(int(n), self._active_limit)
        return True

    def idle_until(self, t: float) -> None:
        if t > self._now:
            self._now = t

    def stats(self) -> EngineStats:
        used = self._total_blocks - self._available()
        return EngineStats(time=self._now, num_running=len(self._running), num_waiting=self.num_waiting,
                           num_kv_blocks_used=used, num_kv_blocks_total=self._total_blocks,
                           kv_cache_usage=used / self._total_blocks, num_preemptions=self._num_preemptions,
                           prefix_cache_queries=self._pc_queries, prefix_cache_hits=self._pc_hits)

    def restart(self, kv_dtype: str | None = None) -> float:
        """Rebuild with ``kv_dtype``; the engine is then down for ``model.restart_base_s`` of
        engine time (``down_until``): the clock runs on, requests may be added and wait, nothing
        is scheduled. In-flight requests are re-queued by recompute (each counts one preemption)
        or drained first."""
        new = self._kv_dtype if kv_dtype is None else kv_dtype
        reason = self.hw.kv_dtype_reason(new)
        if reason is not None:
            raise DtypeUnavailable(reason)
        if self.cfg.restart_mode == "drain":
            self._draining = True
            if self._pending is None:
                self._pending = StepResult(start_time=self._now, duration=0.0)
            try:
                while self._running:
                    self._iterate(self._pending)
            finally:
                self._draining = False
        for seq in reversed(list(self._running.values())):
            self._preempt(seq)
            seq.npre += 1  # recomputed after the restart
        self._running.clear()
        self._configure(new)
        cost = self.model.restart_base_s
        self._down_until = self._now + cost  # the clock goes on; nothing runs until then
        return cost

    @property
    def down_until(self) -> float:
        """Engine time at which a restart ends (the past when the engine is up)."""
        return self._down_until

    def step(self) -> StepResult:
        agg = self._take_pending()
        self.idle_until(self._down_until)  # one iteration: after the restart, if one is on
        if not self._running and not self._waiting and self._inbound:
            self.idle_until(self._inbound[0][0])  # nothing to run before the next arrives
        self._iterate(agg)
        agg.duration = self._now - agg.start_time
        return agg

    def advance_until(self, t_end: float, stop_on_finish: bool = False, stop_on_first_token: bool = False) -> StepResult:
        if self._pending is None:  # _take_pending, inline
            agg = StepResult(self._now, 0.0)
        else:
            agg, self._pending = self._pending, None
        if self._now < self._down_until:  # restarting: time passes, nothing runs
            self.idle_until(min(t_end, self._down_until))
        finished, first_tokens, inbound = agg.finished, agg.first_tokens, self._inbound
        nfin = nft = 0
        while self._now < t_end:
            if inbound:
                self._take_inbound()
            if self._partial is None and self._n_dec and (not self._waiting or not self._can_admit()):
                self._fast_forward(min(t_end, inbound[0][0]) if inbound else t_end, stop_on_finish, agg)
                if self._now >= t_end:
                    break
            if stop_on_finish:
                nfin = len(finished)
            if stop_on_first_token:
                nft = len(first_tokens)
            if not self._iterate(agg):
                if inbound and inbound[0][0] < t_end:
                    self.idle_until(inbound[0][0])  # idle until the next request is in
                    continue
                self.idle_until(t_end)
                break
            if stop_on_finish and len(finished) > nfin:
                break
            if stop_on_first_token and len(first_tokens) > nft:
                break
        agg.duration = self._now - agg.start_time
        return agg

    # ---- internals ---------------------------------------------------------------------------
    def _take_pending(self) -> StepResult:
        """The result to fill: a fresh one, or what a draining restart produced."""
        if self._pending is None:
            return StepResult(self._now, 0.0)  # (start_time, duration)
        agg, self._pending = self._pending, None
        return agg

    def _take_inbound(self) -> None:
        """Requests whose ingress latency has passed join the waiting queue, in order."""
        inbound, now = self._inbound, self._now
        while inbound and inbound[0][0] <= now:
            self._waiting.append(inbound.popleft()[1])

    def reset_prefix_cache(self) -> None:
        if self._running or self.num_waiting:
            raise EngineError("reset_prefix_cache with requests in flight")
        for h in self._evictable:
            del self._cache[h]
            self._free += self._bph
        self._evictable.clear()

    def _available(self) -> int:
        return self._free + len(self._evictable) * self._bph

    def _take_blocks(self, n: int) -> None:
        """Allocate ``n`` blocks: plain free ones first, then evict LRU unreferenced cache entries."""
        while self._free < n:
            h, _ = self._evictable.popitem(last=False)
            del self._cache[h]
            self._free += self._bph
        self._free -= n

    def _release(self, seq: _Seq, held: int) -> None:
        """Give back a request's ``held`` blocks (private ones freed, shared ones de-referenced)."""
        if not seq.shared:  # nothing shared: all private
            self._free += held
            seq.held = 0
            return
        bph = self._bph
        self._free += held - len(seq.shared) * bph
        cache, ev = self._cache, self._evictable
        for h in reversed(seq.shared):
            c = cache[h] - 1
            cache[h] = c
            if c == 0:
                ev[h] = None
        seq.shared = []
        seq.held = 0

    def _leave_decode(self, seq: _Seq) -> None:
        self._n_dec -= 1
        self._sum_base -= seq.base
        self._cnt[seq.phase] -= 1
        seq.epoch += 1
        seq.decoding = False

    def _preempt(self, seq: _Seq) -> None:
        """Recompute-preempt ``seq``: free its KV, put it at the front of the waiting queue."""
        if seq.decoding:
            held = -(-(seq.base + self._it - 1) // self._bs)  # KV after the last iteration
            self._leave_decode(seq)
        else:
            held = seq.held
        self._release(seq, held)
        if self._partial is seq:
            self._partial = None
        seq.computed = 0
        seq.reg_done = False
        self._running.pop(seq.rid, None)
        self._waiting.appendleft(seq)

    def _lookup(self, seq: _Seq) -> int:
        """Number of leading prefix hashes of ``seq`` found in the cache (usable as hits)."""
        hashes = seq.req.prefix_hashes
        if not hashes or not self._bph or seq.req.prefix_block_tokens != 512:
            return 0
        cache = self._cache
        n = 0
        # Only full 512-token prompt blocks, and keep >= 1 token to compute (as vLLM).
        limit = min(len(hashes), seq.prompt // 512, (seq.prompt + seq.gen - 1) // 512)
        while n < limit and hashes[n] in cache:
            n += 1
        return n

    def _admission_need(self, seq: _Seq, budget: int) -> tuple[int, int, int]:
        """(hits, chunk, blocks still needed beyond what is available) for admitting ``seq``."""
        hits = self._lookup(seq) if self._pc and seq.req.prefix_hashes else 0
        start = hits * 512
        chunk = min(seq.prompt + seq.gen - start, budget)
        new = -(-(start + chunk) // self._bs) - hits * self._bph
        avail = self._free + len(self._evictable) * self._bph
        if hits:  # hit entries that sit in the evictable pool stop being available once shared
            ev = self._evictable
            avail -= sum(1 for h in seq.req.prefix_hashes[:hits] if h in ev) * self._bph
        return hits, chunk, new - avail

    def _can_admit(self) -> bool:
        if not self._waiting or self._draining or len(self._running) >= self._max_active:
            return False
        budget = self._mnbt - self._n_dec
        if budget <= 0:
            return False
        return self._admission_need(self._waiting[0], budget)[2] <= 0

    def _register(self, seq: _Seq) -> None:
        """Publish fully computed 512-token prompt blocks of ``seq`` in the prefix cache."""
        hashes = seq.req.prefix_hashes
        upto = min(len(hashes), min(seq.computed, seq.prompt) // 512)
        cache = self._cache
        k = len(seq.shared)
        while k < upto:
            h = hashes[k]
            if h in cache:  # computed twice (admitted before the other copy was cached)
                seq.reg_done = True
                return
            cache[h] = 1
            seq.shared.append(h)
            k += 1

    def _schedule_running(self, budget: int) -> tuple[int, list[tuple[_Seq, int, int]], bool]:
        """Allocate this iteration's blocks for the running requests, preempting from the back
        when blocks run out. Returns (budget left, [(partial, chunk, prior)], preempted?)."""
        bs = self._bs
        j = self._it
        p = self._partial
        n_dec = self._n_dec
        need = self._cnt[(-j) % bs] if n_dec else 0
        if p is None:
            if need <= self._free:  # the common case: plain free blocks suffice
                self._free -= need
                return budget - n_dec, [], False
            if need <= self._available():
                self._take_blocks(need)
                return budget - n_dec, [], False
        else:
            pchunk = min(p.prompt + p.gen - p.computed, budget - n_dec)
            pneed = -(-(p.computed + pchunk) // bs) - p.held
            if need + pneed <= self._available():
                self._take_blocks(need + pneed)
                p.held += pneed
                return budget - n_dec - pchunk, [(p, pchunk, p.computed)], False
        # Slow path: vLLM's running loop with preemption of the most recently admitted (fcfs)
        # or of the largest (priority, arrival) (priority).
        order = list(self._running.values())
        avail = self._available()
        i = 0
        preempted = False
        sched: list[tuple[_Seq, int, int]] = []
        got: dict[str, tuple[int, int]] = {}  # priority: what each scheduled request took
        left = budget
        while i < len(order):
            seq = order[i]
            if seq.decoding:
                r_need, r_tok = (1 if (seq.phase + j) % bs == 0 else 0), 1
            else:
                r_tok = min(seq.prompt + seq.gen - seq.computed, left)
                r_need = -(-(seq.computed + r_tok) // bs) - seq.held
            victim_self = False
            while avail < r_need:
                if self._prio:
                    k = max(range(len(order)), key=lambda x: order[x].key)
                    victim = order.pop(k)
                    if k < i:  # scheduled earlier this iteration: its tokens and blocks come back
                        i -= 1
                        left += self._unschedule(victim, got.pop(victim.rid), sched)
                else:
                    victim = order.pop()
                self._preempt(victim)
                self._num_preemptions += 1
                self._pending_preempted.append(victim.rid)
                victim.npre += 1
                preempted = True
                avail = self._available()
                if victim is seq:
                    victim_self = True
                    break
            if victim_self:
                if self._prio:  # vLLM schedules no running request after one that preempted itself
                    self._skip_decoders(order[i:])
                break
            self._take_blocks(r_need)
            avail -= r_need
            left -= r_tok
            if self._prio:
                got[seq.rid] = (r_need, r_tok)
            if not seq.decoding:
                seq.held += r_need
                sched.append((seq, r_tok, seq.computed))
            i += 1
        return left, sched, preempted

    def _skip_decoders(self, rest: list[_Seq]) -> None:
        """Take the decoders the running loop did not reach out of this iteration (priority
        policy: the loop stopped at a request that preempted itself, and vLLM's ``break`` leaves
        the rest unscheduled for the step); ``_rejoin`` puts them back after it, one iteration
        later (``_skipped``)."""
        for seq in rest:
            if seq.decoding:
                self._leave_decode(seq)
                self._skipped.append(seq)

    def _rejoin(self, shift: int) -> None:
        """The decoders ``_skip_decoders`` took out rejoin the decode aggregates with their
        context ``shift`` iterations later than it would have been (1: the iteration ran
        without them; 0: it did not run), their finish moved as far."""
        bs = self._bs
        for seq in self._skipped:
            seq.base -= shift
            seq.phase = (seq.phase - shift) % bs
            seq.decoding = True
            self._n_dec += 1
            self._sum_base += seq.base
            self._cnt[seq.phase] += 1
            self._hseq += 1
            heappush(self._heap, (seq.prompt + seq.out - 1 - seq.base, self._hseq, seq.epoch, seq))
        self._skipped.clear()

    def _unschedule(self, seq: _Seq, taken: tuple[int, int], sched: list[tuple[_Seq, int, int]]) -> int:
        """Undo ``seq``'s place in this iteration before it is preempted (priority policy, as
        vLLM restores a scheduled victim's budget): a decoder's new block is freed here (its held
        KV counts only past iterations); a prefill's is in ``held``, which ``_preempt`` frees.
        Returns the tokens it had been given."""
        need, tok = taken
        if seq.decoding:
            self._free += need
        else:
            sched[:] = [s for s in sched if s[0] is not seq]
        return tok

    def _iterate(self, agg: StepResult) -> bool:
        """Run one iteration into ``agg``; False when there is nothing to run.

        The hot loop, in vLLM's order: schedule the running requests, admit waiting ones, charge
        the step time, then apply prefill progress and decode finishes. Each phase is a method
        called only when it has work (an empty queue, no prefill or no finish costs no call)."""
        if self._inbound:
            self._take_inbound()
        if not self._running and not self._can_admit():
            return False
        j = self._it
        self._pending_preempted = agg.preempted
        left, prefills, preempted = self._schedule_running(self._mnbt)
        n = self._n_dec  # decoders scheduled (after any preemption)
        # Admit waiting requests (not in an iteration that preempted).
        if not preempted and not self._draining and self._waiting:
            self._admit_waiting(left, prefills)
        if n == 0 and not prefills:
            if self._skipped:
                self._rejoin(0)
            return preempted  # everything was preempted: no time passes, the next call admits
        # Step time from aggregates.
        ptok = 0
        pairs = 0.0
        pctx = 0
        for _seq, c, prior in prefills:
            ptok += c
            pairs += c * (prior + (c + 1) / 2)
            pctx += prior + c
        dt = self._st.step_time(ptok, pairs, pctx, n, self._sum_base + n * j, n + len(prefills))
        t = self._now + dt
        out_tokens = n + self._apply_prefills(prefills, j, t, agg) if prefills else n
        heap = self._heap
        if heap and heap[0][0] <= j:
            self._finish_decoders(j, t, agg)
        agg.num_iterations += 1
        agg.num_prefill_tokens += ptok
        agg.num_decode_tokens += n
        agg.num_output_tokens += out_tokens
        self._now = t
        self._it = j + 1
        if self._skipped:
            self._rejoin(1)
        return True

    def _admit_waiting(self, left: int, prefills: list[tuple[_Seq, int, int]]) -> None:
        """Admit waiting requests in queue order while the token budget ``left``, the running cap
        and KV blocks allow, appending (seq, chunk, prior) to ``prefills`` (as vLLM's waiting
        loop: the first request that does not fit stops admission)."""
        bs, pc = self._bs, self._pc
        running, waiting, max_active = self._running, self._waiting, self._max_active
        while waiting and left > 0 and len(running) < max_active:
            seq = waiting[0]
            if pc and seq.req.prefix_hashes:
                hits, chunk, short = self._admission_need(seq, left)
                if short > 0:
                    break
            else:  # ``_admission_need`` without prefix hits (computed and held are 0 here)
                hits = 0
                chunk = seq.prompt + seq.gen
                if chunk > left:
                    chunk = left
                if -(-chunk // bs) > self._free + len(self._evictable) * self._bph:
                    break
            waiting.popleft()
            running[seq.rid] = seq
            if pc:
                self._pc_queries += seq.prompt + seq.gen
            if hits:
                self._share_hits(seq, hits)
            new = -(-(seq.computed + chunk) // bs) - seq.held
            if new <= self._free:
                self._free -= new
            else:
                self._take_blocks(new)
            seq.held += new
            prefills.append((seq, chunk, seq.computed))
            left -= chunk

    def _share_hits(self, seq: _Seq, hits: int) -> None:
        """Start ``seq`` on its first ``hits`` cached prefix blocks: referenced (so no longer
        evictable), counted as computed and held, and as prefix-cache hits."""
        self._pc_hits += hits * 512
        ev, cache = self._evictable, self._cache
        for h in seq.req.prefix_hashes[:hits]:
            cache[h] += 1
            ev.pop(h, None)
        seq.shared = list(seq.req.prefix_hashes[:hits])
        seq.computed = hits * 512
        seq.held = hits * self._bph

    def _apply_prefills(self, prefills: list[tuple[_Seq, int, int]], j: int, t: float, agg: StepResult) -> int:
        """Apply this iteration's prefill chunks (ending at time ``t``): publish prefix blocks, keep
        the unfinished chunk as the partial request, emit first tokens, finish one-token requests
        and move the rest into the decode aggregates. Returns the output tokens produced."""
        bs, pc = self._bs, self._pc
        out_tokens = 0
        for seq, c, prior in prefills:
            seq.computed = prior + c
            if pc and seq.req.prefix_hashes and not seq.reg_done:
                self._register(seq)
            total = seq.prompt + seq.gen
            if seq.computed < total:
                self._partial = seq
                continue
            if self._partial is seq:
                self._partial = None
            seq.gen += 1
            out_tokens += 1
            if seq.gen == 1:
                seq.first_token_time = t
                self._queued_tokens -= seq.prompt
                agg.first_tokens.append((seq.rid, seq.req.arrival_time, t))
            if seq.gen >= seq.out:
                self._finish(seq, seq.held, t, agg)
                continue
            L = seq.computed
            seq.base = L - j
            seq.phase = (L - j - 1) % bs
            seq.decoding = True
            self._n_dec += 1
            self._sum_base += seq.base
            self._cnt[seq.phase] += 1
            self._hseq += 1
            heappush(self._heap, (j + seq.out - seq.gen, self._hseq, seq.epoch, seq))
        return out_tokens

    def _finish_decoders(self, j: int, t: float, agg: StepResult) -> None:
        """Finish the decoding requests whose last token is iteration ``j`` (heap entries of an
        older epoch are stale: the request left the decode set since)."""
        heap, bs = self._heap, self._bs
        while heap and heap[0][0] <= j:
            f, _, ep, seq = heappop(heap)
            if ep != seq.epoch:
                continue
            seq.gen = seq.out
            # _leave_decode, inline
            self._n_dec -= 1
            self._sum_base -= seq.base
            self._cnt[seq.phase] -= 1
            seq.epoch += 1
            seq.decoding = False
            self._finish(seq, -(-(seq.base + j) // bs), t, agg)

    def _finish(self, seq: _Seq, held: int, t: float, agg: StepResult) -> None:
        if seq.shared:
            self._release(seq, held)
        else:  # _release without shared blocks
            self._free += held
            seq.held = 0
        del self._running[seq.rid]
        self._ids.discard(seq.rid)
        r = seq.req
        agg.finished.append(FinishedRequest(r.request_id, r.arrival_time, seq.first_token_time, t, r.prompt_len,
                                            seq.out, r.priority, seq.npre))

    def _fast_forward(self, t_end: float, stop_on_finish: bool, agg: StepResult) -> None:
        """Run, in closed form, the pure-decode iterations before the next event: a finish,
        block exhaustion, or the first iteration starting at or after ``t_end``."""
        heap = self._heap
        while heap and heap[0][2] != heap[0][3].epoch:
            heappop(heap)
        j, n, bs = self._it, self._n_dec, self._bs
        k_fin = heap[0][0] - j if heap else 1 << 62  # iterations before the finishing one
        if k_fin <= 0:
            return
        a, b = self._st.decode_coeffs(n)
        a0 = a + b * (self._sum_base + n * j)  # first iteration's time
        D = t_end - self._now
        if a0 >= D:
            return  # the first iteration already reaches t_end: plain stepping is cheaper
        bn = b * n
        # span(k) = k * a0 + bn * (k * (k - 1) / 2.0): the time of iterations 0..k-1 (written
        # out below where it is evaluated).
        # Smallest k with span(k) >= D: iterations 0..k-1 start before t_end.
        if bn > 0:
            q = a0 - bn / 2.0
            k_time = max(0, math.ceil((-q + math.sqrt(q * q + 2.0 * bn * D)) / bn))
        else:
            k_time = max(0, math.ceil(D / a0))
        while k_time > 0 and (k_time - 1) * a0 + bn * ((k_time - 1) * (k_time - 2) / 2.0) >= D:
            k_time -= 1
        while k_time * a0 + bn * (k_time * (k_time - 1) / 2.0) < D:
            k_time += 1
        K = min(k_fin, k_time)
        # Blocks: the decode set needs cnt[(-(j+m)) % bs] blocks at iteration j+m.
        cnt = self._cnt
        r = (-j) % bs  # cyc[m] = cnt[(r - m) % bs]: cnt read backwards from r, wrapping round
        cyc = cnt[r::-1] + cnt[:r:-1]
        avail = self._free + len(self._evictable) * self._bph
        qk, rk = divmod(K, bs)
        need = qk * n + sum(cyc[:rk])  # blocks for iterations 0..K-1
        if need > avail:
            c = avail // n
            rem = avail - c * n
            m = 0
            while cyc[m] <= rem:
                rem -= cyc[m]
                m += 1
            K = c * bs + m
            if K <= 0:
                return
            qk, rk = divmod(K, bs)
            need = qk * n + sum(cyc[:rk])
        elif K <= 0:
            return
        if need <= self._free:
            self._free -= need
        else:
            self._take_blocks(need)
        self._now += K * a0 + bn * (K * (K - 1) / 2.0)
        self._it = j + K
        agg.num_iterations += K
        agg.num_decode_tokens += n * K
        agg.num_output_tokens += n * K
