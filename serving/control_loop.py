"""The gateway's control loop: every interval, per upstream,

    Telemetry (own request timings + upstream /metrics) -> controller -> Shield -> knobs -> Admission

Controllers: ``policy`` (the exported PPO policy through ``PolicyRuntime``), ``pid``,
``static``, and ``shadow`` (PID acts; the policy's choice is computed, logged and compared).
A policy that fails to load, raises, or yields non-finite outputs is replaced by PID, and the
gateway says so (log, ``batchpilot:policy_fallbacks``, ``/admin/status``).

Canary (the guide's grey release): a newly loaded policy drives a share of traffic (that share
of upstreams; with one upstream that share of control intervals) while the incumbent drives
the rest; after ``canary_min_intervals`` canary decisions it is promoted, unless its mean
goodput fell more than ``canary_max_drop`` below the incumbent's, in which case it is rolled
back. With time-sliced canaries the comparison is approximate (knobs carry over between
intervals), which is why the window is long.

KV dtype: a switch the shield lets through restarts a managed upstream (drained first, one at a
time, by the supervisor); for an unmanaged upstream it is only recommended (log + metric).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from batchpilot.core.engine import KV_DTYPES_8BIT, KV_DTYPES_16BIT, EngineCapabilities, MemoryModel
from batchpilot.core.vllm_cpu import cpu_kv8_unavailable_reason
from batchpilot.metrics import parse_vllm_metrics
from batchpilot.core.actions import action_mask, action_to_proposal
from batchpilot.policies.controllers import Controller, build_controller
from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.core.shield import INTERVENTION_KINDS, Shield, ShieldConfig, ShieldInputs
from batchpilot.core.admission import depths_padded
from batchpilot.serving.lanes import Lane
from batchpilot.serving.settings import CONTROL_MODES
from batchpilot.core.telemetry import Snapshot
from batchpilot.serving.upstream import UpstreamDown

if TYPE_CHECKING:
    from batchpilot.policies.runtime import PolicyRuntime
    from batchpilot.serving.gateway import Gateway

log = logging.getLogger(__name__)

CANARY_STATES = {"none": 0, "evaluating": 1, "promoted": 2, "rolled_back": 3}


def upstream_engine_model(lane: Lane, max_num_seqs: int, kv8_dtype: str, managed: bool) -> tuple[MemoryModel, EngineCapabilities]:
    """The shield's view of an upstream. The KV pool is the budget (vLLM pre-allocates it;
    weights live outside it), in units of one 16-bit block; an 8-bit block is half of one."""
    info = lane.upstream.info
    blocks = (info.num_kv_blocks if info and info.num_kv_blocks else 16384)
    block_size = (info.block_size if info and info.block_size else 16)
    bytes_ = {d: 1.0 for d in KV_DTYPES_16BIT} | {d: 0.5 for d in KV_DTYPES_8BIT}
    mem = MemoryModel(budget_bytes=float(blocks), weights_bytes=0.0, activation_bytes=0.0, block_size=block_size,
                      kv_block_bytes=bytes_, num_kv_blocks_total=blocks)
    why8 = cpu_kv8_unavailable_reason()
    kv = {d: None for d in KV_DTYPES_16BIT} | {d: why8 for d in KV_DTYPES_8BIT}
    max_len = info.max_model_len if info and info.max_model_len else 2048
    caps = EngineCapabilities(kv_dtypes=kv, max_model_len=max_len, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max(max_len, 2048), block_size=block_size)
    return mem, caps


def _needed_prefixes() -> tuple[str, ...]:
    from batchpilot.metrics import VLLM_METRIC_NAMES

    return tuple(sorted({n.removesuffix("_total") for names in VLLM_METRIC_NAMES.values() for n in names}))


_NEEDED = _needed_prefixes()


def _only_needed(text: str) -> str:
    """The lines of vLLM's /metrics the parser reads. The full text (histogram buckets of every
    metric) takes ~50 ms to parse on a busy core; the filtered one under a millisecond."""
    keep = []
    for line in text.splitlines():
        if line.startswith(_NEEDED) and "_bucket{" not in line:
            keep.append(line)
        elif line.startswith("# TYPE ") and line[7:].startswith(_NEEDED):
            keep.append(line)
    return "\n".join(keep) + "\n"


@dataclass
class LaneControl:
    """Per-upstream controller state."""

    shield: Shield
    pid: Controller
    static: Controller
    last_counters: dict[str, float] = field(default_factory=dict)
    breaker_restart_done: bool = False
    last_decision: dict[str, Any] = field(default_factory=dict)
    #: Who set the knobs the last interval ran under: a snapshot measures the interval that
    #: just ended, so its goodput is that decision's, not the one about to be taken.
    last_acting: str | None = None


@dataclass
class Canary:
    """A candidate policy on trial against the incumbent (the guide's grey release)."""

    runtime: "PolicyRuntime"
    path: str
    share: float
    cand_goodput: list[float] = field(default_factory=list)
    base_goodput: list[float] = field(default_factory=list)

    def record(self, who: str, goodput: float, *, min_intervals: int,
               max_drop: float) -> tuple[bool, str] | None:
        """Add one interval's goodput for ``who`` ("canary" or the incumbent). Once the canary
        has ``min_intervals`` of them (and the incumbent at least one): (promote?, why) —
        rolled back when its mean goodput is more than ``max_drop`` below the incumbent's."""
        (self.cand_goodput if who == "canary" else self.base_goodput).append(goodput)
        if len(self.cand_goodput) < min_intervals or not self.base_goodput:
            return None
        cand, base = float(np.mean(self.cand_goodput)), float(np.mean(self.base_goodput))
        if cand < (1.0 - max_drop) * base:
            return False, (f"canary goodput {cand:.2f}/s < {1 - max_drop:.0%} of incumbent "
                           f"{base:.2f}/s: rolled back")
        return True, f"canary goodput {cand:.2f}/s vs incumbent {base:.2f}/s: promoted"


class ControlLoop:
    """Runs the decisions; the admin API calls its ``reload_policy`` / ``set_mode`` / ``freeze``."""

    def __init__(self, gw: "Gateway") -> None:
        self.gw = gw
        cfg = self.cfg = gw.cfg
        s = gw.settings
        self.mode = cfg.control.mode
        self.frozen = False
        self.fallback_reason: str | None = None
        self.runtime: PolicyRuntime | None = None
        self.policy_path: str | None = None
        self.canary: Canary | None = None
        self.canary_state = "none"
        self.num_ticks = 0
        self.shadow_agree: list[bool] = []
        self.events: list[str] = []  # recent notable events, newest last (admin status)
        slo_ms = {"ttft": s.slo.ttft_ms, "tpot": s.slo.tpot_ms, "e2el": s.slo.e2el_ms}
        pid_node = dict(s.policy) if s.policy.get("kind") == "pid" else {"kind": "pid"}
        pid_node.setdefault("initial_batch_cap", cfg.control.initial_batch_cap)
        shield_cfg = ShieldConfig.from_cfg(s.shield)
        self.lane_ctl: dict[int, LaneControl] = {}
        now = time.monotonic()
        for ln in gw.lanes:
            mem, caps = upstream_engine_model(ln, cfg.max_num_seqs, cfg.kv8_dtype, ln.upstream.managed is not None)
            static = build_controller({"kind": "static", "batch_cap": ln.knobs.batch_cap,
                                       "bucketing": ln.knobs.bucketing, "kv_dtype": ln.knobs.kv_dtype}, cfg.max_num_seqs)
            self.lane_ctl[ln.index] = LaneControl(
                shield=Shield(shield_cfg, mem, caps, s.slo, now=now),
                pid=build_controller(pid_node, cfg.max_num_seqs, slo_ms),
                static=static,
            )
        if self.mode in ("policy", "shadow"):
            self.load_policy(cfg.control.policy_dir)
        self._task: asyncio.Task | None = None
        self._publish_mode()

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batchpilot-control")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        interval = self.cfg.control.interval_s
        next_t = time.monotonic() + interval
        while True:
            await asyncio.sleep(max(next_t - time.monotonic(), 0.0))
            next_t += interval
            for ln in self.gw.lanes:
                try:
                    await self.tick(ln)
                except Exception:  # one bad tick must not stop control of the service
                    log.exception("control tick failed on %s", ln.name)

    # --- policy management -----------------------------------------------------------------
    def _note(self, msg: str) -> None:
        # Values from admin calls end up here: escape control characters so none forges a line.
        msg = "".join(c if c.isprintable() else repr(c)[1:-1] for c in msg)
        log.warning("%s", msg)
        self.events = (self.events + [f"{time.strftime('%H:%M:%S')} {msg}"])[-50:]

    def _resolve_policy_dir(self, path: str | None) -> str:
        if path:
            return path
        from batchpilot.config import REPO_ROOT

        return str(REPO_ROOT / "policies" / "pretrained")

    def load_policy(self, path: str | None) -> bool:
        """Load the policy the controller modes use; on failure fall back to PID and say why."""
        from batchpilot.policies.runtime import PolicyLoadError, PolicyRuntime

        p = self._resolve_policy_dir(path)
        try:
            rt = PolicyRuntime.from_dir(p)
        except (PolicyLoadError, OSError, ValueError) as exc:
            self.runtime = None
            self._fallback("load_failed", f"policy at {p!r} failed to load: {exc}")
            return False
        self._use_policy(rt, p)
        return True

    def _use_policy(self, runtime: "PolicyRuntime", path: str) -> None:
        self.runtime = runtime
        self.policy_path = path
        self.fallback_reason = None
        self._publish_mode()
        log.info("policy loaded from %r", path)

    def reload_policy(self, path: str | None, canary_share: float | None = None) -> dict[str, Any]:
        """Admin: load a policy now, or start a canary with it (``canary_share`` > 0). A policy
        that fails to load raises ``ValueError`` and changes nothing: the running one stays."""
        from batchpilot.policies.runtime import PolicyLoadError, PolicyRuntime

        p = self._resolve_policy_dir(path or self.policy_path)
        share = self.cfg.control.canary_share if canary_share is None else canary_share
        try:
            rt = PolicyRuntime.from_dir(p)
        except (PolicyLoadError, OSError, ValueError) as exc:
            self._note(f"policy at {p!r} failed to load; the running controller is kept: {exc}")
            raise ValueError(f"policy at {p!r} failed to load (the running controller is kept): {exc}") from None
        if share > 0 and self.runtime is not None:
            self.canary = Canary(rt, p, share)
            self.canary_state = "evaluating"
            self._note(f"canary started: {p!r} on {share:.0%} of traffic")
            self._publish_mode()
            return {"ok": True, "canary": True, "path": p}
        self._use_policy(rt, p)
        return {"ok": True, "canary": False, "path": p, "fallback_reason": self.fallback_reason}

    def set_mode(self, mode: str) -> None:
        if mode not in CONTROL_MODES:
            raise ValueError(f"mode {mode!r}; one of {CONTROL_MODES}")
        self.mode = mode
        if mode in ("policy", "shadow") and self.runtime is None:
            self.load_policy(self.cfg.control.policy_dir)
        self._note(f"control mode set to {mode}")
        self._publish_mode()

    def freeze(self, frozen: bool, knobs: dict[str, Any] | None = None) -> None:
        """Hold the knobs (the breaker still protects). ``knobs`` sets them first, within the
        shield's range (not its step limit: an operator's explicit choice). A batch cap out of
        range raises ``ValueError`` before anything changes; it is never silently clamped."""
        knobs = {key: knobs[key] for key in ("batch_cap", "bucketing") if key in knobs} if knobs else {}
        cap = knobs.get("batch_cap")
        if cap is not None:
            top = min(self.lane_ctl[ln.index].shield.max_batch for ln in self.gw.lanes)
            if not 1 <= cap <= top:
                raise ValueError(f"batch_cap must be in [1, {top}] (the shield's max_batch), got {cap}")
        self.frozen = frozen
        for ln in self.gw.lanes if knobs else ():
            ln.set_knobs(ln.knobs.with_(**knobs))
        self._note(f"knobs {'frozen' if frozen else 'released'}" + (f" at {knobs}" if knobs else ""))

    def force_kv_dtype(self, dtype: str) -> dict[str, Any]:
        """Admin: switch every upstream's KV dtype (restart managed ones, one at a time)."""
        caps = self.lane_ctl[self.gw.lanes[0].index].shield.capabilities
        why = caps.why_not(dtype)
        if why is not None:
            raise ValueError(f"kv dtype {dtype!r} cannot run here: {why}")
        out: dict[str, str] = {}
        managed = []
        for ln in self.gw.lanes:
            if ln.knobs.kv_dtype == dtype:
                out[ln.name] = "already"
            elif ln.upstream.managed is not None:
                managed.append(ln)
                out[ln.name] = "restarting"
            else:
                self.gw.metrics.kv_recommendation.labels(ln.name, dtype).set(1)
                out[ln.name] = "recommended (not managed)"
        if managed:
            async def one_by_one() -> None:
                for ln in managed:  # the supervisor's lock also serialises them
                    await self.gw.supervisor.restart(ln, cause="admin", kv_dtype=dtype)
                    self.lane_ctl[ln.index].shield.last_dtype_switch = time.monotonic()

            self.gw.supervisor.spawn(one_by_one(), "batchpilot-admin-kv-dtype")
        self._note(f"operator KV dtype switch to {dtype}: {out}")
        return {"dtype": dtype, "upstreams": out}

    def _fallback(self, reason: str, message: str) -> None:
        self.fallback_reason = f"{reason}: {message}"
        self.gw.metrics.policy_fallbacks.labels(reason).inc()
        self._note(f"policy fallback to PID ({message})")
        self._publish_mode()

    def acting(self) -> str:
        if self.mode in ("pid", "shadow"):
            return "pid"
        if self.mode == "static":
            return "static"
        return "pid" if self.runtime is None else "policy"

    def _publish_mode(self) -> None:
        m = self.gw.metrics
        act = self.acting()
        for mode in CONTROL_MODES:
            for a in ("policy", "pid", "static"):
                m.controller.labels(mode, a).set(float(mode == self.mode and a == act))
        m.canary.set(CANARY_STATES[self.canary_state])

    # --- one decision ----------------------------------------------------------------------
    def _policy_proposal(self, runtime: "PolicyRuntime", obs: np.ndarray, knobs: Knobs) -> Proposal:
        """Raises ValueError for non-finite outputs (the caller falls back)."""
        logits = runtime.logits(obs)
        if not np.all(np.isfinite(logits)):
            raise ValueError("policy returned non-finite outputs (NaN/inf)")
        kv_ok = {d: cpu_kv8_unavailable_reason() is None for d in KV_DTYPES_8BIT} | {d: True for d in KV_DTYPES_16BIT}
        mask = action_mask(kv_ok, kv16_dtype="auto", kv8_dtype=self.cfg.kv8_dtype)
        action = runtime.act(obs, mask)
        return action_to_proposal(action, knobs, kv16_dtype="auto", kv8_dtype=self.cfg.kv8_dtype)

    def decide(self, lane: Lane, snap: Snapshot, obs: np.ndarray) -> tuple[Proposal, str]:
        ctl = self.lane_ctl[lane.index]
        pid_p = ctl.pid.decide(snap, lane.knobs)  # PID always runs: it is the fallback, keep it warm
        if self.mode == "static":
            return ctl.static.decide(snap, lane.knobs), "static"
        if self.mode == "pid" or self.runtime is None:
            return pid_p, "pid"
        runtime, who = self.runtime, "policy"
        if self.canary is not None and self._canary_drives(lane):
            runtime, who = self.canary.runtime, "canary"
        try:
            pol_p = self._policy_proposal(runtime, obs, lane.knobs)
        except Exception as exc:
            if who == "canary":
                self._end_canary(promote=False, why=f"canary policy failed: {exc}")
                return pid_p, "pid"
            self.runtime = None
            self._fallback("bad_output", f"policy failed at decision time: {exc}")
            return pid_p, "pid"
        if self.mode == "shadow":
            cur = lane.knobs.batch_cap
            sign = lambda x: (x > cur) - (x < cur)  # noqa: E731
            self.shadow_agree = (self.shadow_agree + [sign(pol_p.batch_cap or cur) == sign(pid_p.batch_cap or cur)])[-100:]
            self.gw.metrics.shadow_agreement.set(sum(self.shadow_agree) / len(self.shadow_agree))
            log.debug("shadow: policy %s vs pid %s", pol_p, pid_p)
            return pid_p, "pid"
        return pol_p, who

    def _canary_drives(self, lane: Lane) -> bool:
        c = self.canary
        n = len(self.gw.lanes)
        if n > 1:
            return lane.index < max(1, math.ceil(c.share * n))
        period = max(1, round(1.0 / max(c.share, 1e-6)))
        return self.num_ticks % period == 0

    def _canary_record(self, who: str, goodput: float) -> None:
        c = self.canary
        if c is None:
            return
        verdict = c.record(who, goodput, min_intervals=self.cfg.control.canary_min_intervals,
                           max_drop=self.cfg.control.canary_max_drop)
        if verdict is not None:
            self._end_canary(*verdict)

    def _end_canary(self, promote: bool, why: str) -> None:
        c = self.canary
        self.canary = None
        if promote and c is not None:
            self.runtime, self.policy_path = c.runtime, c.path
        self.canary_state = "promoted" if promote else "rolled_back"
        self._note(why)
        self._publish_mode()

    async def _scrape(self, lane: Lane) -> dict[str, float]:
        try:
            return parse_vllm_metrics(_only_needed(await lane.upstream.metrics_text()))
        except (UpstreamDown, ValueError):
            return {}

    async def tick(self, lane: Lane) -> None:
        """One decision for one upstream."""
        t0 = time.perf_counter()
        self.num_ticks += 1
        ctl = self.lane_ctl[lane.index]
        m = await self._scrape(lane) if lane.upstream.healthy else {}
        last = ctl.last_counters
        d_pre = max(0.0, m.get("num_preemptions", 0.0) - last.get("num_preemptions", m.get("num_preemptions", 0.0)))
        d_q = m.get("prefix_cache_queries", 0.0) - last.get("prefix_cache_queries", 0.0)
        d_h = m.get("prefix_cache_hits", 0.0) - last.get("prefix_cache_hits", 0.0)
        if m:
            ctl.last_counters = m
        lane.telemetry.on_preemptions(int(d_pre))
        hit = d_h / d_q if d_q > 0 else 0.0
        now = time.monotonic()
        snap = lane.telemetry.snapshot(
            now,
            queue_depth=depths_padded(lane.admission.queue_depths),
            num_running=int(m.get("num_running", lane.admission.num_in_flight)),
            num_waiting_engine=int(m.get("num_waiting", 0)),
            kv_cache_usage=float(m.get("kv_cache_usage", 0.0)),
            knobs=lane.knobs,
            prefix_cache_hit_rate=hit,
        )
        obs = lane.telemetry.observation(snap)
        if self.frozen:
            proposal, who = Proposal(), "frozen"
        else:
            proposal, who = self.decide(lane, snap, obs)
        info = lane.upstream.info
        inputs = ShieldInputs.from_snapshot(snap, num_kv_blocks_total=info.num_kv_blocks if info else None)
        dec = ctl.shield.apply(proposal, lane.knobs, inputs, now)
        if ctl.last_acting is not None:
            self._canary_record(ctl.last_acting, snap.request_goodput)
        self._apply(lane, ctl, dec, who)
        ctl.last_acting = who
        mt = self.gw.metrics
        mt.goodput.labels(lane.name).set(snap.request_goodput)
        mt.p99_ttft.labels(lane.name).set(snap.ttft_p99_ms)
        if m:
            mt.upstream_kv_usage.labels(lane.name).set(snap.kv_cache_usage)
            mt.upstream_prefix_hit_rate.labels(lane.name).set(hit)
        ctl.last_decision = {"acting": who, "proposal": str(proposal), "knobs": dec.knobs.as_dict(),
                             "interventions": dec.interventions, "breaker_level": dec.breaker_level,
                             "goodput": snap.request_goodput, "ttft_p99_ms": snap.ttft_p99_ms}
        mt.control_tick.observe(time.perf_counter() - t0)

    def _apply(self, lane: Lane, ctl: LaneControl, dec: Any, who: str) -> None:
        mt = self.gw.metrics
        for kind in dec.interventions:
            mt.shield_interventions.labels(kind if kind in INTERVENTION_KINDS else "other").inc()
        if dec.interventions:
            lane.telemetry.on_shield_intervention(dec.num_interventions)
        for a in dec.alerts:
            mt.alerts.inc()
            self._note(f"shield alert on {lane.name}: {a}")
        new = dec.knobs
        # KV dtype: restart a managed upstream (drained, one at a time), else recommend.
        want = new.kv_dtype
        if want != lane.knobs.kv_dtype:
            new = new.with_(kv_dtype=lane.knobs.kv_dtype)  # in force only once the restart is done
            guard = self.gw.quality
            if want in KV_DTYPES_8BIT and guard is not None and guard.blocks_8bit:
                pass  # the quality guard keeps 16-bit
            elif lane.upstream.managed is not None:
                self._note(f"{who} switches {lane.name} KV cache to {want}: restarting it")
                self.gw.supervisor.spawn(self.gw.supervisor.restart(lane, cause="kv_dtype", kv_dtype=want), "batchpilot-restart")
            else:
                mt.kv_recommendation.labels(lane.name, want).set(1)
                log.info("recommend kv_cache_dtype=%s for %s (not managed: not applied)", want, lane.name)
        lane.set_knobs(new)
        # Breaker levels 2 and 3.
        prev = lane.breaker_level
        lane.breaker_level = dec.breaker_level
        mt.breaker_level.labels(lane.name).set(dec.breaker_level)
        if dec.breaker_level >= 2:
            lane.shed_fraction = self.cfg.breaker.shed_fraction
            if prev < 2:
                n = lane.shed_queued(dec.shed_max_priority_kept)
                self._note(f"breaker level 2 on {lane.name}: shed {n} queued low-priority requests, "
                           f"rejecting {lane.shed_fraction:.0%} of low-priority arrivals")
        else:
            lane.shed_fraction = 0.0
        if dec.recommend_restart and self.cfg.breaker.restart and not ctl.breaker_restart_done:
            if lane.upstream.managed is not None:
                ctl.breaker_restart_done = True
                self._note(f"breaker level 3 on {lane.name}: restarting it (core requests stay queued)")
                self.gw.supervisor.spawn(self.gw.supervisor.restart(lane, cause="breaker"), "batchpilot-restart")
            else:
                self._note(f"breaker level 3 on {lane.name}: restart recommended (not managed)")
        if dec.breaker_level == 0:
            ctl.breaker_restart_done = False
        # The quality guard's fallback to 16-bit.
        guard = self.gw.quality
        if guard is not None and guard.blocks_8bit and lane.knobs.kv_dtype in KV_DTYPES_8BIT \
                and lane.upstream.managed is not None and not lane.upstream.restarting:
            self._note(f"quality guard: output-diff rate {guard.diff_rate:.1%} above threshold; "
                       f"{lane.name} back to 16-bit KV")
            self.gw.supervisor.spawn(self.gw.supervisor.restart(lane, cause="quality", kv_dtype="auto"), "batchpilot-restart")

    def status(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "acting": self.acting(),
            "frozen": self.frozen,
            "policy_path": self.policy_path,
            "fallback_reason": self.fallback_reason,
            "canary": {"state": self.canary_state,
                       "path": self.canary.path if self.canary else None,
                       "share": self.canary.share if self.canary else None},
            "lanes": {ln.name: {**self.lane_ctl[ln.index].last_decision, "knobs_in_force": ln.knobs.as_dict(),
                                "queue_depths": list(ln.admission.queue_depths),
                                "in_flight": ln.admission.num_in_flight,
                                "healthy": ln.upstream.healthy, "restarting": ln.upstream.restarting}
                      for ln in self.gw.lanes},
            "events": self.events[-20:],
        }
