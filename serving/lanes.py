"""A lane: one upstream with its own admission queues, telemetry and knobs.

The gateway's asyncio side of ``Admission`` (which is synchronous and shared with training):
a request waits on a future until ``admit`` hands it a slot; every path out (finished, failed,
timed out, client gone) goes through ``release`` or ``cancel`` exactly once, so the books of
admission always balance and no slot leaks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Callable

from batchpilot.core.admission import Admission, AdmissionConfig, Rejection
from batchpilot.core.engine import Request
from batchpilot.core.knobs import Knobs
from batchpilot.core.telemetry import Telemetry
from batchpilot.serving.errors import Refused
from batchpilot.serving.prom import GatewayMetrics, bucket_name
from batchpilot.serving.upstream import Upstream

log = logging.getLogger(__name__)


#: HTTP status per admission rejection reason.
REJECT_STATUS = {"queue_full": 429, "shed_low_priority": 429, "deadline": 429, "no_slack": 429, "timeout": 503,
                 "cancelled": 499, "too_large_for_memory": 400}
REJECT_MESSAGE = {
    "queue_full": "the gateway's queue for this prompt-length bucket is full; retry later",
    "too_large_for_memory": ("the request alone (prompt + max_tokens, times its sequences) would put the engine above "
                             "its memory ceiling; lower max_tokens, n/best_of or the prompt"),
    "shed_low_priority": "overload: low-priority requests are being shed (circuit breaker level 2); retry later",
    "timeout": "the request did not reach the model within the request timeout; retry later",
    "deadline": "overload: the request waited past its time-to-first-token objective and can no longer meet it; "
                "retry later",
    "no_slack": "overload: the queue ahead of the request is predicted to take longer than its time-to-first-token "
                "objective; retry later or elsewhere",
}


#: How vLLM and PyTorch name running out of memory in an error answer (torch's
#: ``OutOfMemoryError`` "CUDA out of memory", "CUDA error: out of memory", HIP/XPU/CPU allocator
#: failures, "Cannot allocate memory").
_OOM_RE = re.compile(rb"out of memory|outofmemoryerror|cannot allocate memory|failed to allocate|\boom\b", re.I)


def is_oom_text(body: bytes) -> bool:
    """Whether an upstream's error answer (its first 64 KiB) says the engine ran out of memory."""
    return bool(_OOM_RE.search(body[:65536]))


def _excerpt(body: bytes, n: int = 160) -> str:
    text = body[:n].decode("utf-8", "replace")
    return "".join(c if c.isprintable() else " " for c in text)


@dataclass
class Lane:
    """One upstream and everything the gateway keeps per upstream."""

    index: int
    upstream: Upstream
    admission: Admission
    telemetry: Telemetry
    knobs: Knobs
    metrics: GatewayMetrics
    retry_after_s: int = 1
    waiters: dict[str, asyncio.Future] = field(default_factory=dict)
    #: Set while a controller's dtype choice waits for a restart, or when it is only recommended.
    num_finished: int = 0
    #: What the upstream reported since the last control tick that counts as running out of
    #: memory (an out-of-memory error answer, the engine process exiting); the control loop
    #: hands it to the shield's breaker (``Shield.report_oom``).
    oom_reports: list[str] = field(default_factory=list)
    #: Called before each admission pass (the control loop's: it rebuilds the lane's memory model
    #: when the upstream reports another engine, so a restart that brought back another KV pool
    #: admits nothing against the previous pool's model while no decision has run since).
    before_admit: Callable[["Lane"], None] | None = None
    #: When (monotonic) the lane last stopped being ``available``; None while it is.
    down_since: float | None = None

    @classmethod
    def build(
        cls, index: int, upstream: Upstream, cfg: AdmissionConfig, knobs: Knobs, telemetry: Telemetry,
        metrics: GatewayMetrics, retry_after_s: int,
    ) -> "Lane":
        lane = cls(index, upstream, Admission(cfg, knobs), telemetry, knobs, metrics, retry_after_s)
        lane.admission.use_slo(telemetry.slo)  # the full SLO: each class by its own TTFT objective
        lane._publish_knobs()
        return lane

    @property
    def name(self) -> str:
        return self.upstream.name

    @property
    def available(self) -> bool:
        """Admits requests now (healthy, not stalled, not draining for a restart)."""
        up = self.upstream
        return up.healthy and not up.restarting and not up.stalled

    @property
    def fails_fast(self) -> bool:
        """Whether requests for this lane, while it is unavailable, are refused after
        ``serve.fail_fast_s``: yes, unless it is down for a restart the gateway chose (queued
        requests wait for that one, within their own timeouts, as they always did)."""
        return not (self.upstream.restarting and self.upstream.planned_restart)

    def note_availability(self, now: float) -> bool:
        """Update ``down_since``; returns whether the lane is available."""
        ok = self.available
        if ok:
            self.down_since = None
        elif self.down_since is None:
            self.down_since = now
        return ok

    @property
    def load(self) -> float:
        a = self.admission
        return (a.num_waiting + a.num_in_flight) / max(a.batch_cap, 1)

    # --- what vLLM reports ----------------------------------------------------------------------
    def report_oom(self, kind: str, what: str) -> None:
        """The upstream ran out of memory or died (``kind``: "error_answer" or "engine_exit")."""
        self.metrics.upstream_oom.labels(self.name, kind).inc()
        if len(self.oom_reports) < 20:
            self.oom_reports.append(what)
        log.warning("upstream %s: %s", self.name, what)

    def check_error_answer(self, status: int, body: bytes) -> None:
        """An error answer from the upstream: report it when it says the engine ran out of memory.
        Only server errors count: a 4xx answer is about the request, and vLLM repeats the
        client's own text in it (``The model `out of memory` does not exist``), so a client
        could otherwise drive the breaker, and restarts, with its request alone."""
        if status >= 500 and is_oom_text(body):
            self.report_oom("error_answer", f"answered {status} naming out-of-memory: {_excerpt(body)}")

    def check_stream_error(self, chunk: bytes) -> None:
        """A streamed chunk: vLLM ends a failed stream with an SSE error event carrying the
        status it would have answered (``{"error": {..., "code": 500}}``); checked like an
        error answer of that status."""
        for line in chunk.splitlines():
            if not line.startswith(b"data:"):
                continue
            try:
                event = json.loads(line[5:])
            except ValueError:
                continue
            err = event.get("error") if isinstance(event, dict) else None
            if isinstance(err, dict):
                code = err.get("code", 500)
                self.check_error_answer(code if isinstance(code, int) and not isinstance(code, bool) else 500, line)

    def take_oom_reports(self) -> list[str]:
        out, self.oom_reports = self.oom_reports, []
        return out

    # --- knobs ---------------------------------------------------------------------------------
    def set_knobs(self, knobs: Knobs) -> None:
        self.admission.set_knobs(knobs)
        self.knobs = knobs
        self._publish_knobs()
        self.pump()

    def _publish_knobs(self) -> None:
        m, n = self.metrics, self.name
        m.batch_cap.labels(n).set(self.knobs.batch_cap)
        from batchpilot.core.engine import KV_DTYPES_8BIT
        from batchpilot.core.knobs import BUCKETING_MODES

        for mode in BUCKETING_MODES:
            m.bucketing.labels(n, mode).set(float(mode == self.knobs.bucketing))
        m.kv_8bit.labels(n).set(float(self.knobs.kv_dtype in KV_DTYPES_8BIT))

    # --- slots -----------------------------------------------------------------------------
    async def acquire(self, req: Request, deadline: float) -> None:
        """Wait for an in-flight slot until ``deadline`` (monotonic). Raises ``Refused`` for a
        full queue, shedding or timeout; on cancellation (client gone) the request leaves the
        queue."""
        now = time.monotonic()
        self.telemetry.on_arrival(now, req.prompt_len)
        rej = self.admission.submit(req, now)
        if rej is not None:
            self._raise_rejection(rej)
        fut = asyncio.get_running_loop().create_future()
        self.waiters[req.request_id] = fut
        self.pump()
        if fut.done():  # decided at once (admitted: the common case; or refused): no timer needed
            fut.result()  # raises the Refused of a request the pump refused (deadline, memory)
            return
        try:
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancellation that lands in the
            # same loop turn as the grant, and a client that had left was then served in full.
            async with asyncio.timeout_at(deadline):
                await fut
        except TimeoutError:
            self.waiters.pop(req.request_id, None)
            if self.admission.is_in_flight(req.request_id):  # admitted in the same instant
                return
            self.admission.cancel(req.request_id, time.monotonic())
            self._count_rejected("timeout")
            raise Refused("timeout", REJECT_MESSAGE["timeout"], status=503, retry_after=self.retry_after_s) from None
        except asyncio.CancelledError:
            # The client left while queued, or just as its slot was granted (the slot is handed
            # on then): either way it never reached the upstream, so it counts as "cancelled".
            self.waiters.pop(req.request_id, None)
            if self.admission.is_in_flight(req.request_id):
                self.release(req.request_id)
            else:
                self.admission.cancel(req.request_id, time.monotonic())
            self.metrics.rejected.labels("cancelled").inc()
            raise
        except Refused:
            raise  # a queued request that was shed: the future carries the Refused

    def release(self, request_id: str, output_tokens: int | None = None) -> None:
        """Free the slot of a request that left the upstream (any way). Idempotent per id.
        ``output_tokens``: what a request that finished normally generated (its answer's usage
        or streamed tokens), for admission's output estimate; None when it was cut short."""
        if self.admission.is_in_flight(request_id):
            now = time.monotonic() if output_tokens is not None else None  # a non-streamed one's drain
            self.admission.on_finished(request_id, output_tokens, now)
            self.pump()

    def on_first_token(self, request_id: str, now: float | None = None) -> None:
        """A streamed request's first token arrived (at ``now``, ``time.monotonic()``; None:
        now): its prompt left the engine's prefill backlog, which may let a held request in."""
        if self.admission.is_in_flight(request_id):
            self.admission.on_first_token(request_id, time.monotonic() if now is None else now)
            self.pump()

    def pump(self) -> None:
        """Hand free slots to waiting requests (in the bucketing order)."""
        if not self.available:
            self._publish_queue()
            return
        if self.before_admit is not None:
            self.before_admit(self)
        now = time.monotonic()
        if self.admission.expires:  # past their deadline or wait limit: refused, never run late
            for rej in self.admission.expire(now):
                self._fail_waiter(rej)
        for r in self.admission.admit(now):
            fut = self.waiters.pop(r.request_id, None)
            if fut is None or fut.done():  # its waiter gave up in the same instant
                self.admission.on_finished(r.request_id)
                continue
            fut.set_result(None)
        for rej in self.admission.take_rejections():  # no longer fit the memory ceiling even alone
            self._fail_waiter(rej)
        self._publish_queue()

    def shed_queued(self, max_priority_kept: int | None) -> int:
        """Breaker level 2 (each decision at that level): reject queued requests above the kept
        priority; arrivals queue and meet the next decision's shed unless a slot frees first."""
        out = self.admission.shed(max_priority_kept, time.monotonic())
        for rej in out:
            self._fail_waiter(rej)
        return len(out)

    def fail_all_waiting(self, reason: str, message: str, count: bool = False) -> int:
        """Reject everything queued (gateway shutdown; ``count``: as rejections in the metrics,
        the lane down past ``serve.fail_fast_s``). Returns how many."""
        n = 0
        for rid in list(self.waiters):
            fut = self.waiters.pop(rid)
            self.admission.cancel(rid, time.monotonic())
            if not fut.done():
                n += 1
                fut.set_exception(Refused(reason, message, status=503, retry_after=self.retry_after_s))
                if count:
                    self._count_rejected(reason)
        self._publish_queue()
        return n

    # --- helpers ---------------------------------------------------------------------------
    def _fail_waiter(self, rej: Rejection) -> None:
        self._count_rejected(rej.reason)
        fut = self.waiters.pop(rej.request_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(self._refusal(rej))

    def _raise_rejection(self, rej: Rejection) -> None:
        self._count_rejected(rej.reason)
        raise self._refusal(rej)

    def _refusal(self, rej: Rejection) -> Refused:
        msg = REJECT_MESSAGE.get(rej.reason, rej.reason)
        if rej.reason == "too_large_for_memory":
            r = rej.request
            frac = getattr(self.admission.memory, "blocks_fraction", None)
            if frac is not None:
                m = self.admission
                out = m.charged_output(r)  # what admission charged it
                blocks = m.memory.request_blocks(r.prompt_len, out, r.num_seqs)
                share = frac(blocks, r.num_seqs, m.kv_dtype)
                ceiling = getattr(getattr(m.memory, "cfg", None), "memory_ceiling", None)
                msg = (f"{msg}: {r.prompt_len} prompt + {out} output tokens x {r.num_seqs} sequence(s) "
                       f"predict {share:.0%} of the engine's memory" + (f" (ceiling {ceiling:.0%})" if ceiling else ""))
        return Refused(rej.reason, msg, status=REJECT_STATUS.get(rej.reason, 503),
                       retry_after=None if rej.reason == "too_large_for_memory" else self.retry_after_s)

    def _count_rejected(self, reason: str) -> None:
        if REJECT_STATUS.get(reason) != 400:  # a 400 is counted by the app's error handler
            self.metrics.rejected.labels(reason).inc()
        self.telemetry.on_rejected()

    def _publish_queue(self) -> None:
        m, n = self.metrics, self.name
        for i, d in enumerate(self.admission.queue_depths):
            m.queue_depth.labels(n, bucket_name(i)).set(d)
        m.in_flight.labels(n).set(self.admission.num_in_flight)
