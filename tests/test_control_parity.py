"""What trains is what serves: one recorded request trace (arrivals, first tokens, finishes and
the engine's counters per interval) driven through the gateway's control loop (its ``tick``,
with a fake upstream answering ``/metrics``; no vLLM) and through the decision path the
environment and the evaluation take (``Telemetry.snapshot`` -> ``control_step``, with the
controller built as the evaluation builds it) gives the same snapshots, observations, decisions
and knobs, interval by interval, for PID, static and the shipped policy.

It caught two drifts: the gateway normalised the policy's observation with its own
``max_model_len`` (2,048) where the policy was trained at 8,192, and its fallback PID was built
from dataclass defaults that differed from ``conf/policy/pid.yaml``."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

import numpy as np
import pytest

from batchpilot.config import load_config
from batchpilot.core.admission import depths_padded
from batchpilot.core.control import control_step
from batchpilot.core.knobs import Knobs
from batchpilot.core.shield import Shield, ShieldConfig
from batchpilot.core.telemetry import SLO, Telemetry
from batchpilot.policies.controllers import build_controller
from batchpilot.policies.ppo_controller import PPOController
from batchpilot.serving.control_loop import ControlLoop, upstream_engine_model
from batchpilot.serving.gateway import AppSettings, Gateway
from batchpilot.serving.upstream import EngineInfo

INTERVAL_S = 1.0
MAX_NUM_SEQS = 256


def recorded_trace(seed: int = 7, intervals: int = 40) -> list[dict]:
    """Per interval: request events and the engine's counters, load rising then falling (so
    PID and the policy both move the cap). Seeded: the same trace every run."""
    rng = np.random.default_rng(seed)
    out, preempted = [], 0
    for i in range(intervals):
        t0 = 1000.0 + i * INTERVAL_S
        load = 0.3 + 1.4 * np.sin(np.pi * i / intervals)
        n = int(rng.poisson(20 * load))
        arrivals = sorted((t0 + float(rng.uniform(0, INTERVAL_S)), int(rng.integers(16, 1800))) for _ in range(n))
        ttft = (0.05 + 1.5 * max(load - 1.0, 0.0)) * rng.lognormal(0.0, 0.4, n)
        tpot = (0.02 + 0.06 * load) * rng.lognormal(0.0, 0.2, n)
        ids = [f"r{i}-{k}" for k in range(n)]
        # Streaming requests report their first token as it comes; every third one does not
        # (non-streaming: its TTFT is recorded when it finishes).
        first = sorted((t + min(f, 0.9), rid, float(f)) for rid, (t, _), f in zip(ids, arrivals, ttft)
                       if int(rid.rsplit("-", 1)[1]) % 3)
        done = [(t0 + float(rng.uniform(0, INTERVAL_S)), rid, float(f), float(p), float(f + 64 * p))
                for rid, f, p in zip(ids, ttft, tpot)]
        preempted += int(rng.poisson(3 * max(load - 1.2, 0.0)))
        out.append({
            "end": t0 + INTERVAL_S, "arrivals": arrivals, "first_tokens": first, "finished": sorted(done),
            "output_tokens": 64 * n, "num_running": min(MAX_NUM_SEQS, int(40 * load)),
            "num_waiting": int(max(load - 1.0, 0.0) * 30), "kv_usage": min(0.95, 0.35 * load),
            "preemptions_total": preempted,
            "generation_total": 64 * n + (out[-1]["generation_total"] if out else 0),
        })
    return out


def _metrics_text(iv: dict) -> str:
    """What vLLM's /metrics would say at the end of the interval."""
    return (f'vllm:num_requests_running{{engine="0",model_name="m"}} {iv["num_running"]}\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {iv["num_waiting"]}\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {iv["kv_usage"]}\n'
            f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {iv["preemptions_total"]}\n'
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {iv["generation_total"]}\n')


def _feed(tel: Telemetry, iv: dict) -> None:
    for t, n in iv["arrivals"]:
        tel.on_arrival(t, n)
    for t, rid, f in iv["first_tokens"]:
        tel.on_first_token(rid, t, f)
    tel.on_output_tokens(iv["output_tokens"])
    for t, rid, f, p, e in iv["finished"]:
        tel.on_finished(rid, t, f, p, e)


def _gateway(mode: str, policy: dict) -> tuple[Gateway, ControlLoop]:
    cfg = load_config(["serve.upstreams=[http://127.0.0.1:9]", f"serve.control.mode={mode}",
                       f"serve.max_num_seqs={MAX_NUM_SEQS}", "serve.control.initial_batch_cap=64"],
                      config_name="serve_app")
    settings = AppSettings.from_cfg(cfg)
    settings.policy = policy
    gw = Gateway(settings)
    lane = gw.lanes[0]
    lane.upstream.info = EngineInfo(model="m", max_model_len=2048, num_kv_blocks=4096, block_size=16, kv_dtype="auto")
    lane.upstream.healthy = True
    return gw, ControlLoop(gw)


@pytest.mark.parametrize("mode", ["pid", "static", "policy"])
def test_gateway_tick_decides_as_the_env_path_does(mode: str) -> None:
    policy_node = {**load_config(["policy=pid"]).policy} if mode != "static" else {"kind": "pid"}
    gw, loop = _gateway(mode, dict(policy_node))
    lane = gw.lanes[0]
    trace = recorded_trace()

    # The reference: the decision path of ServingEnv.step_proposal / evaluation.run_episode,
    # from the same configs (SLO, shield, memory model, knobs) the gateway was given.
    s = gw.settings
    slo = SLO(ttft_ms=s.slo.ttft_ms, tpot_ms=s.slo.tpot_ms, e2el_ms=s.slo.e2el_ms)
    mem, caps = upstream_engine_model(lane, MAX_NUM_SEQS, managed=False)
    start = trace[0]["end"] - INTERVAL_S
    shield = Shield(ShieldConfig.from_cfg(s.shield), mem, caps, slo, now=start)
    tel = Telemetry(slo, num_buckets=3, window_s=gw.cfg.control.window_s, max_num_seqs=MAX_NUM_SEQS,
                    max_model_len=gw.cfg.max_model_len)
    tel.reset(start)
    lane.telemetry.reset(start)
    loop.lane_ctl[lane.index].shield = Shield(ShieldConfig.from_cfg(s.shield), mem, caps, slo, now=start)
    knobs = lane.knobs
    if mode == "policy":
        controller = PPOController.from_dir(None, max_num_seqs=MAX_NUM_SEQS,
                                             kv_runnable={d: caps.can_run(d) for d in caps.kv_dtypes})
        assert loop.policies.acting() == "policy"
    elif mode == "static":
        controller = build_controller({"kind": "static", "batch_cap": knobs.batch_cap, "bucketing": knobs.bucketing,
                                       "kv_dtype": knobs.kv_dtype}, MAX_NUM_SEQS)
    else:
        slo_ms = {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms, "e2el": slo.e2el_ms}
        controller = build_controller(policy_node, MAX_NUM_SEQS, slo_ms)
        controller.reset(knobs)  # the gateway's PID starts from the serve's initial cap too
        loop.lane_ctl[lane.index].pid.reset(knobs)

    texts = iter([_metrics_text(iv) for iv in trace])

    async def fake_metrics(timeout_s: float = 2.0) -> str:
        return next(texts)

    lane.upstream.metrics_text = fake_metrics  # type: ignore[method-assign]
    moved = 0
    last_pre = 0
    for iv in trace:
        _feed(tel, iv)
        _feed(lane.telemetry, iv)
        tel.on_preemptions(iv["preemptions_total"] - last_pre)
        last_pre = iv["preemptions_total"]
        snap = tel.snapshot(iv["end"], queue_depth=depths_padded(lane.admission.queue_depths),
                            num_running=iv["num_running"], num_waiting_engine=iv["num_waiting"],
                            kv_cache_usage=iv["kv_usage"], knobs=knobs)
        step = control_step(controller, snap, knobs, shield, iv["end"])
        if step.decision.interventions:  # as ServingEnv.step_proposal counts them
            tel.on_shield_intervention(len(step.decision.interventions))
        asyncio.run(loop.tick(lane, now=iv["end"]))
        got = loop.lane_ctl[lane.index].last_decision
        assert got["ttft_p99_ms"] == snap.ttft_p99_ms and got["goodput"] == snap.request_goodput
        assert got["acting"] == (mode if mode != "policy" else "policy")
        assert got["proposal"] == str(step.proposal), (iv["end"], got["proposal"], step.proposal)
        assert got["interventions"] == step.decision.interventions
        assert got["breaker_level"] == step.decision.breaker_level
        assert lane.knobs == step.decision.knobs, (iv["end"], lane.knobs, step.decision.knobs)
        if mode == "policy":
            np.testing.assert_array_equal(loop.policies.policy.observation(snap), controller.observation(snap))
        moved += step.decision.knobs != knobs
        knobs = step.decision.knobs
    if mode != "static":
        assert moved >= 3, "the trace should make the controller move the knobs"
    assert asdict(knobs) == asdict(lane.knobs)


def test_the_gateway_policy_sees_the_training_scales() -> None:
    """The shipped policy's observation in the gateway uses the manifest's max_model_len
    (8,192 at training), not the serve config's 2,048."""
    gw, loop = _gateway("policy", {"kind": "pid"})
    pol = loop.policies.policy
    assert pol is not None and pol.max_model_len == 8192 and gw.cfg.max_model_len == 2048


def test_one_call_per_finished_request_records_its_first_token_once() -> None:
    """``on_finished`` records the TTFT of a request whose first token was not reported (the
    gateway's non-streaming requests; production TTFT read 0 when only the env reported first
    tokens), and does not count a reported one twice."""
    tel = Telemetry(SLO(ttft_ms=1000.0, tpot_ms=100.0), window_s=10.0)
    tel.reset(0.0)
    tel.on_first_token("streamed", 1.0, 0.2)
    tel.on_finished("streamed", 2.0, 0.2, 0.01, 1.2)
    tel.on_finished("not-streamed", 2.5, 0.4, 0.01, 1.4)
    tel.on_first_token("abandoned", 2.6, 0.3)
    tel.on_abandoned("abandoned")
    snap = tel.snapshot(3.0, queue_depth=(0, 0, 0), num_running=0, num_waiting_engine=0, kv_cache_usage=0.0,
                        knobs=Knobs(8))
    assert sorted(x / 1e3 for x in tel._ttft_ms) == [0.2, 0.3, 0.4]  # each request's TTFT once
    assert snap.ttft_p50_ms == pytest.approx(300.0) and snap.request_throughput == pytest.approx(2 / 3.0)
    assert not tel._first_seen


def test_the_gateway_counts_output_tokens_as_the_engine_generates_them() -> None:
    """The gateway learns a request's tokens when it ends; the engine's counter (and the
    simulator) count them as they come out, which is what the shield's present time between
    tokens needs. With the counter the interval's rate is its delta; without it, the own count."""
    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    lane.telemetry.reset(0.0)
    texts = iter(['vllm:num_requests_running{engine="0"} 20\nvllm:generation_tokens_total{engine="0"} 1000\n',
                  'vllm:num_requests_running{engine="0"} 20\nvllm:generation_tokens_total{engine="0"} 3000\n',
                  'vllm:num_requests_running{engine="0"} 20\n'])

    async def fake_metrics(timeout_s: float = 2.0) -> str:
        return next(texts)

    lane.upstream.metrics_text = fake_metrics  # type: ignore[method-assign]
    rates = []
    for t in (1.0, 2.0, 3.0):
        lane.telemetry.on_output_tokens(50)  # one request of 50 tokens ended in each interval
        asyncio.run(loop.tick(lane, now=t))
        rates.append(loop.lane_ctl[lane.index].last_snapshot.output_throughput)
    assert rates == [50.0, 2000.0, 50.0]  # no earlier counter, the counter's delta, no counter
