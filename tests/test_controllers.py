"""Baseline controllers: PID direction, length weighting, anti-windup; AIMD sawtooth; static
settings and the factory."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from batchpilot.core.controller import Controller
from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.core.pid import PIDConfig, PIDController
from batchpilot.core.telemetry import SLO, Snapshot
from batchpilot.policies.controllers import (
    AIMDController,
    StaticController,
    build_controller,
    initial_knobs,
    register_controller,
)
from batchpilot.schemas.policy import AIMDConfig

POLICY_DIR = Path(__file__).resolve().parent.parent / "conf" / "policy"


def snap(ttft_p99_ms: float = 100.0, queue: int = 10, mean_prompt_len: float = 512.0,
         preemptions: int = 0, cap: int = 32, time: float = 0.0) -> Snapshot:
    return Snapshot(
        time=time, interval_s=0.05, arrival_rate=10.0, mean_prompt_len=mean_prompt_len,
        queue_depth=(queue, 0, 0), num_running=cap, num_waiting_engine=0, kv_cache_usage=0.5,
        request_throughput=5.0, output_throughput=500.0, request_goodput=5.0,
        ttft_p50_ms=ttft_p99_ms / 2, ttft_p99_ms=ttft_p99_ms, tpot_p50_ms=10.0, tpot_p99_ms=20.0,
        e2el_p50_ms=1000.0, e2el_p99_ms=2000.0, slo_attainment=1.0, preemptions=preemptions,
        rejected=0, shield_interventions=0, knobs=Knobs(cap), time_since_dtype_switch_s=0.0,
    )


def pid(**over) -> PIDController:
    """The guide's textbook PID on TTFT (the shipped defaults steer on TPOT)."""
    return PIDController(PIDConfig(**{"metric": "ttft", "kp": 0.5, "smoothing": 0.5, "settle_s": 0.0,
                                      "initial_batch_cap": 32, "slo_ms": 1000.0, "target_frac": 0.8, **over}))


def test_pid_raises_cap_when_far_under_target_with_queue():
    c = pid()
    p = c.decide(snap(ttft_p99_ms=50.0, queue=20), Knobs(32))
    assert p.batch_cap is not None and p.batch_cap > 32
    assert p.batch_cap <= 32 + int(0.25 * 32) + 1  # a bounded, gradient-style step


def test_pid_holds_without_queue_and_lowers_above_target():
    c = pid()
    assert c.decide(snap(ttft_p99_ms=50.0, queue=0), Knobs(32)).batch_cap == 32
    assert c.integral == 0.0  # no demand: nothing winds up
    c = pid()
    p = c.decide(snap(ttft_p99_ms=3000.0, queue=20), Knobs(32))
    assert p.batch_cap is not None and p.batch_cap < 32


def test_pid_converges_on_a_plant_and_stays_near_target():
    """Latency grows with the cap (p99 = 10 ms x cap); target 800 ms -> cap near 80."""
    c = pid()
    cap = 10
    history = []
    for _ in range(300):
        cap = c.decide(snap(ttft_p99_ms=10.0 * cap, queue=50), Knobs(cap)).batch_cap
        history.append(cap)
    tail = history[-50:]
    assert 65 <= min(tail) and max(tail) <= 90, tail


def test_pid_length_weighting_shrinks_upward_steps():
    short = pid().decide(snap(ttft_p99_ms=50.0, mean_prompt_len=256), Knobs(100)).batch_cap
    long_ = pid().decide(snap(ttft_p99_ms=50.0, mean_prompt_len=8192), Knobs(100)).batch_cap
    assert short > long_ > 100
    # downward steps are not weighted
    d_short = pid().decide(snap(ttft_p99_ms=3000.0, mean_prompt_len=256), Knobs(100)).batch_cap
    d_long = pid().decide(snap(ttft_p99_ms=3000.0, mean_prompt_len=8192), Knobs(100)).batch_cap
    assert d_short == d_long < 100


@pytest.mark.parametrize("at,first,then,direction", [(256, 10.0, 3000.0, -1), (1, 5000.0, 10.0, +1)])
def test_pid_anti_windup_recovers_promptly_after_saturation(at, first, then, direction):
    c = pid(max_batch=256, min_batch=1, queue_aware=False)
    for _ in range(2000):  # pinned at a bound with the error pushing into it
        p = c.decide(snap(ttft_p99_ms=first, queue=100), Knobs(at))
        assert p.batch_cap == at
    assert abs(c.integral) <= c.cfg.integral_limit
    moves = []
    for _ in range(3):
        moves.append(c.decide(snap(ttft_p99_ms=then, queue=100), Knobs(at)).batch_cap - at)
    assert any(m * direction > 0 for m in moves[:2]), moves  # within two decisions
    assert moves[-1] * direction > 0


def test_queue_aware_steers_on_tpot_in_overload():
    """TTFT 5 s with 200 waiting behind 32 running is queueing; TPOT 20 ms says the engine has room."""
    overload = snap(ttft_p99_ms=5000.0, queue=200, cap=32)
    assert pid().decide(overload, Knobs(32)).batch_cap > 32
    assert pid(queue_aware=False).decide(overload, Knobs(32)).batch_cap < 32
    aimd = AIMDController(AIMDConfig(slo_ms=1000.0, tpot_slo_ms=100.0))
    assert aimd.decide(overload, Knobs(32)).batch_cap == 36
    assert AIMDController(AIMDConfig(slo_ms=1000.0, queue_aware=False)).decide(overload, Knobs(32)).batch_cap == 24
    # the same TTFT without a backlog is the batch's fault
    assert pid().decide(snap(ttft_p99_ms=5000.0, queue=5, cap=32), Knobs(32)).batch_cap < 32


def test_pid_waits_for_a_cut_to_show_before_cutting_again():
    """The windowed P99 stays high for a while after a cut: a settling PID does not keep
    cutting on it, and does not wind its integral up meanwhile."""
    c = pid(settle_s=10.0, queue_aware=False)
    cap = c.decide(snap(ttft_p99_ms=5000.0, time=0.0), Knobs(100)).batch_cap
    assert cap < 100
    for t in range(1, 10):
        assert c.decide(snap(ttft_p99_ms=5000.0, time=float(t)), Knobs(cap)).batch_cap == cap
    assert c.integral == pytest.approx(-2.0)  # clipped first error only: frozen while settling
    assert c.decide(snap(ttft_p99_ms=5000.0, time=10.0), Knobs(cap)).batch_cap < cap
    # upward steps are never held
    c = pid(settle_s=10.0)
    cap = c.decide(snap(ttft_p99_ms=5000.0, queue=0, time=0.0), Knobs(100)).batch_cap
    assert c.decide(snap(ttft_p99_ms=50.0, queue=20, time=1.0), Knobs(cap)).batch_cap > cap
    # without settling it cuts every interval
    c = pid(queue_aware=False)
    caps = [100]
    for t in range(3):
        caps.append(c.decide(snap(ttft_p99_ms=5000.0, time=float(t)), Knobs(caps[-1])).batch_cap)
    assert caps[0] > caps[1] > caps[2] > caps[3]
    with pytest.raises(ValueError, match="settle_s"):
        PIDConfig(settle_s=-1.0)


def test_pid_reset_forgets_state():
    c = pid()
    for _ in range(10):
        c.decide(snap(ttft_p99_ms=10.0), Knobs(32))
    c.reset(Knobs(32))
    assert c.integral == 0.0 and c.output == 0.0 and c.prev_error is None


def test_aimd_sawtooth():
    """p99 = 10 ms x cap against a 1000 ms SLO: +4 up to just over 100, then x0.75, repeat."""
    c = AIMDController(AIMDConfig(slo_ms=1000.0, additive_increase=4, multiplicative_decrease=0.75,
                                  initial_batch_cap=32))
    cap, caps = 32, []
    for _ in range(200):
        new = c.decide(snap(ttft_p99_ms=10.0 * cap, queue=50), Knobs(cap)).batch_cap
        if 10.0 * cap > 1000.0:
            assert new == int(cap * 0.75)
        else:
            assert new == cap + 4
        cap = new
        caps.append(cap)
    peaks = [caps[i] for i in range(1, len(caps) - 1) if caps[i - 1] < caps[i] > caps[i + 1]]
    assert len(peaks) >= 5 and all(100 < p <= 104 for p in peaks), peaks
    assert min(caps[50:]) >= 75  # troughs at ~0.75 x peak


def test_aimd_holds_without_queue_and_cuts_on_preemptions():
    c = AIMDController(AIMDConfig(slo_ms=1000.0))
    assert c.decide(snap(ttft_p99_ms=10.0, queue=0), Knobs(40)).batch_cap == 40
    assert c.decide(snap(ttft_p99_ms=10.0, preemptions=3), Knobs(40)).batch_cap == 30
    assert c.decide(snap(ttft_p99_ms=5000.0, queue=1), Knobs(1)).batch_cap == 1  # floor at min_batch


def test_configs_build_the_right_controllers():
    built = {}
    for name in ("pid", "aimd", "static", "vllm_default"):
        cfg = OmegaConf.load(POLICY_DIR / f"{name}.yaml")
        built[name] = build_controller(cfg, max_num_seqs=256, slo=SLO(ttft_ms=1000.0, tpot_ms=100.0, e2el_ms=None))
        assert isinstance(built[name], Controller)
    pid = built["pid"]
    assert isinstance(pid, PIDController)
    assert pid.cfg.slo_ms == {"ttft": 1000.0, "tpot": 100.0}[pid.cfg.metric]  # the metric's own SLO
    assert isinstance(built["aimd"], AIMDController)
    assert isinstance(built["vllm_default"], StaticController) and built["vllm_default"].name == "vllm_default"
    p = built["vllm_default"].decide(snap(), Knobs(32))
    assert p == Proposal(batch_cap=256, bucketing="fifo", kv_dtype="auto")
    small = build_controller(OmegaConf.load(POLICY_DIR / "vllm_default.yaml"), max_num_seqs=64)
    assert small.decide(snap(), Knobs(32)).batch_cap == 64
    assert initial_knobs(OmegaConf.load(POLICY_DIR / "vllm_default.yaml"), 256) == Knobs(256, "fifo", "auto")
    assert initial_knobs(OmegaConf.load(POLICY_DIR / "pid.yaml"), 16).batch_cap == 16


def test_factory_rejects_unknown_and_accepts_registered_kinds():
    with pytest.raises(ValueError, match="unknown policy kind"):
        build_controller({"kind": "ppo_not_registered"}, 256)
    with pytest.raises(ValueError, match="Key 'kpp' not in 'PIDConfig'"):
        build_controller({"kind": "pid", "kpp": 1.0}, 256)
    with pytest.raises(ValueError, match="metric"):
        build_controller({"kind": "aimd", "metric": "p50"}, 256)

    class Fixed:
        name = "fixed"

        def reset(self, knobs: Knobs) -> None: ...

        def decide(self, snapshot: Snapshot, knobs: Knobs) -> Proposal:
            return Proposal(batch_cap=7)

    register_controller("test_fixed", lambda cfg, n: Fixed())
    assert build_controller({"kind": "test_fixed"}, 256).decide(snap(), Knobs(1)).batch_cap == 7


@pytest.mark.parametrize("kind", ["pid", "aimd"])
def test_controller_defaults_are_the_shipped_config(kind: str) -> None:
    """One set of defaults: a controller built from its dataclass alone (the gateway's fallback
    PID, ``{"kind": "pid"}``) is the one ``conf/policy/<kind>.yaml`` composes to, setpoints
    included (they disagreed: TTFT vs TPOT, kp 0.5 vs 1.0, cap 32 vs 128; then the fallback
    PID's setpoint was the TTFT objective)."""
    from batchpilot.config import load_config

    slo = SLO(ttft_ms=500.0, tpot_ms=40.0)
    composed = build_controller(load_config([f"policy={kind}"]).policy, 256, slo)
    assert composed.cfg == build_controller({"kind": kind}, 256, slo).cfg  # type: ignore[attr-defined]


def test_policy_files_are_read_over_their_schema(tmp_path: Path) -> None:
    """The evaluation and the training baseline read a policy file without Hydra, over the schema
    its defaults name, so each comes out as ``policy=<name>`` composes (a key the file leaves
    out is the dataclass default: ``kv_start`` was false to ``start_knobs`` where ppo.yaml left
    it out); a file naming no schema, an unknown key or a wrong type is one error naming it."""
    from batchpilot.config import load_config, load_group_file
    from batchpilot.nodes import ConfigError, plain
    from batchpilot.schemas.policy import with_policy_schema

    for path in sorted(POLICY_DIR.glob("*.yaml")):
        read = plain(with_policy_schema(load_group_file("policy", path.stem), path.name))
        assert read == plain(load_config([f"policy={path.stem}"]).policy), path.stem
    assert with_policy_schema(load_group_file("policy", "ppo"), "ppo.yaml").kv_start is True
    (tmp_path / "policy").mkdir()
    for name, text, says in (
        ("typo", "defaults: [schema_pid, _self_]\nkind: pid\nkpp: 1.0\n", r"policy/typo.yaml: Key 'kpp' not in"),
        ("badtype", "defaults: [schema_pid, _self_]\nkind: pid\nkp: fast\n", r"(?s)policy/badtype.yaml: Value 'fast'.*full_key: kp"),
        ("bare", "kind: pid\n", r"policy/bare.yaml: its defaults must name one policy schema"),
    ):
        (tmp_path / "policy" / f"{name}.yaml").write_text(text)
        with pytest.raises(ConfigError, match=says):
            with_policy_schema(load_group_file("policy", name, [tmp_path]), f"policy/{name}.yaml")