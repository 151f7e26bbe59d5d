"""``serve.forward_priority``: the gateway tells an engine on ``--scheduling-policy priority``
each request's class in the forwarded body's ``priority`` field (vLLM reads it there), keeps a
client's own value unless it is more important than the client may ask for, and starts its
managed engines with the flag. Checked on the pure parts, against a fake upstream that records
what it was sent, and (live) against a real ``vllm serve`` that orders by what it got."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from gateway_helpers import TRUSTED_KEY, FakeVLLM, running_gateway, wait_until

from batchpilot.schemas.serve import ServeConfig, managed_engine_args
from batchpilot.serving.errors import BadRequest, GatewayError
from batchpilot.serving.request_body import forwarded_priority, inspect_body, with_field, with_model

KEY_HEADER = "x-batchpilot-key"


# --- the pure parts ----------------------------------------------------------------------------

def test_fields_are_spliced_after_the_brace_one_after_another() -> None:
    parsed = inspect_body(b'  {"prompt": "caf\\u00e9", "echo": true}', False, 8, 100)
    raw = with_field(with_model(parsed, "tiny"), parsed.brace, "priority", 3)
    assert raw.startswith(b'  {"priority": 3, "model": "tiny", ')
    assert json.loads(raw) == {"prompt": "caf\u00e9", "echo": True, "model": "tiny", "priority": 3}


def test_the_forwarded_priority_is_the_class_unless_the_client_set_one_it_may_set() -> None:
    assert forwarded_priority({"prompt": "x"}, 1, False, KEY_HEADER) == 1
    assert forwarded_priority({"priority": 5}, 1, False, KEY_HEADER) is None  # less important: kept
    assert forwarded_priority({"priority": 1}, 1, False, KEY_HEADER) is None
    assert forwarded_priority({"priority": 0}, 1, True, KEY_HEADER) is None  # trusted: kept
    with pytest.raises(GatewayError, match=r"'priority': 0 is more important than the request's class \(1\); "
                       r"it needs a trusted key in header x-batchpilot-key") as e:
        forwarded_priority({"priority": 0}, 1, False, KEY_HEADER)
    assert e.value.status == 403
    # Read as vLLM's pydantic reads it (lax mode): "3" and 3.0 are 3; false is 0, which needs a key.
    assert forwarded_priority({"priority": "3"}, 1, False, KEY_HEADER) is None
    assert forwarded_priority({"priority": 3.0}, 1, False, KEY_HEADER) is None
    with pytest.raises(GatewayError, match="'priority': 0 is more important"):
        forwarded_priority({"priority": False}, 1, False, KEY_HEADER)
    for bad in ("high", 1.5, None, [1]):
        with pytest.raises(BadRequest, match="'priority' must be an integer"):
            forwarded_priority({"priority": bad}, 1, False, KEY_HEADER)


def _serve(**kw: Any) -> ServeConfig:
    return ServeConfig(managed=True, **kw)


def test_managed_engines_start_with_the_priority_policy_only_when_priorities_are_forwarded() -> None:
    assert managed_engine_args(_serve()) == ["--enforce-eager"]
    assert managed_engine_args(_serve(forward_priority=True)) == ["--enforce-eager", "--scheduling-policy", "priority"]
    said = ["--enforce-eager", "--scheduling-policy=priority"]
    assert managed_engine_args(_serve(forward_priority=True, extra_vllm_args=said)) == said
    with pytest.raises(ValueError, match=r"serve.forward_priority=true with --scheduling-policy fcfs in "
                       r"serve.extra_vllm_args: the managed engines would ignore the priorities"):
        _serve(forward_priority=True, extra_vllm_args=["--scheduling-policy", "fcfs"])
    with pytest.raises(ValueError, match=r"serve.forward_priority=true with --scheduling-policy fcfs"):
        _serve(forward_priority=True, extra_vllm_args=["--scheduling_policy=fcfs"])  # vLLM's other spelling
    # An engine on priority without the classes forwarded would see every request at 0.
    for said in (["--scheduling-policy", "priority"], ["--scheduling_policy", "priority"]):
        with pytest.raises(ValueError, match=r"--scheduling-policy priority but serve.forward_priority=false"):
            _serve(extra_vllm_args=said)


# --- the gateway in front of a recording upstream ----------------------------------------------

class _Recording(FakeVLLM):
    """A fake vLLM that keeps every completion body it is sent."""

    bodies: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        if self.path.startswith("/v1/completions"):
            type(self).bodies.append(body)
            self._answer(json.dumps({"id": "c", "object": "text_completion", "model": "fake", "choices": [
                {"index": 0, "text": "ok", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}).encode())
        else:
            self._answer(b'{"count": 1}')


def _send(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": "hello there", "max_tokens": 2, **body},
                      headers=headers, timeout=60)


@pytest.mark.slow  # two gateway starts (no vLLM)
def test_the_gateway_forwards_the_class_only_when_told_to() -> None:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Recording)
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    base = ("serve.managed=false", f"serve.upstreams=[http://127.0.0.1:{upstream.server_port}]",
            "serve.tokenizer=chars", "serve.startup_timeout_s=60")
    try:
        with running_gateway(*base, "serve.forward_priority=true", timeout_s=120) as gw:
            _Recording.bodies.clear()
            answers = [_send(gw.url, {}), _send(gw.url, {}, **{"x-priority": "3"}),
                       _send(gw.url, {"priority": 7}), _send(gw.url, {"priority": 0}, **{KEY_HEADER: TRUSTED_KEY}),
                       _send(gw.url, {"priority": 0})]
            assert [r.status_code for r in answers] == [200, 200, 200, 200, 403], [r.text for r in answers]
            assert answers[-1].json()["error"]["param"] == "priority"
            assert [b["priority"] for b in _Recording.bodies] == [1, 3, 7, 0]  # the 403 never left
            assert all(b["prompt"] == "hello there" and b["model"] == "fake" for b in _Recording.bodies)
        with running_gateway(*base, timeout_s=120) as gw:  # off (the default): the body as sent
            _Recording.bodies.clear()
            assert _send(gw.url, {}, **{"x-priority": "3"}).status_code == 200
            assert _send(gw.url, {"priority": 7}).status_code == 200
            # A client's own, more important priority still needs the key: an engine its
            # operator started on priority would obey it whether the gateway forwards or not.
            assert _send(gw.url, {"priority": -1000}).status_code == 403
            assert _send(gw.url, {"priority": 0}, **{KEY_HEADER: TRUSTED_KEY}).status_code == 200
            assert [b.get("priority") for b in _Recording.bodies] == [None, 7, 0]
    finally:
        upstream.shutdown()
        upstream.server_close()


# --- live: a real vllm serve orders by what the gateway forwarded ------------------------------

def _gauge(vllm_url: str, name: str) -> float:
    """A vLLM gauge from its /metrics (summed over its label sets)."""
    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"vllm:{name}{{"))


async def _ordered_through(gw_url: str, vllm_url: str, own: bool) -> tuple[list[str], bool]:
    """A long request runs alone (the engine runs one at a time); meanwhile a request of
    priority 5 and then an untagged one (class 1) wait in vLLM. ``own``: the clients also put
    those priorities in the body themselves. Returns the order the three finish in, and whether
    both waited in vLLM before the long one ended."""
    done: list[str] = []
    async with httpx.AsyncClient(timeout=300) as c:
        async def one(name: str, headers: dict[str, str], max_tokens: int) -> None:
            body = {"prompt": f"{name} says hello", "max_tokens": max_tokens, "ignore_eos": True}
            if own and name != "long":
                body["priority"] = int(headers.get("x-priority", 1))
            r = await c.post(f"{gw_url}/v1/completions", headers=headers, json=body)
            assert r.status_code == 200, r.text
            done.append(name)

        def until(cond: Any, what: str) -> Any:
            return asyncio.to_thread(wait_until, cond, 120, what)

        long = asyncio.create_task(one("long", {}, 1500))
        await until(lambda: _gauge(vllm_url, "num_requests_running") >= 1, "the long request running")
        low = asyncio.create_task(one("p5", {"x-priority": "5"}, 4))
        await until(lambda: _gauge(vllm_url, "num_requests_waiting") >= 1, "the priority-5 request waiting")
        high = asyncio.create_task(one("p1", {}, 4))
        await until(lambda: _gauge(vllm_url, "num_requests_waiting") >= 2, "both requests waiting")
        queued = "long" not in done
        await asyncio.gather(long, low, high)
    return done, queued


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("forward", [True, False])
def test_a_priority_engine_serves_the_forwarded_class_first(request: pytest.FixtureRequest, forward: bool) -> None:
    """The managed engine runs ``--max-num-active-seqs 1``; the gateway's static cap (8) lets
    all three requests through at once, so the order they are served in is vLLM's own.
    ``forward``: the gateway adds ``--scheduling-policy priority`` and the classes, and the
    untagged request (class 1), sent after the priority-5 one, finishes first. Off (the
    control): the engine is fcfs and the priority-5 one finishes first, although the clients
    put both priorities in the bodies themselves: vLLM 0.32 on fcfs answers them (200) and
    ignores the field (its API docs say a non-zero priority is an error there)."""
    with running_gateway(*(["serve.forward_priority=true"] if forward else []), "serve.control.mode=static",
                         "serve.extra_vllm_args=[--enforce-eager,--max-num-active-seqs,1]",
                         "control.initial_batch_cap=8", request=request) as gw:
        up = next(iter(gw.status()["upstreams"].values()))
        cmdline = open(f"/proc/{up['pid']}/cmdline", "rb").read().split(b"\0")
        assert (b"--scheduling-policy" in cmdline) == forward
        if forward:
            assert cmdline[cmdline.index(b"--scheduling-policy") + 1] == b"priority"
        t0 = time.monotonic()
        order, queued = asyncio.run(_ordered_through(gw.url, up["url"], own=not forward))
        print(f"finished in order {order} ({time.monotonic() - t0:.1f} s)")
        assert queued, "the long request ended before both others were queued: nothing was ordered"
        assert order == (["long", "p1", "p5"] if forward else ["long", "p5", "p1"]), order
        # A client's own, less important priority is taken by vLLM as it is.
        r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 9}, timeout=120)
        assert r.status_code == 200, r.text
