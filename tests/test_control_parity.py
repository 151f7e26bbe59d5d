"""What trains is what serves: a ``ServingEnv`` (simulated tiny deployment, bursty load that
makes the shield and the breaker act) is run as the evaluation runs it (controller -> the env's
own ``step_proposal``: shield stage -> ``actuate``) while a recorder notes what its telemetry saw
each interval (request events, the engine's counters, admission's queues). Those intervals are
then replayed into the gateway's control loop (its ``tick``: the events into the lane's
telemetry, the counters as a fake upstream's ``/metrics``, the queues as the lane admission's;
no vLLM), and the gateway must see the same snapshots (and, for the policy, observations), take
the same proposals and let the same knobs and interventions through, interval by interval, for
PID, static and the shipped policy. ``ServingEnv`` is the reference itself, so if its decision
path drifts from the gateway's this test fails.

It caught two drifts (against an earlier hand-written copy of the env path): the gateway
normalised the policy's observation with its own ``max_model_len`` (2,048) where the policy was
trained at 8,192, and its fallback PID was built from dataclass defaults that differed from
``conf/policy/pid.yaml``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pytest

from batchpilot.config import load_config
from batchpilot.core.admission import Admission
from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.core.shield import Shield, ShieldConfig
from batchpilot.core.telemetry import SLO, Snapshot, Telemetry
from batchpilot.envs.serving_env import ServingEnv
from batchpilot.policies.controllers import build_controller
from batchpilot.policies.ppo_controller import PPOController
from batchpilot.serving.control_loop import ControlLoop
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


def _gateway(mode: str, policy: dict, overrides: Sequence[str] = ()) -> tuple[Gateway, ControlLoop]:
    cfg = load_config(["serve.upstreams=[http://127.0.0.1:9]", f"serve.control.mode={mode}",
                       f"serve.max_num_seqs={MAX_NUM_SEQS}", "control.initial_batch_cap=64", *overrides],
                      config_name="serve_app")
    settings = AppSettings.from_cfg(cfg)
    settings.policy = policy
    gw = Gateway(settings)
    lane = gw.lanes[0]
    lane.upstream.info = EngineInfo(model="m", max_model_len=2048, num_kv_blocks=4096, block_size=16, kv_dtype="auto")
    lane.upstream.healthy = True
    return gw, ControlLoop(gw)


#: The simulated deployment and load the env runs: the tiny model on its CPU profile, bursts
#: well past its capacity (the cap moves, the step limit and the breaker's shedding act).
ENV_OVERRIDES = ["model=tiny_llama", "hardware=cpu_tiny", "engine=sim", "workload=bursty",
                 "workload.duration_s=60", "env.episode_s=60", "workload.on_rate=150", "workload.off_rate=10",
                 "workload.on_s=6", "workload.off_s=10", "workload.lengths.prompt_mean=800",
                 "workload.lengths.output_mean=150"]
STEPS = 30
#: Telemetry events the replay gives the gateway's telemetry as its own request handling would.
#: Not replayed: preemptions (the gateway counts them from vLLM's counter), shield interventions
#: (each side's control step counts its own), KV switches (each side's plant).
REPLAYED = ("on_arrival", "on_first_token", "on_output_tokens", "on_finished", "on_rejected", "on_abandoned")


@dataclass
class Interval:
    """What the env's telemetry saw up to one snapshot: the events, and what was read beside
    them (the engine's counters, admission's queues) as ``Telemetry.snapshot`` was given them."""

    time: float
    reads: dict[str, Any]
    events: list[tuple[str, tuple, dict]] = field(default_factory=list)
    preemptions: int = 0
    output_tokens: int = 0


class TelemetryRecorder:
    """Stands in front of the env's ``Telemetry``: every call goes through unchanged, and each
    ``snapshot`` closes one ``Interval`` of what came before it."""

    def __init__(self, telemetry: Telemetry, first: Interval) -> None:
        self._tel = telemetry
        self.intervals = [first]
        self._open = Interval(0.0, {})

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._tel, name)
        if not name.startswith("on_"):
            return attr

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if name in REPLAYED:
                self._open.events.append((name, args, kwargs))
            if name == "on_preemptions":
                self._open.preemptions += int(args[0])
            if name == "on_output_tokens":
                self._open.output_tokens += int(args[0])
            return attr(*args, **kwargs)

        return recorded

    def snapshot(self, now: float, **reads: Any) -> Snapshot:
        self._open.time, self._open.reads = now, reads
        self.intervals.append(self._open)
        self._open = Interval(0.0, {})
        return self._tel.snapshot(now, **reads)


def _env_controller(mode: str, env: ServingEnv, loop: ControlLoop) -> Any:
    """The controller as the evaluation builds it, from the same configs the gateway was given."""
    slo, knobs = env.slo, env.knobs
    if mode == "policy":  # the shipped policy, for the engine the gateway's policy was loaded for
        pm = loop.policies
        return PPOController.from_dir(None, max_num_seqs=pm.max_num_seqs, kv_runnable=pm.kv_runnable,
                                      kv_restart_s=pm.kv_restart_s, slo=pm.slo)
    if mode == "static":
        return build_controller({"kind": "static", "batch_cap": knobs.batch_cap, "bucketing": knobs.bucketing,
                                 "kv_dtype": knobs.kv_dtype}, env._max_num_seqs)
    return build_controller(dict(env.cfg.policy), env._max_num_seqs, slo)


def _run_env(mode: str, env: ServingEnv, controller: Any) -> tuple[list[Interval], list[tuple[Snapshot, Proposal, dict]]]:
    """``STEPS`` intervals of the env as ``evaluation.matrix.run_episode`` runs them; per step the
    snapshot the controller saw, its proposal and the env's info (knobs after, interventions)."""
    env.reset(seed=3)
    s0 = env.snapshot
    first = Interval(s0.time, {"queue_depth": s0.queue_depth, "num_running": s0.num_running,
                               "num_waiting_engine": s0.num_waiting_engine, "kv_cache_usage": s0.kv_cache_usage,
                               "num_late_waiting": s0.num_late_waiting})
    rec = env.telemetry = TelemetryRecorder(env.telemetry, first)  # type: ignore[assignment]
    controller.reset(env.knobs)
    steps = []
    for _ in range(STEPS):
        snap = env.snapshot
        proposal = controller.decide(snap, env.knobs)
        _, _, terminated, truncated, info = env.step_proposal(proposal)
        assert not (terminated or truncated), info.get("error")
        steps.append((snap, proposal, info))
    return rec.intervals, steps


def _metrics_of(totals: dict[str, float], iv: Interval) -> str:
    """vLLM's /metrics at the end of ``iv``: the engine's gauges and its running counters."""
    r = iv.reads
    totals["preempt"] += iv.preemptions
    totals["gen"] += iv.output_tokens
    return (f'vllm:num_requests_running{{engine="0",model_name="m"}} {r["num_running"]}\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {r["num_waiting_engine"]}\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {float(r["kv_cache_usage"])!r}\n'
            f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {totals["preempt"]}\n'
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {totals["gen"]}\n')


def _replay_admission(lane: Any) -> dict[str, Any]:
    """The lane's admission reports the env's queues (the replay sets ``reads`` per interval)."""
    reads: dict[str, Any] = {}

    class Replayed(type(lane.admission)):  # type: ignore[misc]
        queue_depths = property(lambda self: tuple(reads["queue_depth"]))
        num_late_waiting = property(lambda self: int(reads.get("num_late_waiting", 0)))

    assert isinstance(lane.admission, Admission)
    lane.admission.__class__ = Replayed
    return reads


@pytest.mark.parametrize("mode", ["pid", "static", "policy"])
def test_gateway_tick_decides_as_the_serving_env_does(mode: str) -> None:
    cfg = load_config([*ENV_OVERRIDES, "policy=pid"])
    env = ServingEnv(cfg=cfg)
    policy_node = dict(cfg.policy) if mode != "static" else {"kind": "pid"}
    gw, loop = _gateway(mode, policy_node, [
        f"serve.max_num_seqs={env._max_num_seqs}", f"serve.max_model_len={env._caps.max_model_len}",
        # One control group for both: the env's interval, window, start knobs and scales.
        *(f"control.{k}={v}" for k, v in cfg.control.items()),
        # The served breaker shrinks by 20 % (conf/serve_app.yaml), training's by 30 %; a KV
        # switch costs the deployment's restart time (the env's; the gateway's once measured).
        f"shield.breaker_shrink={env.shield_cfg.breaker_shrink}", f"shield.dtype_restart_s={env.shield_cfg.dtype_restart_s}"])
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    assert gw.settings.slo == env.slo and ctl.shield.cfg == env.shield_cfg, "the gateway runs other configs"
    assert gw.settings.control == env.control, "the gateway's loop runs another interval, window or start"
    controller = _env_controller(mode, env, loop)
    if mode == "policy":
        assert loop.policies.acting() == "policy"
    intervals, steps = _run_env(mode, env, controller)

    # The upstream is the env's engine: its memory model and limits (as it would report them).
    start = intervals[0].time
    ctl.shield = Shield(ShieldConfig.from_cfg(gw.settings.shield), env.engine.memory_model(), env._caps,
                        gw.settings.slo, now=start)
    assert lane.knobs == steps[0][0].knobs
    ctl.pid.reset(lane.knobs)  # as the env's controller was, at the episode's start
    lane.telemetry.reset(start)
    reads = _replay_admission(lane)
    totals = {"preempt": 0, "gen": 0}
    texts: list[str] = []

    async def fake_metrics(timeout_s: float = 2.0) -> str:
        return texts.pop()

    lane.upstream.metrics_text = fake_metrics  # type: ignore[method-assign]
    moved = intervened = 0
    for k, (snap, proposal, info) in enumerate(steps):
        iv = intervals[k]
        for name, args, kwargs in iv.events:
            getattr(lane.telemetry, name)(*args, **kwargs)
        reads.clear()
        reads.update(iv.reads)
        texts.append(_metrics_of(totals, iv))
        before = lane.knobs
        asyncio.run(loop.tick(lane, now=iv.time))
        got = ctl.last_decision
        assert ctl.last_snapshot == snap, (k, ctl.last_snapshot, snap)
        if mode == "policy":
            np.testing.assert_array_equal(loop.policies.policy.observation(ctl.last_snapshot),
                                          controller.observation(snap))
        assert got["acting"] == mode
        assert got["proposal"] == str(proposal), (k, got["proposal"], proposal)
        assert got["interventions"] == info["shield"], (k, got["interventions"], info["shield"])
        assert lane.knobs.as_dict() == info["knobs"], (k, lane.knobs, info["knobs"])
        moved += lane.knobs != before
        intervened += bool(info["shield"])
    assert intervened >= 3, "the load should make the shield act"
    if mode != "static":
        assert moved >= 3, "the load should make the controller move the knobs"


def test_a_plant_without_a_shield_is_built_so_from_configuration() -> None:
    """``env.shielded: false`` (what the evaluation's ``episode_config`` sets for a policy run as
    shipped, vllm_default): the env is built with no shield, so a proposal passes as it is; the
    evaluation's episode loop refuses an env built for the other case instead of swapping its
    shield."""
    from batchpilot.core.control import PassThroughShield
    from batchpilot.evaluation.matrix import run_episode

    bare = ServingEnv(cfg=load_config([*ENV_OVERRIDES, "env.shielded=false"]))
    shielded = ServingEnv(cfg=load_config(ENV_OVERRIDES))
    for env in (bare, shielded):
        env.reset(seed=0)
    assert isinstance(bare.shield, PassThroughShield) and bare.fail_safe is None
    assert isinstance(shielded.shield, Shield) and shielded.fail_safe is not None
    jump = Proposal(batch_cap=200)  # +212 %: far past the 30 % step
    _, _, _, _, info = bare.step_proposal(jump)
    assert bare.knobs.batch_cap == 200 and info["shield"] == {}
    _, _, _, _, info = shielded.step_proposal(jump)
    assert shielded.knobs.batch_cap < 200 and "step_limit" in info["shield"]
    pid = build_controller({"kind": "pid"}, bare._max_num_seqs)
    with pytest.raises(ValueError, match="env.shielded"):
        run_episode(bare, pid, 0)  # asked for a shielded episode on an env built without one
    with pytest.raises(ValueError, match="env.shielded"):
        run_episode(shielded, pid, 0, shielded=False)


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
