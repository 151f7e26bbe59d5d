"""Keeping upstreams alive: health checks, restarts one at a time (drain first), warm-up.

A restart stops admissions on its lane, waits for in-flight requests to finish (up to the
request timeout), restarts the process, warms it up and reopens the lane; queued requests
wait for it within their own timeouts (with one upstream that is the "queue during the
restart" behaviour). A crashed managed upstream is restarted without draining.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from batchpilot.serving.lanes import Lane
from batchpilot.serving.prom import GatewayMetrics
from batchpilot.serving.settings import ServeConfig

log = logging.getLogger(__name__)


class Supervisor:
    """Owns the health loop and every restart; one restart at a time across all lanes."""

    def __init__(self, cfg: ServeConfig, lanes: list[Lane], metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.lanes = lanes
        self.metrics = metrics
        self._restart_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self.last_restart_s: float | None = None

    async def start_all(self) -> None:
        """Start (managed) or wait for (unmanaged) every upstream, then warm each up."""
        await asyncio.gather(*(ln.upstream.start(self.cfg.startup_timeout_s) for ln in self.lanes))
        for ln in self.lanes:
            self.metrics.upstream_up.labels(ln.name).set(1)
            await self.warm_up(ln)
            ln.pump()
        self._task = asyncio.create_task(self._health_loop(), name="batchpilot-health")

    async def stop_all(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for ln in self.lanes:
            ln.fail_all_waiting("shutting_down", "the gateway is shutting down")
            await ln.upstream.stop()
            await ln.upstream.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            for ln in self.lanes:
                if ln.upstream.restarting:
                    continue
                was = ln.upstream.healthy
                ok = await ln.upstream.check_health(timeout_s=max(1.0, 4 * self.cfg.health_interval_s))
                self.metrics.upstream_up.labels(ln.name).set(float(ok))
                if ok and not was:
                    log.info("upstream %s is healthy again", ln.name)
                    ln.pump()
                elif not ok and was:
                    log.warning("upstream %s stopped answering /health", ln.name)
                if not ok and ln.upstream.managed is not None and self.cfg.auto_restart:
                    asyncio.create_task(self.restart(ln, cause="crash", drain=False))

    async def restart(self, lane: Lane, *, cause: str, kv_dtype: str | None = None, drain: bool = True) -> bool:
        """Restart a managed lane's upstream; returns False when it is not managed or already
        restarting. Queued requests wait; in-flight ones finish first when ``drain``."""
        if lane.upstream.managed is None or lane.upstream.restarting:
            return False
        async with self._restart_lock:
            up = lane.upstream
            up.restarting = True
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
                self.metrics.upstream_up.labels(lane.name).set(1)
                await self.warm_up(lane)
                return True
            except Exception:
                log.exception("restart of upstream %s failed; the health loop will try again", lane.name)
                return False
            finally:
                up.restarting = False
                lane.pump()

    async def warm_up(self, lane: Lane) -> None:
        """Send the configured frequent prefixes so the prefix cache starts warm."""
        prompts = self.cfg.warmup.prompts
        if not prompts or lane.upstream.info is None:
            return
        body = {"model": lane.upstream.info.model, "max_tokens": self.cfg.warmup.max_tokens}
        try:
            await asyncio.gather(*(
                lane.upstream.client.post("/v1/completions", json={**body, "prompt": p}, timeout=30.0)
                for p in prompts
            ))
            log.info("warmed %s with %d prompts", lane.name, len(prompts))
        except httpx.HTTPError as exc:
            log.warning("warm-up of %s failed: %r", lane.name, exc)
