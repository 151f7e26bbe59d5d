"""A hypothesis state machine over the gateway's control path, without vLLM.

What it drives, all on one simulated clock (the control loop, the lanes, the supervisor and the
event loop's timers read it, so the dwell, the timeouts and the restarts agree with the ticks):

* control decisions (runs of them per step) with random and adversarial proposals, the engine's
  counters coming and going (telemetry gaps), preemption storms, slow first tokens (overload);
* a managed fake upstream (in most examples) that crashes, refuses connections, restarts
  (draining first or not), and comes back with another KV pool or none (unknown KV budget);
  KV dtype switches that the shield lets through restart it onto the new dtype;
* operator calls: freeze (walked or forced), KV switches (through the gate or forced), reset,
  mode switches, policy reloads (a canary too, and a bad path), the quality guard's 8-bit block;
* requests of mixed priority that stay queued across decisions, so breaker level 2 sheds real
  requests, that finish, time out or whose clients leave.

Invariants, checked over at least 10,000 control decisions (counters asserted at the end, so the
test cannot pass without exercising them):

* the cap moves at most one step per decision (30 %, minimum 1), forced operator calls aside;
* it never rises on an interval without the engine's counters, and heads for the safe cap when
  the KV budget is unknown;
* the predicted memory stays within the ceiling, or the cap is on its way down to it;
* every admission keeps the predicted memory of the requests in flight within the ceiling
  (each charged its prompt + max_tokens, all its sequences), recomputed here from the requests
  themselves against the KV pool the upstream reports now, not only from admission's books:
  also right after a restart brought back another pool, and with requests in flight that were
  admitted while the budget was unknown;
* every KV dtype switch the shield or the operator's gate lets through comes at least the dwell
  time after the previous switch of any kind (controller, operator, forced, quality fallback);
  an 8-bit switch is never asked for while the quality guard blocks 8-bit, unless forced;
* core-priority requests are never shed, at any breaker level; at most one restart per lane runs
  at a time; the admission books balance at the end (no slot leaks).

Three gaps this machine found, each with its own regression test: the quality guard's fallback
restart did not start the dwell (tests/test_control_loop.py); a restart's own admission pass
checked against the previous pool's model until the next decision (tests/test_control_loop.py);
requests admitted under an unknown budget stayed booked at 0 KV blocks (tests/test_admission.py).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import math
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_control_parity import MAX_NUM_SEQS

import batchpilot.serving.actuation as actuation_mod
import batchpilot.serving.control_loop as control_loop_mod
import batchpilot.serving.lanes as lanes_mod
import batchpilot.serving.supervisor as supervisor_mod
from batchpilot.config import load_config
from batchpilot.core.engine import KV_DTYPES_8BIT, Request
from batchpilot.core.knobs import BUCKETING_MODES, Knobs, Proposal
from batchpilot.schemas.serve import QualityGuardConfig
from batchpilot.serving.control_loop import ControlLoop, upstream_engine_model
from batchpilot.serving.errors import Refused
from batchpilot.serving.gateway import AppSettings, Gateway
from batchpilot.serving.quality_guard import QualityGuard
from batchpilot.serving.upstream import EngineInfo, UpstreamDown

pytestmark = pytest.mark.slow  # >= 10,000 control decisions: ~1-2 min on a shared 2-core machine

#: The one clock of a run (simulated seconds).
CLOCK = [0.0]
#: Why this machine cannot run 8-bit KV (None: it can), as ``cpu_kv8_unavailable_reason`` says.
KV8_REASON: list[str | None] = [None]
#: What happened over the whole run (all examples), asserted at the end.
STATS: Counter[str] = Counter()
MIN_DECISIONS = 10_000


@functools.cache
def _settings() -> AppSettings:
    """The shipped serve config (composed once: hydra takes ~1 s), one unmanaged upstream."""
    cfg = load_config(["serve.upstreams=[http://127.0.0.1:9]", "serve.control.mode=pid",
                       f"serve.max_num_seqs={MAX_NUM_SEQS}", "control.initial_batch_cap=64"],
                      config_name="serve_app")
    settings = AppSettings.from_cfg(cfg)
    settings.policy = {"kind": "pid"}
    return settings


class SimTime:
    """The ``time`` module as the gateway's modules see it in this test: ``monotonic`` is the
    simulated clock, the rest is the real module."""

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    @staticmethod
    def monotonic() -> float:
        return CLOCK[0]


class SimLoop(asyncio.SelectorEventLoop):
    """An event loop on the simulated clock: a timer (a request's timeout, a restart under way,
    a drain's poll) fires once the test has moved the clock past it."""

    def time(self) -> float:
        return CLOCK[0]


class Scripted:
    """A controller proposing whatever the state machine drew (random or adversarial)."""

    name = "policy"

    def __init__(self) -> None:
        self.next = Proposal()

    def reset(self, knobs: Knobs) -> None:
        pass

    def decide(self, snapshot: object, knobs: Knobs) -> Proposal:
        return self.next


class FakeEngine:
    """The managed ``vllm serve`` process as the supervisor sees it."""

    def __init__(self) -> None:
        self.exited = False
        self.proc = SimpleNamespace(returncode=None)
        self.kv_cache_space_gib = 1
        self.kv_dtype = "auto"
        self.pid = None

    def alive(self) -> bool:
        return not self.exited

    def close(self) -> None:
        pass


proposals = st.builds(
    Proposal,
    batch_cap=st.one_of(st.none(), st.integers(-10, 10_000), st.sampled_from([0, 1, 2, 3, 255, 256, 257])),
    bucketing=st.one_of(st.none(), st.sampled_from([*BUCKETING_MODES, "bogus"])),
    kv_dtype=st.one_of(st.none(), st.sampled_from(["auto", "fp8", "float16", "nope"])),
)
#: One control interval: the proposal; the engine's counters (running, waiting, KV use, new
#: preemptions: a storm at >= 10), missing when ``gap`` is 0 (no /metrics); how many first
#: tokens came in it within the TTFT objective, and a slow one (over it: overload while requests
#: wait) when ``slow`` is 0; its length; and whether the controller acting proposes the drawn
#: proposal (adversarial) or decides itself. (Few draws per interval: hypothesis bounds the data
#: of one example, so every draw here is fewer decisions per example.)
intervals = st.tuples(
    proposals,
    st.tuples(st.integers(0, 300), st.integers(0, 500), st.floats(0.0, 1.0),
              st.one_of(st.integers(0, 3), st.integers(0, 50))),
    st.integers(0, 9),
    st.integers(0, 3),
    st.integers(0, 9),
    st.floats(0.05, 30.0),
    st.booleans(),
)
#: KV pools an upstream may come back with (None: its /metrics has no cache info).
pools = st.sampled_from([4096, 512, 16384, None, 2048])


class ControlPath(RuleBasedStateMachine):
    @initialize(managed=st.integers(0, 3).map(bool), kv8=st.booleans(), start_8bit=st.booleans())
    def start(self, managed: bool, kv8: bool, start_8bit: bool) -> None:
        """One upstream, managed (restartable) or not; 8-bit KV runnable or not, and running
        from the start (``serve.kv_dtype: fp8``) or not."""
        CLOCK[0] = 1000.0
        KV8_REASON[0] = None if kv8 else "no 8-bit KV cache on this machine (test)"
        running = "fp8" if kv8 and start_8bit else "auto"
        self.aloop = SimLoop()
        settings = copy.deepcopy(_settings())
        settings.serve.kv_dtype = running
        if not managed and kv8:
            settings.serve.upstream_kv_dtypes = ["auto", "fp8"]  # as if its operator declared them
        gw = Gateway(settings)
        self.gw, self.lane = gw, gw.lanes[0]
        gw.cfg.warmup.prompts = []
        up = self.lane.upstream
        up.info = EngineInfo(model="m", max_model_len=2048, num_kv_blocks=4096, block_size=16, kv_dtype=running)
        up.healthy = True
        self.pool_seen = up.info  # the upstream's KV pool as the last decision saw it
        self.engine = FakeEngine() if managed else None
        up.managed = self.engine
        gw.quality = QualityGuard(QualityGuardConfig(), gw.metrics)
        self.loop = ControlLoop(gw)  # sees the upstream as managed (or not) from the start
        self.sup = gw.supervisor
        self.lane.telemetry.reset(CLOCK[0])
        self.scripted, self.adversarial = Scripted(), True
        real = type(self.loop)._controller

        def pick(lane):  # whoever acts proposes what was drawn, or decides itself; frozen: the target
            c, who = real(self.loop, lane)
            return (self.scripted, who) if who != "frozen" and self.adversarial else (c, who)

        self.loop._controller = pick
        self.metrics: str | None = None
        self.probe_answer: str | None = None
        self.next_pool: int | None = 4096
        self.restart_s = 5.0
        self.restarts_running = 0
        self.restart_cause = "none"
        self.n = 0
        self.reqs: dict[str, Request] = {}
        self.queued: dict[str, asyncio.Task] = {}
        self.held: list[str] = []
        self.last_switch = -math.inf  # the last KV dtype switch of any kind, as seen from here
        self.last_switch_kind = "none"
        self.violations: list[str] = []
        self.unbooked: set[str] = set()  # admitted while the KV budget was unknown
        self.preempted = 0

        async def metrics_text(timeout_s: float = 2.0) -> str:
            if self.metrics is None:
                raise UpstreamDown("vllm0 /metrics: timed out")
            return self.metrics

        async def probe(timeout_s: float) -> str | None:
            if self.engine is not None and self.engine.exited:
                return "the vllm serve process exited (code -9)"
            return self.probe_answer

        async def restart(timeout_s: float, kv_dtype: str | None = None) -> float:
            self.restarts_running += 1
            if self.restarts_running > 1:  # (raised here, the supervisor would only log it)
                self.violations.append("two restarts of one upstream at once")
            STATS["restarts"] += 1
            try:
                up.healthy = False
                await asyncio.sleep(self.restart_s)  # simulated seconds: ticks pass meanwhile
                pool = self.next_pool
                running = kv_dtype or self.lane.knobs.kv_dtype
                if running != self.lane.knobs.kv_dtype and self.restart_cause == "quality":
                    self._switched("quality fallback", check=False)  # a switch too, not through a gate
                up.info = EngineInfo(model="m", max_model_len=2048, num_kv_blocks=pool,
                                     block_size=16 if pool else None, kv_dtype=running)
                STATS["restarts_unknown_pool"] += pool is None
                self.engine.exited = False
                up.healthy = True
                up.num_restarts += 1
                return self.restart_s
            finally:
                self.restarts_running -= 1

        up.metrics_text, up.probe, up.restart = metrics_text, probe, restart

        # Every restart asked for, checked when it is asked for (cause, dtype).
        sup_restart = self.sup.restart

        def asked(lane, *, cause: str, kv_dtype: str | None = None, drain: bool = True):
            STATS[f"restart_asked_{cause}"] += 1
            if kv_dtype is not None and kv_dtype != lane.knobs.kv_dtype and lane.index not in self.sup._pending:
                if cause == "kv_dtype":  # the controller's, let through by the shield this decision
                    if kv_dtype in KV_DTYPES_8BIT and gw.quality.blocks_8bit:
                        self.violations.append("8-bit KV switch asked for while the quality guard blocks it")
                    self._switched("controller", check=True)
            return sup_restart(lane, cause=cause, kv_dtype=kv_dtype, drain=drain)

        self.sup.restart = asked
        sup_restart_now = self.sup._restart

        async def restarting(lane, *, cause: str, kv_dtype: str | None, drain: bool) -> bool:
            self.restart_cause = cause  # (one restart at a time runs this: the supervisor's lock)
            return await sup_restart_now(lane, cause=cause, kv_dtype=kv_dtype, drain=drain)

        self.sup._restart = restarting

        # Every admission: the memory of what is in flight, recomputed from the requests.
        adm = self.lane.admission
        admit = adm.admit

        def checked_admit(now: float) -> list:
            out = admit(now)
            if out:
                self._check_admission(out)
            return out

        adm.admit = checked_admit

    # --- helpers ---------------------------------------------------------------------------
    @property
    def ctl(self):
        return self.loop.lane_ctl[self.lane.index]

    def run(self, coro):
        out = self.aloop.run_until_complete(coro)
        self.settle()
        return out

    def settle(self) -> None:
        """Let what is ready run (spawned restarts, admissions, timers already due)."""
        async def turns() -> None:
            for _ in range(8):
                await asyncio.sleep(0)

        self.aloop.run_until_complete(turns())
        self.harvest()

    def advance(self, dt: float) -> None:
        CLOCK[0] += dt
        self.settle()

    def harvest(self) -> None:
        """Requests whose wait ended: admitted (held) or refused (never a core one shed)."""
        kept = self.ctl.shield.cfg.shed_max_priority_kept
        for rid, task in list(self.queued.items()):
            if not task.done():
                continue
            del self.queued[rid]
            if task.cancelled():
                continue
            exc = task.exception()
            if exc is None:
                self.held.append(rid)
                continue
            assert isinstance(exc, Refused), exc
            STATS[f"refused_{exc.reason}"] += 1
            if exc.reason == "shed_low_priority":
                assert self.reqs[rid].priority > kept, f"core request {rid} shed"

    def _check_admission(self, out: list) -> None:
        """Called from inside admission: a violation is recorded (raising here would leave
        admission's books half-updated) and the ``no_violation`` invariant fails on it."""
        adm, ctl = self.lane.admission, self.ctl
        STATS["admissions"] += len(out)
        if adm.memory is None:  # budget unknown: by count, at the safe cap
            STATS["admissions_budget_unknown"] += len(out)
            self.unbooked.update(r.request_id for r in out)
            return
        ceiling = ctl.shield.cfg.memory_ceiling
        frac = adm.predicted_fraction()
        if frac is None or frac > ceiling + 1e-9:
            self.violations.append(f"admission's own prediction {frac} > ceiling {ceiling}: {out}")
        # The same prediction from the requests themselves (prompt + max_tokens, all their
        # sequences), against the KV pool the upstream reports now.
        mem, _ = upstream_engine_model(self.lane, self.gw.cfg.max_num_seqs, self.engine is not None)
        if not mem.known:
            return
        shield, model_in_use = ctl.shield, ctl.shield.memory
        shield.memory = mem
        try:
            reqs = [self.reqs[r] for r in adm._in_flight]
            blocks = sum(shield.request_blocks(r.prompt_len, r.max_tokens, r.num_seqs) for r in reqs)
            mine = shield.blocks_fraction(blocks, sum(r.num_seqs for r in reqs), adm.kv_dtype)
        finally:
            shield.memory = model_in_use
        # Requests admitted while the budget was unknown are in flight (admission books them
        # again once it is known), or the upstream reports another pool than the last decision
        # saw (admission rebuilds the model before it admits): the same check.
        STATS["admissions_with_requests_admitted_unknown_in_flight"] += bool(self.unbooked.intersection(adm._in_flight))
        STATS["admissions_before_a_decision_saw_the_pool"] += self.lane.upstream.info is not self.pool_seen
        STATS["admissions_rechecked"] += len(out)
        if mine > ceiling + 1e-9:
            self.violations.append(f"{len(reqs)} requests in flight predict {mine:.2f} of memory "
                                   f"(admission's books: {frac:.2f}; ceiling {ceiling})")

    def _switched(self, what: str, *, check: bool) -> None:
        """A KV dtype switch decided now; through a gate (``check``) it must come at least the
        dwell time after the last switch of any kind."""
        now = CLOCK[0]
        if check:
            dwell = self.ctl.shield.cfg.min_dtype_dwell_s
            if now - self.last_switch < dwell:
                self.violations.append(f"{what} KV switch {now - self.last_switch:.0f} s after the last "
                                       f"one ({self.last_switch_kind}; dwell {dwell:.0f} s)")
            STATS["switches_checked_against_dwell"] += 1
            STATS["switches_checked_after_a_quality_fallback"] += self.last_switch_kind == "quality fallback"
        self.last_switch, self.last_switch_kind = now, what

    # --- control decisions -----------------------------------------------------------------
    # Hypothesis picks rules alike (and leaves some out of an example): the same run of
    # decisions under three names makes control decisions most of what a run does.
    runs = st.lists(intervals, min_size=20, max_size=60)

    @rule(ivs=runs)
    def decide(self, ivs: list) -> None:
        for iv in ivs:
            self._tick(*iv)

    @rule(ivs=runs)
    def decide_more(self, ivs: list) -> None:
        self.decide(ivs)

    @rule(ivs=runs)
    def decide_even_more(self, ivs: list) -> None:
        self.decide(ivs)

    def _tick(self, p: Proposal, counters: tuple, gap: int, fast: int, slow: int, dt: float,
              adversarial: bool) -> None:
        lane, ctl = self.lane, self.ctl
        self.advance(dt)  # restarts due meanwhile finish, timeouts fire
        now = CLOCK[0]
        if gap == 0:
            self.metrics = None
        else:
            running, waiting, kv, preempted = counters
            self.preempted += preempted
            self.metrics = (f'vllm:num_requests_running{{engine="0"}} {running}\n'
                            f'vllm:num_requests_waiting{{engine="0"}} {waiting}\n'
                            f'vllm:kv_cache_usage_perc{{engine="0"}} {kv}\n'
                            f'vllm:num_preemptions_total{{engine="0"}} {self.preempted}\n')
        for ttft in [0.3] * fast + ([3.0] if slow == 0 else []):
            self.n += 1
            lane.telemetry.on_finished(f"t{self.n}", now, ttft, 0.01, ttft + 0.5)
        self.scripted.next, self.adversarial = p, adversarial
        before = lane.knobs
        core_queued = [r for r in self.queued if self.reqs[r].priority == 0]
        shed0 = self.gw.metrics.rejected.labels("shed_low_priority")._value.get()
        self.aloop.run_until_complete(self.loop.tick(lane, now=now))
        STATS["decisions"] += 1
        self.pool_seen = lane.upstream.info
        after, dec = lane.knobs, ctl.last_decision
        step = ctl.shield.max_step(before.batch_cap)
        assert abs(after.batch_cap - before.batch_cap) <= step, (before, after, dec)
        if ctl.stale_intervals:
            STATS["decisions_without_counters"] += 1
            assert after.batch_cap <= before.batch_cap, (before, after, dec)
        new = dec["knobs"]
        if new["kv_dtype"] != before.kv_dtype:  # the shield let a switch through (the plant may decline it)
            STATS["switches_let_through_by_the_shield"] += 1
        if "dtype_dwell" in dec["interventions"]:
            STATS["switches_refused_by_dwell"] += 1
        if not ctl.shield.memory.known:
            STATS["decisions_budget_unknown"] += 1
            safe = self.gw.cfg.control.safe_batch_cap
            assert after.batch_cap <= max(safe, before.batch_cap - step), (before, after, dec)
        else:
            frac = ctl.shield.predicted_fraction(after.batch_cap, new["kv_dtype"])
            if frac > ctl.shield.cfg.memory_ceiling + 1e-9:  # over: on its way down, a full step
                assert after.batch_cap <= max(ctl.shield.cfg.min_batch, before.batch_cap - step), (frac, dec)
        STATS[f"breaker_level_{dec['breaker_level']}"] += 1
        self.settle()
        shed = self.gw.metrics.rejected.labels("shed_low_priority")._value.get() - shed0
        if shed:
            STATS["decisions_that_shed"] += 1
            if core_queued:  # core requests were queued when it shed (harvest: none of them was)
                STATS["sheds_with_core_queued"] += 1

    # --- requests --------------------------------------------------------------------------
    @rule(reqs=st.lists(st.tuples(st.integers(1, 2047), st.integers(1, 2048), st.integers(1, 8),
                                  st.integers(0, 2), st.floats(1.0, 600.0)), min_size=1, max_size=30))
    def arrive(self, reqs: list[tuple[int, int, int, int, float]]) -> None:
        """Long, wide and mixed-priority requests; those not admitted stay queued across
        decisions (a timeout, a shed, a slot freeing or their client leaving ends the wait)."""
        now = CLOCK[0]
        for prompt, out, seqs, prio, wait_s in reqs:
            self.n += 1
            rid = f"r{self.n}"
            req = self.reqs[rid] = Request(rid, now, prompt, out, priority=prio, num_seqs=seqs, max_tokens=out)
            self.queued[rid] = self.aloop.create_task(self.lane.acquire(req, now + wait_s))
        STATS["requests"] += len(reqs)
        STATS["core_requests"] += sum(r[3] == 0 for r in reqs)
        self.settle()

    @rule(k=st.integers(1, 20), ttft=st.floats(0.01, 5.0))
    def finish(self, k: int, ttft: float) -> None:
        now = CLOCK[0]
        for rid in self.held[:k]:
            self.lane.release(rid)
            self.lane.telemetry.on_finished(rid, now, ttft, 0.02, ttft + 1.0)
        self.held = self.held[k:]
        self.settle()

    @rule(k=st.integers(1, 10))
    def clients_leave(self, k: int) -> None:
        for rid in list(self.queued)[:k]:
            self.queued[rid].cancel()
        self.settle()

    @rule()
    def engine_reports_oom(self) -> None:
        self.lane.report_oom("error_answer", "answered 500 naming out-of-memory: CUDA out of memory")

    # --- the upstream ----------------------------------------------------------------------
    @rule(kind=st.sampled_from(["crash", "refused", "slow", "answers", "restart", "restart_no_drain"]),
          pool=pools, restart_s=st.floats(0.5, 90.0))
    def upstream(self, kind: str, pool: int | None, restart_s: float) -> None:
        """The upstream dies, stops answering or answers again, or is restarted; whatever
        restart comes next brings back ``pool`` (None: a /metrics without the KV pool)."""
        self.next_pool, self.restart_s = pool, restart_s
        if kind in ("restart", "restart_no_drain"):
            if self.engine is None:
                return
            drain = kind == "restart"

            async def go() -> None:
                self.sup.spawn(self.sup.restart(self.lane, cause="test", drain=drain), "test-restart")

            self.run(go())
            return
        if kind == "crash":
            if self.engine is None:
                return
            self.engine.exited = True
        self.probe_answer = {"refused": "connection refused (test)", "slow": "/health did not answer within 5 s",
                             "answers": None, "crash": None}[kind]
        self.run(self.sup.probe(self.lane))
        STATS[f"upstream_{kind}"] += 1

    @rule(pool=pools)
    def engine_info_changes(self, pool: int | None) -> None:
        """What the upstream reports of its KV pool changes (a re-read /metrics; for an
        unmanaged upstream, its operator restarted it): the next decision rebuilds the model."""
        info = self.lane.upstream.info
        self.lane.upstream.info = EngineInfo(model="m", max_model_len=2048, num_kv_blocks=pool,
                                             block_size=16 if pool else None, kv_dtype=info.kv_dtype if info else None)
        STATS["info_swaps"] += 1

    # --- the operator ----------------------------------------------------------------------
    @rule(cap=st.integers(1, 256), frozen=st.booleans(), force=st.booleans(),
          bucketing=st.one_of(st.none(), st.sampled_from(BUCKETING_MODES)))
    def operator_freeze(self, cap: int, frozen: bool, force: bool, bucketing: str | None) -> None:
        knobs = {"batch_cap": cap} | ({"bucketing": bucketing} if bucketing else {})
        before = self.lane.knobs

        async def go() -> bool:
            try:
                self.loop.freeze(frozen, knobs if frozen or force else None, force=force)
            except ValueError:
                return False
            return True

        ok = self.run(go())
        if ok and force:
            assert self.lane.knobs.batch_cap == cap  # set at once: an override, counted
            STATS["forced_freezes"] += 1
        elif ok:
            assert self.lane.knobs.batch_cap == before.batch_cap  # walked to by the decisions

    @rule(dtype=st.sampled_from(["auto", "fp8", "float16"]), force=st.booleans())
    def operator_kv_switch(self, dtype: str, force: bool) -> None:
        blocked = self.gw.quality.blocks_8bit
        changes = self.lane.knobs.kv_dtype != dtype

        async def go() -> str | None:
            try:
                self.loop.force_kv_dtype(dtype, force=force)
            except ValueError as exc:
                return str(exc)
            return None

        refused = self.run(go())
        if refused is None:
            if changes:
                self._switched("operator" + (" (forced)" if force else ""), check=not force)
                if not force:
                    assert not (blocked and dtype in KV_DTYPES_8BIT)
            STATS["operator_switches_forced" if force else "operator_switches"] += 1
        elif not force:
            if "cannot run here" in refused:
                STATS["operator_switch_refused_unrunnable"] += 1
            elif "quality guard" in refused:
                assert blocked and dtype in KV_DTYPES_8BIT
                STATS["operator_switch_refused_quality"] += 1
            elif "s after the last one" in refused:
                STATS["operator_switch_refused_dwell"] += 1
            else:
                STATS["operator_switch_refused_other"] += 1  # memory, or no gain to repay the restart
        else:
            assert "cannot run here" in refused, refused  # force never makes the impossible possible

    @rule()
    def operator_reset(self) -> None:
        last = self.ctl.shield.last_dtype_switch
        self.run(self._call(self.loop.reset_state))
        assert self.ctl.shield.breaker_level == 0 and self.ctl.shield.last_dtype_switch == last
        STATS["resets"] += 1

    @rule(mode=st.sampled_from(["pid", "policy", "static", "shadow"]))
    def operator_mode(self, mode: str) -> None:
        self.run(self._call(self.loop.policies.set_mode, mode))
        STATS[f"mode_{mode}"] += 1

    @rule(share=st.sampled_from([0.0, 0.5, None]), bad=st.booleans())
    def operator_reload(self, share: float | None, bad: bool) -> None:
        pm = self.loop.policies
        before = (pm.policy, pm.canary)
        try:
            self.run(self._call(pm.reload_policy, "/nonexistent/policy" if bad else None, share))
        except ValueError:
            assert bad and (pm.policy, pm.canary) == before  # the running one stays
            STATS["reloads_refused"] += 1
            return
        STATS["reloads"] += 1

    @rule(block=st.booleans())
    def quality_guard(self, block: bool) -> None:
        g = self.gw.quality
        if block:
            while not g.blocks_8bit:  # replays disagreeing
                g.record(0.5)
            STATS["quality_blocks"] += 1
        else:
            g.reset()  # the operator's /admin/quality/reset

    @precondition(lambda self: self.lane.knobs.kv_dtype in KV_DTYPES_8BIT
                  and self.lane.upstream.managed is not None and not self.lane.upstream.restarting)
    @rule(iv=intervals)
    def quality_guard_while_8bit(self, iv: tuple) -> None:
        """The guard blocks 8-bit while a managed lane runs it, then a decision: the fallback
        restart. Drawn only in that state: the rule above met it in ~1 % of examples, and one CI
        run (2026-12-05) asked for no fallback in 800 examples."""
        self.quality_guard(True)
        self._tick(*iv)

    async def _call(self, fn, *args):
        return fn(*args)

    @invariant()
    def no_violation(self) -> None:
        STATS["steps"] += 1
        assert not self.violations, self.violations
        assert 1 <= self.lane.knobs.batch_cap <= self.ctl.shield.max_batch

    def teardown(self) -> None:
        if not hasattr(self, "aloop"):
            return
        try:
            for t in self.queued.values():
                t.cancel()
            for rid in self.held:
                self.lane.release(rid)
            self.settle()

            async def stop() -> None:
                for t in list(self.sup._tasks):
                    t.cancel()
                await asyncio.gather(*self.sup._tasks, return_exceptions=True)

            self.aloop.run_until_complete(stop())
            adm = self.lane.admission
            if not self.violations:  # (one raised inside admission may leave its books half-done)
                adm.check_counts()
                assert adm.num_in_flight == 0 and adm.num_waiting == 0, "a slot leaked"
            STATS["examples"] += 1
        finally:
            self.aloop.close()


#: What each run must have exercised (at least once; the decisions at least MIN_DECISIONS times).
EXERCISED = ("decisions_that_shed", "sheds_with_core_queued", "refused_shed_low_priority", "breaker_level_2",
             "switches_checked_against_dwell", "switches_refused_by_dwell", "operator_switch_refused_dwell",
             "operator_switches", "operator_switches_forced", "restarts", "restart_asked_kv_dtype",
             "restart_asked_quality", "decisions_budget_unknown", "decisions_without_counters",
             "admissions_rechecked", "forced_freezes", "resets", "reloads", "reloads_refused", "refused_timeout")


def test_control_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every serving module that reads the clock: actuation stamps the KV switch's dwell when a
    # restart is done, and on the real clock (not patched) it let a later switch through the
    # dwell 54-216 s after the last one in this simulated time.
    for mod in (actuation_mod, control_loop_mod, lanes_mod, supervisor_mod):
        monkeypatch.setattr(mod, "time", SimTime())
    monkeypatch.setattr(control_loop_mod, "cpu_kv8_unavailable_reason", lambda: KV8_REASON[0])
    STATS.clear()
    t0 = time.perf_counter()
    # Hypothesis bounds the data of one example, so how many decisions 100 examples make varies
    # (~5,000-12,000 here): rounds of 100 until the run has made MIN_DECISIONS and exercised
    # every path above (a few at most; each round ~20-60 s on a shared 2-core machine). The
    # quality guard's restart was the rarest (none in 800 examples once, before its own rule).
    # derandomize=False: under CI (the CI variable set) hypothesis's "ci" profile derandomizes,
    # which made all 8 rounds the same 100 examples, so a path one round missed all missed.
    for _ in range(8):
        run_state_machine_as_test(ControlPath, settings=settings(
            max_examples=100, stateful_step_count=100, deadline=None, derandomize=False,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
        STATS["rounds"] += 1
        if STATS["decisions"] >= MIN_DECISIONS and all(STATS[what] for what in EXERCISED):
            break
    print(f"{time.perf_counter() - t0:.0f} s: {dict(sorted(STATS.items()))}")
    # Not vacuous: every invariant above met what it guards.
    assert STATS["decisions"] >= MIN_DECISIONS, dict(STATS)
    missing = [what for what in EXERCISED if not STATS[what]]
    assert not missing, f"{missing} never exercised in {STATS['rounds']} rounds ({STATS['examples']} examples)"
