"""A hypothesis state machine over the gateway's control path, without vLLM: ticks with random
and adversarial proposals, engine counters that come and go (telemetry gaps), operator freezes
and KV switches, and core-priority arrivals. Over 10,000 steps none of the hard limits breaks:

* the cap moves at most one step (30 %, minimum 1) per decision, forced operator calls aside;
* it never rises on an interval without the engine's counters;
* the predicted memory stays within the ceiling, or the cap is on its way down to it;
* every admission keeps the predicted memory of the requests in flight within the ceiling
  (each charged its prompt + max_tokens, all its sequences);
* a KV dtype switch the shield lets through respects the dwell time;
* core-priority requests are never shed, at any breaker level.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_control_parity import _gateway

from batchpilot.core.engine import Request
from batchpilot.core.knobs import BUCKETING_MODES, Knobs, Proposal
from batchpilot.serving.errors import Refused
from batchpilot.serving.upstream import UpstreamDown

pytestmark = pytest.mark.slow  # 10,000 control steps: ~30 s


class Scripted:
    """A controller proposing whatever the state machine drew (random or adversarial)."""

    name = "policy"

    def __init__(self) -> None:
        self.next = Proposal()

    def reset(self, knobs: Knobs) -> None:
        pass

    def decide(self, snapshot: object, knobs: Knobs) -> Proposal:
        return self.next


proposals = st.builds(
    Proposal,
    batch_cap=st.one_of(st.none(), st.integers(-10, 10_000), st.sampled_from([0, 1, 2, 3, 255, 256, 257])),
    bucketing=st.one_of(st.none(), st.sampled_from([*BUCKETING_MODES, "bogus"])),
    kv_dtype=st.one_of(st.none(), st.sampled_from(["auto", "fp8", "float16", "nope"])),
)


class ControlPath(RuleBasedStateMachine):
    @initialize(declare_fp8=st.booleans())
    def start(self, declare_fp8: bool) -> None:
        self.gw, self.loop = _gateway("pid", {"kind": "pid"})
        self.lane = self.gw.lanes[0]
        self.ctl = self.loop.lane_ctl[self.lane.index]
        if declare_fp8:
            self.ctl.shield.capabilities.kv_dtypes["fp8"] = None
        self.controller = Scripted()
        self.loop._controller = lambda _lane: ((self.controller, "policy") if not self.loop.frozen
                                               else type(self.loop)._controller(self.loop, _lane))
        self.now = time.monotonic()  # the shield's clock starts with the gateway's
        self.metrics: str | None = None
        self.last_switch = -1e9
        self.core_ids = 0

        async def metrics(timeout_s: float = 2.0) -> str:
            if self.metrics is None:
                raise UpstreamDown("vllm0 /metrics: timed out")
            return self.metrics

        self.lane.upstream.metrics_text = metrics
        self.held: list[str] = []
        self.num_admissions = 0
        adm = self.lane.admission
        admit = adm.admit

        def checked_admit(now: float) -> list:
            out = admit(now)
            if out:
                self.num_admissions += len(out)
                frac = adm.predicted_fraction()
                assert frac is not None and frac <= self.ctl.shield.cfg.memory_ceiling + 1e-9, (frac, out)
            return out

        adm.admit = checked_admit

    @rule(p=proposals, running=st.integers(0, 300), waiting=st.integers(0, 500), kv=st.floats(0.0, 1.0),
          preempted=st.integers(0, 50), gap=st.booleans(), dt=st.floats(0.05, 30.0))
    def tick(self, p: Proposal, running: int, waiting: int, kv: float, preempted: int, gap: bool, dt: float) -> None:
        self.metrics = None if gap else (
            f'vllm:num_requests_running{{engine="0"}} {running}\n'
            f'vllm:num_requests_waiting{{engine="0"}} {waiting}\n'
            f'vllm:kv_cache_usage_perc{{engine="0"}} {kv}\n'
            f'vllm:num_preemptions_total{{engine="0"}} {preempted + self.ctl.last_counters.get("num_preemptions", 0)}\n')
        self.controller.next = p
        before = self.lane.knobs
        dwell_left = self.ctl.shield.cfg.min_dtype_dwell_s - (self.now + dt - self.ctl.shield.last_dtype_switch)
        self.now += dt
        asyncio.run(self.loop.tick(self.lane, now=self.now))
        after = self.lane.knobs
        dec = self.ctl.last_decision
        step = self.ctl.shield.max_step(before.batch_cap)
        assert abs(after.batch_cap - before.batch_cap) <= step, (before, after, dec)
        if gap:
            assert after.batch_cap <= before.batch_cap, (before, after, dec)
        new = dec["knobs"]
        if new["kv_dtype"] != before.kv_dtype:  # the shield let a switch through
            assert dwell_left <= 0, (dwell_left, dec)
        frac = self.ctl.shield.predicted_fraction(after.batch_cap, new["kv_dtype"])
        if frac > self.ctl.shield.cfg.memory_ceiling + 1e-9:  # over: on its way down, a full step
            assert after.batch_cap <= max(self.ctl.shield.cfg.min_batch, before.batch_cap - step), (frac, dec)

    @rule(cap=st.integers(1, 256), frozen=st.booleans())
    def operator_freeze(self, cap: int, frozen: bool) -> None:
        try:
            self.loop.freeze(frozen, {"batch_cap": cap} if frozen else None)
        except ValueError:
            pass

    @rule(dtype=st.sampled_from(["auto", "fp8"]))
    def operator_kv_switch(self, dtype: str) -> None:
        try:
            self.loop.force_kv_dtype(dtype)
        except ValueError:
            pass

    @rule()
    def core_request(self) -> None:
        """Core priority is never shed, whatever the breaker does."""
        self.core_ids += 1
        req = Request(f"core-{self.core_ids}", self.now, 8, 8, priority=0)

        async def go() -> None:
            try:
                await self.lane.acquire(req, time.monotonic() + 1e-3)  # queued behind held ones: a timeout
            except Refused as exc:
                assert exc.reason != "shed_low_priority", exc.reason
                return
            self.lane.release(req.request_id)

        self.lane.upstream.healthy = True
        asyncio.run(go())

    @rule(reqs=st.lists(st.tuples(st.integers(1, 2047), st.integers(1, 2048), st.integers(1, 8),
                                  st.integers(0, 2)), min_size=1, max_size=40))
    def burst(self, reqs: list[tuple[int, int, int, int]]) -> None:
        """Long and wide requests at once; the admitted ones stay in flight for a while."""
        self.lane.upstream.healthy = True

        async def go() -> None:
            tasks, prios = {}, {}
            for prompt, out, seqs, prio in reqs:
                self.core_ids += 1
                rid = f"b-{self.core_ids}"
                prios[rid] = prio
                tasks[rid] = asyncio.ensure_future(
                    self.lane.acquire(Request(rid, self.now, prompt, out, priority=prio, num_seqs=seqs), self.now + 1e6))
            await asyncio.sleep(0)
            for rid, t in tasks.items():
                if t.done() and t.exception() is None:
                    self.held.append(rid)
                elif t.done():  # refused: never a core request shed
                    assert prios[rid] > 0 or t.exception().reason != "shed_low_priority", t.exception()
                else:
                    t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

        asyncio.run(go())

    @rule(k=st.integers(1, 20))
    def finish(self, k: int) -> None:
        for rid in self.held[:k]:
            self.lane.release(rid)
        self.held = self.held[k:]

    @invariant()
    def cap_in_range(self) -> None:
        if hasattr(self, "lane"):
            assert 1 <= self.lane.knobs.batch_cap <= self.ctl.shield.max_batch


ControlPath.TestCase.settings = settings(max_examples=100, stateful_step_count=100, deadline=None)
test_control_path = ControlPath.TestCase
