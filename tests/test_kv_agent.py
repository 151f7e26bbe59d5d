"""The KV-precision agent: its epoch summary, its slow environment (a switch goes through the
shield and is charged its restart), export and loading beside the batch policy, and the shipped
agent's behaviour where 8-bit KV pays and where a restart is too costly."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import pytest
from gymnasium.utils.env_checker import check_env

from batchpilot.config import load_config
from batchpilot.core.engine import KV_DTYPES_8BIT
from batchpilot.core.knobs import Knobs
from batchpilot.core.kv_epoch import KV_FEATURE_NAMES, KVEpoch, kv_target
from batchpilot.core.telemetry import SLO, Snapshot
from batchpilot.envs.kv_env import KVPrecisionEnv
from batchpilot.policies.artifact import PolicyLoadError
from batchpilot.policies.controllers import build_controller
from batchpilot.policies.kv_agent import KV_AGENT_SUBDIR, KVAgent
from batchpilot.policies.ppo_controller import PRETRAINED_DIR, PPOController


def _snap(t: float, *, kv: float = 0.5, queue: int = 0, running: int = 10, cap: int = 16,
          dtype: str = "auto", good: float = 2.0, arrivals: float = 4.0, preempt: int = 0) -> Snapshot:
    return Snapshot(
        time=t, interval_s=1.0, arrival_rate=arrivals, mean_prompt_len=500.0, queue_depth=(queue, 0, 0),
        num_running=running, num_waiting_engine=0, kv_cache_usage=kv, request_throughput=good,
        output_throughput=100.0, request_goodput=good, ttft_p50_ms=100.0, ttft_p99_ms=200.0,
        tpot_p50_ms=20.0, tpot_p99_ms=30.0, e2el_p50_ms=1000.0, e2el_p99_ms=2000.0, slo_attainment=0.5,
        preemptions=preempt, rejected=0, shield_interventions=0, knobs=Knobs(cap, "fifo", dtype),
        time_since_dtype_switch_s=math.inf,
    )


def test_epoch_summary_features():
    ep = KVEpoch(epoch_s=4.0)
    done = [ep.add(_snap(t, kv=0.2 * t, queue=5 if t % 2 else 0, running=16 if t == 4 else 8, preempt=1))
            for t in (1.0, 2.0, 3.0, 4.0)]
    assert done == [False, False, False, True]
    obs = dict(zip(KV_FEATURE_NAMES, ep.observation(restart_s=120.0)))
    assert obs["kv_usage_mean"] == pytest.approx(0.5)
    assert obs["kv_usage_max"] == pytest.approx(0.8)
    assert obs["held_by_memory"] == pytest.approx(0.5)  # queued while fewer than the cap ran: t=1, 3
    assert obs["running_per_cap"] == pytest.approx((8 * 3 / 16 + 1.0) / 4)
    assert obs["served_per_arrival"] == pytest.approx(0.5)
    assert obs["preemptions"] == pytest.approx(math.log1p(4) / math.log1p(1000))
    assert obs["restart_cost"] == pytest.approx(0.2) and obs["time_since_switch"] == 1.0
    assert obs["kv_8bit"] == 0.0


def test_epoch_refuses_nan_and_empty():
    ep = KVEpoch(epoch_s=2.0)
    with pytest.raises(ValueError, match="no interval"):
        ep.observation(60.0)
    ep.add(dataclasses.replace(_snap(1.0), kv_cache_usage=float("nan")))
    with pytest.raises(ValueError, match="kv_usage_mean"):
        ep.observation(60.0)
    with pytest.raises(ValueError, match="epoch_s"):
        KVEpoch(0.0)


def test_kv_action_is_keep_or_switch():
    kw = {"kv16_dtype": "auto", "kv8_dtype": "fp8"}
    assert kv_target(0, "auto", **kw) is None and kv_target(0, "fp8", **kw) is None
    assert kv_target(1, "auto", **kw) == "fp8" and kv_target(1, "fp8", **kw) == "auto"
    with pytest.raises(ValueError):
        kv_target(2, "auto", **kw)


# --- the slow environment ----------------------------------------------------------------------
#: Llama-3-8B on H100, ~4k prompts and ~1k answers at 7 req/s: more sequences than 16-bit KV
#: holds under the memory ceiling, so 8-bit KV passes the shield's gain check.
#: Core traffic (``priorities=[1.0]``: class 0), which the breaker never sheds: the backlog that
#: makes 8-bit KV pay stays (untagged traffic is shed at level 2 and leaves no demand to repay it).
KV_BOUND = ["workload=poisson", "workload.rate=7.0", "workload.lengths.prompt_mean=4000",
            "workload.lengths.output_mean=1000", "env.episode_s=300", "workload.duration_s=300",
            "workload.priorities=[1.0]"]


def _pid(env):
    pid = build_controller(load_config(["policy=pid"]).policy, env.engine.capabilities().max_num_seqs,
                           slo=SLO(ttft_ms=1000.0, tpot_ms=100.0, e2el_ms=None))
    return pid


def _kv_env(*overrides: str) -> KVPrecisionEnv:
    return KVPrecisionEnv(load_config([*KV_BOUND, *overrides]), _pid, epoch_s=60.0)


def test_kv_env_passes_check_env():
    env = _kv_env("env.episode_s=130", "workload.duration_s=130")
    check_env(env, skip_render_check=True)


def test_a_switch_goes_through_the_shield_and_is_charged_its_restart():
    env = _kv_env()
    obs, _ = env.reset(seed=0)
    assert obs.shape == (len(KV_FEATURE_NAMES),) and 60.0 <= env.inner.engine.now < 70.0  # one epoch, engine time
    t_switch = env.inner.engine.now
    _, r_switch, *_, info = env.step([1])
    assert info["kv_proposed"] in KV_DTYPES_8BIT and info["kv_dtype"] in KV_DTYPES_8BIT
    # The restart (40 s for this model) is charged in engine time.
    assert env.inner.engine.down_until == pytest.approx(t_switch + float(env.inner.cfg.model.restart_base_s), abs=1.0)
    # Asking to switch back inside the dwell is refused by the shield.
    _, _, *_, info = env.step([1])
    assert "dtype_dwell" in info["kv_refused"] and info["kv_dtype"] in KV_DTYPES_8BIT

    keep = _kv_env()
    keep.reset(seed=0)
    _, r_keep, *_, info = keep.step([0])
    assert "kv_proposed" not in info and info["kv_dtype"] == "auto"
    assert r_keep > r_switch  # the restart costs the epoch


def test_paired_reward_is_the_switch_effect():
    """Paired, an epoch without any switch yet pays exactly 0 (same seed, same controller)."""
    env = KVPrecisionEnv(load_config(KV_BOUND), _pid, epoch_s=60.0, paired=True)
    env.reset(seed=2)
    _, r, *_, info = env.step([0])
    assert r == 0.0 and info["unpaired_reward"] != 0.0
    _, r, *_, info = env.step([1])
    assert info["kv_dtype"] in KV_DTYPES_8BIT and r < 0.0  # the restart's epoch

def test_same_seed_same_slow_episode():
    def run() -> list[float]:
        env = _kv_env()
        out = [float(env.reset(seed=4)[0].sum())]
        for a in (0, 1, 0, 0):
            obs, r, *_ = env.step([a])
            out += [float(obs.sum()), r]
        return out

    assert run() == run()



def test_labelled_decisions_see_their_whole_horizon():
    """Counterfactual labels: the first epoch always, the rest only where the horizon fits, and
    an episode has exactly ``kv.episode_epochs`` decisions (the arithmetic behind the bound)."""
    import numpy as np

    from batchpilot.policies.kv_training import decision_points, make_kv_env

    rng = np.random.default_rng(0)
    for _ in range(50):
        picks = decision_points(rng, 20, 10, 5)
        assert 0 in picks and len(picks) == 5 and max(picks) <= 10
    assert decision_points(rng, 3, 2, 2) == {0, 1}
    with pytest.raises(ValueError, match="samples_per_episode"):
        decision_points(rng, 20, 10, 12)
    with pytest.raises(ValueError, match="shorter than kv.horizon_epochs"):
        decision_points(rng, 5, 10, 1)

    cfg = load_config(["kv.epoch_s=20", "kv.episode_epochs=3", "kv.deployments=[llama3_8b/h100]",
                       "env.memory_utilization=null", "env.load_vs_capacity=null"], config_name="train_kv")
    env = make_kv_env(cfg, list(cfg.kv.deployments))()
    env.reset(seed=0)
    steps, done = 0, False
    while not done:
        *_, term, trunc, _ = env.step([0])
        steps, done = steps + 1, term or trunc
    env.close()
    assert steps == 3

# --- export, loading, the controller ------------------------------------------------------------
def _trained_tiny(tmp_root: str, method: str) -> str:
    """A tiny training run (the pipeline, not a useful agent)."""
    import json
    import subprocess
    import sys

    from batchpilot.config import REPO_ROOT

    out = f"{tmp_root}/run"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "train_kv.py"), "logger=none", f"kv.method={method}",
           "kv.total_timesteps=64", "kv.n_envs=1", "kv.n_steps=64", "kv.batch_size=32", "kv.n_epochs=1",
           "kv.counterfactual_episodes=2", "kv.samples_per_episode=2", "kv.horizon_epochs=2", "kv.fit_epochs=5",
           "kv.episode_epochs=3", "kv.epoch_s=20", "kv.deployments=[llama3_8b/h100]", "kv.held_out_deployments=[]",
           "kv.test_seeds=[1]", "kv.progress_bar=false", f"hydra.run.dir={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((Path(out) / "kv_comparison.json").read_text())
    assert summary["method"] == method and {r["controller"] for r in summary["rows"]} == {"never", "8bit_at_once", "agent"}
    if method == "counterfactual":
        assert summary["fit"]["samples"] == 4.0  # 2 episodes x 2 labelled decision points
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["counterfactual", "ppo"])
def test_training_exports_an_agent_that_the_controller_runs(tmp_path_factory, method: str):
    run = _trained_tiny(str(tmp_path_factory.mktemp("kv")), method)
    agent = KVAgent.from_dir(f"{run}/{KV_AGENT_SUBDIR}", restart_s=40.0)
    assert agent.epoch.epoch_s == 20.0
    # Beside a batch policy, PPOController runs it: a KV proposal only at an epoch's end.
    folder = tmp_path_factory.mktemp("policy")
    shutil.copytree(PRETRAINED_DIR, folder, dirs_exist_ok=True)
    shutil.rmtree(folder / KV_AGENT_SUBDIR, ignore_errors=True)
    shutil.copytree(f"{run}/{KV_AGENT_SUBDIR}", folder / KV_AGENT_SUBDIR)
    ctl = PPOController.from_dir(folder, max_num_seqs=256, max_model_len=8192,
                                 kv_runnable={"auto": True, "fp8": True}, kv_restart_s=40.0)
    assert ctl.kv_agent is not None
    assert PPOController.from_dir(folder, max_num_seqs=256, max_model_len=8192).kv_agent is None  # no restart time
    assert PPOController.from_dir(folder, max_num_seqs=256, max_model_len=8192, kv_agent=False,
                                  kv_restart_s=40.0).kv_agent is None
    knobs = Knobs(64, "fifo", "auto")
    ctl.reset(knobs)
    for t in range(1, 60):
        ctl.decide(_snap(float(t), cap=64), knobs)
        assert ctl.kv_agent.num_decisions == t // 20
    lane = ctl.for_lane("b")
    assert lane.kv_agent is not ctl.kv_agent and lane.kv_agent.runtime is ctl.kv_agent.runtime


def test_a_broken_agent_is_a_load_error(tmp_path):
    shutil.copytree(PRETRAINED_DIR, tmp_path, dirs_exist_ok=True)
    (tmp_path / KV_AGENT_SUBDIR).mkdir(exist_ok=True)
    (tmp_path / KV_AGENT_SUBDIR / "manifest.json").write_text("{not json")
    with pytest.raises(PolicyLoadError):
        PPOController.from_dir(tmp_path, max_num_seqs=256, max_model_len=8192, kv_restart_s=40.0)


def test_the_docs_list_the_kv_features_in_order():
    from batchpilot.config import REPO_ROOT

    text = (REPO_ROOT / "docs" / "observation.md").read_text()
    section = text[text.index("## The KV-precision agent's observation"):]
    rows = [line.split("|")[2].strip().strip("`") for line in section.splitlines() if line.startswith("| ") and "`" in line]
    assert rows == list(KV_FEATURE_NAMES)


def _eval_rows(tmp: Path, extra: list[str]) -> dict[tuple[str, int], dict]:
    from batchpilot.evaluation.matrix import evaluate
    from batchpilot.evaluation.plan import compose_eval

    # The agent's own switches: the policy starts at the engine's 16-bit dtype, as ppo_no_kv does
    # (kv_start would start it at 8 bits where memory binds, leaving the agent nothing to decide).
    overrides = ["policies=[ppo,ppo_no_kv]", "workload=long_context", "seeds=[0,1]", "logger=none",
                 "plots=false", f"out_dir={tmp}", "+policy_overrides.ppo.kv_start=false", *extra]
    cfg, _ = compose_eval(overrides)
    return {(r["policy"], int(r["seed"])): r for r in evaluate(cfg, overrides)}


@pytest.mark.slow
def test_shipped_agent_switches_where_kv_binds_and_gains(tmp_path: Path) -> None:
    """The shipped agent (policies/pretrained/kv_agent) on a load it never trained on: long
    prompts and answers (long_context) on a Llama-3-8B/H100 engine with 0.35 of its memory, at
    1 req/s, under the default admission (on time first, newest first once late). It proposes
    8-bit, the shield lets it through, and goodput rises on every seed over the same batch
    policy without the agent, by half again over the two (docs/training.md: 0.317 -> 0.618
    req/s over six seeds; 1.94x and 1.08x on these two)."""
    assert (PRETRAINED_DIR / KV_AGENT_SUBDIR / "manifest.json").is_file()
    # Core traffic (priority 0, never shed). Untagged (priority 1, since 2026-12-06 as at the
    # gateway), the breaker sheds 37 % of this load at level 2, the agent (trained when every
    # simulated request was core) sees no backlog and never proposes 8-bit: 0.565 req/s with or
    # without it, against 0.614 with it here (six seeds; docs/training.md).
    rows = _eval_rows(tmp_path, ["workload.rate=1.0", "engine.gpu_memory_utilization=0.35",
                                 "workload.priorities=[1.0]"])
    for seed in (0, 1):
        with_agent, without = rows[("ppo", seed)], rows[("ppo_no_kv", seed)]
        assert with_agent["dtype_switches"] >= 1 and without["dtype_switches"] == 0
        assert with_agent["request_goodput"] > without["request_goodput"], seed
    gain = sum(rows[("ppo", s)]["request_goodput"] for s in (0, 1)) / sum(
        rows[("ppo_no_kv", s)]["request_goodput"] for s in (0, 1))
    assert gain > 1.3, gain


@pytest.mark.slow
def test_shipped_agent_never_switches_deepseek(tmp_path: Path) -> None:
    """DeepSeek-V3 (a 600 s restart) under the same long requests: no switch, so the agent
    changes nothing."""
    rows = _eval_rows(tmp_path, ["workload.rate=4.0", "model=deepseek_v3", "hardware=h200"])
    for seed in (0, 1):
        assert rows[("ppo", seed)]["dtype_switches"] == 0
        assert rows[("ppo", seed)]["request_goodput"] == rows[("ppo_no_kv", seed)]["request_goodput"]
