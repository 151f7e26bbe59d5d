"""Decode speed on the served path: ``n`` simultaneous requests through a real ``vllm serve``
(the built-in tiny model), wall milliseconds per output token; and the served round trip: one
one-token request at a time on an idle server, client wall time.

The in-process calibration times ``engine.step()``; a live evaluation goes through vLLM's API
server, which does per-sequence work every step (outputs sent from the engine process,
detokenised, bookkept) on the same cores. This measures that path so the calibration can add it
(``evaluation/calibration.py`` ``fit_served_extra``; ``scripts/calibrate.py served=true``,
``scripts/bench.py target=served_decode``). The round trip, less the one iteration the
simulator charges for it, is the time a request spends crossing the API server each way, which
the simulator's ``engine.ingress_latency_s`` stands for (``scripts/bench.py
target=served_round_trip``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from batchpilot.platform.tiny_model import build_tiny_model
from batchpilot.serving.upstream import ManagedVLLM, free_port

SERVED_NAME = "tiny-llama"


async def _batch(url: str, n: int, prompt_tokens: int, max_tokens: int) -> float:
    """Seconds for ``n`` simultaneous non-streaming completions of ``max_tokens`` each."""
    body = {"model": SERVED_NAME, "prompt": [1 + i % 500 for i in range(prompt_tokens)],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(c.post(url + "/v1/completions", json=body) for _ in range(n)))
        wall = time.perf_counter() - t0
    bad = [r.status_code for r in answers if r.status_code != 200]
    if bad:
        raise RuntimeError(f"served decode: {len(bad)} of {n} requests failed ({bad[:3]})")
    return wall


@contextmanager
def served_tiny_model(startup_timeout_s: float = 300.0) -> Iterator[str]:
    """A ``vllm serve`` of the built-in tiny model (1 GiB KV, 256 sequences), healthy; yields its URL."""
    vllm = ManagedVLLM(str(build_tiny_model()), free_port(), served_model_name=SERVED_NAME, max_model_len=2048,
                       max_num_seqs=256, kv_cache_space_gib=1, extra_args=["--enforce-eager"], log_path=None)
    try:
        vllm.start()
        deadline = time.monotonic() + startup_timeout_s
        while True:
            try:
                if httpx.get(vllm.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not vllm.alive():
                raise RuntimeError("served decode: vllm serve did not become healthy")
            time.sleep(0.5)
        yield vllm.url
    finally:
        vllm.stop()


def measure_served_decode(settings: Any, startup_timeout_s: float = 300.0) -> list[tuple[int, float]]:
    """``[(n, wall ms per output token)]``, the best of ``settings.repeats`` per ``n`` in
    ``settings.concurrencies``, after batches of ``settings.warmup`` sizes
    (``ServedDecodeSettings``); starts and stops its own ``vllm serve``."""
    prompt_tokens, max_tokens = int(settings.prompt_tokens), int(settings.max_tokens)
    out: list[tuple[int, float]] = []
    with served_tiny_model(startup_timeout_s) as url:
        for n in settings.warmup:
            asyncio.run(_batch(url, int(n), prompt_tokens, max_tokens))
        for n in settings.concurrencies:
            wall = min(asyncio.run(_batch(url, int(n), prompt_tokens, max_tokens))
                       for _ in range(int(settings.repeats)))
            out.append((int(n), wall / max_tokens * 1e3))
    return out


def measure_round_trip(prompt_tokens: int, requests: int, warmup: int, startup_timeout_s: float = 300.0) -> list[float]:
    """Client wall seconds of ``requests`` completions of one token for a ``prompt_tokens`` prompt,
    sent one at a time (the server idle in between), after ``warmup`` such requests."""
    if prompt_tokens < 1 or requests < 1 or warmup < 0:
        raise ValueError(f"round trip: prompt_tokens={prompt_tokens} and requests={requests} must be >= 1, "
                         f"warmup={warmup} >= 0")
    with served_tiny_model(startup_timeout_s) as url:
        for _ in range(warmup):
            asyncio.run(_batch(url, 1, prompt_tokens, 1))
        return [asyncio.run(_batch(url, 1, prompt_tokens, 1)) for _ in range(requests)]
