"""``bench_gateway(cfg)``: the latency the gateway adds over calling ``vllm serve`` directly.

One ``vllm serve`` (tiny model, started here) and one gateway process in front of it. A
single client sends rounds of identical requests at a fixed rate, straight to vLLM and
through the gateway (order rotating), one at a time so nothing queues; max_tokens=1 keeps
the engine's own noise small. Reported:

- ``overhead_p50_ms`` / ``overhead_p99_ms`` (the headline): percentiles of the per-pair
  difference, gateway minus direct, for the same request at the same moment: what one request
  pays for the gateway (the target is p99 < 2 ms);
- ``overhead_p99_ci95_ms``: a 95 % bootstrap interval of that p99 (pairs resampled);
- ``tail_difference_p50_ms`` / ``tail_difference_p99_ms``: p50 / p99 through the gateway minus
  the same percentile direct. The difference of two tails: vLLM's own p99 moves by milliseconds
  between runs, so it came out negative in some runs (-6.6 ms once, with a paired p99 of 5.6 ms);
- ``internal_*``: time spent inside the gateway's handler (its ``x-gateway-overhead-ms``
  header: before the upstream call plus after it), without the extra HTTP hop;
- ``control_*``: the same per-pair statistic for two *direct* calls of one round (an A/A
  control): how far vLLM alone moves between two calls a few milliseconds apart. The paired
  figure carries this noise on top of what the gateway adds;
- ``added_*``: per request, the client's latency through the gateway minus the time the
  gateway spent waiting for vLLM (its ``Server-Timing: upstream;dur=``): the client-to-gateway
  hop and the handler, without vLLM's own variation. It leaves out the difference between the
  gateway-to-vLLM hop and the client-to-vLLM hop a direct call makes (both local TCP).
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

import aiohttp
import httpx
import numpy as np

from batchpilot.schemas.bench import GatewayBenchConfig  # declared there (schema/gateway_bench)


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
    """``n`` rounds of three identical requests (direct, through the gateway, direct again), in
    an order that rotates round by round; the second direct call is the A/A control."""
    out: dict[str, list[float]] = {"direct": [], "gateway": [], "direct_again": [], "internal": [], "upstream": []}
    body = {"model": model, "prompt": b.prompt, "max_tokens": b.max_tokens}
    calls = (("direct", direct), ("gateway", gateway), ("direct_again", direct))
    # aiohttp, as in vLLM's own benchmark client: a lighter client than httpx, whose own time
    # (and its tail) is in every measured call, direct or not.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as c:
        t0 = time.monotonic()
        for i in range(n):
            delay = t0 + i / b.rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            for name, url in calls[i % 3:] + calls[:i % 3]:
                s = time.perf_counter()
                async with c.post(url + "/v1/completions", json=body) as r:
                    text = await r.text()
                out[name].append((time.perf_counter() - s) * 1e3)
                if r.status != 200:
                    raise RuntimeError(f"{name} request failed: {r.status} {text[:200]}")
                if name == "gateway":
                    out["internal"].append(float(r.headers["x-gateway-overhead-ms"]))
                    out["upstream"].append(server_timing(r.headers["server-timing"], "upstream"))
    return out


def server_timing(header: str, metric: str) -> float:
    """The ``dur`` of ``metric`` in a Server-Timing header (``upstream;dur=12.3, ...``)."""
    for entry in header.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        if name == metric:
            for param in params:
                key, _, value = param.partition("=")
                if key == "dur":
                    return float(value)
    raise ValueError(f"no {metric!r} duration in Server-Timing header {header!r}")


def bench_gateway(cfg: Any) -> dict[str, Any]:
    """Start vLLM + gateway, measure, stop both; returns the figures (milliseconds)."""
    from batchpilot.config import REPO_ROOT
    from batchpilot.platform.tiny_model import build_tiny_model
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
    control = np.asarray(res["direct_again"]) - d
    outside = g - np.asarray(res["upstream"])
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
        "control_p50_ms": p(control, 50), "control_p99_ms": p(control, 99),
        "control_p99_ci95_ms": list(_paired_p99_interval(control)),
        "added_p50_ms": p(outside, 50), "added_p99_ms": p(outside, 99),
        "added_p99_ci95_ms": list(_paired_p99_interval(outside)),
    }


def _paired_p99_interval(diff: np.ndarray, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of the p99 of the per-pair differences (pairs resampled)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(diff), size=(n_boot, len(diff)))
    lo, hi = np.percentile(np.percentile(diff[idx], 99, axis=1), [2.5, 97.5])
    return round(float(lo), 3), round(float(hi), 3)
