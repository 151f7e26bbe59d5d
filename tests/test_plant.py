"""The plant contract (``batchpilot.core.plant``): one ``actuate`` carries a shield decision out
on the environment's engine side and on a gateway lane, so breaker levels 2-3 and KV switches
mean the same in training and in front of users. The gateway used to shed its queue once on
entering level 2 and then reject 50 % of low-priority arrivals at random, while the environment
shed the queue at every decision; level 3 restarted only in the gateway."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from test_control_parity import _gateway

from batchpilot.config import load_config
from batchpilot.core.engine import EngineCapabilities, Request
from batchpilot.core.knobs import Knobs
from batchpilot.core.plant import BreakerTrip, actuate
from batchpilot.core.shield import Decision
from batchpilot.envs.serving_env import ServingEnv


@dataclass
class Recorder:
    """A plant that records what it was asked to do (``in_force``: whether a KV switch is)."""

    in_force: bool = True
    restartable: bool = True
    calls: list[tuple] = field(default_factory=list)

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(kv_dtypes=("auto", "fp8"), max_num_seqs=256)

    def set_knobs(self, knobs: Knobs) -> None:
        self.calls.append(("knobs", knobs))

    def shed(self, max_priority_kept: int) -> int:
        self.calls.append(("shed", max_priority_kept))
        return 3

    def switch_kv_dtype(self, dtype: str) -> bool:
        self.calls.append(("kv", dtype))
        return self.in_force

    def restart(self, cause: str) -> bool:
        self.calls.append(("restart", cause))
        return self.restartable


def _dec(level: int, cap: int = 8, kv: str = "auto") -> Decision:
    return Decision(Knobs(cap, "fifo", kv), breaker_level=level, shed_max_priority_kept=0 if level >= 2 else None,
                    recommend_restart=level >= 3)


def test_level_2_sheds_at_every_decision_and_level_3_restarts_once_per_trip() -> None:
    p, trip, cur = Recorder(), BreakerTrip(), Knobs(8)
    done = [actuate(_dec(lv), cur, p, trip, restart_on_trip=True) for lv in (0, 2, 2, 3, 3, 2, 0, 3)]
    assert [d.shed for d in done] == [0, 3, 3, 3, 3, 3, 0, 3]
    assert [d.restart for d in done] == [None, None, None, "done", None, None, None, "done"]
    assert sum(c[0] == "restart" for c in p.calls) == 2  # one per trip (level 0 ends a trip)


def test_without_breaker_restart_level_3_is_only_advised() -> None:
    p = Recorder()
    done = actuate(_dec(3), Knobs(8), p, BreakerTrip(), restart_on_trip=False)
    assert done.restart == "advised" and not any(c[0] == "restart" for c in p.calls)
    done = actuate(_dec(3), Knobs(8), Recorder(restartable=False), BreakerTrip(), restart_on_trip=True)
    assert done.restart == "advised"  # an unmanaged upstream: the plant could not


@pytest.mark.parametrize("in_force", [True, False])
def test_a_kv_switch_is_in_force_only_when_the_plant_says_so(in_force: bool) -> None:
    p = Recorder(in_force=in_force)
    done = actuate(_dec(0, kv="fp8"), Knobs(8), p, BreakerTrip(), restart_on_trip=True)
    assert done.kv_switch == "fp8" and done.kv_in_force is in_force
    assert done.knobs.kv_dtype == ("fp8" if in_force else "auto")
    assert p.calls[0] == ("kv", "fp8") and p.calls[1] == ("knobs", done.knobs)  # restart first, then knobs


def _queue(admission, n: int, tag: str) -> None:
    """``n`` queued requests alternating core (priority 0) and low priority (1)."""
    for i in range(n):
        req = Request(f"{tag}-{i}", 0.0, 100, 10, priority=i % 2)
        assert admission.submit(req, 0.0) is None


def test_the_env_and_a_gateway_lane_carry_out_a_breaker_sequence_alike() -> None:
    """The same decisions, the same queue: the same sheds, knobs and restart on both plants."""
    env = ServingEnv(cfg=load_config(["control.initial_batch_cap=1"]))
    env.reset(seed=0)
    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    ctl = loop.lane_ctl[lane.index]
    restarts: list[str] = []
    ctl.plant.restart = lambda cause: restarts.append(cause) or True  # type: ignore[method-assign]
    lane.set_knobs(Knobs(1, "fifo", "auto"))
    env_trip = BreakerTrip()
    seen: dict[str, list] = {"env": [], "gateway": []}
    levels = (0, 2, 2, 3, 3, 0)
    for k, lv in enumerate(levels):
        _queue(env.admission, 6, f"d{k}")
        _queue(lane.admission, 6, f"d{k}")
        d = _dec(lv, cap=1)
        a = actuate(d, env.knobs, env._plant, env_trip, restart_on_trip=True)
        b = actuate(d, lane.knobs, ctl.plant, ctl.trip, restart_on_trip=True)
        seen["env"].append((a.shed, a.restart, env.knobs))
        seen["gateway"].append((b.shed, b.restart, lane.knobs))
        env.admission.shed(-1)  # empty both queues for the next decision
        lane.admission.shed(-1)
    assert seen["env"] == seen["gateway"]
    assert [s[0] for s in seen["env"]] == [0, 3, 3, 3, 3, 0]  # the 3 low-priority requests, each time
    assert env.episode_metrics()["breaker_restarts"] == 1 and restarts == ["breaker"]
    env.close()
