"""The lookahead bound (policies/lookahead.py): its copies of the simulator replay the episode
exactly, with the base option alone it is PID with shortest-first order, fed the recent past it
is a forecast (not the bound), and what it cannot do (a live engine, an option outside the
policy's actions) is one clear error."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from batchpilot.config import load_config
from batchpilot.core.knobs import Proposal
from batchpilot.core.telemetry import SLO
from batchpilot.envs.serving_env import ServingEnv
from batchpilot.evaluation.matrix import evaluate, run_episode
from batchpilot.evaluation.plan import EvaluationError, compose_eval
from batchpilot.policies.lookahead import ARRIVALS, LookaheadController, LookaheadError, Option, recent_arrivals
from batchpilot.schemas import LookaheadConfig

#: A bursty minute on Llama-3-8B/H100, loaded enough that the options differ (clients capped at
#: 1024 tokens: with the workload's own caps, some sending none, admission's memory check holds
#: the batch below where the cap matters).
BURSTY = ["workload=bursty", "workload.duration_s=40", "env.episode_s=40", "env.drain_on_truncate=true",
          "workload.max_tokens.caps=[1024]", "workload.max_tokens.weights=null"]


def test_a_copy_of_the_episode_finishes_what_the_episode_then_finishes() -> None:
    """With the horizon one epoch long, the value the lookahead computed for its choice on a
    copy is the number of requests the real episode then finished within the SLO in that epoch:
    the copies are faithful, so the bound is about these very episodes."""
    env = ServingEnv(load_config(BURSTY))
    ctl = LookaheadController(LookaheadConfig(epoch_s=5.0, horizon_s=5.0), env.slo, 256)
    run_episode(env, ctl, seed=0)
    done = env.finished_requests
    assert len(ctl.log) >= 6 and len({e["chosen"] for e in ctl.log}) > 1, ctl.log  # it does choose
    for now, nxt in zip(ctl.log, ctl.log[1:]):
        got = sum(1 for r in done[now["finished"]:nxt["finished"]] if env.slo.met(r.ttft, r.tpot, r.e2el))
        assert now["values"][now["chosen"]] == got, (now, got)
        assert now["values"][now["chosen"]] == max(now["values"])
    env.close()


def test_with_only_its_base_option_it_is_pid_with_shortest_first(tmp_path: Path) -> None:
    overrides = ["policies=[pid_sf,lookahead]", "seeds=[0,1]", "logger=none", "plots=false",
                 "workload=bursty", "workload.duration_s=30", f"out_dir={tmp_path}",
                 "+policy_overrides.lookahead.options=[\"1\"]"]
    cfg, _ = compose_eval(overrides)
    rows = evaluate(cfg, overrides)
    by = {(r["policy"], r["seed"]): r for r in rows}
    for seed in (0, 1):
        for key in ("request_goodput", "slo_attainment", "completed", "rejected", "p99_ttft_ms"):
            assert by[("lookahead", seed)][key] == by[("pid_sf", seed)][key], (seed, key)


@pytest.mark.parametrize("text,match", [
    ("2.0", r"option '2.0': the cap part must be max or one of the residual policy's factors \[0.7, 0.85, 1.0"),
    ("1/lifo", r"option '1/lifo': order 'lifo' is not one of \['fifo', 'shortest_first', 'weighted'\]"),
    ("big", r"option 'big': the cap part must be max"),
])
def test_an_option_outside_the_policy_actions_is_refused(text: str, match: str) -> None:
    with pytest.raises(LookaheadError, match=match):
        Option.parse(text, "shortest_first")
    assert str(Option.parse("max/fifo", "weighted")) == "max/fifo"
    assert Option.parse("0.85", "weighted") == Option(0.85, "weighted")


@pytest.mark.live  # the plan reads the live engine's limits (vLLM)
def test_the_evaluation_refuses_it_on_the_live_engine_before_starting_one(tmp_path: Path) -> None:
    overrides = ["policies=[lookahead]", "engine=vllm", "model=tiny_llama", "hardware=cpu_tiny", "seeds=[0]",
                 "logger=none", f"out_dir={tmp_path}"]
    cfg, _ = compose_eval(overrides)
    with pytest.raises(EvaluationError, match=r"policy 'lookahead' tries its options on copies of the simulator: "
                                              r"run it with engine=sim"):
        evaluate(cfg, overrides)


def test_it_refuses_an_engine_it_cannot_copy_and_a_short_horizon() -> None:
    ctl = LookaheadController(LookaheadConfig(), SLO(), 256)
    live = types.SimpleNamespace(cfg=load_config(["engine=vllm"]), interval_s=1.0)
    with pytest.raises(LookaheadError, match=r"needs the simulator \(engine=sim\).*'vllm' engine cannot be copied"):
        ctl.bind(live)
    with pytest.raises(LookaheadError, match=r"0 < epoch_s <= horizon_s, got 10.0 and 5.0"):
        LookaheadController(LookaheadConfig(epoch_s=10.0, horizon_s=5.0), SLO(), 256)
    with pytest.raises(LookaheadError, match="call bind"):
        ctl.decide(None, None)  # type: ignore[arg-type]


def test_recent_arrivals_repeat_the_last_horizon_under_their_own_ids() -> None:
    env = ServingEnv(load_config(BURSTY))
    env.reset(seed=0)
    for _ in range(20):
        env.step_proposal(Proposal(batch_cap=env.knobs.batch_cap, bucketing=env.knobs.bucketing, kv_dtype=None))
    stream, now = env.stream, env.engine.now
    seen = stream.arrival_s[: len(stream) - stream.num_remaining]
    last = seen[seen >= now - 8.0]
    forecast = recent_arrivals(stream, now, 8.0)
    assert len(forecast) == last.size > 0
    assert forecast.arrival_s.tolist() == (last + 8.0).tolist()
    assert forecast.prompt_len.tolist() == stream.prompt_len[seen.size - last.size: seen.size].tolist()
    assert forecast.next_arrival_time >= now and forecast.pop_until(now + 8.0)[0].request_id == "f0"
    env.close()


def test_fed_recent_arrivals_it_is_a_forecast_not_the_bound() -> None:
    """The copies see the recent past instead of the future: the choices (and so the episode)
    differ from the bound's, and it still chooses."""
    runs = {}
    for arrivals in ARRIVALS:
        env = ServingEnv(load_config(BURSTY))
        ctl = LookaheadController(LookaheadConfig(epoch_s=5.0, horizon_s=10.0, arrivals=arrivals), env.slo, 256)
        run_episode(env, ctl, seed=0)
        runs[arrivals] = [e["values"] for e in ctl.log]
        assert len({e["chosen"] for e in ctl.log}) > 1, (arrivals, ctl.log)
        env.close()
    assert runs["future"] != runs["recent"]
    with pytest.raises(LookaheadError, match=r"arrivals must be one of \['future', 'recent'\], got 'past'"):
        LookaheadController(LookaheadConfig(arrivals="past"), SLO(), 256)
