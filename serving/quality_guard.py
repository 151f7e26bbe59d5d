"""Quality guard for 8-bit KV (the guide's QuantizationMonitor).

While an upstream runs an 8-bit KV cache, a share of requests is replayed greedily (temperature
0, ``max_tokens`` tokens) on that upstream and on a 16-bit reference server; a sample
"differs" when the token sequences disagree anywhere. The output-diff rate over a sliding
window is exported; above the threshold (default 5 %) the guard blocks 8-bit KV and the
control loop restarts managed upstreams in 16-bit. The block is sticky until ``reset`` (admin):
a quality problem should be looked at, not flapped on.

Replays run in the background with bounded concurrency; they never delay the client's request.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from batchpilot.core.engine import KV_DTYPES_8BIT, Request
from batchpilot.schemas.serve import QualityGuardConfig
from batchpilot.serving.errors import GatewayError
from batchpilot.serving.prom import GatewayMetrics
from batchpilot.serving.upstream import auth_headers

if TYPE_CHECKING:
    from batchpilot.serving.lanes import Lane

log = logging.getLogger(__name__)

#: Admission priority of a replay: below any client's, so it is shed first.
REPLAY_PRIORITY = 1_000


def token_agreement(a: list[int] | str, b: list[int] | str) -> float:
    """Share of positions (over the longer output) where both outputs hold the same token."""
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    same = sum(1 for x, y in zip(a, b) if x == y)
    return same / n


@dataclass(slots=True)
class Sample:
    lane: "Lane"
    body: dict[str, Any]
    path: str
    prompt_len: int = 1


class QualityGuard:
    """Samples, replays, and keeps the output-diff rate."""

    def __init__(self, cfg: QualityGuardConfig, metrics: GatewayMetrics, api_key: str | None = None) -> None:
        """``api_key``: the upstreams' (``serve.upstream_api_key``); the reference is a vLLM
        server deployed like them, so it is sent there too."""
        self.cfg = cfg
        self.metrics = metrics
        self._window: deque[bool] = deque(maxlen=cfg.window)
        self.blocks_8bit = False
        self._sem = asyncio.Semaphore(4)
        self._tasks: set[asyncio.Task] = set()
        self._ref = (httpx.AsyncClient(base_url=cfg.reference_url, timeout=30.0, headers=dict(auth_headers(api_key)))
                     if cfg.reference_url else None)
        self.metrics.output_diff_rate.set(0.0)

    @property
    def num_samples(self) -> int:
        return len(self._window)

    @property
    def diff_rate(self) -> float:
        return sum(self._window) / len(self._window) if self._window else 0.0

    def record(self, agreement: float) -> None:
        """One compared sample; flips ``blocks_8bit`` when the rate crosses the threshold."""
        self._window.append(agreement < 1.0)
        self.metrics.quality_samples.labels("differs" if agreement < 1.0 else "same").inc()
        rate = self.diff_rate
        self.metrics.output_diff_rate.set(rate)
        if not self.blocks_8bit and len(self._window) >= self.cfg.min_samples and rate > self.cfg.threshold:
            self.blocks_8bit = True
            log.warning("quality guard: output-diff rate %.1f%% > %.1f%% over %d samples: blocking 8-bit KV",
                        100 * rate, 100 * self.cfg.threshold, len(self._window))

    def reset(self) -> None:
        self._window.clear()
        self.blocks_8bit = False
        self.metrics.output_diff_rate.set(0.0)

    def maybe_sample(self, lane: "Lane", body: dict[str, Any], chat: bool, prompt_len: int = 1) -> Sample | None:
        """A replay job for this request, or None (guard off, 16-bit lane, not drawn)."""
        c = self.cfg
        if not c.enabled or self._ref is None or lane.knobs.kv_dtype not in KV_DTYPES_8BIT:
            return None
        if random.random() >= c.sample_share:
            return None
        keep = ("model", "messages") if chat else ("model", "prompt")
        b = {k: body[k] for k in keep if k in body}
        if not chat and not isinstance(b.get("prompt"), str):
            return None  # batches / token ids: skip, one prompt per sample keeps it simple
        b.update(max_tokens=c.max_tokens, temperature=0.0, stream=False, return_token_ids=True)
        return Sample(lane, b, "/v1/chat/completions" if chat else "/v1/completions", prompt_len)

    def submit(self, sample: Sample) -> None:
        """Replay ``sample`` in the background; the task is kept (not garbage-collected mid-run)
        and a failure the replay did not expect is logged with its traceback, not lost."""
        t = asyncio.create_task(self._replay(sample), name="batchpilot-quality-replay")
        self._tasks.add(t)
        t.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.metrics.quality_samples.labels("error").inc()
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    async def compare(self, client_a: httpx.AsyncClient, client_b: httpx.AsyncClient, path: str, body: dict[str, Any]) -> float:
        """Token agreement of the same greedy request on two servers."""
        ra, rb = await asyncio.gather(client_a.post(path, json=body, timeout=30.0),
                                      client_b.post(path, json=body, timeout=30.0))
        ra.raise_for_status()
        rb.raise_for_status()
        return token_agreement(_output(ra.json()), _output(rb.json()))

    async def _replay(self, s: Sample) -> None:
        """Replay on the upstream and the reference. The upstream's copy takes a slot in the
        lane's admission like any request (the least important priority, so the breaker sheds
        it first): replays bypassing admission could push the batch past the cap."""
        async with self._sem:
            req = Request(f"qg-{uuid.uuid4().hex}", time.monotonic(), s.prompt_len, self.cfg.max_tokens,
                          priority=REPLAY_PRIORITY, reports_first_token=False,  # not streamed
                          max_tokens=self.cfg.max_tokens)
            try:
                await s.lane.acquire(req, time.monotonic() + 30.0)
            except GatewayError as exc:
                self.metrics.quality_samples.labels("skipped").inc()
                log.debug("quality replay skipped: %s", exc.reason)
                return
            try:
                self.record(await self.compare(s.lane.upstream.client, self._ref, s.path, s.body))
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                self.metrics.quality_samples.labels("error").inc()
                log.debug("quality replay failed: %r", exc)
            finally:
                s.lane.release(req.request_id)

    async def aclose(self) -> None:
        """Cancel the replays under way and wait for them (each frees its admission slot)."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ref is not None:
            await self._ref.aclose()


def _output(resp: dict[str, Any]) -> list[int] | str:
    ch = resp["choices"][0]
    ids = ch.get("token_ids")
    if ids:
        return list(ids)
    if "message" in ch:
        return ch["message"].get("content") or ""
    return ch.get("text", "")
