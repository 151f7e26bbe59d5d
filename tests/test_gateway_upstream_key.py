"""The gateway in front of a real ``vllm serve`` that requires an API key (``VLLM_API_KEY``,
vLLM's own variable: the managed engine is started with it): every upstream call carries the
key, clients never see or supply it, and it appears in no log or status."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import httpx
import pytest
from gateway_helpers import RunningGateway, running_gateway

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "upstream-key-0d9c2b7e5a"


@pytest.fixture(scope="module")
def gw(request: pytest.FixtureRequest) -> RunningGateway:
    with running_gateway("control.interval_s=0.5", env={"VLLM_API_KEY": KEY}, request=request) as g:
        yield g


def _vllm_url(gw: RunningGateway) -> str:
    return next(iter(gw.status()["upstreams"].values()))["url"]


def test_the_upstream_requires_the_key(gw: RunningGateway) -> None:
    """Without this, the rest proves nothing: the managed vLLM refuses calls without the key."""
    url = _vllm_url(gw)
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200


def test_requests_through_the_gateway_carry_the_key_not_the_clients(gw: RunningGateway) -> None:
    """Completions, streamed or not, and /v1/models succeed through the gateway, also when the
    client sends an ``Authorization`` of its own (which is not forwarded)."""
    for headers in ({}, {"authorization": "Bearer some-client-key"}):
        r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                       headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", headers=headers, timeout=120,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                "stream": True}) as s:
            assert s.status_code == 200
            text = s.read().decode()
        assert text.rstrip().endswith("data: [DONE]"), text[-200:]
        r = httpx.get(f"{gw.url}/v1/models", headers=headers, timeout=30)
        assert r.status_code == 200 and r.json()["data"], r.text


def test_the_quality_guards_reference_gets_the_key_too(gw: RunningGateway) -> None:
    """The 16-bit reference is a vLLM server deployed like the upstreams: with the gateway's
    key its greedy replay is answered (without it, vLLM's 401 would be counted as an error
    on every sample and the guard would never compare anything)."""
    import asyncio

    from batchpilot.schemas.serve import QualityGuardConfig
    from batchpilot.serving.prom import GatewayMetrics
    from batchpilot.serving.quality_guard import QualityGuard

    url = _vllm_url(gw)
    body = {"model": "tiny-llama", "prompt": "compare me", "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}

    async def agreement(api_key: str | None) -> float:
        guard = QualityGuard(QualityGuardConfig(reference_url=url), GatewayMetrics(), api_key=api_key)
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as c:
            try:
                return await guard.compare(c, guard._ref, "/v1/completions", body)
            finally:
                await guard.aclose()

    assert asyncio.run(agreement(KEY)) == 1.0
    with pytest.raises(httpx.HTTPStatusError, match="401"):
        asyncio.run(agreement(None))


def test_the_key_is_in_no_log_and_no_status(gw: RunningGateway) -> None:
    """Not in the admin status, the gateway's metrics, its log, the managed engine's log, or
    the engine's command line (it gets the key in its environment)."""
    status = gw.status()
    assert KEY not in json.dumps(status)
    assert KEY not in httpx.get(f"{gw.url}/metrics", timeout=30).text
    logs = [Path(gw.log_path), *Path(status["engine_log_dir"]).glob("*.log")]
    assert len(logs) >= 2
    for path in logs:
        assert KEY not in path.read_text(errors="replace"), path
    for pid in gw.upstream_pids():
        for child in [pid, *_descendants(pid)]:
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                assert KEY.encode() not in Path(f"/proc/{child}/cmdline").read_bytes()


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                kids = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
                for k in kids:
                    out += [int(k), *_descendants(int(k))]
    return out
