"""Admission: the queues in front of the engine, and the in-flight cap that sets the batch.

Requests wait in length buckets; the in-flight cap (the ``batch_cap`` knob) limits how many
are inside the engine, with a lower cap for long prompts; the bucketing mode decides which
bucket is served next. One implementation, used by the training environment and the gateway,
so it knows nothing about engines or HTTP: callers hand admitted requests to their engine and
report back with ``on_finished``.

Life of a request (nothing is ever lost)::

    submit ──► WAITING ──admit──► IN_FLIGHT ──on_finished──► FINISHED
       │          │
       │          ├─expire──► rejected "timeout" / "deadline"
       │          ├─shed────► rejected "shed_low_priority"
       │          ├─cancel──► rejected "cancelled"
       │          └─admit───► rejected "too_large_for_memory" (no longer fits alone; ``take_rejections``)
       └─► rejected "queue_full" / "shed_low_priority" / "too_large_for_memory" / "no_slack"
           (never enters a queue)

``num_submitted == num_admitted + num_rejected + num_waiting`` and
``num_admitted == num_finished + num_in_flight`` hold after every call (``check_counts``).

Each bucket keeps two heaps ordered by (priority, arrival, submit order): prompts over
``long_prompt_threshold`` and the rest, so a full long cap never blocks shorter requests of the
same bucket. With ``on_time_first`` (the default; it needs the TTFT objective from ``use_slo``) a
request that has waited its TTFT moves to a second pair of heaps: within a bucket it ranks after
on-time requests of its priority, and across buckets the bucketing mode chooses among buckets
whose next request is on time first; with request classes of different TTFT objectives
(``class_deadline_order``) the bucketing mode chooses among the buckets of the tightest class
unless a looser class's request has an earlier deadline (arrival + its objective) than that
choice. Removal by timeout, shedding or cancel is lazy (entries marked dead and skipped
when they reach a heap top), so every operation is O(log n) amortised; ``shed`` is O(n) and
only runs when the circuit breaker asks for it.

The prefill backlog (``prefill_backlog_budgets``, with the engine's token budget from
``use_token_budget``): admission also holds requests while the prompts in flight that have not
produced a first token (``on_first_token``) add up to that many iterations of the engine's
prefill. An engine takes its own queue first come, first served, and every queued prompt shares
the coming iterations with the running decodes; held here instead, they keep this module's
order (on time first, newest first, the bucketing mode) until the engine is ready for them.

Early refusal (``early_refusal``, off by default): a request above
``deadline_max_priority_kept`` is refused at ``submit`` ("no_slack"; 429 + Retry-After at the
gateway, so its client learns at once and can go elsewhere) when its predicted time to first
token is over ``early_refusal_slack`` times the TTFT objective, instead of waiting its objective
out first (``ttft_deadline``). The prediction uses what this module sees and nothing else
(``predicted_first_token_s``): the prompt tokens queued on time ahead of it, in flight without a
first token and its own, over the drain rate measured from ``on_first_token`` while a backlog
existed (requests waiting here or prefill in flight: ``drain_rate``), plus what it already
waited. O(1): running sums.

Memory, per request (``memory``, the shield): besides the count, a request is admitted only if
the predicted memory of everything in flight plus it stays within the shield's ceiling. Each
request is charged the KV blocks it holds at its end, all its sequences at prompt + its charged
output (``charged_output``): with ``charge: max_tokens`` its ``max_tokens`` (the most it may
generate: the client's cap, or vLLM's default when the client sent none; a request without it
is charged its prompt alone); with ``charge: estimate`` (the default) that cap at most a high
quantile of what recently finished requests generated (``core/output_estimate.py``, fed through
``on_finished(request_id, output_tokens)``), since vLLM reserves nothing and preempts when
blocks run short. All through the shield's one memory model (``Shield.fits``). Its true output
length is never read: the gateway cannot know it, and the simulator's requests carry it only for
the engine (and the env reports it once the request has finished). One that does not fit now
waits for room, as a request over the count cap does (it blocks its bucket's order: no
smaller request overtakes it); one that cannot fit even alone is rejected with
"too_large_for_memory" (at submit, or at admission when the model moved since and nothing is in
flight to wait for: collect those with ``take_rejections``). Without ``memory`` (the default)
admission counts only, as before; setting ``memory`` (again, for a new model) books the requests
in flight through it, so none admitted by count stays charged 0 blocks once it is known.
Priority plays no part: a core request waits like any other and is refused only when it can
never run.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass
from heapq import heappop, heappush
from typing import Any, Protocol, Sequence

from batchpilot.core.knobs import BUCKETING_MODES, Knobs
from batchpilot.core.output_estimate import CHARGE_MODES, OutputEstimate
from batchpilot.core.telemetry import SLO
from batchpilot.nodes import from_node

#: Why a request left admission without running. A short slug, machine-readable.
REJECT_REASONS: tuple[str, ...] = ("queue_full", "timeout", "shed_low_priority", "cancelled", "too_large_for_memory",
                                   "deadline", "no_slack")


class AdmissibleRequest(Protocol):
    """What admission reads from a request (``core.engine.Request`` fits). ``max_tokens``
    (most tokens it may generate) and ``num_seqs`` are read when present; ``output_len`` (what
    the engine will generate) never is."""

    request_id: str
    prompt_len: int
    priority: int
    arrival_time: float


class MemoryCheck(Protocol):
    """The per-request memory check (``core.shield.Shield`` is one): the KV blocks a request
    holds at its end, and whether a total of blocks and sequences stays within the ceiling.
    ``fits`` is monotone: a total it accepts stays accepted with fewer blocks or sequences."""

    def request_blocks(self, prompt_len: int, output_len: int, num_seqs: int = 1) -> int: ...

    def fits(self, kv_blocks: int, num_seqs: int, kv_dtype: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class Rejection:
    """A request that will not run, with the reason the caller reports to its client."""

    request: Any
    reason: str
    time: float

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class AdmissionConfig:
    """Admission settings (the ``admission`` node of the env / serve config)."""

    #: Prompt-length boundaries between buckets, ascending: ``[1024, 8192]`` gives short
    #: (< 1024), medium (1024..8191) and long (>= 8192).
    boundaries: tuple[int, ...] = (1024, 8192)
    #: Prompts longer than this count against ``max_num_long`` (the guide's long-request cap).
    long_prompt_threshold: int = 2048
    #: At most this many long prompts in flight at once.
    max_num_long: int = 32
    #: Waiting requests per bucket; a submit into a full bucket is rejected ("queue_full").
    max_queue_len: int = 4096
    #: Waiting longer than this (from arrival) is rejected by ``expire`` ("timeout"); None = never.
    max_wait_s: float | None = None
    #: The TTFT deadline: a queued request above ``deadline_max_priority_kept`` that has waited
    #: its TTFT objective (the SLO's ``ttft_ms``, given by ``use_slo``) can no longer meet it;
    #: ``expire`` refuses it ("deadline": 429 + Retry-After at the gateway) rather than serve it
    #: late with capacity that requests still on time need. Core requests are never refused.
    ttft_deadline: bool = False
    #: The highest priority ``ttft_deadline`` and ``early_refusal`` never refuse (0: core
    #: requests are kept; -1: every priority may be refused).
    deadline_max_priority_kept: int = 0
    #: Early refusal: at ``submit``, refuse a request above ``deadline_max_priority_kept``
    #: ("no_slack": 429 + Retry-After at the gateway) when its predicted time to first token,
    #: from arrival, exceeds ``early_refusal_slack`` x the TTFT objective (``use_slo``). The
    #: prediction (``Admission.predicted_first_token_s``): what it waited so far + (prompt tokens
    #: queued on time + prompt tokens in flight without a first token + its own prompt) / the
    #: drain rate, the last two terms at least the measured admission-to-first-token time when
    #: ``first_token_margin`` measures it. The drain rate is prompt tokens reaching their first
    #: token per second of time with a backlog (requests waiting here, or prompts in flight
    #: without a first token; idle time does not count, a full batch cap does), over the
    #: last ``early_refusal_window`` first tokens; nothing is refused early until
    #: ``early_refusal_min_samples`` first tokens were measured. Its client learns at once, not
    #: after waiting its objective out (``ttft_deadline``), and can retry elsewhere.
    early_refusal: bool = False
    early_refusal_slack: float = 1.0
    early_refusal_min_samples: int = 8
    early_refusal_window: int = 64
    #: A waiting request that has waited its TTFT objective (``use_slo``) can no longer meet
    #: it: it yields to requests that still can, whatever the bucketing order, and runs when
    #: none of those waits. Under sustained overload a plain queue makes every request wait its
    #: turn past the objective; this keeps serving the ones still on time. Nothing is refused
    #: (``ttft_deadline`` refuses instead).
    on_time_first: bool = True
    #: With ``on_time_first``, once any waiting request has gone late the queue holds more than
    #: the engine serves in time: requests still on time are then taken newest first (most slack
    #: left: "adaptive LIFO"), since the oldest on-time request, with almost none, would mostly
    #: go late while it is served. First come, first served again once none is late. With
    #: ``ttft_deadline`` or ``early_refusal`` the late ones are refused rather than kept, so a
    #: refusal for lack of time counts as a late request for one TTFT objective after it:
    #: otherwise the refusals would empty the late heaps and turn the order back to first come,
    #: first served in the middle of the overload that caused them.
    newest_first_when_late: bool = True
    #: Request classes with their own TTFT objectives (``SLO.classes``), earliest deadline first
    #: across classes: among the requests still on time, the bucketing mode chooses among the
    #: bucket heads of the class with the shortest objective (newest first while overloaded, as
    #: without classes), unless the oldest on-time request of a looser class has an earlier
    #: deadline (arrival + its class's objective) than that choice: then it goes first. Within a
    #: bucket, priority still orders first. An interactive request (0.8 s) thus overtakes batch
    #: requests (20 s) until one of those has less time left than it, where ``shortest_first``
    #: starved them and ``weighted`` gave them a fixed share. With it, early
    #: refusal counts ahead of a new request only what this order serves before it: the on-time
    #: prompts of its own class as the bucketing mode takes them and all of the classes with a
    #: shorter objective, none of those with a longer one. When every request is judged by one
    #: objective (one class) nothing changes: the bucketing mode orders as without it.
    class_deadline_order: bool = True
    #: Breaker level 2 sheds the least important class present first: only the waiting
    #: requests of the highest priority number waiting or submitted in the last
    #: ``shed_class_window_s`` (and never one at or below the shield's ``shed_max_priority_kept``),
    #: instead of every priority above that. With one class present above the kept priority it
    #: sheds what it shed without it.
    shed_least_important_first: bool = True
    shed_class_window_s: float = 60.0
    #: Hold requests here while the prompt tokens in flight that have not produced a first token
    #: reach this many of the engine's per-iteration token budgets (``use_token_budget``; None
    #: = no hold). The engine takes its queue first come, first served and a long queue of
    #: prompts there shares each iteration with the decodes (TPOT); held here, they keep the
    #: order above and the engine only ever has about one iteration of prefill ahead of it.
    #: A request whose first token its caller cannot see (``reports_first_token`` False on
    #: the request) counts nothing.
    prefill_backlog_budgets: float | None = 1.0
    #: With ``on_time_first``, count a waiting request late that much before its TTFT objective
    #: has passed: the time from admission to first token, measured on this admission's own
    #: recent requests (an exponential average at ``first_token_margin_rate``, at most
    #: ``first_token_margin_max`` of the objective). A request admitted just before its
    #: objective runs out still spends its prefill (and its wait in the engine) after it, so
    #: on time "at admission" is not on time at its first token.
    first_token_margin: bool = False
    first_token_margin_rate: float = 0.1
    first_token_margin_max: float = 0.5
    #: Share of admissions per bucket in ``weighted`` mode (normalised; one per bucket).
    weights: tuple[float, ...] = (0.5, 0.3, 0.2)
    #: Move the boundaries online by incremental k-means over (log prompt length, priority).
    adapt_boundaries: bool = False
    #: Learning rate of the k-means centroids (a constant rate tracks drifting workloads).
    adapt_rate: float = 0.01
    #: Weight of priority against log length in the k-means distance (0 = length only).
    adapt_priority_weight: float = 0.0
    #: What the memory check charges for a request's output (``core/output_estimate.py``):
    #: ``max_tokens`` (its cap: the client's, or the model's room when it sent none) or
    #: ``estimate`` (the cap, at most the ``charge_quantile`` of the output lengths of the last
    #: ``charge_window`` finished requests; ``charge_prior_tokens`` until ``charge_min_samples``
    #: have finished, null = the cap). vLLM reserves nothing and preempts on shortage, so an
    #: under-estimate costs preemptions, not failures.
    charge: str = "estimate"
    charge_quantile: float = 0.95
    charge_window: int = 500
    charge_min_samples: int = 32
    charge_prior_tokens: int | None = None

    def __post_init__(self) -> None:
        self.boundaries = tuple(int(b) for b in self.boundaries)
        self.weights = tuple(float(w) for w in self.weights)
        b = self.boundaries
        if any(x <= 0 for x in b) or any(b[i] >= b[i + 1] for i in range(len(b) - 1)):
            raise ValueError(f"admission.boundaries must be positive and ascending, got {list(b)}")
        if len(self.weights) != len(b) + 1:
            raise ValueError(
                f"admission.weights needs one weight per bucket ({len(b) + 1} for boundaries "
                f"{list(b)}), got {list(self.weights)}"
            )
        if any(not (w > 0 and math.isfinite(w)) for w in self.weights):
            raise ValueError(f"admission.weights must be positive, got {list(self.weights)}")
        if self.long_prompt_threshold < 0:
            raise ValueError(f"admission.long_prompt_threshold must be >= 0, got {self.long_prompt_threshold}")
        if self.max_num_long < 0:
            raise ValueError(f"admission.max_num_long must be >= 0, got {self.max_num_long}")
        if self.max_queue_len < 1:
            raise ValueError(f"admission.max_queue_len must be >= 1, got {self.max_queue_len}")
        if self.max_wait_s is not None and not self.max_wait_s > 0:
            raise ValueError(f"admission.max_wait_s must be > 0 or null, got {self.max_wait_s}")
        if not 0 < self.adapt_rate <= 1:
            raise ValueError(f"admission.adapt_rate must be in (0, 1], got {self.adapt_rate}")
        if self.prefill_backlog_budgets is not None and not (
                self.prefill_backlog_budgets > 0 and math.isfinite(self.prefill_backlog_budgets)):
            raise ValueError(f"admission.prefill_backlog_budgets must be > 0 or null, got {self.prefill_backlog_budgets}")
        if not (self.early_refusal_slack > 0 and math.isfinite(self.early_refusal_slack)):
            raise ValueError(f"admission.early_refusal_slack must be > 0, got {self.early_refusal_slack}")
        if self.early_refusal_min_samples < 1:
            raise ValueError(f"admission.early_refusal_min_samples must be >= 1, got {self.early_refusal_min_samples}")
        if self.early_refusal_window < self.early_refusal_min_samples:
            raise ValueError(f"admission.early_refusal_window must be >= early_refusal_min_samples "
                             f"({self.early_refusal_min_samples}), got {self.early_refusal_window}")
        if not (self.shed_class_window_s > 0 and math.isfinite(self.shed_class_window_s)):
            raise ValueError(f"admission.shed_class_window_s must be > 0, got {self.shed_class_window_s}")
        if not 0 < self.first_token_margin_rate <= 1:
            raise ValueError(f"admission.first_token_margin_rate must be in (0, 1], got {self.first_token_margin_rate}")
        if not 0 <= self.first_token_margin_max < 1:
            raise ValueError(f"admission.first_token_margin_max must be in [0, 1), got {self.first_token_margin_max}")
        if self.adapt_priority_weight < 0:
            raise ValueError(f"admission.adapt_priority_weight must be >= 0, got {self.adapt_priority_weight}")
        if self.charge not in CHARGE_MODES:
            raise ValueError(f"admission.charge must be one of {list(CHARGE_MODES)}, got {self.charge!r}")
        try:  # checked whatever the mode, so switching to estimate later cannot fail
            OutputEstimate(self.charge_quantile, self.charge_window, self.charge_min_samples, self.charge_prior_tokens)
        except ValueError as e:
            raise ValueError(f"admission.charge_*: {e}") from None

    def new_output_estimate(self) -> OutputEstimate | None:
        """A fresh estimator for ``charge: estimate`` (None for ``max_tokens``)."""
        if self.charge != "estimate":
            return None
        return OutputEstimate(self.charge_quantile, self.charge_window, self.charge_min_samples,
                              self.charge_prior_tokens)

    @property
    def num_buckets(self) -> int:
        return len(self.boundaries) + 1

    @classmethod
    def from_cfg(cls, node: Any) -> "AdmissionConfig":
        """From the ``admission`` node of the env or serve config (one dataclass for both, typed
        there by ``env/schema`` and ``serve/schema`` in batchpilot/schemas/) or a mapping; missing keys keep their
        defaults, an unknown key or a wrong type raises naming the key."""
        return from_node(cls, node)


@dataclass(slots=True)
class _Entry:
    """A waiting request; ``alive`` goes False when it leaves the queue by any path, ``late``
    goes True when it can no longer meet its TTFT objective (``on_time_first``). ``seqs`` and
    ``blocks`` are what it will count in flight, as submit found them (``blocks``: 0 without
    ``memory``; setting ``memory`` counts them again), so admit does not count them twice;
    ``charged`` is the output tokens ``blocks`` charged (admit counts again when the output
    estimate moved since)."""

    request: Any
    bucket: int
    is_long: bool
    seq: int
    seqs: int
    blocks: int
    charged: int = 0
    alive: bool = True
    late: bool = False
    #: Its class's TTFT objective in seconds as submit found it (``class_deadline_order``, which
    #: books the on-time prompt tokens per class by it; None otherwise or without one).
    objective: float | None = None


class _Bucket:
    """One length bucket: (priority, arrival, seq) heaps, long prompts apart, and requests
    past their TTFT objective apart (``on_time_first``); the on-time ones also newest first."""

    __slots__ = ("heaps", "newest", "num_waiting", "num_late", "on_time_tokens", "class_tokens")

    def __init__(self, by_class: bool = False) -> None:
        # heaps[late][long]: on time / late x not long / long
        self.heaps: tuple[tuple[list, list], tuple[list, list]] = (([], []), ([], []))
        # newest[long]: the on-time entries again, (priority, -arrival, -seq): newest first
        self.newest: tuple[list, list] = ([], [])
        self.num_waiting = 0
        self.num_late = 0  # of num_waiting, those past their TTFT objective
        self.on_time_tokens = 0  # prompt tokens of the waiting ones not late (early refusal)
        #: ``on_time_tokens`` per class objective (``_Entry.objective``), with ``class_deadline_order``.
        self.class_tokens: dict[float | None, int] | None = {} if by_class else None

    def push(self, e: _Entry) -> None:
        r = e.request
        self.num_waiting += 1
        late = e.late
        self._push(self.heaps[late][e.is_long], (r.priority, r.arrival_time, e.seq, e), late)
        if not late:
            self.on_time_tokens += r.prompt_len
            self._count_class(e, r.prompt_len)
            self._push(self.newest[e.is_long], (r.priority, -r.arrival_time, -e.seq, e), False)

    def mark_late(self, e: _Entry) -> None:
        """Move ``e`` to the late heaps (its on-time entry is skipped from now on)."""
        e.late = True
        self.num_late += 1
        r = e.request
        self.on_time_tokens -= r.prompt_len
        self._count_class(e, -r.prompt_len)
        self._push(self.heaps[1][e.is_long], (r.priority, r.arrival_time, e.seq, e), True)

    def _push(self, h: list, item: tuple, late: bool) -> None:
        """Push, and drop the dead entries once they outnumber the waiting ones: entries leave
        lazily, and a heap that is not read (the newest-first one while nobody is late) would
        otherwise keep every request it ever held. Amortised O(1) a push."""
        heappush(h, item)
        if len(h) > 2 * self.num_waiting + 32:
            h[:] = [t for t in h if t[3].alive and t[3].late == late]
            heapq.heapify(h)

    def head(self, allow_long: bool, newest: bool = False) -> _Entry | None:
        """The next live entry, or None: by priority, then on time before late, then arrival
        (the on-time ones newest first with ``newest``). Skips (and drops) dead entries and the
        on-time entries of those gone late; ``pop`` removes the rest lazily. The late heaps are
        not read while none of this bucket's waiting requests is late (they hold only dead
        entries then, dropped when read later or when a push compacts them)."""
        best, best_key = None, None
        kinds = (0, 1) if allow_long else (0,)
        for late in (0, 1) if self.num_late else (0,):
            heaps = self.newest if newest and not late else self.heaps[late]
            for kind in kinds:
                h = heaps[kind]
                while h:
                    top = h[0]
                    e = top[3]
                    if e.alive and e.late == late:
                        key = (top[0], late, top[1], top[2])
                        if best_key is None or key < best_key:
                            best, best_key = e, key
                        break
                    heappop(h)
        return best

    def pop(self, e: _Entry) -> None:
        """Count ``e`` out; the caller marks it dead, so its heap entries are skipped."""
        self.num_waiting -= 1
        self.num_late -= e.late
        if not e.late:
            self.on_time_tokens -= e.request.prompt_len
            self._count_class(e, -e.request.prompt_len)

    def _count_class(self, e: _Entry, tokens: int) -> None:
        """Book ``tokens`` on time to ``e``'s class (``class_tokens``; nothing without it)."""
        by = self.class_tokens
        if by is not None:
            n = by.get(e.objective, 0) + tokens
            if n:
                by[e.objective] = n
            else:
                del by[e.objective]


class Admission:
    """Length-bucketed waiting queues plus the in-flight cap. See the module docstring."""

    def __init__(self, cfg: AdmissionConfig, knobs: Knobs, memory: MemoryCheck | None = None) -> None:
        self.cfg = cfg
        #: KV blocks the requests in flight hold at their end, as ``memory`` charged them.
        self.kv_blocks_in_flight = 0
        self._late: list[Rejection] = []
        self._boundaries: list[float] = list(cfg.boundaries)
        self._buckets = [_Bucket(cfg.class_deadline_order) for _ in range(cfg.num_buckets)]
        self._waiting: dict[str, _Entry] = {}
        # request_id -> (is_long, sequences, KV blocks, the request: to book it again)
        self._in_flight: dict[str, tuple[bool, int, int, Any]] = {}
        self._memory: MemoryCheck | None = None
        #: The output charge's estimator (``cfg.charge == "estimate"``; None: the cap is charged).
        #: Fed by ``on_finished`` with what finished requests generated, nothing else.
        self.output_estimate: OutputEstimate | None = cfg.new_output_estimate()
        self.memory = memory
        #: Sequences in flight: what the batch cap bounds (a request with n=4 runs four).
        self.num_seqs_in_flight = 0
        #: Prompt tokens in flight whose request has not produced its first token (the engine's
        #: prefill backlog, ``prefill_backlog_budgets``), and per request.
        self.prefill_tokens_in_flight = 0
        self._awaiting_first: dict[str, tuple[int, float]] = {}  # request_id -> (prompt tokens, admitted at)
        #: Mean seconds from admission to first token over recent requests (``first_token_margin``;
        #: None until one has been measured).
        self.first_token_s: float | None = None
        #: The base TTFT objective in seconds (``use_slo``; None: none): what early refusal, the
        #: deadline and lateness count in for a priority without a class of its own, and
        #: ``_ttft_by_priority`` the classes' (``SLO.classes``: priority -> seconds or None).
        self.ttft_s: float | None = None
        self._ttft_by_priority: dict[int, float | None] = {}
        # The drain rate (``drain_rate``): (prompt tokens, seconds of backlog since the previous
        # first token) of the last first tokens, their running sums, and since when the current
        # backlog's clock runs (None: idle, nothing waiting and no prefill in flight).
        self._drain: deque[tuple[int, float]] = deque()
        self._drain_tokens = 0
        self._drain_time = 0.0
        self._busy_since: float | None = None
        #: Hold admissions at this many prefill tokens in flight (``use_token_budget``; None: no hold).
        self.prefill_hold_tokens: int | None = None
        self._expiry: list[tuple[float, int, _Entry]] = []  # (arrival, seq, entry), lazy
        # The TTFT deadline's heap, by the time each request's deadline passes (arrival + its
        # class's objective), lazy; and ``on_time_first``'s, one (arrival, seq, entry) heap per
        # objective in seconds (a class's own margin, ``late_margin_for``, keeps each in order).
        self._deadlines: list[tuple[float, int, _Entry]] = []
        self._lateness: dict[float, list[tuple[float, int, _Entry]]] = {}
        #: Seconds after which a waiting request is late (``on_time_first`` and ``use_slo``; the
        #: base objective's: a class's own is ``late_after_for``).
        self.late_after_s: float | None = None
        #: Seconds a request above core priority may wait (``use_slo``; the base objective's, a
        #: class's own is ``deadline_for``); None = no deadline.
        self.deadline_s: float | None = None
        #: Whether any class has a deadline (``ttft_deadline`` and an objective): ``expire`` runs;
        #: and whether any can go late (``on_time_first`` and an objective). Set by ``use_slo``.
        self._any_deadline = False
        self._any_late = False
        #: Whether ``_choose`` orders classes by deadline (``class_deadline_order`` and the SLO
        #: judges some priority by another TTFT objective than the rest). Set by ``use_slo``.
        self._class_order = False
        #: When a request of each priority was last submitted (``shed_least_important_first``).
        self._last_submit: dict[int, float] = {}
        #: When a request was last refused for lack of time ("deadline", "no_slack"), and its
        #: class's objective: the queue counts as overloaded (newest first) for that long after.
        self._refused_late_at = -math.inf
        self._refused_late_s = 0.0
        self._seq = 0
        self._pass = [0.0] * cfg.num_buckets  # stride scheduling, weighted mode
        self._stride = [1.0 / w for w in cfg.weights]
        self._vtime = 0.0
        self._centroids = self._initial_centroids()
        self.max_priority_kept: int | None = None
        self.batch_cap = 1
        self.bucketing = "fifo"
        self.kv_dtype = "auto"
        self.set_knobs(knobs)
        # counters
        self.num_submitted = 0
        self.num_admitted = 0
        self.num_finished = 0
        self.num_long_in_flight = 0
        self.num_rejected_by_reason: Counter[str] = Counter()

    # --- memory --------------------------------------------------------------------------
    @property
    def memory(self) -> MemoryCheck | None:
        """The per-request memory check (None: count only). May be set after construction
        (``admission.memory = shield``), and again whenever its model changes."""
        return self._memory

    @memory.setter
    def memory(self, memory: MemoryCheck | None) -> None:
        """Setting it books the requests in flight again, through it: admitted by count (no
        check: 0 blocks) they would otherwise count nothing once the budget is known (admission
        predicted 1.3 % while they needed 245 %), and a new KV pool may have another block size.
        The waiting requests' block counts are taken again too."""
        self._memory = memory
        for e in self._waiting.values():
            e.charged = self.charged_output(e.request)
            e.blocks = self._blocks(e.request, e.seqs) if memory is not None else 0
        total = 0
        for rid, (is_long, seqs, _, req) in self._in_flight.items():
            blocks = self._blocks(req, _num_seqs(req)) if memory is not None else 0
            self._in_flight[rid] = (is_long, seqs, blocks, req)
            total += blocks
        self.kv_blocks_in_flight = total

    # --- knobs ---------------------------------------------------------------------------
    def set_knobs(self, knobs: Knobs) -> None:
        """Apply the shield's knobs. Lowering the cap preempts nothing: admission just waits
        until enough in-flight requests finish."""
        if knobs.bucketing not in BUCKETING_MODES:
            raise ValueError(f"unknown bucketing mode {knobs.bucketing!r}; one of {BUCKETING_MODES}")
        if knobs.batch_cap < 1:
            raise ValueError(f"batch_cap must be >= 1, got {knobs.batch_cap}")
        self.batch_cap = int(knobs.batch_cap)
        self.bucketing = knobs.bucketing
        self.kv_dtype = knobs.kv_dtype

    # --- read-outs -----------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_rejected(self) -> int:
        return sum(self.num_rejected_by_reason.values())

    @property
    def queue_depths(self) -> tuple[int, ...]:
        return tuple(b.num_waiting for b in self._buckets)

    @property
    def waiting_on_time_tokens(self) -> int:
        """Prompt tokens of the waiting requests not (yet) late: the queue a new request waits
        behind (``early_refusal``; all waiting requests without ``on_time_first``)."""
        return sum(b.on_time_tokens for b in self._buckets)

    @property
    def num_late_waiting(self) -> int:
        """Waiting requests past their TTFT objective (``on_time_first``; as of the last
        ``admit``): a backlog the served requests' TTFT does not show, since they go last."""
        return sum(b.num_late for b in self._buckets)

    @property
    def expires(self) -> bool:
        """Whether ``expire`` can refuse anything (a wait limit or a TTFT deadline is set)."""
        return self.cfg.max_wait_s is not None or self._any_deadline

    def use_slo(self, slo: SLO | float | None) -> None:
        """The TTFT objectives the deadline, lateness and early refusal count: an ``SLO`` (its
        base ``ttft_ms`` and each class's, ``SLO.classes``: a request is judged by its
        priority's) or one TTFT objective in ms for every request (None: none)."""
        if isinstance(slo, SLO):
            base, by_priority = slo.ttft_ms, {p: slo.for_priority(p).ttft_ms for p in slo.priorities}
        else:
            base, by_priority = slo, {}

        def seconds(ms: float | None) -> float | None:
            return float(ms) / 1000.0 if ms is not None and ms > 0 else None

        self.ttft_s = seconds(base)
        self._ttft_by_priority = {p: seconds(ms) for p, ms in by_priority.items()}
        self.deadline_s = self.ttft_s if self.cfg.ttft_deadline else None
        self.late_after_s = self.ttft_s if self.cfg.on_time_first else None
        objective = any(v is not None for v in (self.ttft_s, *self._ttft_by_priority.values()))
        self._any_deadline = self.cfg.ttft_deadline and objective
        self._any_late = self.cfg.on_time_first and objective
        objectives = {self.ttft_s, *self._ttft_by_priority.values()}
        self._class_order = self.cfg.class_deadline_order and len(objectives) > 1

    def ttft_s_for(self, priority: int) -> float | None:
        """The TTFT objective (seconds) a request of ``priority`` is judged by (``use_slo``)."""
        by = self._ttft_by_priority
        return by.get(priority, self.ttft_s) if by else self.ttft_s

    def deadline_for(self, priority: int) -> float | None:
        """Seconds a request of ``priority`` may wait before ``expire`` refuses it ("deadline");
        None: never (no ``ttft_deadline``, no objective, or a kept priority)."""
        if not self.cfg.ttft_deadline or priority <= self.cfg.deadline_max_priority_kept:
            return None
        return self.ttft_s_for(priority)

    def late_after_for(self, priority: int) -> float | None:
        """Seconds after which a waiting request of ``priority`` is late (``on_time_first``)."""
        return self.ttft_s_for(priority) if self.cfg.on_time_first else None

    def use_token_budget(self, max_num_batched_tokens: int | None) -> None:
        """The engine's per-iteration token budget, which ``prefill_backlog_budgets`` counts in
        (None: unknown, no hold)."""
        f = self.cfg.prefill_backlog_budgets
        ok = f is not None and max_num_batched_tokens is not None and max_num_batched_tokens > 0
        self.prefill_hold_tokens = max(1, int(f * max_num_batched_tokens)) if ok else None

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Current bucket boundaries (they move when ``adapt_boundaries`` is on)."""
        return tuple(int(round(b)) for b in self._boundaries)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._in_flight

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def check_counts(self) -> None:
        """Raise AssertionError when the books do not balance (a bug)."""
        if self.num_submitted != self.num_admitted + self.num_rejected + self.num_waiting:
            raise AssertionError(
                f"submitted {self.num_submitted} != admitted {self.num_admitted} + rejected "
                f"{self.num_rejected} + waiting {self.num_waiting}"
            )
        if self.num_admitted != self.num_finished + self.num_in_flight:
            raise AssertionError(
                f"admitted {self.num_admitted} != finished {self.num_finished} + in flight {self.num_in_flight}"
            )
        if self.prefill_tokens_in_flight != sum(n for n, _ in self._awaiting_first.values()) or not set(self._awaiting_first) <= set(self._in_flight):
            raise AssertionError(f"prefill backlog {self.prefill_tokens_in_flight} tokens does not match the requests in flight")
        if sum(self.queue_depths) != self.num_waiting:
            raise AssertionError(f"queue depths {self.queue_depths} do not sum to {self.num_waiting}")
        late = sum(e.late for e in self._waiting.values())
        per_bucket = [0] * len(self._buckets)
        for e in self._waiting.values():
            per_bucket[e.bucket] += 0 if e.late else e.request.prompt_len
        if per_bucket != [b.on_time_tokens for b in self._buckets]:
            raise AssertionError(f"on-time tokens per bucket {[b.on_time_tokens for b in self._buckets]} != {per_bucket}")
        if self.cfg.class_deadline_order:
            by_class: list[Counter] = [Counter() for _ in self._buckets]
            for e in self._waiting.values():
                if not e.late:
                    by_class[e.bucket][e.objective] += e.request.prompt_len
            if [dict(c) for c in by_class] != [b.class_tokens for b in self._buckets]:
                raise AssertionError(f"on-time tokens per class {[b.class_tokens for b in self._buckets]} != {by_class}")
        if self.num_late_waiting != late:
            raise AssertionError(f"late count {self.num_late_waiting} != {late} waiting past their TTFT objective")

    def bucket_of(self, prompt_len: int) -> int:
        """Index of the bucket a prompt of this length goes to."""
        for i, b in enumerate(self._boundaries):
            if prompt_len < b:
                return i
        return len(self._boundaries)

    # --- events --------------------------------------------------------------------------
    def submit(self, req: AdmissibleRequest, now: float) -> Rejection | None:
        """Queue a request; returns a Rejection when it cannot wait (full bucket, or shed
        priority while the breaker sheds). Raises ValueError on a duplicate id (a bug)."""
        rid = req.request_id
        waiting = self._waiting
        if rid in waiting or rid in self._in_flight:
            raise ValueError(f"request {rid!r} is already in admission")
        self.num_submitted += 1
        cfg = self.cfg
        if cfg.adapt_boundaries:
            self._adapt(req)
        if cfg.shed_least_important_first and req.priority in self._ttft_by_priority:
            self._last_submit[req.priority] = now
        if self.max_priority_kept is not None and req.priority > self.max_priority_kept:
            return self._reject(req, "shed_low_priority", now)
        seqs = getattr(req, "num_seqs", 1)
        if type(seqs) is not int or seqs < 1:
            seqs = _num_seqs(req)
        memory = self._memory
        charged = self.charged_output(req)
        if memory is not None:
            blocks = int(memory.request_blocks(req.prompt_len, charged, seqs))  # _blocks
            if not memory.fits(blocks, seqs, self.kv_dtype):
                return self._reject(req, "too_large_for_memory", now)
        else:
            blocks = 0
        prompt_len = req.prompt_len
        bucket = 0  # bucket_of, inline
        for b in self._boundaries:
            if prompt_len < b:
                break
            bucket += 1
        queue = self._buckets[bucket]
        if queue.num_waiting >= cfg.max_queue_len:
            return self._reject(req, "queue_full", now)
        if cfg.early_refusal and self._no_slack(req, now):
            self._refused_late(req, now)
            return self._reject(req, "no_slack", now)
        if queue.num_waiting == 0:
            # A bucket that was idle rejoins at the current virtual time: no banked credit.
            self._pass[bucket] = max(self._pass[bucket], self._vtime)
        seq = self._seq
        e = _Entry(req, bucket, prompt_len > cfg.long_prompt_threshold, seq, seqs, blocks, charged)
        if cfg.class_deadline_order:
            e.objective = self.ttft_s_for(req.priority)
        self._seq = seq + 1
        queue.push(e)
        waiting[rid] = e
        if self._busy_since is None:
            self._busy_since = now  # a backlog starts: the drain rate's clock runs
        arrival = req.arrival_time
        if cfg.max_wait_s is not None:
            heappush(self._expiry, (arrival, seq, e))
        if self._any_deadline and (deadline := self.deadline_for(req.priority)) is not None:
            heappush(self._deadlines, (arrival + deadline, seq, e))
        if self._any_late and (late_s := self.late_after_for(req.priority)) is not None:
            heap = self._lateness.get(late_s)
            if heap is None:
                heap = self._lateness[late_s] = []
            heappush(heap, (arrival, seq, e))
        return None

    def submit_or_admit(self, req: AdmissibleRequest, now: float) -> tuple[Rejection | None, bool]:
        """``submit(req, now)``, and when nothing else waits and ``admit(now)`` would take it at
        once, take it: returns (the rejection or None, whether it was admitted). The state after
        is the one ``submit`` then ``admit`` leave (counters, virtual times, submit order), so a
        caller that hands an admitted request to its engine before calling ``admit`` as usual
        sees the same; the request never enters a queue (the common case below saturation,
        where the queues' heaps cost more than the rest of admission). Otherwise it is plain
        ``submit`` and the caller's ``admit`` decides."""
        cfg = self.cfg
        hold = self.prefill_hold_tokens
        if (self._waiting or (cfg.early_refusal and self._no_slack(req, now))
                or cfg.max_wait_s is not None or self._any_deadline or cfg.adapt_boundaries
                or self.max_priority_kept is not None or self.num_seqs_in_flight >= self.batch_cap
                or (hold is not None and self.prefill_tokens_in_flight >= hold)):
            return self.submit(req, now), False
        prompt_len = req.prompt_len
        is_long = prompt_len > cfg.long_prompt_threshold
        in_flight = self._in_flight
        rid = req.request_id
        if (is_long and self.num_long_in_flight >= cfg.max_num_long) or rid in in_flight:
            return self.submit(req, now), False
        seqs = getattr(req, "num_seqs", 1)
        if type(seqs) is not int or seqs < 1:
            seqs = _num_seqs(req)
        if in_flight and self.num_seqs_in_flight + seqs > self.batch_cap:
            return self.submit(req, now), False
        memory = self._memory
        if memory is not None:
            blocks = int(memory.request_blocks(prompt_len, self.charged_output(req), seqs))  # _blocks
            # Beside what is in flight within the ceiling, it fits alone too (``fits`` is monotone);
            # otherwise ``submit`` asks about it alone.
            if not memory.fits(self.kv_blocks_in_flight + blocks, self.num_seqs_in_flight + seqs, self.kv_dtype):
                return self.submit(req, now), False
        else:
            blocks = 0
        # submit: counted, in an empty bucket (never full: max_queue_len >= 1) that rejoins at the
        # virtual time, the next submit number taken.
        self.num_submitted += 1
        if cfg.shed_least_important_first and req.priority in self._ttft_by_priority:
            self._last_submit[req.priority] = now
        bucket = 0  # bucket_of, inline
        for b in self._boundaries:
            if prompt_len < b:
                break
            bucket += 1
        passes = self._pass
        passes[bucket] = max(passes[bucket], self._vtime)
        self._seq += 1
        # admit: it is the only one waiting, so every bucketing mode picks it; late or not, it
        # leaves no trace once admitted.
        self._vtime = passes[bucket]
        passes[bucket] += self._stride[bucket]
        in_flight[rid] = (is_long, seqs, blocks, req)
        self.num_seqs_in_flight += seqs
        self.kv_blocks_in_flight += blocks
        self.num_long_in_flight += is_long
        if getattr(req, "reports_first_token", True):
            if self._busy_since is None:
                self._busy_since = now  # a backlog starts: the drain rate's clock runs
            self._awaiting_first[rid] = (prompt_len, now)
            self.prefill_tokens_in_flight += prompt_len
        self.num_admitted += 1
        return None, True

    def admit(self, now: float) -> list[Any]:
        """Pop as many waiting requests as the caps (count and memory) allow, in bucketing
        order; the caller hands them to the engine. (Call ``expire`` first if stale requests must
        not run; with ``memory`` set, collect ``take_rejections`` after.)"""
        out: list[Any] = []
        waiting = self._waiting
        if not waiting:  # nothing to admit, nothing to mark late (the late heaps drop dead entries when next read)
            return out
        self._mark_late(now)
        hold = self.prefill_hold_tokens
        in_flight, memory, max_num_long = self._in_flight, self._memory, self.cfg.max_num_long
        estimate = self.output_estimate
        while self.num_seqs_in_flight < self.batch_cap and waiting:
            if hold is not None and self.prefill_tokens_in_flight >= hold:
                break  # the engine has an iteration of prefill ahead of it: the rest wait here
            e = self._choose(self.num_long_in_flight < max_num_long, now)
            if e is None:
                break  # only long prompts wait and the long cap is full
            seqs, blocks = e.seqs, e.blocks
            if in_flight and self.num_seqs_in_flight + seqs > self.batch_cap:
                break  # it waits for room (alone it may exceed the cap, or it could never run)
            if memory is not None and estimate is not None and (charged := self.charged_output(e.request)) != e.charged:
                # The estimate moved while it waited: it is charged what admission charges now.
                blocks = e.blocks = int(memory.request_blocks(e.request.prompt_len, charged, seqs))
                e.charged = charged
            if memory is not None and not memory.fits(
                    self.kv_blocks_in_flight + blocks, self.num_seqs_in_flight + seqs, self.kv_dtype):
                if in_flight:
                    break  # it waits for memory to free up
                self._drop(e)  # alone it no longer fits (the model moved since it was queued)
                self._late.append(self._reject(e.request, "too_large_for_memory", now))
                continue
            bucket, req = e.bucket, e.request
            self._buckets[bucket].pop(e)
            self._vtime = self._pass[bucket]
            self._pass[bucket] += self._stride[bucket]
            e.alive = False
            rid = req.request_id
            del waiting[rid]
            in_flight[rid] = (e.is_long, seqs, blocks, req)
            self.num_seqs_in_flight += seqs
            self.kv_blocks_in_flight += blocks
            self.num_long_in_flight += e.is_long
            if getattr(req, "reports_first_token", True):
                self._awaiting_first[rid] = (req.prompt_len, now)
                self.prefill_tokens_in_flight += req.prompt_len
            self.num_admitted += 1
            out.append(req)
        if not waiting and not self.prefill_tokens_in_flight:
            self._busy_since = None  # all admitted, none with a first token to wait for
        return out

    def on_finished(self, request_id: str, output_tokens: int | None = None, now: float | None = None) -> None:
        """Free the slot of a request that left the engine (finished, failed, cancelled or
        disconnected). Raises KeyError for an id that is not in flight (a bug). ``output_tokens``:
        what it generated, for a request that finished normally and whose answer said so (the
        gateway: ``usage.completion_tokens`` or the streamed tokens; the env: the finished
        request); it feeds the output estimate (``charge: estimate``). None for a request cut
        short (failed, cancelled, aborted): what it generated so far is not its length.

        ``now`` (the ``admit`` clock): a request whose first token its caller could not see
        (``reports_first_token`` False: not streamed) that finished normally feeds the drain rate
        with its prompt here, late but counted. Left out, the engine's prefill of non-streamed
        prompts would count as backlog time with no tokens drained in it, and with much such
        traffic the rate would read low and ``early_refusal`` refuse what it could serve."""
        is_long, seqs, blocks, req = self._in_flight.pop(request_id)
        if output_tokens is not None and self.output_estimate is not None:
            self.output_estimate.observe(output_tokens)
        if (now is not None and output_tokens is not None
                and not getattr(req, "reports_first_token", True)):
            self._observe_drain(int(req.prompt_len), now)
        entry = self._awaiting_first.pop(request_id, None)  # on_first_token(request_id), inline
        if entry is not None:
            self.prefill_tokens_in_flight -= entry[0]
            if not self.prefill_tokens_in_flight and not self._waiting:
                self._busy_since = None  # idle, and no first token to time the rest of this backlog by
        self.num_seqs_in_flight -= seqs
        self.kv_blocks_in_flight -= blocks
        self.num_long_in_flight -= is_long
        self.num_finished += 1

    def on_first_token(self, request_id: str, now: float | None = None) -> float | None:
        """A request in flight produced its first token (at ``now``, on the clock ``admit`` was
        given; None: not timed): its prompt leaves the prefill backlog (then call ``admit``: a
        held request may go) and, timed, its time from admission feeds ``first_token_s`` and is
        returned, and its prompt feeds the drain rate (``drain_rate``). Idempotent; unknown ids
        are a no-op (None)."""
        entry = self._awaiting_first.pop(request_id, None)
        if entry is None:
            return None
        prompt_len, admitted_at = entry
        self.prefill_tokens_in_flight -= prompt_len
        if now is None:
            if not self.prefill_tokens_in_flight and not self._waiting:
                self._busy_since = None
            return None
        self._observe_drain(prompt_len, now)
        sample = max(0.0, now - admitted_at)
        if self.cfg.first_token_margin:
            prev, rate = self.first_token_s, self.cfg.first_token_margin_rate
            self.first_token_s = sample if prev is None else prev + rate * (sample - prev)
        return sample

    @property
    def late_margin_s(self) -> float:
        """How much before its TTFT objective a waiting request counts as late
        (``first_token_margin``; 0 when off, unmeasured or without an objective), for the base
        objective (``late_margin_for`` a class's)."""
        return self.late_margin_for(self.late_after_s)

    def late_margin_for(self, late_after_s: float | None) -> float:
        """``late_margin_s`` for a class whose requests are late after ``late_after_s``."""
        if not self.cfg.first_token_margin or self.first_token_s is None or late_after_s is None:
            return 0.0
        return min(self.first_token_s, self.cfg.first_token_margin_max * late_after_s)

    @property
    def drain_rate(self) -> float | None:
        """Prompt tokens that reached their first token per second while a backlog existed
        (requests waiting here or prompts in flight without a first token), over the last
        ``early_refusal_window`` first tokens; None until ``early_refusal_min_samples`` were
        measured (or no backlog time has passed)."""
        if len(self._drain) < self.cfg.early_refusal_min_samples or not self._drain_time > 0:
            return None
        return self._drain_tokens / self._drain_time

    def predicted_first_token_s(self, prompt_len: int, arrival_time: float, now: float,
                                priority: int | None = None) -> float | None:
        """Predicted seconds from arrival to first token of a request submitted at ``now``: what
        it waited + (the prompt tokens queued on time ahead of it + in flight without a first
        token + its own) / ``drain_rate``, the engine's part at least ``first_token_s`` when
        measured. From this module's telemetry alone (no output length). None while the rate is
        unmeasured.

        Which queued tokens are ahead follows the order ``admit`` will take: in FIFO order every
        on-time one; while the queue runs newest first (``newest_first_when_late``, overloaded)
        a new request goes before the on-time ones of its own bucket, so only the buckets served
        before it count (the shorter ones with ``shortest_first``, none with ``fifo``; all with
        ``weighted``, whose shares interleave). Counting the whole queue there refused requests
        that would have been served next. With classes ordered by deadline (``class_deadline_order``,
        a request's ``priority`` given), that rule counts its own class's prompts only, plus every
        on-time prompt of a class with a shorter objective and none of one with a longer."""
        rate = self.drain_rate
        if rate is None:
            return None
        engine_s = (self.prefill_tokens_in_flight + prompt_len) / rate
        if self.first_token_s is not None:
            engine_s = max(engine_s, self.first_token_s)
        ahead = self._on_time_tokens_ahead(prompt_len, now, priority)
        return max(0.0, now - arrival_time) + ahead / rate + engine_s

    def _on_time_tokens_ahead(self, prompt_len: int, now: float, priority: int | None = None) -> int:
        """Prompt tokens queued on time that ``admit`` takes before a request of ``prompt_len``
        (and ``priority``) submitted at ``now`` (``predicted_first_token_s``)."""
        if self._class_order and priority is not None:
            return self._class_tokens_ahead(prompt_len, now, self.ttft_s_for(priority))
        if self.bucketing == "weighted" or not self._newest_first(now):
            return self.waiting_on_time_tokens
        if self.bucketing == "fifo":
            return 0
        bucket = self.bucket_of(prompt_len)
        return sum(b.on_time_tokens for b in self._buckets[:bucket])

    def _class_tokens_ahead(self, prompt_len: int, now: float, own: float | None) -> int:
        """``_on_time_tokens_ahead`` under ``class_deadline_order`` for a request whose class's
        objective is ``own``: the on-time prompts of the classes with a shorter objective (their
        deadlines come first), none of a longer one's (they have more time left: an interactive
        request overtakes the batch prompts; those within ``own`` of their deadline would go
        first and are not counted), and of its own class what the bucketing mode serves first
        (the rule without classes). A class without an objective has no deadline: it goes after
        the others (``_class_choice``) and is never counted ahead."""
        same_by_bucket = []
        ahead = 0
        own_s = math.inf if own is None else own
        for b in self._buckets:
            by = b.class_tokens or {}
            same_by_bucket.append(by.get(own, 0))
            for o, n in by.items():
                if o != own and (math.inf if o is None else o) < own_s:
                    ahead += n
        if self.bucketing == "weighted" or not self._newest_first(now):
            return ahead + sum(same_by_bucket)
        if self.bucketing == "fifo":
            return ahead
        return ahead + sum(same_by_bucket[:self.bucket_of(prompt_len)])

    def _newest_first(self, now: float) -> bool:
        """Whether the on-time queue runs newest first now (``newest_first_when_late``): a
        request waited past its TTFT objective, or one was refused for lack of time within the
        last objective (``_refused_late_at``: the refused request's class's objective)."""
        if not self.cfg.newest_first_when_late:
            return False
        if self._any_late and now - self._refused_late_at <= self._refused_late_s:
            return True
        for b in self._buckets:
            if b.num_late:
                return True
        return False

    def _no_slack(self, req: Any, now: float) -> bool:
        """Whether ``early_refusal`` refuses ``req`` at submit (the caller checked the flag)."""
        ttft_s = self.ttft_s_for(req.priority)
        if ttft_s is None or req.priority <= self.cfg.deadline_max_priority_kept:
            return False
        predicted = self.predicted_first_token_s(req.prompt_len, req.arrival_time, now, req.priority)
        return predicted is not None and predicted > self.cfg.early_refusal_slack * ttft_s

    def _observe_drain(self, prompt_len: int, now: float) -> None:
        """A prompt reached its first token at ``now``: one sample of the drain rate (its tokens
        over the backlog time since the previous first token or the backlog's start). Backlog
        time is time with requests waiting here or prompts in flight without a first token: a
        full batch cap drains the queue slower than the engine prefills, and that must show."""
        since = self._busy_since
        if since is not None:
            dt = max(0.0, now - since)
            window = self._drain
            window.append((prompt_len, dt))
            self._drain_tokens += prompt_len
            self._drain_time += dt
            if len(window) > self.cfg.early_refusal_window:
                old_tokens, old_dt = window.popleft()
                self._drain_tokens -= old_tokens
                self._drain_time -= old_dt
            now = max(now, since)
        self._busy_since = now if self.prefill_tokens_in_flight or self._waiting else None

    def cancel(self, request_id: str, now: float) -> Rejection | None:
        """A client went away. A waiting request is dropped (reason "cancelled"); an in-flight
        one frees its slot (the caller aborts it in the engine); an unknown id (already
        finished or rejected) is a no-op. Returns the Rejection for a waiting one."""
        if request_id in self._in_flight:
            self.on_finished(request_id)
            return None
        e = self._waiting.get(request_id)
        if e is None:
            return None
        self._drop(e)
        return self._reject(e.request, "cancelled", now)

    def expire(self, now: float) -> list[Rejection]:
        """Refuse requests that waited longer than ``max_wait_s`` since arrival ("timeout"), and
        those above core priority past their class's TTFT deadline ("deadline")."""
        out: list[Rejection] = []
        # The wait limit's heap is keyed by arrival, the deadline's by when it passes.
        for heap, limit, reason in (
                (self._expiry, None if self.cfg.max_wait_s is None else now - self.cfg.max_wait_s, "timeout"),
                (self._deadlines, now if self._any_deadline else None, "deadline")):
            if limit is None:
                continue
            while heap and (not heap[0][2].alive or heap[0][0] < limit):
                _, _, e = heapq.heappop(heap)
                if e.alive:
                    self._drop(e)
                    out.append(self._reject(e.request, reason, now))
                    if reason == "deadline":
                        self._refused_late(e.request, now)
        return out

    def shed(self, max_priority_kept: int | None, now: float = 0.0, *, persist: bool = False) -> list[Rejection]:
        """Breaker level 2: drop waiting requests with ``priority > max_priority_kept``; core
        (low-number) ones stay (with ``shed_least_important_first``, only the least important class
        present: ``least_important_kept``). One-shot (callers repeat it each interval while the breaker
        says so); with ``persist`` such new submits are rejected too, until ``shed(None)``."""
        if max_priority_kept is None:
            self.max_priority_kept = None
            return []
        if self.cfg.shed_least_important_first:
            max_priority_kept = self.least_important_kept(max_priority_kept, now)
        if persist:
            self.max_priority_kept = max_priority_kept
        victims = [e for e in self._waiting.values() if e.request.priority > max_priority_kept]
        out = []
        for e in victims:
            self._drop(e)
            out.append(self._reject(e.request, "shed_low_priority", now))
        return out

    def least_important_kept(self, max_priority_kept: int, now: float) -> int:
        """The highest priority ``shed`` keeps with ``shed_least_important_first``: all but the
        least important declared class present (the highest priority with its own entry in
        ``SLO.classes`` waiting or submitted within ``shed_class_window_s`` of ``now``), and at
        least ``max_priority_kept``. Only classes the operator declared count: a request that
        merely tags itself less important (any client may) or a quality-guard replay must not
        turn the breaker's shedding off for everyone else. Without classes of different
        objectives (``class_deadline_order`` off or one objective) it is ``max_priority_kept``,
        as without the rule. O(n), as ``shed``."""
        declared = self._ttft_by_priority
        if not self._class_order or not declared:
            return max_priority_kept
        horizon = now - self.cfg.shed_class_window_s
        present = {p for p, t in self._last_submit.items() if t >= horizon}
        present.update(p for e in self._waiting.values() if (p := e.request.priority) in declared)
        if not present:
            return max_priority_kept
        return max(max_priority_kept, max(present) - 1)

    def take_rejections(self) -> list[Rejection]:
        """Requests ``admit`` refused since the last call ("too_large_for_memory": alone they
        no longer fit the memory ceiling), for the caller to report to their clients."""
        out, self._late = self._late, []
        return out

    def predicted_fraction(self, extra: Any = None) -> float | None:
        """What ``memory`` predicts for the requests in flight (plus ``extra``, a request), as a
        fraction of the budget; None without ``memory`` or when it cannot say."""
        frac = getattr(self.memory, "blocks_fraction", None)
        if frac is None:
            return None
        blocks, seqs = self.kv_blocks_in_flight, self.num_seqs_in_flight
        if extra is not None:
            extra_seqs = _num_seqs(extra)
            blocks, seqs = blocks + self._blocks(extra, extra_seqs), seqs + extra_seqs
        return float(frac(blocks, seqs, self.kv_dtype))

    # --- internals -----------------------------------------------------------------------
    def charged_output(self, req: Any) -> int:
        """The output tokens the memory check charges ``req`` now: its cap
        (``charged_max_tokens``) with ``charge: max_tokens``; with ``charge: estimate``, the cap at
        most the estimate of recent completions (``OutputEstimate.charge``). Never ``output_len``."""
        est = self.output_estimate
        if est is None:
            return charged_max_tokens(req)
        return est.charge(getattr(req, "max_tokens", None))

    def _blocks(self, req: Any, seqs: int) -> int:
        """KV blocks ``req`` holds at its end; ``seqs`` is its ``_num_seqs`` (callers have it)."""
        assert self._memory is not None
        return int(self._memory.request_blocks(req.prompt_len, self.charged_output(req), seqs))

    def _reject(self, req: Any, reason: str, now: float) -> Rejection:
        self.num_rejected_by_reason[reason] += 1
        return Rejection(req, reason, now)

    def _drop(self, e: _Entry) -> None:
        """Take a waiting entry out (lazily from the heaps; at once from the counts)."""
        e.alive = False
        self._buckets[e.bucket].pop(e)
        if not self._waiting and not self.prefill_tokens_in_flight:
            self._busy_since = None  # the backlog is gone (refused or cancelled)
        del self._waiting[e.request.request_id]

    def _mark_late(self, now: float) -> None:
        """Move the requests that waited their class's TTFT objective (less its margin,
        ``late_margin_for``) to the late heaps. A request once late stays late, even if the
        margin shrinks after."""
        if not self._any_late:
            return
        for late_s, heap in self._lateness.items():
            limit = now - (late_s - self.late_margin_for(late_s))
            while heap and (not heap[0][2].alive or heap[0][0] <= limit):
                _, _, e = heappop(heap)
                if e.alive:
                    self._buckets[e.bucket].mark_late(e)

    def _refused_late(self, req: Any, now: float) -> None:
        """A request was refused for lack of time at ``now``: the queue runs newest first for
        its class's objective after (``_newest_first``), or longer while an earlier refusal's
        window lasts longer."""
        late_s = self.ttft_s_for(req.priority) or 0.0
        if now + late_s >= self._refused_late_at + self._refused_late_s:
            self._refused_late_at, self._refused_late_s = now, late_s

    def _choose(self, allow_long: bool, now: float) -> _Entry | None:
        buckets = self._buckets
        newest = self._newest_first(now)
        # The head of each bucket that has one, in bucket order (an entry knows its bucket).
        heads = [h for b in buckets if b.num_waiting and (h := b.head(allow_long, newest)) is not None]
        if len(heads) <= 1:  # none, or one bucket to serve: every mode picks it
            return heads[0] if heads else None
        on_time = [h for h in heads if not h.late]
        if on_time:  # a bucket whose next request can still meet its TTFT goes first
            if self._class_order:
                return self._class_choice(on_time, allow_long, newest)
            heads = on_time
        return self._by_mode(heads, newest and bool(on_time))

    def _by_mode(self, heads: list[_Entry], newest_on_time: bool) -> _Entry:
        """The bucketing mode's pick among bucket heads (in bucket order; ``newest_on_time``:
        on-time heads while the queue runs newest first)."""
        if self.bucketing == "shortest_first":
            return heads[0]
        if self.bucketing == "weighted":
            return min(heads, key=lambda h: (self._pass[h.bucket], h.bucket))
        if newest_on_time:  # fifo, overloaded: the newest on-time head across buckets
            return max(heads, key=lambda h: (h.request.arrival_time, h.seq))
        return min(heads, key=lambda h: (h.request.arrival_time, h.seq))  # fifo: the oldest head across buckets

    def _class_choice(self, heads: list[_Entry], allow_long: bool, newest: bool) -> _Entry:
        """``class_deadline_order`` among the on-time bucket heads: the bucketing mode picks among
        the heads of the class with the shortest TTFT objective (newest first while overloaded,
        as without classes), unless a request of a looser class (the oldest on time of its
        bucket: the one with the least time left) has an earlier deadline (arrival + its class's
        objective) than that pick: the earliest such goes first. A batch request (20 s) thus
        waits behind interactive ones (0.8 s) until it has less time left than the one they would
        serve. One objective for all: the bucketing mode alone; a class without an objective goes
        after those with one."""
        objectives = [math.inf if (o := self.ttft_s_for(h.request.priority)) is None else o for h in heads]
        if min(objectives) == max(objectives):
            return self._by_mode(heads, newest)
        tight = min(objectives)
        pick = self._by_mode([h for h, o in zip(heads, objectives) if o == tight], newest)
        due = pick.request.arrival_time + tight
        for h, o in zip(heads, objectives):
            if o == tight:
                continue
            oldest = self._buckets[h.bucket].head(allow_long) if newest else h
            late_s = None if oldest is None or oldest.late else self.ttft_s_for(oldest.request.priority)
            if late_s is not None and late_s != tight and oldest.request.arrival_time + late_s < due:  # None: no deadline
                pick, due = oldest, oldest.request.arrival_time + late_s
        return pick

    def _initial_centroids(self) -> list[list[float]]:
        """One centroid per bucket (in log length), placed so that the midpoints between
        neighbours are exactly the configured boundaries."""
        logs = [math.log(b) for b in self.cfg.boundaries]
        half = 0.5 * (logs[1] - logs[0]) if len(logs) > 1 else math.log(2.0)
        c = [logs[0] - half]
        for edge in logs:
            c.append(2.0 * edge - c[-1])
        return [[v, 0.0] for v in c]

    def _adapt(self, req: AdmissibleRequest) -> None:
        """Incremental k-means step (the guide's DynamicBucketer): move the nearest centroid
        towards this request; boundaries sit at the midpoints (in log length) of adjacent
        centroids. Requests already waiting keep their bucket."""
        x = math.log(max(req.prompt_len, 1))
        p = float(req.priority) * self.cfg.adapt_priority_weight
        c = self._centroids
        k = min(range(len(c)), key=lambda i: (c[i][0] - x) ** 2 + (c[i][1] - p) ** 2)
        rate = self.cfg.adapt_rate
        c[k][0] += rate * (x - c[k][0])
        c[k][1] += rate * (p - c[k][1])
        c.sort(key=lambda v: v[0])
        self._boundaries = [
            max(1.0, math.exp(0.5 * (c[i][0] + c[i + 1][0]))) for i in range(len(c) - 1)
        ]
        for i in range(1, len(self._boundaries)):  # keep strictly ascending
            self._boundaries[i] = max(self._boundaries[i], self._boundaries[i - 1] + 1.0)


def _num_seqs(req: Any) -> int:
    return max(1, int(getattr(req, "num_seqs", 1)))


def charged_max_tokens(req: Any) -> int:
    """The output tokens admission charges a request: its ``max_tokens`` (the most it may
    generate, as the gateway knows it), 0 when it has none. Never ``output_len``: how long the
    answer turns out is unknown until the engine produces it (tests/test_no_oracle.py)."""
    m = getattr(req, "max_tokens", None)
    return 0 if m is None else max(int(m), 0)


def depths_padded(depths: Sequence[int], n: int = 3) -> tuple[int, ...]:
    """Queue depths padded/folded to ``n`` entries (telemetry's three-bucket layout)."""
    d = list(depths)
    if len(d) <= n:
        return tuple(d + [0] * (n - len(d)))
    return tuple(d[: n - 1] + [sum(d[n - 1 :])])
