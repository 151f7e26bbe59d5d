"""Clients a new user brings, through the gateway and straight to the same ``vllm serve`` (tiny
model), compared: the gateway is transparent for valid requests (the same answers, token for
token, at temperature 0 or a fixed seed), each of many concurrent clients gets its own answer,
and a client that leaves mid-stream stops the upstream's generation (not only the gateway's
slot). One gateway for the module (~1 min of start-up)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import httpx
import pytest
from gateway_helpers import RunningGateway, running_gateway, wait_until

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def gw(request: pytest.FixtureRequest) -> RunningGateway:
    with running_gateway(request=request) as g:
        yield g


def _direct(gw: RunningGateway) -> str:
    return next(iter(gw.status()["upstreams"].values()))["url"]


def _streamed(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream as its client reads it: each choice's text (a chat's content) joined, its finish
    reason, the usage, the model. Not its chunks: vLLM's server sends the tokens generated since
    its last send together, so one answer comes in other chunks from run to run (a CI run here:
    ' ke' then '\x19...' through the gateway, ' ke\x19' directly)."""
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for c in chunks:
        for ch in c["choices"]:
            i = ch["index"]
            piece = ch["text"] if "text" in ch else (ch.get("delta") or {}).get("content")
            text[i] = text.get(i, "") + (piece or "")
            if ch.get("finish_reason"):
                finish[i] = ch["finish_reason"]
        usage = c.get("usage") or usage
    return {"text": text, "finish_reason": finish, "usage": usage, "model": sorted({c["model"] for c in chunks})}


def _same(d: Any) -> Any:
    """An answer without what differs between two calls by design (ids, timestamps)."""
    if isinstance(d, dict):
        return {k: _same(v) for k, v in d.items() if k not in ("id", "created", "system_fingerprint")}
    if isinstance(d, list):
        return [_same(x) for x in d]
    return d


def test_the_openai_sdk_gets_what_vllm_answers(gw: RunningGateway) -> None:
    """Completions and chat, streamed and not, n > 1, logprobs, stop strings, max_tokens left
    out, usage in streams: the same objects (a stream: the same text, finish reason and usage)
    through the gateway as from vLLM directly."""
    import openai

    vllm = _direct(gw)
    model = httpx.get(f"{vllm}/v1/models", timeout=30).json()["data"][0]["id"]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    prompt = "The quick brown fox"
    cases: list[tuple[str, Callable[[openai.OpenAI], Any]]] = [
        ("completion", lambda c: c.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)),
        ("no max_tokens", lambda c: c.completions.create(model=model, prompt=prompt, temperature=0)),
        ("n=3", lambda c: c.completions.create(model=model, prompt=prompt, max_tokens=5, n=3, seed=7)),
        ("logprobs", lambda c: c.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                                    logprobs=3)),
        ("stop", lambda c: c.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0,
                                                stop=["e", "a"])),
        ("stream + usage", lambda c: list(c.completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}))),
        ("token ids", lambda c: c.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=3, temperature=0)),
        ("chat", lambda c: c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)),
        ("chat no max_tokens", lambda c: c.chat.completions.create(model=model, messages=msgs, temperature=0)),
        ("chat n=2 logprobs", lambda c: c.chat.completions.create(model=model, messages=msgs, max_tokens=4, n=2,
                                                                  seed=1, logprobs=True, top_logprobs=2)),
        ("chat stream + usage", lambda c: list(c.chat.completions.create(
            model=model, messages=msgs, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}))),
    ]
    direct_c, gw_c = (openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) for base in (vllm, gw.url))

    def answer(c: openai.OpenAI, call: Callable[[openai.OpenAI], Any]) -> Any:
        r = call(c)
        return _streamed([x.model_dump() for x in r]) if isinstance(r, list) else _same(r.model_dump())

    for name, call in cases:
        # vLLM first (its prefix cache then holds the prompt), then the gateway, then vLLM again:
        # the gateway's answer is compared with vLLM's under the same cache state (a prompt
        # served from the cache is computed in other shapes, and this random model's near-even
        # logits can tip at the last bit).
        answer(direct_c, call)
        through = answer(gw_c, call)
        assert through == answer(direct_c, call), name
    # An error vLLM raises comes back as the SDK's same exception and message.
    errors = []
    for c in (direct_c, gw_c):
        with pytest.raises(openai.NotFoundError) as exc:
            c.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=3)
        errors.append(str(exc.value))
    assert errors[0] == errors[1]


def test_many_concurrent_clients_each_get_their_own_answer(gw: RunningGateway) -> None:
    """80 clients at once with distinct prompts, half of them streaming: each answer is the one
    vLLM gives that prompt directly (temperature 0), none swapped or mixed."""
    vllm = _direct(gw)
    prompts = [f"Request {i}: tell me about {w}" for i, w in
               enumerate(["cats", "dogs", "rain", "sun", "the sea", "stars", "code", "tea"] * 10)]

    async def one(c: httpx.AsyncClient, base: str, prompt: str, stream: bool) -> str:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        if not stream:
            r = await c.post(f"{base}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = []
        async with c.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += [ch["text"] for ch in json.loads(line[6:])["choices"]]
        return "".join(text)

    async def run() -> tuple[list[str], list[str]]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(limits=limits, timeout=300) as c:
            await asyncio.gather(*(one(c, vllm, p, False) for p in prompts))  # the same cache state after
            through = await asyncio.gather(*(one(c, gw.url, p, i % 2 == 0) for i, p in enumerate(prompts)))
            direct = await asyncio.gather(*(one(c, vllm, p, False) for p in prompts))
        return direct, through

    direct, through = asyncio.run(run())
    assert len(set(direct)) > len(prompts) // 2  # the prompts really have different answers
    # None gets another client's answer. A batch of another shape may still tip one of this
    # random model's near-even logits (not seen here, but CPUs differ), so an answer that is no
    # one's is tolerated for a few; another prompt's answer never.
    swapped = [i for i, t in enumerate(through) if t != direct[i] and t in set(direct) - {direct[i]}]
    assert swapped == [], [(i, prompts[i], through[i]) for i in swapped]
    differ = [i for i, (d, t) in enumerate(zip(direct, through)) if d != t]
    assert len(differ) <= len(prompts) // 20, [(i, direct[i], through[i]) for i in differ]


def _vllm_sum(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_a_client_leaving_mid_stream_stops_the_generation_upstream(gw: RunningGateway) -> None:
    """A stream of 32 sequences of 2,000 tokens whose client closes its socket after 5 events:
    vLLM stops generating (its running count falls to 0 far short of 64,000 tokens, which take
    it over a minute here), the gateway frees the slot, and the next request is served. So many
    tokens because vLLM's engine runs ahead of its API server: on a loaded machine it generated
    a 2,000-token stream to its end in the 4 s its API server took to act on the abort, called
    directly too."""
    vllm = _direct(gw)
    n, max_tokens = 32, 2000
    port = int(gw.url.rsplit(":", 1)[1])

    async def leave_after(events: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"prompt": "go", "n": n, "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while got.count(b"data: ") < events:
            chunk = await reader.read(65536)
            assert chunk, got
            got += chunk
        writer.close()

    before = _vllm_sum(vllm, "vllm:generation_tokens_total")
    asyncio.run(leave_after(5))
    wait_until(lambda: _vllm_sum(vllm, "vllm:num_requests_running") == 0, 120, "vLLM's running count back to 0")
    generated = _vllm_sum(vllm, "vllm:generation_tokens_total") - before
    assert generated < n * max_tokens / 2, f"vLLM generated {generated:.0f} tokens: the stream was not aborted upstream"
    wait_until(lambda: gw.metric("batchpilot:in_flight") == 0, 60, "the gateway's slot freed")
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "still there?", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_invalid_requests_are_refused_in_the_openai_error_form(gw: RunningGateway) -> None:
    """What vLLM refuses the gateway refuses with the same status, in the OpenAI error form
    ({"error": {"message", "type", "param", "code"}}); a body not sent as JSON gets vLLM's own
    message, without taking a slot."""
    vllm = _direct(gw)
    as_json = {"content-type": "application/json"}
    cases: list[tuple[bytes, dict[str, str]]] = [
        (b'{"prompt": "hi"', as_json),  # malformed JSON
        (b"", as_json),  # empty body
        (b'{"prompt": "h\xff\xfei"}', as_json),  # not UTF-8 (vLLM's answer is not in the OpenAI form)
        (b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}),
        (json.dumps({"prompt": "hi", "max_tokens": 3}).encode(), {"content-type": "text/plain"}),
        (json.dumps({"prompt": "hi", "max_tokens": 3}).encode(), {}),
        (json.dumps({"prompt": "hi", "max_tokens": -5}).encode(), as_json),
        (json.dumps({"prompt": "hi", "model": "gpt-4"}).encode(), as_json),
        (json.dumps({"prompt": "hello " * 3000}).encode(), as_json),  # longer than max_model_len
        (json.dumps({"prompt": [1, 2, 10**9], "max_tokens": 2}).encode(), as_json),  # not a token id
    ]
    for raw, headers in cases:
        direct = httpx.post(f"{vllm}/v1/completions", content=raw, headers=headers, timeout=60)
        through = httpx.post(f"{gw.url}/v1/completions", content=raw, headers=headers, timeout=60)
        assert through.status_code == direct.status_code and 400 <= direct.status_code < 500, (raw[:60], through.text)
        err = through.json()["error"]
        assert {"message", "type", "param", "code"} <= err.keys() and err["code"] == through.status_code, raw[:60]
        if headers.get("content-type") != "application/json":
            assert err["message"] == "Unsupported Media Type: Only 'application/json' is allowed"
            assert "Unsupported Media Type" in direct.json()["error"]["message"]
    # vLLM reads true as 1 (pydantic's lax mode): so does the gateway.
    body = {"prompt": "hi", "max_tokens": True}
    assert [httpx.post(f"{u}/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"]
            for u in (vllm, gw.url)] == [1, 1]
    wait_until(lambda: gw.metric("batchpilot:in_flight") == 0, 60, "no slot held")
