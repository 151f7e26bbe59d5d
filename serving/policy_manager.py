"""Which controller acts on the gateway's lanes, and the policy's life cycle: load, reload,
canary (the guide's grey release), shadow, and the fallback to PID.

The policy is a ``PPOController`` (``policies/ppo_controller.py``), the same class the
evaluation runs: built from the policy folder with the observation settings recorded in its
manifest at training time (rate scales, ``max_model_len``), so the features it sees in
production mean what they meant in training. A policy that fails to load, raises, or yields
non-finite outputs gives way to PID, and the manager says so (``note``, the
``batchpilot:policy_fallbacks`` metric, ``/admin/status``).

Canary: a newly loaded policy drives a share of traffic (that share of upstreams; with one
upstream that share of control intervals) while the incumbent drives the rest; after
``canary_min_intervals`` canary decisions and ``canary_min_requests`` requests a side it is
promoted, unless its per-request SLO attainment fell more than ``canary_max_drop`` (relative) below the incumbent's, in which case
it is rolled back. Attainment is per request (requests that met every SLO / requests that
finished or were refused), not goodput: routing gives each lane a share of traffic that depends
on its own cap, so a lane's goodput measures how much traffic it was sent as much as how well
its controller served it (a canary that cut its cap was sent less and looked no worse per
second than its share allowed).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.core.telemetry import SLO, Snapshot
from batchpilot.policies.artifact import PolicyLoadError
from batchpilot.policies.ppo_controller import PRETRAINED_DIR, PPOController
from batchpilot.schemas.serve import CONTROL_MODES, ControlConfig
from batchpilot.serving.prom import GatewayMetrics

log = logging.getLogger(__name__)

CANARY_STATES = {"none": 0, "evaluating": 1, "promoted": 2, "rolled_back": 3}


@dataclass
class Canary:
    """A candidate policy on trial against the incumbent."""

    policy: PPOController
    path: str
    share: float
    #: Per side ("canary", "incumbent"): control intervals, requests counted, requests that met the SLO.
    intervals: dict[str, int] = field(default_factory=lambda: {"canary": 0, "incumbent": 0})
    requests: dict[str, int] = field(default_factory=lambda: {"canary": 0, "incumbent": 0})
    met: dict[str, int] = field(default_factory=lambda: {"canary": 0, "incumbent": 0})

    def attainment(self, side: str) -> float | None:
        n = self.requests[side]
        return self.met[side] / n if n else None

    def record(self, who: str, requests: int, met: int, *, min_intervals: int,
               max_drop: float, min_requests: int = 1) -> tuple[bool, str] | None:
        """Add one interval of ``who`` ("canary" or anyone else: the incumbent): ``requests``
        finished or refused under its knobs, ``met`` of them within every SLO. Once the canary
        has ``min_intervals`` intervals and each side ``min_requests`` requests: (promote?, why),
        rolled back when its attainment is below ``(1 - max_drop)`` x the incumbent's."""
        side = "canary" if who == "canary" else "incumbent"
        requests, met = max(int(requests), 0), max(int(met), 0)
        self.intervals[side] += 1
        self.requests[side] += requests
        self.met[side] += min(met, requests)
        cand, base = self.attainment("canary"), self.attainment("incumbent")
        n_c, n_b = self.requests["canary"], self.requests["incumbent"]
        if self.intervals["canary"] < min_intervals or cand is None or base is None or min(n_c, n_b) < min_requests:
            return None
        if cand < (1.0 - max_drop) * base:
            return False, (f"canary SLO attainment {cand:.1%} ({n_c} requests) < {1 - max_drop:.0%} of the "
                           f"incumbent's {base:.1%} ({n_b} requests): rolled back")
        return True, (f"canary SLO attainment {cand:.1%} ({n_c} requests) vs incumbent {base:.1%} "
                      f"({n_b} requests): promoted")


class PolicyManager:
    """Mode, policy, canary and fallback; no I/O, so unit tests drive it directly.

    ``max_num_seqs``, ``kv_runnable`` and ``kv_restart_s`` describe the upstream engines (what a
    policy's running counts are normalised by, which KV dtypes its mask allows, what a KV switch
    costs its KV agent); ``slo`` is the gateway's SLO, which a policy steers on (as its PID and
    shield do; None = the SLO the policy was trained at); ``note`` reports notable events.
    """

    def __init__(self, cfg: ControlConfig, metrics: GatewayMetrics, *, max_num_seqs: int,
                 kv_runnable: Mapping[str, bool], note: Callable[[str], None],
                 kv_restart_s: float | None = None, slo: SLO | None = None) -> None:
        self.cfg = cfg
        self.slo = slo
        self.metrics = metrics
        self.max_num_seqs = max_num_seqs
        self.kv_runnable = dict(kv_runnable)
        self.kv_restart_s = kv_restart_s
        self.note = note
        self.mode = cfg.mode
        self.policy: PPOController | None = None
        self.policy_path: str | None = None
        self.fallback_reason: str | None = None
        #: Intervals the policy handed to PID because the observation left the training range.
        self.num_out_of_range = 0
        self.last_out_of_range: list[str] = []
        self.canary: Canary | None = None
        self.canary_state = "none"
        self.shadow_agree: list[bool] = []
        if self.mode in ("policy", "shadow"):
            self.load_policy(cfg.policy_dir)
        self.publish()

    # --- loading -------------------------------------------------------------------------
    def _build(self, path: str) -> PPOController:
        return PPOController.from_dir(path, max_num_seqs=self.max_num_seqs, kv_runnable=self.kv_runnable,
                                      kv_restart_s=self.kv_restart_s, slo=self.slo)

    def load_policy(self, path: str | None) -> bool:
        """Load the policy the controller modes use; on failure fall back to PID and say why."""
        p = path or str(PRETRAINED_DIR)
        try:
            policy = self._build(p)
        except (PolicyLoadError, OSError, ValueError) as exc:
            self.policy = None
            self._fallback("load_failed", f"policy at {p!r} failed to load: {exc}")
            return False
        self._use(policy, p)
        return True

    def reload_policy(self, path: str | None, canary_share: float | None = None) -> dict[str, Any]:
        """Admin: load a policy now, or start a canary with it (``canary_share`` > 0). A policy
        that fails to load raises ``ValueError`` and changes nothing: the running one stays."""
        p = path or self.policy_path or str(PRETRAINED_DIR)
        share = self.cfg.canary_share if canary_share is None else canary_share
        try:
            policy = self._build(p)
        except (PolicyLoadError, OSError, ValueError) as exc:
            self.note(f"policy at {p!r} failed to load; the running controller is kept: {exc}")
            raise ValueError(f"policy at {p!r} failed to load (the running controller is kept): {exc}") from None
        if share > 0 and self.policy is not None:
            self.canary = Canary(policy, p, share)
            self.canary_state = "evaluating"
            self.note(f"canary started: {p!r} on {share:.0%} of traffic")
            self.publish()
            return {"ok": True, "canary": True, "path": p}
        self._use(policy, p)
        return {"ok": True, "canary": False, "path": p, "fallback_reason": self.fallback_reason}

    def _use(self, policy: PPOController, path: str) -> None:
        self.policy, self.policy_path, self.fallback_reason = policy, path, None
        self.publish()
        log.info("policy loaded from %r", path)

    def set_mode(self, mode: str) -> None:
        if mode not in CONTROL_MODES:
            raise ValueError(f"mode {mode!r}; one of {CONTROL_MODES}")
        self.mode = mode
        if mode in ("policy", "shadow") and self.policy is None:
            self.load_policy(self.cfg.policy_dir)
        self.note(f"control mode set to {mode}")
        self.publish()

    # --- who acts ------------------------------------------------------------------------
    def acting(self) -> str:
        if self.mode in ("pid", "shadow"):
            return "pid"
        if self.mode == "static":
            return "static"
        return "pid" if self.policy is None else "policy"

    def policy_for(self, lane_index: int, num_lanes: int, tick: int) -> tuple[PPOController, str] | None:
        """The policy that acts on this lane this interval ("policy" or "canary"), or None
        when a baseline acts (mode pid/static/shadow, or no policy loaded)."""
        if self.acting() != "policy":
            return None
        c = self.canary
        if c is not None and self._canary_drives(lane_index, num_lanes, tick):
            return c.policy.for_lane(lane_index), "canary"
        assert self.policy is not None
        return self.policy.for_lane(lane_index), "policy"

    def lane_policies(self, lane_index: int) -> list[PPOController]:
        """The loaded policy's and the canary's controllers for one lane (to reset them)."""
        loaded = [self.policy, self.canary.policy if self.canary is not None else None]
        return [p.for_lane(lane_index) for p in loaded if p is not None]

    def canary_lanes(self, num_lanes: int) -> set[int] | None:
        """With several upstreams and a canary on trial: the lanes it drives (routing sends them
        a fixed ``share`` of requests, so the verdict compares like with like: least-loaded
        routing would send a bad canary less traffic and hide it). None otherwise."""
        c = self.canary
        if c is None or num_lanes < 2 or self.acting() != "policy":
            return None
        return set(range(max(1, math.ceil(c.share * num_lanes))))

    def _canary_drives(self, lane_index: int, num_lanes: int, tick: int) -> bool:
        share = self.canary.share if self.canary else 0.0
        if num_lanes > 1:
            return lane_index < max(1, math.ceil(share * num_lanes))
        period = max(1, round(1.0 / max(share, 1e-6)))
        return tick % period == 0

    def failed(self, who: str, exc: Exception) -> None:
        """The acting policy raised (e.g. non-finite outputs): PID takes over."""
        if who == "canary":
            self.end_canary(promote=False, why=f"canary policy failed: {exc}")
        else:
            self.policy = None
            self._fallback("bad_output", f"policy failed at decision time: {exc}")

    def shadow(self, snapshot: Snapshot, knobs: Knobs, acted: Proposal) -> None:
        """Shadow mode: compute the policy's proposal and compare its batch direction with
        the one that acted (PID's)."""
        if self.mode != "shadow" or self.policy is None:
            return
        try:
            mine = self.policy.decide(snapshot, knobs)
        except ValueError as exc:
            self.failed("policy", exc)
            return
        cur = knobs.batch_cap
        sign = lambda x: (x > cur) - (x < cur)  # noqa: E731
        self.shadow_agree = (self.shadow_agree + [sign(mine.batch_cap or cur) == sign(acted.batch_cap or cur)])[-100:]
        self.metrics.shadow_agreement.set(sum(self.shadow_agree) / len(self.shadow_agree))
        log.debug("shadow: policy %s vs acting %s", mine, acted)

    # --- canary --------------------------------------------------------------------------
    def record(self, who: str, snapshot: Snapshot) -> None:
        """Credit an interval's requests (finished, refused, and which met the SLO) to whoever
        set the knobs it ran under."""
        c = self.canary
        if c is None:
            return
        dt = snapshot.interval_s
        finished = round(snapshot.request_throughput * dt)
        met = round(snapshot.request_goodput * dt)
        verdict = c.record(who, finished + snapshot.rejected, met, min_intervals=self.cfg.canary_min_intervals,
                           max_drop=self.cfg.canary_max_drop, min_requests=self.cfg.canary_min_requests)
        if verdict is not None:
            self.end_canary(*verdict)

    def end_canary(self, promote: bool, why: str) -> None:
        c = self.canary
        self.canary = None
        if promote and c is not None:
            self.policy, self.policy_path = c.policy, c.path
        self.canary_state = "promoted" if promote else "rolled_back"
        self.note(why)
        self.publish()

    # --- reporting -----------------------------------------------------------------------
    def _fallback(self, reason: str, message: str) -> None:
        self.fallback_reason = f"{reason}: {message}"
        self.metrics.policy_fallbacks.labels(reason).inc()
        self.note(f"policy fallback to PID ({message})")
        self.publish()

    def publish(self) -> None:
        act = self.acting()
        for mode in CONTROL_MODES:
            for a in ("policy", "pid", "static"):
                self.metrics.controller.labels(mode, a).set(float(mode == self.mode and a == act))
        self.metrics.canary.set(CANARY_STATES[self.canary_state])

    def out_of_range(self, features: list[str]) -> None:
        """The policy handed an interval to PID: its observation left the training range."""
        self.num_out_of_range += 1
        self.last_out_of_range = list(features)
        self.metrics.policy_fallbacks.labels("out_of_range").inc()

    def status(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "acting": self.acting(),
            "out_of_range": {"intervals": self.num_out_of_range, "last_features": self.last_out_of_range},
            "policy_path": self.policy_path,
            "fallback_reason": self.fallback_reason,
            "canary": {"state": self.canary_state,
                       "path": self.canary.path if self.canary else None,
                       "share": self.canary.share if self.canary else None,
                       "slo_attainment": ({side: self.canary.attainment(side) for side in ("canary", "incumbent")}
                                          if self.canary else None)},
        }


__all__ = ["CANARY_STATES", "Canary", "PolicyManager"]
