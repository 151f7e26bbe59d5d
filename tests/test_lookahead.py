"""The lookahead bound (policies/lookahead.py): its copies of the simulator replay the episode
exactly, with the base option alone it is PID with shortest-first order, fed the recent past it
is a forecast (not the bound), its admission options change what the environment does for their
epoch only, and what it cannot do (a live engine, an option outside the policy's actions) is
one clear error."""

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
from batchpilot.policies.controllers import build_controller
from batchpilot.policies.lookahead import (
    ARRIVALS,
    LookaheadController,
    LookaheadError,
    Option,
    apply_admission,
    recent_arrivals,
)
from batchpilot.schemas.policy import LookaheadConfig

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


@pytest.mark.parametrize("text,want,back", [
    ("1", Option(1.0, "shortest_first"), "1/shortest_first"),
    ("max/keep", Option(None, "shortest_first", (("ttft_deadline", False),)), "max/shortest_first/keep"),
    ("1.3/fifo/refuse/budget=2", Option(1.3, "fifo", (("deadline_max_priority_kept", -1), ("prefill_backlog_budgets",
                                                                                            2.0),
                                                      ("ttft_deadline", True))), "1.3/fifo/refuse/budget=2"),
    ("0.7/budget=none/refuse=0", Option(0.7, "shortest_first", (
        ("deadline_max_priority_kept", 0), ("prefill_backlog_budgets", None), ("ttft_deadline", True))),
     "0.7/shortest_first/refuse=0/budget=none"),
    ("1/refuse=-1/weighted", Option(1.0, "weighted", (("deadline_max_priority_kept", -1), ("ttft_deadline", True))),
     "1/weighted/refuse"),
    ("1/early=1.50/keep", Option(1.0, "shortest_first", (("deadline_max_priority_kept", -1), ("early_refusal", True),
                                                         ("early_refusal_slack", 1.5), ("ttft_deadline", False))),
     "1/shortest_first/keep/early=1.5"),
    ("max/early=off", Option(None, "shortest_first", (("early_refusal", False),)), "max/shortest_first/early=off"),
])
def test_an_option_names_its_admission_after_its_cap(text: str, want: Option, back: str) -> None:
    got = Option.parse(text, "shortest_first")
    assert got == want and str(got) == back
    assert Option.parse(back, "fifo") == got  # what it writes back parses to the same option


@pytest.mark.parametrize("text,match", [
    ("1/refuse/keep", r"option '1/refuse/keep': two deadline parts \('refuse' and 'keep'\)"),
    ("1/fifo/weighted", r"option '1/fifo/weighted': two order parts \('fifo' and 'weighted'\)"),
    ("1/budget=0", r"option '1/budget=0': budget='0' must be a number > 0 .* or none"),
    ("1/budget=inf", r"option '1/budget=inf': budget='inf' must be a number > 0"),
    ("1/budget=lots", r"option '1/budget=lots': budget='lots' must be a number > 0"),
    ("1/refuse=core", r"option '1/refuse=core': refuse='core' needs an integer priority"),
    ("1/early=-1", r"option '1/early=-1': early='-1' must be a number > 0"),
    ("1/early/early=2", r"option '1/early/early=2': two early parts \('early' and 'early=2'\)"),
    ("1/refuse=0/early", r"option '1/refuse=0/early': its parts set admission.deadline_max_priority_kept to 0 and "
                         r"-1 \('early'\)"),
    ("1/budget", r"option '1/budget': order 'budget' is not one of .* \(nor an admission part: refuse\[=<priority>\], "
                 r"keep, early\[=<slack>\], early=off, budget=<x>\|none\)"),
    ("1/", r"option '1/': order '' is not one of"),
])
def test_a_malformed_admission_part_is_refused_naming_the_option(text: str, match: str) -> None:
    with pytest.raises(LookaheadError, match=match):
        Option.parse(text, "shortest_first")


def _run(options: list[str], epoch_s: float, horizon_s: float, *extra: str) -> tuple[ServingEnv, LookaheadController]:
    env = ServingEnv(load_config([*BURSTY, *extra]))
    ctl = LookaheadController(LookaheadConfig(epoch_s=epoch_s, horizon_s=horizon_s, options=options), env.slo, 256)
    run_episode(env, ctl, seed=0)
    return env, ctl


def test_a_refuse_option_makes_the_env_refuse_late_requests_that_keep_serves() -> None:
    """The bursty minute overloads the engine: chosen every epoch, ``refuse`` makes admission
    refuse queued requests past their TTFT objective ("deadline"), single-class as they are;
    ``keep`` (the env's own setting here) refuses none, and ends where the base option does."""
    refused, _ = _run(["1/refuse"], 5.0, 5.0)
    kept, _ = _run(["1/keep"], 5.0, 5.0)
    base, _ = _run(["1"], 5.0, 5.0)
    assert refused.admission.num_rejected_by_reason["deadline"] > 0
    assert kept.admission.num_rejected_by_reason["deadline"] == 0
    assert kept.admission.num_rejected_by_reason == base.admission.num_rejected_by_reason
    assert len(kept.finished_requests) == len(base.finished_requests)
    for env in (refused, kept, base):
        env.close()


def test_an_early_option_refuses_at_arrival_for_its_epoch() -> None:
    """``early``: admission refuses at submit ("no_slack") requests predicted to miss their TTFT
    objective, which the env's own admission (early refusal off) never does."""
    early, _ = _run(["1/early"], 5.0, 5.0)
    base, _ = _run(["1"], 5.0, 5.0)
    assert early.admission.num_rejected_by_reason["no_slack"] > 0
    assert base.admission.num_rejected_by_reason["no_slack"] == 0 and not base.admission_cfg.early_refusal
    for env in (early, base):
        env.close()


def test_an_options_admission_holds_for_its_epoch_then_the_envs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """On each copy the option's admission (refuse, two token budgets of prefill) holds for the
    epoch's 5 steps and the env's own configuration for the other 5 of the horizon; the
    environment itself runs the chosen option; ``apply_admission`` with the base option puts the
    env's own configuration back, and with it what admission derived from it."""
    seen: list[tuple[ServingEnv, bool, float | None, int | None]] = []
    step = ServingEnv.step_proposal

    def recording(self: ServingEnv, proposal: Proposal):  # noqa: ANN202 (the wrapped method's)
        adm = self.admission
        seen.append((self, adm.cfg is self.admission_cfg, adm.deadline_s, adm.prefill_hold_tokens))
        return step(self, proposal)

    monkeypatch.setattr(ServingEnv, "step_proposal", recording)
    env = ServingEnv(load_config([*BURSTY, "workload.duration_s=20", "env.episode_s=20"]))
    own = env.admission_cfg
    assert not own.ttft_deadline and own.prefill_backlog_budgets == 1.0
    ctl = LookaheadController(LookaheadConfig(epoch_s=5.0, horizon_s=10.0, options=["1/refuse/budget=2"]), env.slo,
                              256)
    run_episode(env, ctl, seed=0)
    hold = env.engine.capabilities().max_num_batched_tokens  # one token budget: the env's own hold
    real = [s for s in seen if s[0] is env]
    assert len(real) == 20 and all(not mine and dl == env.slo.ttft_ms / 1000 and h == 2 * hold
                                   for _, mine, dl, h in real), real
    copies: dict[int, list[tuple[bool, float | None, int | None]]] = {}
    for e, mine, dl, h in seen:
        if e is not env:
            copies.setdefault(id(e), []).append((mine, dl, h))
    assert len(copies) == len(ctl.log) == 4
    for steps in copies.values():  # the last epoch's copy ends with the episode, at 5 steps
        assert steps[:5] == [(False, env.slo.ttft_ms / 1000, 2 * hold)] * 5, steps
        assert steps[5:] == [(True, None, hold)] * (len(steps) - 5), steps
    assert [len(steps) for steps in copies.values()] == [10, 10, 10, 5]
    apply_admission(env, ctl.base)
    adm = env.admission
    assert adm.cfg is own and adm.deadline_s is None and adm.prefill_hold_tokens == hold and not own.ttft_deadline
    env.close()


def test_the_wide_option_set_parses_and_keeps_the_base() -> None:
    """``conf/policy/lookahead_wide.yaml`` extends ``lookahead``: its 12 options all parse,
    differ, and include the base (ties go to it)."""
    ctl = build_controller(load_config(["policy=lookahead_wide"]).policy, 256)
    assert isinstance(ctl, LookaheadController)
    assert len(ctl.options) == len(set(ctl.options)) == 12 and ctl.base in ctl.options
    assert (ctl.cfg.epoch_s, ctl.cfg.horizon_s) == (10.0, 40.0)
    assert {dict(o.admission).get("prefill_backlog_budgets", "own") for o in ctl.options} == {"own", 0.5, 2.0}


def test_copies_stay_faithful_with_admission_options() -> None:
    """As with the cap options: with the horizon one epoch long, the value computed on a copy
    for the chosen option (admission settings included) is what the episode then finished
    within the SLO, so an option's admission acts on the copy exactly as on the environment."""
    env, ctl = _run(["1", "1/refuse", "1/early", "1/budget=2", "0.7/refuse/budget=0.5"], 5.0, 5.0)
    done = env.finished_requests
    assert any(ctl.options[e["chosen"]].admission for e in ctl.log), ctl.log  # an admission option was chosen
    for now, nxt in zip(ctl.log, ctl.log[1:]):
        got = sum(1 for r in done[now["finished"]:nxt["finished"]] if env.slo.met(r.ttft, r.tpot, r.e2el))
        assert now["values"][now["chosen"]] == got, (now, got)
    env.close()
