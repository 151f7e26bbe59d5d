"""``bench_gateway(cfg)``: the latency the gateway adds over calling ``vllm serve`` directly.

One ``vllm serve`` (tiny model, started here) and one gateway process in front of it. A
single client sends pairs of identical requests at a fixed rate, one straight to vLLM and one
through the gateway (order alternating), one at a time so nothing queues; max_tokens=1 keeps
the engine's own noise small. Reported:

- ``overhead_p50_ms`` / ``overhead_p99_ms`` (the headline): percentiles of the per-pair
  difference, gateway minus direct, for the same request at the same moment: what one request
  pays for the gateway (the target is p99 < 2 ms);
- ``overhead_p99_ci95_ms``: a 95 % bootstrap interval of that p99 (pairs resampled);
- ``tail_difference_p50_ms`` / ``tail_difference_p99_ms``: p50 / p99 through the gateway minus
  the same percentile direct. The difference of two tails: vLLM's own p99 moves by milliseconds
  between runs, so it came out negative in some runs (-6.6 ms once, with a paired p99 of 5.6 ms);
- ``internal_*``: time spent inside the gateway's handler (its ``x-gateway-overhead-ms``
  header: before the upstream call plus after it), without the extra HTTP hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import numpy as np

from batchpilot.schemas import GatewayBenchConfig  # declared there (schema/gateway_bench); re-exported


def _wait(url: str, path: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url}{path} not ready after {timeout_s} s")


async def _pairs(direct: str, gateway: str, model: str, b: GatewayBenchConfig, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "gateway": [], "internal": []}
    body = {"model": model, "prompt": b.prompt, "max_tokens": b.max_tokens}
    async with httpx.AsyncClient(timeout=30) as c:
        t0 = time.monotonic()
        for i in range(n):
            delay = t0 + i / b.rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            order = (("direct", direct), ("gateway", gateway))
            for name, url in (order if i % 2 == 0 else order[::-1]):
                s = time.perf_counter()
                r = await c.post(url + "/v1/completions", json=body)
                out[name].append((time.perf_counter() - s) * 1e3)
                if r.status_code != 200:
                    raise RuntimeError(f"{name} request failed: {r.status_code} {r.text[:200]}")
                if name == "gateway":
                    out["internal"].append(float(r.headers["x-gateway-overhead-ms"]))
    return out


def bench_gateway(cfg: Any) -> dict[str, Any]:
    """Start vLLM + gateway, measure, stop both; returns the figures (milliseconds)."""
    from batchpilot.config import REPO_ROOT
    from batchpilot.core.tiny_model import build_tiny_model
    from batchpilot.serving.upstream import ManagedVLLM, free_port

    b = GatewayBenchConfig.from_cfg(cfg)
    model = str(build_tiny_model())
    vllm = ManagedVLLM(model, free_port(), served_model_name="tiny-llama", max_model_len=2048, max_num_seqs=256,
                       kv_cache_space_gib=1, extra_args=["--enforce-eager"],
                       log_path=None)
    gw_port = free_port()
    gw_proc: subprocess.Popen | None = None
    try:
        vllm.start()
        _wait(vllm.url, "/health", 300, vllm.proc)
        gw_proc = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), f"serve.upstreams=[{vllm.url}]",
             f"serve.model={model}", f"serve.port={gw_port}", f"serve.control.mode={b.control_mode}",
             "serve.log_level=warning",
             "hydra.run.dir=/tmp/batchpilot-hydra", "hydra.output_subdir=null", "hydra/job_logging=none",
             "hydra/hydra_logging=none", *b.serve_overrides],
            # Own process group (to end it), same session as vLLM and this client: see ManagedVLLM.
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO_ROOT, process_group=0,
        )
        gw_url = f"http://127.0.0.1:{gw_port}"
        _wait(gw_url, "/readyz", 120, gw_proc)
        asyncio.run(_pairs(vllm.url, gw_url, "tiny-llama", b, b.warmup_pairs))
        res = asyncio.run(_pairs(vllm.url, gw_url, "tiny-llama", b, b.num_pairs))
    finally:
        if gw_proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(gw_proc.pid, signal.SIGTERM)
            try:
                gw_proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(gw_proc.pid, signal.SIGKILL)
        vllm.stop()
    d, g, i = (np.asarray(res[k]) for k in ("direct", "gateway", "internal"))
    diff = g - d
    p = lambda x, q: round(float(np.percentile(x, q)), 3)  # noqa: E731
    lo, hi = _paired_p99_interval(diff)
    return {
        "target": "gateway",
        "rate_per_s": b.rate,
        "num_pairs": b.num_pairs,
        "direct_p50_ms": p(d, 50), "direct_p99_ms": p(d, 99),
        "gateway_p50_ms": p(g, 50), "gateway_p99_ms": p(g, 99),
        "overhead_p50_ms": p(diff, 50), "overhead_p99_ms": p(diff, 99),
        "overhead_p99_ci95_ms": [lo, hi],
        "tail_difference_p50_ms": round(p(g, 50) - p(d, 50), 3),
        "tail_difference_p99_ms": round(p(g, 99) - p(d, 99), 3),
        "internal_p50_ms": p(i, 50), "internal_p99_ms": p(i, 99),
    }


def _paired_p99_interval(diff: np.ndarray, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of the p99 of the per-pair differences (pairs resampled)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(diff), size=(n_boot, len(diff)))
    lo, hi = np.percentile(np.percentile(diff[idx], 99, axis=1), [2.5, 97.5])
    return round(float(lo), 3), round(float(hi), 3)
