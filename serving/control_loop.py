"""The gateway's control loop: every interval, per upstream,

    Telemetry (own request timings + upstream /metrics) -> controller -> Shield -> knobs -> Admission

The decision itself is the core's one control step (``batchpilot.core.control``), the one the
environment and the evaluation take. Which controller acts (the policy, its canary, PID,
static; shadow) is ``PolicyManager``'s call; restarts are the supervisor's. What stays here:
reading the interval (telemetry + the upstream's counters) and carrying the decision out on
the lane (knobs, breaker levels 2 and 3, KV dtype switches; the quality guard's fallback is the
lane plant's veto inside ``actuate``).

KV dtype: a switch the shield lets through restarts a managed upstream (drained first, one at a
time, by the supervisor); for an unmanaged upstream it is only recommended (log + metric).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from batchpilot.core.admission import depths_padded
from batchpilot.core.control import ControllerChain, ControlStep, FailSafe, control_step, shield_inputs
from batchpilot.core.controller import Controller
from batchpilot.core.engine import KV_DTYPES_8BIT, KV_DTYPES_16BIT, EngineCapabilities, MemoryModel, ModelMemory
from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.core.plant import BreakerTrip, actuate
from batchpilot.core.shield import INTERVENTION_KINDS, Decision, Shield, ShieldConfig, ShieldInputs
from batchpilot.core.telemetry import Snapshot
from batchpilot.metrics import parse_vllm_metrics
from batchpilot.platform.vllm_cpu import cpu_kv8_unavailable_reason, engines_run_on_cpu
from batchpilot.policies.controllers import build_controller
from batchpilot.schemas.serve import ServeConfig
from batchpilot.serving.actuation import LanePlant, LaneServices
from batchpilot.serving.lanes import Lane
from batchpilot.serving.policy_manager import PolicyManager
from batchpilot.serving.upstream import UpstreamDown

log = logging.getLogger(__name__)


class GatewayView(LaneServices, Protocol):
    """What the control loop uses of the gateway (``Gateway`` is one): typed here rather than
    by importing the gateway, which builds the control loop."""

    cfg: ServeConfig
    settings: Any  # the gateway's AppSettings: slo, control (the loop's interval, start knobs), shield, policy
    lanes: list[Lane]
    model_dir: str | None


def deployment_model(model_dir: str | None, tensor_parallel: int = 1) -> tuple[ModelMemory | None, str]:
    """The deployment's model in the core's one memory model, from its ``config.json`` (KV
    formula, MLA included) and the size of its weight files (per rank); (None, why) when the
    folder or its config is missing."""
    if not model_dir:
        return None, "no model folder (serve.model) to read the model's config from"
    path = Path(model_dir)
    try:
        config = json.loads((path / "config.json").read_text())
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) or \
            sum(f.stat().st_size for f in path.glob("*.bin"))
        tp = max(1, int(tensor_parallel))
        return ModelMemory.from_hf_config(config, tensor_parallel=tp, weights_bytes=weights / tp), str(path)
    except (OSError, ValueError) as exc:
        return None, f"cannot read the model config in {model_dir}: {exc}"


def upstream_engine_model(lane: Lane, max_num_seqs: int, managed: bool,
                          declared_kv_dtypes: list[str] | None = None, *,
                          model: ModelMemory | None = None,
                          given_kv_bytes: float | None = None,
                          max_num_batched_tokens: int | None = None) -> tuple[MemoryModel, EngineCapabilities]:
    """The shield's view of an upstream, from what the upstream itself says (``/v1/models``,
    ``vllm:cache_config_info``) and how the gateway launched it; never from the gateway's own
    host unless the engine runs there (managed).

    Memory: the core's one model (``ModelMemory``, the simulator's and the live engine's KV
    formula) fed from the deployment's model (``model``: its config.json and weights) and the
    engine's real KV pool (``num_gpu_blocks`` x ``block_size`` from ``vllm:cache_config_info``):
    budget = weights + the pool (vLLM's activation workspace is not visible from outside; it is
    left out, so the ceiling applies to weights + KV). When vLLM reports an override pool
    (``num_gpu_blocks_override``: a pool deliberately smaller than the memory the engine holds)
    and the gateway knows what it gave the engine for KV (``given_kv_bytes``: a managed CPU
    engine's ``VLLM_CPU_KVCACHE_SPACE``), the budget is weights + that memory, the env's rule
    (``VLLMEngine._given_budget_bytes``): the pool's own limit is then vLLM's (it preempts);
    counted as weights + pool, the 80 % ceiling held the pool at ~60 % and the breaker shed
    what vLLM serves with a few preemptions. Without the model: the pool alone in
    blocks (``source`` "kv_pool"; an 8-bit block counts half). Without the pool: ``source``
    "unknown: ...", which the control loop answers with the safe static cap (never a guessed
    budget; it was an invented 16,384 blocks).

    KV dtypes: a managed engine can run what this machine's vLLM can; an unmanaged one what its
    operator declared (``serve.upstream_kv_dtypes``), else only the dtype it runs.

    Token budget per iteration: ``max_num_batched_tokens`` (``token_budget``: what the gateway
    started the engine with or its operator said), else vLLM's CPU server default (2,048, or
    ``max_model_len`` if larger); vLLM does not publish it on /metrics."""
    info = lane.upstream.info
    blocks = info.num_kv_blocks if info and info.num_kv_blocks else None
    block_size = info.block_size if info and info.block_size else None
    running = lane.knobs.kv_dtype
    if blocks is None or block_size is None:
        missing = "num_gpu_blocks" if blocks is None else "block_size"
        zero = {d: 0.0 for d in (*KV_DTYPES_16BIT, *KV_DTYPES_8BIT)}
        mem = MemoryModel(budget_bytes=1.0, weights_bytes=0.0, activation_bytes=0.0, block_size=block_size or 16,
                          kv_block_bytes=zero, num_kv_blocks_total=0,
                          source=f"unknown: {lane.name}'s /metrics has no vllm:cache_config_info {missing}")
    elif model is not None:
        given = info is not None and info.num_kv_blocks_override is not None and given_kv_bytes is not None
        mem = model.memory_model(block_size=block_size, num_blocks=blocks,
                                 kv_dtype=running if running in KV_DTYPES_16BIT + KV_DTYPES_8BIT else "auto",
                                 budget_bytes=model.weights_bytes + float(given_kv_bytes) if given else None)
        if given:
            mem = replace(mem, source="model, given KV memory (override pool)")
    else:
        bytes_ = {d: 1.0 for d in KV_DTYPES_16BIT} | {d: 0.5 for d in KV_DTYPES_8BIT}
        mem = MemoryModel(budget_bytes=float(blocks), weights_bytes=0.0, activation_bytes=0.0, block_size=block_size,
                          kv_block_bytes=bytes_, num_kv_blocks_total=blocks, source="kv_pool")
    if managed:
        why8 = cpu_kv8_unavailable_reason()
        kv = {d: None for d in KV_DTYPES_16BIT} | {d: why8 for d in KV_DTYPES_8BIT}
    else:
        ok = set(declared_kv_dtypes or ()) | {running} | ({"auto"} if running in KV_DTYPES_16BIT else set())
        why = (f"{lane.name} is not managed by the gateway and its operator did not declare it can run this "
               "KV dtype (serve.upstream_kv_dtypes)")
        kv = {d: (None if d in ok else why) for d in (*KV_DTYPES_16BIT, *KV_DTYPES_8BIT)}
    max_len = info.max_model_len if info and info.max_model_len else 2048
    caps = EngineCapabilities(kv_dtypes=kv, max_model_len=max_len, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens or max(max_len, 2048),
                              block_size=block_size or 16)
    return mem, caps


def given_kv_bytes(lane: Lane) -> float | None:
    """The memory the gateway gave a managed CPU engine for its KV cache
    (``VLLM_CPU_KVCACHE_SPACE``); None for an engine it does not manage or on a GPU, where
    what vLLM holds (``gpu_memory_utilization`` of the device) is not visible from here."""
    managed = lane.upstream.managed
    if managed is None or not engines_run_on_cpu():
        return None
    return float(managed.kv_cache_space_gib) * 2**30


def _vllm_arg(cfg: Any, *names: str) -> str | None:
    """The value of the first of ``names`` in the managed engines' extra arguments."""
    args = list(cfg.extra_vllm_args or ())
    for i, a in enumerate(args):
        for name in names:
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
            if a == name and i + 1 < len(args):
                return args[i + 1]
    return None


def _tensor_parallel(cfg: Any) -> int:
    """``serve.tensor_parallel``, else ``--tensor-parallel-size``/``-tp`` in the managed engines'
    arguments, else 1."""
    if cfg.tensor_parallel:
        return int(cfg.tensor_parallel)
    return int(_vllm_arg(cfg, "--tensor-parallel-size", "-tp") or 1)


def token_budget(cfg: Any) -> int | None:
    """``serve.max_num_batched_tokens``, else ``--max-num-batched-tokens`` in the engines'
    arguments, else None (``upstream_engine_model`` then takes vLLM's CPU server default)."""
    if cfg.max_num_batched_tokens:
        return int(cfg.max_num_batched_tokens)
    given = _vllm_arg(cfg, "--max-num-batched-tokens")
    return int(given) if given else None


def decision_record(tick: int, lane: str, now: float, who: str, snap: Snapshot, dec: Decision) -> dict[str, Any]:
    """One decision as ``GET /admin/decisions`` lists it: what the controller saw (the snapshot's
    latencies, load and queue) and the knobs the shield let through. A value that is not finite
    is null (JSON has no NaN)."""
    seen = {"arrival_rate": snap.arrival_rate, "goodput": snap.request_goodput, "ttft_p99_ms": snap.ttft_p99_ms,
            "tpot_p99_ms": snap.tpot_p99_ms, "kv_cache_usage": snap.kv_cache_usage}
    return {"tick": tick, "lane": lane, "t": now, "acting": who, **dec.knobs.as_dict(),
            "interventions": sorted(dec.interventions), "breaker_level": dec.breaker_level,
            "queue": int(sum(snap.queue_depth)), "running": snap.num_running,
            **{k: float(v) if math.isfinite(v) else None for k, v in seen.items()}}


@dataclass
class LaneControl:
    """Per-upstream controller state."""

    shield: Shield
    pid: Controller
    static: Controller
    last_counters: dict[str, float] = field(default_factory=dict)
    #: Intervals in a row without the upstream's counters (failed /metrics scrape or down).
    stale_intervals: int = 0
    last_snapshot: Snapshot | None = None
    #: The lane as the plant decisions act on (``serving/actuation.py``), and its breaker trip.
    plant: LanePlant | None = None
    trip: BreakerTrip = field(default_factory=BreakerTrip)
    last_decision: dict[str, Any] = field(default_factory=dict)
    #: Who set the knobs the last interval ran under: a snapshot measures the interval that
    #: just ended, so its goodput is that decision's, not the one about to be taken.
    last_acting: str | None = None
    #: The upstream's ``EngineInfo`` the memory model was built from (rebuilt when it changes:
    #: a restart may bring another KV pool or dtype).
    info: Any = None
    #: Where the restart time the shield and the KV agent weigh comes from: "configured"
    #: (``shield.dtype_restart_s``) until the managed upstream has come up once, then "measured".
    restart_source: str = "configured"


class Hold:
    """Frozen knobs: proposes the operator's target (nothing without one), so the shield walks
    the knobs there and then keeps them (its breaker still protects)."""

    name = "frozen"

    def __init__(self, target: dict[str, Any] | None = None) -> None:
        self.target = target or {}

    def reset(self, knobs: Knobs) -> None:
        pass

    def decide(self, snapshot: Snapshot, knobs: Knobs) -> Proposal:
        return Proposal(batch_cap=self.target.get("batch_cap"), bucketing=self.target.get("bucketing"))


class ControlLoop:
    """Runs the decisions; the admin API calls its ``freeze`` and ``force_kv_dtype`` (and ``policies`` for the rest)."""

    def __init__(self, gw: GatewayView) -> None:
        self.gw = gw
        cfg = self.cfg = gw.cfg
        s = gw.settings
        self.frozen = False
        self.target: dict[str, Any] = {}  # the operator's knob target while frozen
        self.overrides: list[str] = []  # forced operator actions, newest last (status)
        self.num_ticks = 0
        self.events: list[str] = []  # recent notable events, newest last (admin status)
        #: One record per decision, oldest first (``decisions``; ``GET /admin/decisions``).
        self.history: deque[dict[str, Any]] = deque(maxlen=int(cfg.control.history_len))
        #: Lane name -> the start KV dtype chosen for it (``choose_start_kv_dtype``; empty: not run).
        self.kv_start: dict[str, str] = {}
        pid_node = dict(s.policy) if s.policy.get("kind") == "pid" else {"kind": "pid"}
        pid_node.setdefault("initial_batch_cap", s.control.initial_batch_cap)
        shield_cfg = ShieldConfig.from_cfg(s.shield)
        #: The shield stage's rules for what a lane cannot see (stale /metrics, unknown memory).
        self.fail_safe = FailSafe.from_cfg(cfg.control)
        self.lane_ctl: dict[int, LaneControl] = {}
        now = time.monotonic()
        self.model, self.model_source = deployment_model(gw.model_dir, _tensor_parallel(cfg))
        if self.model is None:
            log.warning("memory model: %s; the shield counts the upstreams' KV pools alone (weights not counted)",
                        self.model_source)
        self.token_budget = token_budget(cfg)
        for ln in gw.lanes:
            mem, caps = self._engine_model(ln)
            static = build_controller({"kind": "static", "batch_cap": ln.knobs.batch_cap,
                                       "bucketing": ln.knobs.bucketing, "kv_dtype": ln.knobs.kv_dtype}, cfg.max_num_seqs)
            self.lane_ctl[ln.index] = LaneControl(
                shield=Shield(shield_cfg, mem, caps, s.slo, now=now),
                pid=build_controller(pid_node, cfg.max_num_seqs, s.slo),
                static=static,
            )
            ctl = self.lane_ctl[ln.index]
            ctl.plant = LanePlant(gw, ln, lambda c=ctl: c.shield, self._note)
            self._use_memory_model(ln, self.lane_ctl[ln.index], mem)
            ln.before_admit = self._check_engine
        caps = self.lane_ctl[gw.lanes[0].index].shield.capabilities
        self.policies = PolicyManager(cfg.control, gw.metrics, max_num_seqs=cfg.max_num_seqs,
                                      kv_runnable={d: caps.can_run(d) for d in caps.kv_dtypes}, note=self._note,
                                      kv_restart_s=shield_cfg.dtype_restart_s, slo=s.slo)
        self._task: asyncio.Task | None = None
        #: When (monotonic) a round of decisions last completed without an error (``failed``).
        self.last_ok = time.monotonic()

    def failed(self, now: float) -> bool:
        """Whether the control loop itself has failed: its task ended (not by ``stop``) or no
        round of decisions completed for ``serve.control.fail_open_after_s``."""
        if self._task is not None and self._task.done():
            return True
        return now - self.last_ok > self.cfg.control.fail_open_after_s

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
        interval = self.gw.settings.control.interval_s
        next_t = time.monotonic() + interval
        while True:
            await asyncio.sleep(max(next_t - time.monotonic(), 0.0))
            next_t += interval
            ok = True
            for ln in self.gw.lanes:
                try:
                    await self.tick(ln)
                except Exception:  # one bad tick must not stop control of the service
                    ok = False
                    log.exception("control tick failed on %s", ln.name)
            if ok:
                self.last_ok = time.monotonic()

    # --- the memory model ------------------------------------------------------------------
    def _use_memory_model(self, ln: Lane, ctl: LaneControl, mem: MemoryModel) -> None:
        """Wire a lane's engine model: admission checks each request against the lane's shield
        (the one prediction) when the budget is known; when it is not, the cap is held at the
        safe static cap (the shield stage's ``FailSafe``) and this says so loudly (log, metric, status)."""
        ctl.info = ln.upstream.info
        ln.admission.memory = ctl.shield if mem.known else None
        # The engine's token budget, which admission's prefill backlog counts in.
        ln.admission.use_token_budget(ctl.shield.capabilities.max_num_batched_tokens)
        self.gw.metrics.memory_model_known.labels(ln.name).set(
            1.0 if mem.known and mem.source != "kv_pool" else 0.5 if mem.known else 0.0)
        why = ctl.shield.no_room_reason() if mem.known else None
        if why is not None:
            self._note(f"{ln.name}: {why}; until then every request is refused as too large for memory")
        if not mem.known:
            self._note(f"memory budget of {ln.name} unknown ({mem.source.removeprefix('unknown: ')}): holding its "
                       f"cap at or below the safe cap {self.cfg.control.safe_batch_cap}, per-request memory "
                       "checks off, until the engine reports its KV pool")

    def _check_engine(self, ln: Lane) -> None:
        """The memory model again when the upstream reports another engine (restarted, first
        seen: its KV pool may differ); at each decision and before each admission pass."""
        ctl = self.lane_ctl[ln.index]
        if ln.upstream.info is not ctl.info:
            self._refresh_memory_model(ln, ctl)

    def _engine_model(self, ln: Lane) -> tuple[MemoryModel, EngineCapabilities]:
        """The shield's view of a lane's upstream as it reports itself now."""
        return upstream_engine_model(ln, self.cfg.max_num_seqs, ln.upstream.managed is not None,
                                     self.cfg.upstream_kv_dtypes, model=self.model,
                                     given_kv_bytes=given_kv_bytes(ln), max_num_batched_tokens=self.token_budget)

    def _refresh_memory_model(self, ln: Lane, ctl: LaneControl) -> None:
        mem, caps = self._engine_model(ln)
        was = ctl.shield.memory.source
        ctl.shield.set_engine(mem, caps)
        self._use_memory_model(ln, ctl, mem)
        if mem.source != was:
            log.info("memory model of %s: %s (was %s)", ln.name, mem.source, was)

    # --- policy management -----------------------------------------------------------------
    def _note(self, msg: str) -> None:
        # Values from admin calls end up here: escape control characters so none forges a line.
        msg = "".join(c if c.isprintable() else repr(c)[1:-1] for c in msg)
        log.warning("%s", msg)
        self.events = (self.events + [f"{time.strftime('%H:%M:%S')} {msg}"])[-50:]

    def freeze(self, frozen: bool, knobs: dict[str, Any] | None = None, *, force: bool = False) -> None:
        """Hold the knobs (the breaker still protects). ``knobs`` are a target the frozen loop
        walks towards through the shield (30 % steps, memory ceiling) like any proposal; with
        ``force`` they are set at once, logged, counted (``batchpilot:admin_overrides``) and
        shown in status. Checked whole first: a batch cap out of range, or knobs that a running
        controller would overwrite at once (not frozen, not forced), raise ``ValueError``
        before anything changes; nothing is silently clamped."""
        knobs = {key: knobs[key] for key in ("batch_cap", "bucketing") if key in knobs} if knobs else {}
        cap = knobs.get("batch_cap")
        if cap is not None:
            top = min(self.lane_ctl[ln.index].shield.max_batch for ln in self.gw.lanes)
            if not 1 <= cap <= top:
                raise ValueError(f"batch_cap must be in [1, {top}] (the shield's max_batch), got {cap}")
        if knobs and not frozen and not force:
            raise ValueError("knobs with frozen=false would be overwritten by the controller at once: "
                             "freeze them (frozen=true) or set them once with force=true")
        self.frozen = frozen
        self.target = {} if force or not frozen else knobs
        if force and knobs:
            for ln in self.gw.lanes:
                ln.set_knobs(ln.knobs.with_(**knobs))
            self._override("freeze", f"knobs set at once to {knobs}, past the shield's step limit")
        self._note(f"knobs {'frozen' if frozen else 'released'}"
                   + (f", walking towards {knobs}" if self.target else ""))

    def reset_state(self) -> None:
        """Control state back to start-up on every lane: the breaker (and its shedding), every
        controller's memory (PID's integral and settle timer, a policy's residual), the
        telemetry windows and counters; knobs, mode, policy and the KV dwell are kept. For an
        operator after maintenance, and for back-to-back experiments, where each run must not
        start under the last one's breaker and latency windows. Lifting a breaker is an
        override: logged, counted, in status."""
        now = time.monotonic()
        for ln in self.gw.lanes:
            ctl = self.lane_ctl[ln.index]
            last_switch = ctl.shield.last_dtype_switch
            ctl.shield.reset(now)
            ctl.shield.last_dtype_switch = last_switch  # a reset is no licence to switch again sooner
            ctl.trip = BreakerTrip()
            for controller in (ctl.pid, ctl.static, *self.policies.lane_policies(ln.index)):
                controller.reset(ln.knobs)
            ln.telemetry.reset(now)
            ctl.last_acting, ctl.last_snapshot, ctl.stale_intervals = None, None, 0
        self._override("reset", "control state reset: breaker, controller memory and telemetry windows")

    def _override(self, kind: str, what: str) -> None:
        self.gw.metrics.admin_overrides.labels(kind).inc()
        self.overrides = (self.overrides + [f"{time.strftime('%H:%M:%S')} {kind}: {what}"])[-20:]
        self._note(f"operator override (force): {what}")

    def force_kv_dtype(self, dtype: str, *, force: bool = False) -> dict[str, Any]:
        """Admin: switch every upstream's KV dtype (restart managed ones, one at a time). It
        goes through the shield's gate (dwell time, memory, predicted gain) and the quality
        guard's 8-bit block, each refusal a ``ValueError`` with the reasons, unless ``force``
        (logged, counted, shown in status). A dtype the engine cannot run is refused always."""
        caps = self.lane_ctl[self.gw.lanes[0].index].shield.capabilities
        why = caps.why_not(dtype)
        if why is not None:
            raise ValueError(f"kv dtype {dtype!r} cannot run here: {why}")
        now = time.monotonic()
        if not force:
            guard = self.gw.quality
            if dtype in KV_DTYPES_8BIT and guard is not None and guard.blocks_8bit:
                raise ValueError(f"the quality guard blocks 8-bit KV (output-diff rate {guard.diff_rate:.1%}); "
                                 "reset it or use force=true")
            refused = {}
            for ln in self.gw.lanes:
                ctl = self.lane_ctl[ln.index]
                if ln.knobs.kv_dtype != dtype:
                    snap = ctl.last_snapshot
                    inputs = shield_inputs(snap, ctl.shield) if snap is not None else ShieldInputs()
                    reasons = ctl.shield.check_dtype(dtype, ln.knobs, inputs, now)
                    if reasons:
                        refused[ln.name] = "; ".join(reasons.values())
            if refused:
                raise ValueError(f"the shield refuses kv dtype {dtype!r}: {refused} (force=true overrides)")
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
        for ln in self.gw.lanes:  # the dwell counts from the operator's switch too
            self.lane_ctl[ln.index].shield.last_dtype_switch = now
        if managed:
            async def one_by_one() -> None:
                for ln in managed:  # the supervisor's lock also serialises them
                    plant = self.lane_ctl[ln.index].plant
                    assert plant is not None  # wired in __init__
                    await plant.restart_onto(dtype, "admin")  # the dwell starts again once it runs

            self.gw.supervisor.spawn(one_by_one(), "batchpilot-admin-kv-dtype")
        if force:
            self._override("kv_dtype", f"KV dtype switch to {dtype} past the shield: {out}")
        self._note(f"operator KV dtype switch to {dtype}: {out}")
        return {"dtype": dtype, "upstreams": out, "forced": force}

    async def choose_start_kv_dtype(self) -> dict[str, str]:
        """The policy's ``kv_start`` in front of real engines, before the gateway serves: the
        evaluation starts a PPO policy at 8-bit KV where the memory ceiling binds at 16 bits
        (``Shield.start_kv_dtype``), and what is evaluated is what is served. Only in ``policy``
        mode with a loaded policy, ``control.kv_start`` and engines started at ``kv_dtype: auto``
        (an explicit dtype is the operator's). The pool that decides is known only once an
        engine runs, so a managed one is restarted onto 8-bit (the dwell counts from it); an
        unmanaged one is advised. Returns lane name -> what was done (for status and tests)."""
        cfg = self.cfg
        if not cfg.control.kv_start or self.policies.mode != "policy" or self.policies.policy is None \
                or cfg.kv_dtype != "auto":
            return {}
        done: dict[str, str] = {}
        for ln in self.gw.lanes:
            ctl = self.lane_ctl[ln.index]
            self._check_engine(ln)
            shield, kv16, kv8 = ctl.shield, ln.knobs.kv_dtype, cfg.kv8_dtype
            if not shield.memory.known:
                done[ln.name] = "16-bit: memory budget unknown"
                continue
            at16, at8 = shield.max_feasible_batch(kv16), shield.max_feasible_batch(kv8)
            room = f"the memory ceiling holds {at16} requests at 16 bits, {at8} at {kv8}, of max_batch {shield.max_batch}"
            if shield.start_kv_dtype(kv16, kv8, cfg.kv8_read_cost) != kv8:
                if at16 >= shield.max_batch:  # memory does not bind: nothing to say
                    done[ln.name] = "16-bit"
                    continue
                why = shield.capabilities.why_not(kv8) or (
                    f"the engine reads 8-bit KV slower (serve.kv8_read_cost={cfg.kv8_read_cost:g}) and at {kv8} "
                    "memory would not bind" if cfg.kv8_read_cost > 1.0 else f"{kv8} holds no more")
                self._note(f"kv_start: {ln.name} stays at 16-bit KV although {room}: {why}")
                done[ln.name] = f"16-bit: {why}"
                continue
            plant = ctl.plant
            assert plant is not None  # wired in __init__
            if ln.upstream.managed is None:
                self.gw.metrics.kv_recommendation.labels(ln.name, kv8).set(1)
                self._note(f"kv_start: {room}; {ln.name} is not managed: recommend kv_cache_dtype={kv8}")
                done[ln.name] = f"recommended {kv8}"
                continue
            self._note(f"kv_start: {room}; restarting {ln.name} at {kv8} before serving")
            plant.acting = "kv_start"
            ok = await plant.restart_onto(kv8, "kv_start")
            done[ln.name] = kv8 if ok else f"16-bit: the restart onto {kv8} failed"
            if not ok:
                self._note(f"kv_start: restarting {ln.name} at {kv8} failed; it serves at 16-bit KV")
        self.kv_start = done
        return done

    # --- one decision ----------------------------------------------------------------------
    def _controller(self, lane: Lane) -> tuple[Controller, str]:
        """Who acts on ``lane`` this interval."""
        ctl = self.lane_ctl[lane.index]
        if self.frozen:
            return Hold(self.target), "frozen"
        if self.policies.mode == "static":
            return ctl.static, "static"
        chosen = self.policies.policy_for(lane.index, len(self.gw.lanes), self.num_ticks)
        return chosen if chosen is not None else (ctl.pid, "pid")

    def decide(self, lane: Lane, snap: Snapshot, now: float) -> tuple[ControlStep, str]:
        """The core control step with the acting controller, PID behind it in the chain: a
        policy that fails gives way to PID in the same interval, and PID decides every interval
        (kept warm as the fallback) unless the knobs are frozen. The shield stage holds the cap
        when the lane's memory budget is unknown or its /metrics are stale."""
        ctl = self.lane_ctl[lane.index]
        controller, who = self._controller(lane)
        step = control_step(controller, snap, lane.knobs, ctl.shield, now, chain=ControllerChain(ctl.pid, "pid"),
                            acting=who, may_fail=who in ("policy", "canary"), keep_warm=who != "frozen",
                            fail_safe=self.fail_safe, stale_intervals=ctl.stale_intervals, where=lane.name)
        if step.failure is not None:
            self.policies.failed(who, step.failure)
        if step.out_of_range:
            self.policies.out_of_range(list(step.out_of_range))
        if step.acting == "pid":
            self.policies.shadow(snap, lane.knobs, step.proposal)
        return step, step.acting

    async def _scrape(self, lane: Lane) -> dict[str, float]:
        try:
            return parse_vllm_metrics(await lane.upstream.metrics_text())
        except (UpstreamDown, ValueError):
            return {}

    async def tick(self, lane: Lane, now: float | None = None) -> None:
        """One decision for one upstream (``now``: the monotonic time, given by tests)."""
        t0 = time.perf_counter()
        self.num_ticks += 1
        ctl = self.lane_ctl[lane.index]
        self._check_engine(lane)
        for what in lane.take_oom_reports():  # what vLLM reported since the last tick: the breaker's OOM
            ctl.shield.report_oom(f"{lane.name} {what}")
        m = await self._scrape(lane) if lane.upstream.healthy else {}
        ctl.stale_intervals = 0 if m else ctl.stale_intervals + 1
        last = ctl.last_counters
        d_pre = max(0.0, m.get("num_preemptions", 0.0) - last.get("num_preemptions", m.get("num_preemptions", 0.0)))
        d_q = m.get("prefix_cache_queries", 0.0) - last.get("prefix_cache_queries", 0.0)
        d_h = m.get("prefix_cache_hits", 0.0) - last.get("prefix_cache_hits", 0.0)
        # Tokens as the engine generated them (the gateway's own count comes only as requests
        # end); None without two readings of the counter, or when it went back (a restart).
        gen = m.get("generation_tokens", -1.0) - last.get("generation_tokens", math.inf)
        gen_tokens = int(gen) if gen >= 0 else None
        if m:
            ctl.last_counters = m
        lane.telemetry.on_preemptions(int(d_pre))
        hit = d_h / d_q if d_q > 0 else 0.0
        now = time.monotonic() if now is None else now
        seen = m or last  # without this interval's counters, the last ones seen (never a 0 KV use)
        snap = lane.telemetry.snapshot(
            now,
            queue_depth=depths_padded(lane.admission.queue_depths),
            num_running=int(seen.get("num_running", lane.admission.num_in_flight)),
            num_waiting_engine=int(seen.get("num_waiting", 0)),
            kv_cache_usage=float(seen.get("kv_cache_usage", 0.0)),
            knobs=lane.knobs,
            prefix_cache_hit_rate=hit,
            output_tokens=gen_tokens,
            num_late_waiting=lane.admission.num_late_waiting,
        )
        ctl.last_snapshot = snap
        self._use_measured_restart(lane, ctl)
        step, who = self.decide(lane, snap, now)
        proposal, dec = step.proposal, step.decision
        if ctl.last_acting is not None:
            self.policies.record(ctl.last_acting, snap)
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
        if self.history.maxlen:
            self.history.append(decision_record(self.num_ticks, lane.name, now, who, snap, dec))
        mt.control_tick.observe(time.perf_counter() - t0)

    def _use_measured_restart(self, lane: Lane, ctl: LaneControl) -> None:
        """What a KV switch costs is what this upstream's last start or restart took, once
        measured: the configured ``dtype_restart_s`` is a guess (60 s without a model config),
        and a gain gate that thinks a 10-minute restart takes a minute lets a bad switch through."""
        took = lane.upstream.measured_restart_s
        if took is None:
            return
        if ctl.shield.cfg.dtype_restart_s != took:
            ctl.shield.cfg = replace(ctl.shield.cfg, dtype_restart_s=float(took))
            ctl.restart_source = "measured"
        for policy in self.policies.lane_policies(lane.index):  # a policy loaded since takes it too
            if policy.kv_agent is not None:
                policy.kv_agent.restart_s = float(took)

    def _apply(self, lane: Lane, ctl: LaneControl, dec: Decision, who: str) -> None:
        mt = self.gw.metrics
        for kind in dec.interventions:
            mt.shield_interventions.labels(kind if kind in INTERVENTION_KINDS else "other").inc()
        if dec.interventions:
            lane.telemetry.on_shield_intervention(dec.num_interventions)
        for a in dec.alerts:
            mt.alerts.inc()
            self._note(f"shield alert on {lane.name}: {a}")
        plant = ctl.plant
        assert plant is not None  # wired in __init__
        plant.acting = who
        done = actuate(dec, lane.knobs, plant, ctl.trip, restart_on_trip=ctl.shield.cfg.breaker_restart)
        if done.restart == "advised" and not ctl.shield.cfg.breaker_restart:
            self._note(f"breaker level 3 on {lane.name}: restart recommended (shield.breaker_restart is off)")
        mt.breaker_level.labels(lane.name).set(dec.breaker_level)

    def decisions(self, since: int = 0) -> list[dict[str, Any]]:
        """The kept decision records whose tick is after ``since`` (oldest first)."""
        return [r for r in self.history if r["tick"] > since]

    def status(self) -> dict[str, Any]:
        return {
            **self.policies.status(),
            "frozen": self.frozen,
            "ticks": self.num_ticks,
            "target": dict(self.target),
            "overrides": self.overrides[-20:],
            "kv_start": dict(self.kv_start),
            "lanes": {ln.name: {**self.lane_ctl[ln.index].last_decision, "knobs_in_force": ln.knobs.as_dict(),
                                "queue_depths": list(ln.admission.queue_depths),
                                "in_flight": ln.admission.num_in_flight,
                                "prefill_backlog_tokens": ln.admission.prefill_tokens_in_flight,
                                "prefill_hold_tokens": ln.admission.prefill_hold_tokens,
                                "first_token_s": ln.admission.first_token_s,
                                "late_margin_s": ln.admission.late_margin_s,
                                "stale_telemetry_intervals": self.lane_ctl[ln.index].stale_intervals,
                                "memory_model": self.lane_ctl[ln.index].shield.memory.source,
                                "kv_restart_s": self.lane_ctl[ln.index].shield.cfg.dtype_restart_s,
                                "kv_restart_source": self.lane_ctl[ln.index].restart_source,
                                "predicted_memory_in_flight": ln.admission.predicted_fraction(),
                                "healthy": ln.upstream.healthy, "restarting": ln.upstream.restarting}
                      for ln in self.gw.lanes},
            "events": self.events[-20:],
        }
