"""No oracle in front of the engine (issue 53, part 3): admission, the shield's memory check and
the controllers see what a gateway sees (prompt length, ``max_tokens``, priority, sequences),
never a request's true output length, which only the engine (the model reaching its end of
sequence) and the finished-request metrics may read.

The simulator's requests here hide ``output_len`` from the control side: reading it from a frame
of a control module raises, in unit tests on ``Admission`` and in a whole ``ServingEnv`` episode
with the per-request memory check on."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

import batchpilot.envs.workloads as workloads
from batchpilot.config import load_config
from batchpilot.core.admission import Admission, AdmissionConfig
from batchpilot.core.engine import Request
from batchpilot.core.knobs import Knobs
from batchpilot.envs.serving_env import ServingEnv
from batchpilot.envs.workloads import RequestStream, build_workload, client_max_tokens
from batchpilot.workload_config import MaxTokensConfig, WorkloadConfigError

_CORE = Path(__file__).resolve().parents[1] / "batchpilot" / "core"
#: Modules on the control side: nothing in them may read a request's output length.
CONTROL_FILES = frozenset(str(_CORE / f"{m}.py") for m in (
    "admission", "shield", "telemetry", "control", "controller", "pid", "residual", "plant", "knobs", "actions",
    "output_estimate",
)) | {str(Path(__file__).resolve().parents[1] / "policies" / "controllers.py")}


class OracleRead(AssertionError):
    """The control side read a request's true output length (not an AttributeError, so no
    ``getattr(req, "output_len", default)`` swallows it)."""


def _control_frame() -> str | None:
    """The control module on the current call stack, if any (the whole stack: a helper called
    from admission counts as admission)."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename in CONTROL_FILES:
            return f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return None


class HiddenOutputRequest(Request):
    """A simulator request whose ``output_len`` raises when anything on the control side reads
    it; the engine (envs/sim_engine.py) and the metrics still read it."""

    __slots__ = ()

    @property  # type: ignore[override]
    def output_len(self) -> int:
        where = _control_frame()
        if where is not None:
            raise OracleRead(f"the control side read request {self.request_id}'s output_len at {where}")
        return Request.output_len.__get__(self)  # the slot

    @output_len.setter
    def output_len(self, value: int) -> None:
        Request.output_len.__set__(self, value)


def _hidden(rid: str, prompt_len: int, output_len: int, max_tokens: int | None, t: float = 0.0) -> HiddenOutputRequest:
    return HiddenOutputRequest(rid, t, prompt_len, output_len, max_tokens=max_tokens)


def _shield():
    """test_shield's engine: 5,120 KV blocks of 16 tokens (81,920 tokens) under the ceiling."""
    from test_shield import caps, memory

    from batchpilot.core.shield import Shield, ShieldConfig
    from batchpilot.core.telemetry import SLO

    return Shield(ShieldConfig(overhead_frac=0.0), memory(), caps(), SLO(ttft_ms=1000.0, tpot_ms=100.0))


def test_a_hidden_output_raises_on_the_control_side_only() -> None:
    """The guard itself: the engine side reads the value, a read from admission's module raises."""
    r = _hidden("x", 100, 7, 64)
    assert r.output_len == 7
    code = compile("r.output_len", str(_CORE / "admission.py"), "eval")
    with pytest.raises(OracleRead, match="output_len"):
        eval(code, {"r": r})
    with pytest.raises(OracleRead):  # not swallowed as a missing attribute
        eval(compile("getattr(r, 'output_len', 0)", str(_CORE / "admission.py"), "eval"), {"r": r})


@pytest.mark.parametrize("fast", [False, True])
def test_memory_admission_charges_max_tokens_never_the_output(fast: bool) -> None:
    """Two requests the same but for the split between the client's cap and the true output:
    admission charges ``max_tokens`` (5,000 tokens x 16 fill the ceiling, not 5,000 tokens of
    output x 16 when the cap is small), through submit, the fast path, admit and re-booking."""
    sh = _shield()
    a = Admission(AdmissionConfig(max_num_long=1000), Knobs(batch_cap=100), memory=sh)
    per = sh.request_blocks(4000, 1000)  # 313 blocks: 16 fit under the 5,120
    got = []
    for i in range(30):  # the true output is tiny, the cap is what a gateway sees
        r = _hidden(f"big{i}", 4000, 3, 1000, float(i))
        if fast:
            rej, took = a.submit_or_admit(r, float(i))
            assert rej is None
            got += [r] if took else []
        else:
            assert a.submit(r, float(i)) is None
    got += a.admit(30.0)
    assert len(got) == 16 and a.kv_blocks_in_flight == 16 * per
    a.memory = sh  # booked again through the check (a new model): still max_tokens
    assert a.kv_blocks_in_flight == 16 * per
    assert a.predicted_fraction(_hidden("probe", 4000, 1, 1000)) > sh.cfg.memory_ceiling

    b = Admission(AdmissionConfig(max_num_long=1000), Knobs(batch_cap=100), memory=sh)
    for i in range(30):  # a long true output behind a small cap cannot happen (the cap stops it)
        assert b.submit(_hidden(f"small{i}", 4000, 16, 16, float(i)), float(i)) is None
    assert len(b.admit(30.0)) == 20  # 251 blocks each at 4,016 tokens: 20 fit
    a.check_counts()
    b.check_counts()


def test_a_request_too_large_by_its_cap_is_refused_whatever_it_would_generate() -> None:
    """The refusal a gateway gives ("lower max_tokens") comes from the cap: a 10-token answer
    behind a cap that cannot fit is refused, a request without a cap is charged its prompt."""
    a = Admission(AdmissionConfig(max_num_long=1000), Knobs(batch_cap=100), memory=_shield())
    rej = a.submit(_hidden("capped", 60_000, 10, 30_000), 0.0)
    assert rej is not None and rej.reason == "too_large_for_memory"
    assert a.submit(_hidden("nocap", 60_000, 30_000, None), 0.0) is None
    assert [r.request_id for r in a.admit(0.0)] == ["nocap"]


@pytest.mark.parametrize("charge", ["max_tokens", "estimate"])
def test_a_whole_episode_with_memory_admission_never_reads_the_output(
        monkeypatch: pytest.MonkeyPatch, charge: str) -> None:
    """A real ServingEnv episode on the simulator, memory admission on (the default), long
    prompts on DeepSeek-V3/H200 so the memory check binds, a controller acting: every request
    the stream hands out hides its output from the control side; the engine still generates
    each one's true length, and the finished requests report it. With ``charge: estimate`` the
    output estimate learns only what finished requests generated, when they finished, and no
    request is ever charged above its cap."""
    monkeypatch.setattr(workloads, "Request", HiddenOutputRequest)
    env = ServingEnv(cfg=load_config([
        "env.episode_s=20", "workload=poisson", "workload.duration_s=20", "model=deepseek_v3", "hardware=h200",
        "workload.rate_scale=3", "workload.lengths.prompt_mean=6000", "control.initial_batch_cap=256",
        "env.drain_on_truncate=true", f"env.admission.charge={charge}", "env.admission.charge_min_samples=8",
    ]))
    assert env.cfg.env.memory_admission
    env.reset(seed=0)
    adm = env.admission
    assert adm.memory is not None
    est = adm.output_estimate
    assert (est is None) == (charge == "max_tokens")
    peak_blocks, rng, sh = 0, np.random.default_rng(0), env.shield
    estimated = False
    while True:
        _, _, term, trunc, info = env.step(env.action_space.sample() if rng.random() < 0.3 else np.array([2, 1, 0]))
        caps = sum(sh.request_blocks(r.prompt_len, r.max_tokens, r.num_seqs) for *_, r in adm._in_flight.values())
        if est is None:  # what admission holds in flight is the caps' charge, request by request
            assert adm.kv_blocks_in_flight == caps
        else:  # never above the caps; only finished requests' lengths, one per finished request
            assert adm.kv_blocks_in_flight <= caps
            done = [f.output_len for f in env.finished_requests]
            assert est.num_observed == len(done) and list(est._recent) == done[-est.window:]
            estimated |= est.value is not None and adm.kv_blocks_in_flight < caps
        peak_blocks = max(peak_blocks, adm.kv_blocks_in_flight)
        if term or trunc:
            break
    assert estimated or est is None  # the estimate did charge less than the caps at some point
    stream = env.stream
    assert stream.max_tokens is not None
    m = info["episode_metrics"]
    assert m["completed"] > 0 and m["completed"] + m["rejected"] == len(stream)
    assert peak_blocks > 0 and np.any(stream.max_tokens > stream.output_len)  # caps above the outputs
    done = {f.request_id: f for f in env.finished_requests}
    ids = [int(rid[1:]) for rid in done]  # ``r<i>``: the stream's index
    assert all(done[f"r{i}"].output_len == stream.output_len[i] for i in ids)  # true lengths generated
    assert all(stream.output_len[i] <= stream.max_tokens[i] for i in ids)


def test_client_max_tokens_draws_caps_resolves_none_and_cuts_outputs() -> None:
    """A cap is cut to the room the model leaves; none sent = that room (vLLM's chat default);
    an output above its request's cap is cut to it (vLLM stops at max_tokens) and counted."""
    p = np.array([100, 1900, 500, 10])
    o = np.array([50, 100, 600, 1])
    mt, o2, cut = client_max_tokens(MaxTokensConfig(caps=[None]), np.random.default_rng(0), p, o, 2048)
    assert mt.tolist() == [1948, 148, 1548, 2038] and o2.tolist() == o.tolist() and cut == 0
    mt, o2, cut = client_max_tokens(MaxTokensConfig(caps=[512]), np.random.default_rng(0), p, o, 2048)
    assert mt.tolist() == [512, 148, 512, 512] and o2.tolist() == [50, 100, 512, 1] and cut == 1
    n = 20_000
    mt, _, _ = client_max_tokens(MaxTokensConfig(caps=[None, 256, 1024], weights=[2, 1, 1]), np.random.default_rng(1),
                                 np.full(n, 48), np.full(n, 8), 2048)
    shares = [float(np.mean(mt == v)) for v in (2000, 256, 1024)]
    assert shares == pytest.approx([0.5, 0.25, 0.25], abs=0.02)


def test_declared_caps_leave_the_rest_of_the_stream_as_drawn() -> None:
    """Drawing caps does not move the arrivals, lengths or priorities a seed draws (the caps
    come from a generator of their own): only outputs above a cap change."""
    base = {"kind": "poisson", "duration_s": 60.0, "rate": 20.0, "priorities": [0.7, 0.3],
            "lengths": {"kind": "lognormal", "prompt_mean": 500, "prompt_sigma": 0.8,
                        "output_mean": 300, "output_sigma": 1.0}}
    plain = build_workload(base, np.random.default_rng(5), 8192)
    mixed = build_workload({**base, "max_tokens": {"caps": [None, 128, 4096], "weights": [1, 1, 1]}},
                           np.random.default_rng(5), 8192)
    for key in ("arrival_s", "prompt_len", "priority"):
        assert np.array_equal(getattr(plain, key), getattr(mixed, key)), key
    assert np.array_equal(np.minimum(plain.output_len, mixed.max_tokens), mixed.output_len)
    assert np.array_equal(plain.max_tokens, 8192 - plain.prompt_len)  # the default: none sent
    cut = int((plain.output_len > mixed.max_tokens).sum())
    assert cut > 0 and mixed.info["max_tokens"]["clipped"] == cut
    reqs = mixed.pop_until(np.inf)
    assert [r.max_tokens for r in reqs] == mixed.max_tokens.tolist()


@pytest.mark.parametrize("name", ["poisson", "bursty", "code_completion", "long_context", "randomized",
                                  "azure_code", "azure_conv", "mooncake_conv"])
def test_every_shipped_workload_declares_caps_its_outputs_keep(name: str) -> None:
    """Each conf/workload file says what its clients send; every request carries a cap within
    the model's room and at least its output. The traces' caps cut no recorded output."""
    wl = load_config([f"workload={name}"]).workload
    s = build_workload(wl, np.random.default_rng(0), 8192)
    assert "max_tokens" in s.info and s.max_tokens is not None
    assert np.all(s.output_len <= s.max_tokens) and np.all(s.prompt_len + s.max_tokens <= 8192)
    if wl.kind == "trace":
        assert s.info["max_tokens"]["clipped"] == 0


def test_bad_caps_and_streams_are_refused_naming_the_key() -> None:
    base = {"kind": "poisson", "duration_s": 5.0, "rate": 1.0, "lengths": {"kind": "fixed", "prompt": 8, "output": 8}}
    with pytest.raises(WorkloadConfigError, match=r"workload\.max_tokens\.caps\[1\]"):
        build_workload({**base, "max_tokens": {"caps": [None, 0]}}, np.random.default_rng(0), 2048)
    with pytest.raises(WorkloadConfigError, match=r"workload\.max_tokens\.weights"):
        build_workload({**base, "max_tokens": {"caps": [64, 128], "weights": [1.0]}}, np.random.default_rng(0), 2048)
    with pytest.raises(WorkloadConfigError, match=r"workload\.max_tokens\.caps"):
        build_workload({**base, "max_tokens": {"caps": []}}, np.random.default_rng(0), 2048)
    with pytest.raises(ValueError, match="exceeds its max_tokens"):
        RequestStream(np.array([0.0]), np.array([8]), np.array([100]), duration_s=1.0, max_tokens=np.array([64]))


@pytest.mark.anyio
@pytest.mark.parametrize("body,chat,cap", [
    ({"prompt": "hello", "max_tokens": 40}, False, 40),
    ({"prompt": "hello"}, False, 16),  # vLLM's /v1/completions default
    ({"messages": [{"role": "user", "content": "hello"}]}, True, None),  # chat, none sent: the model's limit
])
async def test_the_gateway_and_the_simulator_hand_admission_the_same_cap(body: dict, chat: bool, cap: int | None) -> None:
    """Both paths feed admission one notion: the gateway's request carries the client's
    ``max_tokens`` as vLLM resolves it, and a workload declaring that cap (null: none sent)
    gives the simulator's request the same number for the same prompt."""
    from test_gateway_units import _FakePool, _proxy_setup

    from batchpilot.serving.errors import ClientGone
    from batchpilot.serving.gateway import _proxy

    pool = _FakePool()  # the upstream never answers: the request stays in flight
    gw, lane, request, left = _proxy_setup(body, pool)  # every prompt counts 3 tokens, max_model_len 2048
    handler = asyncio.create_task(_proxy(request, "/v1/chat/completions" if chat else "/v1/completions", chat))
    await asyncio.wait_for(pool.sent.wait(), 5)
    (req,) = [entry[3] for entry in lane.admission._in_flight.values()]
    mt, _, _ = client_max_tokens(MaxTokensConfig(caps=[cap]), np.random.default_rng(0), np.array([3]), np.array([1]), 2048)
    assert req.max_tokens == int(mt[0]) == (2048 - 3 if cap is None else cap)
    left.set()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(handler, 5)
    await lane.upstream.client.aclose()


def _gateway_with_admission(admission: dict):
    """A gateway built from a serve config whose ``admission`` node is ``admission``, one fake
    upstream (max_model_len 2,048, every prompt 3 tokens), and a Starlette request factory."""
    import json
    from types import SimpleNamespace

    from starlette.requests import Request as StarletteRequest

    from batchpilot.schemas.serve import ServeConfig
    from batchpilot.serving.gateway import AppSettings, Gateway
    from batchpilot.serving.upstream import EngineInfo

    gw = Gateway(AppSettings(serve=ServeConfig.from_cfg({"upstreams": ["http://127.0.0.1:9"], "admission": admission})))
    lane = gw.lanes[0]
    lane.upstream.healthy = True
    lane.upstream.info = EngineInfo(model="m", max_model_len=2048)

    async def tokenize(body) -> int:
        return 3

    lane.upstream.tokenize = tokenize

    def request(body: dict) -> StarletteRequest:
        raw = json.dumps(body).encode()
        sent, never = [False], asyncio.Event()

        async def receive() -> dict:
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await never.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
                 "app": SimpleNamespace(state=SimpleNamespace(gateway=gw)), "client": ("127.0.0.1", 1)}
        return StarletteRequest(scope, receive)

    return gw, lane, request


def _answer(n: int, how: str):
    """The upstream's answer to a request that generated ``n`` tokens: a JSON body with
    ``usage``, a stream ending with a usage chunk, or a stream of one chunk per token and none."""
    from test_gateway_units import _FakeStreamAnswer

    if how == "json":
        return _FakeStreamAnswer([b'{"choices": [{"text": "x"}], "usage": {"prompt_tokens": 3, "completion_tokens": %d}}'
                                  % n])
    tokens = [b'data: {"choices": [{"text": "x"}]}\n\n'] * n + [b'data: {"choices": [{"text": "", "finish_reason": "stop"}]}\n\n']
    usage = [b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": %d}}\n\n' % n]
    return _FakeStreamAnswer(tokens + (usage if how == "usage" else []) + [b"data: [DONE]\n\n"])


@pytest.mark.anyio
async def test_the_gateway_and_the_simulator_feed_the_output_estimate_the_same_way() -> None:
    """The env feeds admission's output estimate each finished request's length; the gateway
    each finished answer's (``usage.completion_tokens``, or its streamed tokens). Replaying an
    episode's finished lengths as upstream answers through the gateway (a serve config with the
    same ``admission.charge_*``) leaves the gateway's estimate where the episode left the env's:
    the same window, the same quantile, the same charge. A request cut short teaches nothing."""
    charge = {"charge": "estimate", "charge_quantile": 0.9, "charge_window": 24, "charge_min_samples": 4}
    env = ServingEnv(cfg=load_config([
        "env.episode_s=10", "workload=poisson", "workload.duration_s=10", "workload.rate_scale=0.3",
        "workload.max_tokens.caps=[1024]", "workload.max_tokens.weights=[1]", "env.drain_on_truncate=true",
        *(f"env.admission.{k}={v}" for k, v in charge.items()),
    ]))
    env.reset(seed=1)
    while not any(env.step(np.array([2, 1, 0]))[2:4]):
        pass
    done = [f.output_len for f in env.finished_requests]
    sim = env.admission.output_estimate
    assert len(done) > 30 and sim is not None and sim.value is not None

    from test_gateway_units import _FakePool

    from batchpilot.serving.gateway import _proxy

    gw, lane, request = _gateway_with_admission(charge)
    est = lane.admission.output_estimate
    assert est is not None and (est.quantile, est.window, est.min_samples) == (sim.quantile, sim.window, sim.min_samples)
    lane.upstream.pool = pool = _FakePool()
    pool.answer.set()
    replay = done[-(sim.window + 6):]
    for i, n in enumerate(replay):
        how = ("json", "usage", "chunks")[i % 3]
        pool.response = _answer(n, how)
        resp = await _proxy(request({"prompt": "hi", "max_tokens": 1024, "stream": how != "json"}),
                            "/v1/completions", False)
        if how != "json":
            async for _ in resp.body_iterator:
                pass
        assert est.num_observed == i + 1 and lane.admission.num_in_flight == 0
    assert list(est._recent) == list(sim._recent) and est.value == sim.value
    assert lane.admission.charged_output(Request("a", 0.0, 3, 1, max_tokens=1024)) == \
        env.admission.charged_output(Request("b", 0.0, 3, 1, max_tokens=1024)) == min(1024, sim.value)

    pool.response = failed = _answer(5, "json")  # an upstream error answer: cut short
    failed.status = 500
    await _proxy(request({"prompt": "hi", "max_tokens": 16}), "/v1/completions", False)
    assert est.num_observed == len(replay) and lane.admission.num_in_flight == 0
    await lane.upstream.client.aclose()
