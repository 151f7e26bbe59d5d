"""Decode speed on the served path: ``n`` simultaneous requests through a real ``vllm serve``
(the built-in tiny model), wall milliseconds per output token.

The in-process calibration times ``engine.step()``; a live evaluation goes through vLLM's API
server, which does per-sequence work every step (outputs sent from the engine process,
detokenised, bookkept) on the same cores. This measures that path so the calibration can add it
(``policies/calibration.py`` ``fit_served_extra``; ``scripts/calibrate.py served=true``,
``scripts/bench.py target=served_decode``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from batchpilot.core.tiny_model import build_tiny_model
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


def measure_served_decode(settings: Any, startup_timeout_s: float = 300.0) -> list[tuple[int, float]]:
    """``[(n, wall ms per output token)]``, the best of ``settings.repeats`` per ``n`` in
    ``settings.concurrencies``, after batches of ``settings.warmup`` sizes
    (``ServedDecodeSettings``); starts and stops its own ``vllm serve`` (1 GiB KV, 256 sequences)."""
    prompt_tokens, max_tokens = int(settings.prompt_tokens), int(settings.max_tokens)
    vllm = ManagedVLLM(str(build_tiny_model()), free_port(), served_model_name=SERVED_NAME, max_model_len=2048,
                       max_num_seqs=256, kv_cache_space_gib=1, extra_args=["--enforce-eager"], log_path=None)
    out: list[tuple[int, float]] = []
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
        for n in settings.warmup:
            asyncio.run(_batch(vllm.url, int(n), prompt_tokens, max_tokens))
        for n in settings.concurrencies:
            wall = min(asyncio.run(_batch(vllm.url, int(n), prompt_tokens, max_tokens))
                       for _ in range(int(settings.repeats)))
            out.append((int(n), wall / max_tokens * 1e3))
    finally:
        vllm.stop()
    return out
