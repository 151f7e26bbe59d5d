"""A learned policy as a bounded correction on PID's decision.

With ``action_mode: residual_pid`` the policy's batch sub-action is not a step of its own: it
picks a factor (0.7, 0.85, 1, 1.15, 1.3) applied to the cap PID would set now. PID runs
alongside on its own view of the cap, kept within the band the actual cap allows, so whatever
the policy learnt, the cap it proposes is never more than 30 % away from PID's, and "1" is PID.
Bucketing and the KV dtype stay the policy's choices. The shield then checks the proposal like
any other. The environment (training) and ``PPOController`` (evaluation, the gateway) both
compose the decision here, so the trained and the served correction are the same code.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from batchpilot.core.actions import BATCH_STEPS, kv_choice, parse_action
from batchpilot.core.knobs import BUCKETING_MODES, Knobs, Proposal
from batchpilot.core.pid import PIDConfig, PIDController, slo_setpoints
from batchpilot.core.telemetry import SLO, Snapshot

ACTION_MODES: tuple[str, ...] = ("residual_pid", "absolute")
#: Multipliers on PID's cap, one per batch sub-action.
RESIDUAL_FACTORS: tuple[float, ...] = tuple(1.0 + s for s in BATCH_STEPS)


def residual_pid_config(
    slo: SLO,
    max_num_seqs: int,
    recorded: Mapping[str, Any] | None = None,
    trained_slo: SLO | None = None,
) -> PIDConfig:
    """The PID a residual policy corrects, steering on ``slo`` (the objectives served now):
    ``recorded`` (a trained policy's manifest, whose objectives were ``trained_slo``) with each
    objective moved by the ratio of the served to the trained SLO, so it aims at the same share
    of the objective the deployment actually has; else ``PIDConfig``'s defaults (=
    ``conf/policy/pid.yaml``) with the SLO filled in. The cap bounds at ``max_num_seqs``."""
    base = dataclasses.asdict(PIDConfig())
    d = dict(recorded or {})
    if not d:
        d = slo_setpoints(slo, base["metric"])
    unknown = set(d) - set(base)
    if unknown:
        raise ValueError(f"residual PID config: unknown keys {sorted(unknown)}; known: {sorted(base)}")
    d = {**base, **d}
    if recorded and trained_slo is not None:
        for key, metric in (("slo_ms", d["metric"]), ("tpot_slo_ms", "tpot")):
            now, then = slo.for_metric(metric), trained_slo.for_metric(metric)
            if d[key] is not None and now and then:
                d[key] = float(d[key]) * now / then
    d["max_batch"] = min(int(d["max_batch"]), max_num_seqs)
    d["initial_batch_cap"] = min(int(d["initial_batch_cap"]), d["max_batch"])
    d["min_batch"] = min(int(d["min_batch"]), d["initial_batch_cap"])
    return PIDConfig(**d)


class ResidualPID:
    """PID plus the policy's factor on its cap (see the module docstring).

    PID's view of the cap is the cap in force divided by the factor last applied: with factor 1
    every interval this is exactly PID (whatever the shield or an operator did to the cap, PID
    sees it as it would alone), and with other factors the cap stays within 0.7-1.3 of PID's.
    """

    def __init__(self, pid_cfg: PIDConfig) -> None:
        self.pid = PIDController(pid_cfg)
        self.factor = 1.0

    @property
    def config(self) -> PIDConfig:
        return self.pid.cfg

    def reset(self, knobs: Knobs) -> None:
        self.pid.reset(knobs)
        self.factor = 1.0

    def base(self, snapshot: Snapshot, knobs: Knobs) -> Proposal:
        """PID's own proposal this interval; acting on it unchanged (factor 1)."""
        p = self._pid_decide(snapshot, knobs)
        self.factor = 1.0
        return p

    def propose(
        self,
        action: np.ndarray | list[int] | tuple[int, ...],
        snapshot: Snapshot,
        knobs: Knobs,
        *,
        kv16_dtype: str = "auto",
        kv8_dtype: str = "fp8",
    ) -> Proposal:
        a_batch, a_bucket, a_kv = parse_action(action)
        base = self._pid_decide(snapshot, knobs)
        self.factor = RESIDUAL_FACTORS[a_batch]
        assert base.batch_cap is not None
        cap = max(1, int(round(base.batch_cap * self.factor)))
        kv = kv_choice(a_kv, knobs, kv16_dtype=kv16_dtype, kv8_dtype=kv8_dtype)
        return Proposal(batch_cap=cap, bucketing=BUCKETING_MODES[a_bucket], kv_dtype=kv)

    def _pid_decide(self, snapshot: Snapshot, knobs: Knobs) -> Proposal:
        c = self.pid.cfg
        view = min(max(int(round(knobs.batch_cap / self.factor)), c.min_batch), c.max_batch)
        p = self.pid.decide(snapshot, knobs.with_(batch_cap=view))
        return p if p.batch_cap is not None else Proposal(view, p.bucketing, p.kv_dtype)
