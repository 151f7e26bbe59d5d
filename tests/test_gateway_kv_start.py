"""The policy's start KV dtype (``kv_start``) in front of a real ``vllm serve``: what the
evaluation scores is what the gateway serves. The evaluation starts a PPO policy at 8-bit KV
where the memory ceiling binds at 16 bits; the gateway restarts its managed engine at 8 bits
before it serves, or says why it cannot (no AVX-512 / AMX on this CPU).

The tiny model's 16-bit KV (512 bytes a token) for 256 requests of 1,024 tokens fills ~13 % of
weights plus its 1 GiB pool, half that at 8 bits: a 10 % ceiling binds at 16 bits only."""

from __future__ import annotations

import httpx
import pytest
from gateway_helpers import running_gateway

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_policy_gateway_starts_its_engine_at_8bit_where_memory_binds() -> None:
    from batchpilot.platform.vllm_cpu import cpu_kv8_unavailable_reason

    why = cpu_kv8_unavailable_reason()
    with running_gateway("serve.control.mode=policy", "shield.memory_ceiling=0.1") as gw:
        status = gw.status()["control"]
        chosen = status["kv_start"]["vllm0"]
        lane = status["lanes"]["vllm0"]
        metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
        restarts = [ln for ln in metrics.splitlines()
                    if ln.startswith("batchpilot:upstream_restarts_total{") and 'cause="kv_start"' in ln]
        if why is None:
            assert chosen == "fp8", status["kv_start"]
            assert lane["knobs_in_force"]["kv_dtype"] == "fp8"
            assert restarts and float(restarts[0].rsplit(" ", 1)[1]) == 1.0, restarts
            assert any("kv_start: the memory ceiling holds" in e and "restarting vllm0 at fp8" in e
                       for e in status["events"])
        else:  # this CPU cannot run fp8 KV: 16-bit, with the reason
            assert chosen.startswith("16-bit: ") and "AVX-512" in chosen, chosen
            assert lane["knobs_in_force"]["kv_dtype"] == "auto" and not restarts
        # It serves, at whichever dtype it chose.
        r = httpx.post(f"{gw.url}/v1/completions", timeout=60,
                       json={"model": "tiny-llama", "prompt": "hello there", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
