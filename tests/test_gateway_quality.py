"""The quality guard's fallback, end to end: a managed upstream runs an 8-bit KV cache, the
guard replays sampled requests on a separate 16-bit reference ``vllm serve``, the output-diff
rate crosses the threshold, and the gateway restarts its upstream in 16-bit, serving throughout.

Nothing is injected: on the random tiny model fp8 KV really changes greedy outputs (measured
here: 14 of 20 16-token replays differed from the same model with 16-bit KV), far above the 5 %
threshold."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import httpx
import pytest
from gateway_helpers import RunningGateway, running_gateway, wait_ready

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(900)]


@contextlib.contextmanager
def reference_server() -> Iterator[str]:
    """A 16-bit ``vllm serve`` of the gateway's own tiny Llama (served as ``tiny-llama`` too)."""
    from batchpilot.platform.tiny_model import build_tiny_model
    from batchpilot.serving.upstream import ManagedVLLM, free_port

    model = build_tiny_model()
    ref = ManagedVLLM(str(model), free_port(), served_model_name="tiny-llama", max_model_len=2048,
                      max_num_seqs=16, kv_dtype="auto", kv_cache_space_gib=1, extra_args=["--enforce-eager"])
    try:
        ref.start()
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{ref.url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline or (ref.proc is not None and ref.proc.poll() is not None):
                raise RuntimeError("the reference vLLM server did not start")
            time.sleep(0.5)
        yield ref.url
    finally:
        ref.stop()


def _lane(gw: RunningGateway) -> dict:
    return next(iter(gw.status()["control"]["lanes"].values()))


def test_output_diffs_above_threshold_fall_back_to_16bit() -> None:
    from batchpilot.platform.vllm_cpu import cpu_kv8_unavailable_reason as kv8_unavailable_reason

    if kv8_unavailable_reason() is not None:
        pytest.skip(kv8_unavailable_reason())
    with reference_server() as ref_url, running_gateway(
        "serve.kv_dtype=fp8", "control.interval_s=0.5",
        f"serve.quality_guard.reference_url={ref_url}", "serve.quality_guard.sample_share=1.0",
        "serve.quality_guard.min_samples=5", "serve.quality_guard.threshold=0.05",
    ) as gw:
        assert _lane(gw)["knobs_in_force"]["kv_dtype"] == "fp8"
        assert gw.metric("batchpilot:knob_kv_8bit") == 1
        assert gw.metric("batchpilot:output_diff_rate") == 0.0
        for i in range(8):  # every request sampled; 5 compared samples are enough to judge
            r = httpx.post(f"{gw.url}/v1/completions",
                           json={"prompt": f"sampled request number {i}", "max_tokens": 4}, timeout=60)
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 420  # replays, then a restart (up to startup_timeout_s, 300 s)
        while time.monotonic() < deadline:
            lane = _lane(gw)
            if lane["knobs_in_force"]["kv_dtype"] == "auto" and lane["healthy"] and not lane["restarting"]:
                break
            time.sleep(1)
        assert lane["knobs_in_force"]["kv_dtype"] == "auto", lane
        wait_ready(gw.url, 60)
        compared = sum(gw.metric("batchpilot:quality_samples_total", outcome=k) for k in ("differs", "same"))
        assert compared >= 5 and gw.metric("batchpilot:quality_samples_total", outcome="differs") >= 1
        assert gw.metric("batchpilot:output_diff_rate") > 0.05
        assert gw.metric("batchpilot:upstream_restarts_total", cause="quality") == 1
        assert gw.metric("batchpilot:knob_kv_8bit") == 0
        events = " ".join(gw.status()["control"]["events"])
        assert "quality guard: output-diff rate" in events, events
        # 16-bit now: served, and no longer sampled.
        for _ in range(3):
            r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "16-bit again", "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, r.text
        time.sleep(1.0)
        sampled = sum(gw.metric("batchpilot:quality_samples_total", outcome=k) for k in ("differs", "same", "error"))
        assert sampled <= 8, sampled
