"""Keeping upstreams alive: health checks, restarts one at a time (drain first), warm-up.

A restart stops admissions on its lane, waits for in-flight requests to finish (up to the
request timeout), restarts the process, warms it up and reopens the lane; queued requests
wait for it within their own timeouts (with one upstream that is the "queue during the
restart" behaviour). A crashed managed upstream is restarted without draining.

Health: a CPU engine busy generating can starve its own API server, so one slow or failed
``/health`` is no proof of death (restarting on one killed a busy upstream with everything in
flight). An upstream is called down when its process has exited or the connection is refused
(at once), or after ``health_failures`` failed probes in a row spanning ``health_grace_s``.
Every background task is kept and awaited on stop, so none outlives the gateway or loses its
exception.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Coroutine

import httpx

from batchpilot.schemas.serve import ServeConfig
from batchpilot.serving.lanes import Lane
from batchpilot.serving.prom import GatewayMetrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Probes:
    """Failed health probes in a row for one lane."""

    failures: int = 0
    since: float = 0.0
    #: When the first of these failed probes was sent (``serve.unresponsive_s`` counts from it).
    first_sent: float = 0.0


class Supervisor:
    """Owns the health loop and every restart; one restart at a time across all lanes."""

    def __init__(self, cfg: ServeConfig, lanes: list[Lane], metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.lanes = lanes
        self.metrics = metrics
        self._restart_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._probes = {ln.index: _Probes() for ln in lanes}
        self._pending: set[int] = set()  # lanes with a restart asked for or under way
        self.closing = False
        self.last_restart_s: float | None = None
        #: Lane index -> when (monotonic) its /health probe under way was sent.
        self._probe_sent: dict[int, float] = {}

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Run ``coro`` in the background, kept (not garbage-collected mid-run), its failure
        logged, cancelled and awaited on stop."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    async def start_all(self) -> None:
        """Start (managed) or wait for (unmanaged) every upstream, then warm each up."""
        await asyncio.gather(*(ln.upstream.start(self.cfg.startup_timeout_s) for ln in self.lanes))
        for ln in self.lanes:
            self.metrics.upstream_up.labels(ln.name).set(1)
            await self.warm_up(ln)
            ln.pump()
        self.spawn(self._health_loop(), "batchpilot-health")

    async def stop_all(self) -> None:
        """Cancel the health loop and any restart under way, then stop every upstream for good."""
        self.closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for ln in self.lanes:
            ln.fail_all_waiting("shutting_down", "the gateway is shutting down")
            await ln.upstream.stop()
            await ln.upstream.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            for ln in self.lanes:
                # Passive while traffic flows: an answer within the interval is a health check.
                if not ln.upstream.restarting and not ln.upstream.answered_within(self.cfg.health_interval_s):
                    await self.probe(ln)

    async def probe(self, ln: Lane) -> None:
        """One health probe of ``ln``; marks it down, or restarts it, when the evidence says so."""
        up, cfg, st = ln.upstream, self.cfg, self._probes[ln.index]
        sent = self._probe_sent[ln.index] = time.monotonic()
        try:
            why = await up.probe(cfg.health_timeout_s)
        finally:
            self._probe_sent.pop(ln.index, None)
        now = time.monotonic()
        if why is None:
            if up.stalled and not (up.managed is not None and up.managed.stopped()):
                up.stalled = False
                log.info("upstream %s answers again", ln.name)
            if st.failures:
                log.info("upstream %s answers /health again after %d failed probes", ln.name, st.failures)
            st.failures = 0
            if not up.healthy:
                log.info("upstream %s is healthy", ln.name)
                up.healthy = True
                ln.pump()
            self.metrics.upstream_up.labels(ln.name).set(1)
            return
        if st.failures == 0:
            st.since, st.first_sent = now, sent
        st.failures += 1
        if cfg.unresponsive_s is not None and "did not answer" in why and now - st.first_sent >= cfg.unresponsive_s:
            up.stalled = True  # unanswered that long, across probes (``check_lanes`` may not have seen it)
        exited = up.managed is not None and not up.managed.alive()
        down = exited or why.startswith("connection refused") or (
            st.failures >= cfg.health_failures and now - st.since >= cfg.health_grace_s)
        log.warning("upstream %s: health probe failed (%d in a row over %.1f s): %s%s", ln.name, st.failures,
                    now - st.since, why, "; calling it down" if down and up.healthy else "")
        if not down:
            return
        if exited and up.healthy:  # once per death, not per probe of a dead process
            ln.report_oom("engine_exit", f"the engine process exited ({why})")
        up.healthy = False
        self.metrics.upstream_up.labels(ln.name).set(0)
        if up.managed is not None and cfg.auto_restart and not self.closing:
            self.spawn(self.restart(ln, cause="crash" if exited else "unresponsive", drain=False),
                       f"batchpilot-restart-{ln.name}")

    def check_lanes(self, now: float) -> None:
        """Several times a second: a lane whose engine is stopped (SIGSTOP) or has not answered
        a /health probe for ``serve.unresponsive_s`` stops admitting (``Upstream.stalled``), at
        once and without a restart; a lane unavailable for ``serve.fail_fast_s`` refuses what is
        queued on it (503 + Retry-After: a client behind a router retries elsewhere at once
        instead of waiting out a restart or a hang)."""
        cfg = self.cfg
        for ln in self.lanes:
            up = ln.upstream
            stopped = up.managed is not None and up.managed.stopped()
            sent = self._probe_sent.get(ln.index)
            if sent is not None and self._probes[ln.index].failures:  # unanswered since the first failed one
                sent = self._probes[ln.index].first_sent
            hung = (cfg.unresponsive_s is not None and sent is not None and now - sent > cfg.unresponsive_s
                    and not up.answered_within(cfg.unresponsive_s, now))
            if stopped or hung:
                if not up.stalled:
                    log.warning("upstream %s %s: no admissions until it answers", ln.name, "is stopped (SIGSTOP)"
                                if stopped else f"has not answered /health for {now - sent:.1f} s")
                up.stalled = True
            elif up.stalled and sent is None and not hung and up.answered_within(cfg.health_interval_s * 4, now):
                up.stalled = False  # real answers came back meanwhile
            was_down = ln.down_since is not None
            if ln.note_availability(now):
                if was_down:
                    ln.pump()
                continue
            if cfg.fail_fast_s is None or now - ln.down_since < cfg.fail_fast_s or not ln.fails_fast:
                continue
            n = ln.fail_all_waiting("upstream_down", f"upstream {ln.name} cannot serve (stopped, restarting or not "
                                    f"answering for {now - ln.down_since:.1f} s); retry later", count=True) \
                if ln.waiters else 0
            # A stalled engine's requests that have had no answer yet are ended too (503, as if
            # never sent); a planned restart's drain lets requests in flight finish instead.
            cut = up.pool.abort_waiting_head() if up.stalled else 0
            if n or cut:
                log.warning("upstream %s down for %.1f s: refused %d queued request(s), ended %d waiting for "
                            "their answer", ln.name, now - ln.down_since, n, cut)

    async def restart(self, lane: Lane, *, cause: str, kv_dtype: str | None = None, drain: bool = True) -> bool:
        """Restart a managed lane's upstream; returns False when it is not managed or already
        restarting. Queued requests wait; in-flight ones finish first when ``drain``."""
        # Claimed before any await: the health loop and the quality path both asking for one
        # (the check used to come before taking the lock) queued two restarts.
        if lane.upstream.managed is None or self.closing or lane.index in self._pending:
            return False
        self._pending.add(lane.index)
        try:
            async with self._restart_lock:
                if self.closing:
                    return False
                return await self._restart(lane, cause=cause, kv_dtype=kv_dtype, drain=drain)
        finally:
            self._pending.discard(lane.index)

    async def _restart(self, lane: Lane, *, cause: str, kv_dtype: str | None, drain: bool) -> bool:
        """One restart, under the lock."""
        up = lane.upstream
        up.restarting = True
        up.planned_restart = drain
        t0 = time.monotonic()
        try:
            if drain:
                deadline = t0 + self.cfg.request_timeout_s
                while lane.admission.num_in_flight and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            log.warning("restarting upstream %s (%s%s)", lane.name, cause,
                        f", kv_cache_dtype={kv_dtype}" if kv_dtype else "")
            self.metrics.upstream_up.labels(lane.name).set(0)
            took = await up.restart(self.cfg.startup_timeout_s, kv_dtype=kv_dtype)
            self.metrics.upstream_restarts.labels(lane.name, cause).inc()
            if kv_dtype is not None:
                lane.set_knobs(lane.knobs.with_(kv_dtype=kv_dtype))
                lane.telemetry.on_dtype_switch(time.monotonic())
            self.last_restart_s = took
            log.info("upstream %s back after %.1f s", lane.name, took)
            self._probes[lane.index] = _Probes()
            self.metrics.upstream_up.labels(lane.name).set(1)
            await self.warm_up(lane)
            return True
        except Exception:
            log.exception("restart of upstream %s failed; the health loop will try again", lane.name)
            return False
        finally:
            up.restarting = up.planned_restart = False
            lane.pump()

    async def warm_up(self, lane: Lane) -> None:
        """Send the configured frequent prefixes so the prefix cache starts warm."""
        prompts = self.cfg.warmup.prompts
        if not prompts or lane.upstream.info is None:
            return
        body = {"model": lane.upstream.info.model, "max_tokens": self.cfg.warmup.max_tokens}
        # The lane admits nothing while it warms up (not open yet, or restarting), so warm-up
        # runs alone; at most batch_cap prompts at once keep it inside the cap too.
        room = asyncio.Semaphore(max(1, lane.knobs.batch_cap))

        async def one(prompt: str) -> None:
            async with room:
                await lane.upstream.client.post("/v1/completions", json={**body, "prompt": prompt}, timeout=30.0)

        try:
            await asyncio.gather(*(one(p) for p in prompts))
            log.info("warmed %s with %d prompts", lane.name, len(prompts))
        except httpx.HTTPError as exc:
            log.warning("warm-up of %s failed: %r", lane.name, exc)
