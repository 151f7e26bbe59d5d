"""``lookahead``: how much a choice among a few actions could add, before anyone trains for it.

A learnt policy can only find what its actions can gain. This controller measures that bound on
the simulator: every ``epoch_s`` it copies the environment (the simulator is deterministic and
its state copies), runs each option on the copy for the epoch and PID-with-the-default-order for
the rest of ``horizon_s``, and takes the option that finished the most requests within the SLO.
It sees the arrivals to come, so its goodput is an upper bound (up to its greedy horizon) for
any policy choosing among these options at this cadence; a small bound says training cannot
help, whatever the algorithm. Evaluated like any controller (``policies=[pid_sf,lookahead]``),
reported as a bound like ``best_static_hindsight``; never deployable, and refused on a live
engine, whose state cannot be copied.

With ``arrivals: recent`` the copies are fed a forecast instead of the future: the arrivals of
the last ``horizon_s``, repeated. That is what a controller with a simulator twin could deploy;
it measures how much of the bound a naive forecast recovers (docs/evaluation.md: none). It is
still favoured: the repeated requests, and those in flight on the copy, keep their true output
lengths, which a gateway learns only when a request finishes.

The options are the residual policy's own batch actions (a factor on PID's cap,
``batchpilot/core/residual.py``) with an order, and ``max`` (the engine's ``max_num_seqs``, a
cap of its own); PID keeps steering underneath, so after an option the next one starts from
where PID would be. An option may also set admission for its epoch, levers the gateway carries
out with the same ``core/admission.py``: ``refuse`` (refuse queued requests past their TTFT
objective), ``keep`` (serve them late), ``early`` (refuse at arrival a request predicted to miss
it), ``budget=<x>`` (the prefill backlog admission lets into the engine, in engine token
budgets). Those settings hold for the option's epoch only, on the copy it is tried
on and on the environment when chosen; the rest of the horizon, and any option without them,
runs the environment's own admission configuration (``apply_admission``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import Counter
from typing import Any

import numpy as np

from batchpilot.core.actions import KV_CHOICES
from batchpilot.core.knobs import BUCKETING_MODES, Knobs, Proposal
from batchpilot.core.residual import RESIDUAL_FACTORS, ResidualPID, residual_pid_config
from batchpilot.core.telemetry import SLO, Snapshot
from batchpilot.envs.workloads import RequestStream
from batchpilot.nodes import from_node
from batchpilot.schemas.policy import LookaheadConfig

#: ``arrivals``: what a copy is fed.
ARRIVALS = ("future", "recent")


class LookaheadError(ValueError):
    """The lookahead cannot run as configured; the message names the setting."""


#: The admission parts an option may name after its cap (and order), for the error message.
ADMISSION_PARTS = "refuse[=<priority>], keep, early[=<slack>], early=off, budget=<x>|none"


@dataclasses.dataclass(frozen=True, slots=True)
class Option:
    """One choice: ``factor`` on PID's cap (None: the engine's max_num_seqs), an order, and the
    admission settings (``AdmissionConfig`` fields) in force for its epoch (none: the env's)."""

    factor: float | None
    bucketing: str
    admission: tuple[tuple[str, Any], ...] = ()
    #: The admission parts as written back (``str``); the settings above are what compares.
    parts: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    @classmethod
    def parse(cls, text: str, default_bucketing: str) -> "Option":
        """``<cap>[/<order>][/refuse[=<p>]|/keep][/early[=<slack>]|/early=off][/budget=<x>|none]``
        (the parts after the cap in any order); the cap is ``max`` or a residual factor.
        ``refuse``: ``ttft_deadline`` on for every priority above ``p`` (default -1: every
        request, so a single-class workload is covered too); ``keep``: ``ttft_deadline`` off;
        ``early``: ``early_refusal`` on above priority -1 (``early_refusal_slack`` when given);
        ``budget``: ``prefill_backlog_budgets`` (``none``: no hold)."""
        head, *rest = str(text).split("/")
        found: dict[str, tuple[str, dict[str, Any]]] = {}
        for part in rest:
            kind, label, settings = _parse_part(text, part)
            if kind in found:
                raise LookaheadError(f"lookahead option {text!r}: two {kind} parts ({found[kind][0]!r} and {part!r})")
            found[kind] = (label, settings)
        order = found.pop("order", (default_bucketing, {}))[0]
        admission: dict[str, Any] = {}
        for label, settings in found.values():
            for key, value in settings.items():
                if admission.setdefault(key, value) != value:
                    raise LookaheadError(f"lookahead option {text!r}: its parts set admission.{key} to "
                                         f"{admission[key]!r} and {value!r} ({label!r})")
        parts = tuple(found[k][0] for k in ("deadline", "early", "budget") if k in found)
        if head == "max":
            return cls(None, order, tuple(sorted(admission.items())), parts)
        try:
            factor = float(head)
        except ValueError:
            factor = math.nan
        match = [f for f in RESIDUAL_FACTORS if math.isclose(f, factor)]
        if not match:
            raise LookaheadError(f"lookahead option {text!r}: the cap part must be max or one of the residual "
                                 f"policy's factors {list(RESIDUAL_FACTORS)}")
        return cls(match[0], order, tuple(sorted(admission.items())), parts)

    def __str__(self) -> str:
        return "/".join((f"{'max' if self.factor is None else f'{self.factor:g}'}", self.bucketing, *self.parts))


def _parse_part(text: str, part: str) -> tuple[str, str, dict[str, Any]]:
    """One ``/``-separated part after the cap: (its kind, its label, the admission settings)."""
    if part in BUCKETING_MODES:
        return "order", part, {}
    if part == "keep":
        return "deadline", part, {"ttft_deadline": False}
    name, eq, value = part.partition("=")
    if name == "refuse":
        try:
            kept = int(value) if eq else -1
        except ValueError:
            raise LookaheadError(f"lookahead option {text!r}: refuse={value!r} needs an integer priority (the "
                                 f"highest priority never refused; refuse alone is -1: every request)") from None
        return "deadline", "refuse" if kept == -1 else f"refuse={kept}", {
            "ttft_deadline": True, "deadline_max_priority_kept": kept}
    if name == "early":
        if value == "off":
            return "early", "early=off", {"early_refusal": False}
        slack = _positive(text, part, value) if eq else None
        settings = {"early_refusal": True, "deadline_max_priority_kept": -1}
        if slack is None:
            return "early", "early", settings
        return "early", f"early={slack:g}", {**settings, "early_refusal_slack": slack}
    if name == "budget" and eq:
        if value.lower() in ("none", "null"):
            return "budget", "budget=none", {"prefill_backlog_budgets": None}
        budget = _positive(text, part, value, " (engine token budgets of prefill in flight) or none")
        return "budget", f"budget={budget:g}", {"prefill_backlog_budgets": budget}
    raise LookaheadError(f"lookahead option {text!r}: order {part!r} is not one of {list(BUCKETING_MODES)} (nor "
                         f"an admission part: {ADMISSION_PARTS})")


def _positive(text: str, part: str, value: str, what: str = "") -> float:
    """The number > 0 an option's part names, or a clear error naming the option."""
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not (x > 0 and math.isfinite(x)):
        raise LookaheadError(f"lookahead option {text!r}: {part.partition('=')[0]}={value!r} must be a number > 0"
                             f"{what}")
    return x


def apply_admission(env: Any, option: Option) -> None:
    """Put ``option``'s admission settings in force on ``env`` (the env's own configuration,
    ``env.admission_cfg``, for an option without any). ``Admission`` caches what
    ``ttft_deadline`` and ``prefill_backlog_budgets`` imply (``use_slo``, ``use_token_budget``),
    so both are called again. A request is put under the TTFT deadline when it is queued: one
    queued before ``refuse`` took effect is never refused (it waits, goes late, is served last)."""
    own = env.admission_cfg
    cfg = dataclasses.replace(own, **dict(option.admission)) if option.admission else own
    adm = env.admission
    if adm.cfg is cfg:
        return
    adm.cfg = cfg
    adm.use_slo(env.slo)
    adm.use_token_budget(env.engine.capabilities().max_num_batched_tokens)


class LookaheadController:
    """See the module docstring. ``bind(env)`` before each episode (``run_episode`` does)."""

    name = "lookahead"
    #: The evaluation refuses it on a live engine before starting one.
    needs_simulator = True

    def __init__(self, cfg: LookaheadConfig, slo: SLO, max_num_seqs: int) -> None:
        if cfg.arrivals not in ARRIVALS:
            raise LookaheadError(f"lookahead.arrivals must be one of {list(ARRIVALS)}, got {cfg.arrivals!r}")
        if not (cfg.epoch_s > 0 and cfg.horizon_s >= cfg.epoch_s):
            raise LookaheadError(f"lookahead needs 0 < epoch_s <= horizon_s, got {cfg.epoch_s} and {cfg.horizon_s}")
        self.cfg = cfg
        self.base = Option(1.0, cfg.bucketing)
        self.options = [Option.parse(o, cfg.bucketing) for o in cfg.options]
        if not self.options:
            raise LookaheadError("lookahead.options is empty")
        self.max_num_seqs = max_num_seqs
        self.residual = ResidualPID(residual_pid_config(slo, max_num_seqs))
        self.env: Any = None
        #: Per decision: the step, requests finished so far, each option's value, the chosen index.
        self.log: list[dict[str, Any]] = []
        self.choices: Counter[str] = Counter()
        self._step = 0
        self._current = self.base

    @property
    def initial_batch_cap(self) -> int:
        """Where the PID underneath starts (the evaluation starts the episode there)."""
        return self.residual.config.initial_batch_cap

    def bind(self, env: Any) -> None:
        """The environment the episode runs in: its copies are what the options are tried on."""
        if str(env.cfg.engine.kind) != "sim":
            raise LookaheadError(f"lookahead needs the simulator (engine=sim): it tries each option on a copy of "
                                 f"the engine's state, and a {env.cfg.engine.kind!r} engine cannot be copied")
        self.env = env
        interval = float(env.interval_s)
        self._epoch_steps = max(1, round(self.cfg.epoch_s / interval))
        self._horizon_steps = max(self._epoch_steps, round(self.cfg.horizon_s / interval))

    def reset(self, knobs: Knobs) -> None:
        self.residual.reset(knobs)
        self.log.clear()
        self.choices.clear()
        self._step = 0
        self._current = self.base

    def decide(self, snapshot: Snapshot, knobs: Knobs) -> Proposal:
        if self.env is None:
            raise LookaheadError("lookahead needs its environment: call bind(env) before the episode")
        if self._step % self._epoch_steps == 0:
            self._current = self._choose()
            apply_admission(self.env, self._current)
        self._step += 1
        return self._propose(self.residual, self._current, snapshot, knobs)

    def _propose(self, residual: ResidualPID, option: Option, snapshot: Snapshot, knobs: Knobs) -> Proposal:
        if option.factor is None:
            residual.base(snapshot, knobs)  # PID keeps steering underneath; the cap is the engine's
            return Proposal(batch_cap=self.max_num_seqs, bucketing=option.bucketing, kv_dtype=None)
        action = (RESIDUAL_FACTORS.index(option.factor), BUCKETING_MODES.index(option.bucketing), KV_CHOICES.index("keep"))
        return residual.propose(action, snapshot, knobs, kv16_dtype=self.env.kv16_dtype, kv8_dtype=self.env.kv8_dtype)

    def _choose(self) -> Option:
        values = [self._value(o) for o in self.options]
        best = max(range(len(values)), key=lambda i: (values[i], self.options[i] == self.base))  # ties: the base
        self.log.append({"step": self._step, "finished": len(self.env.finished_requests), "values": values,
                         "chosen": best})
        self.choices[str(self.options[best])] += 1
        return self.options[best]

    def _value(self, option: Option) -> int:
        """Requests finished within the SLO on a copy: ``option`` for the epoch, then the base."""
        env, residual = copy.deepcopy(self.env), copy.deepcopy(self.residual)
        if self.cfg.arrivals == "recent":
            env.stream = recent_arrivals(env.stream, env.engine.now, self.cfg.horizon_s)
        try:
            start = len(env.finished_requests)
            for i in range(self._horizon_steps):
                chosen = option if i < self._epoch_steps else self.base
                if i in (0, self._epoch_steps):
                    apply_admission(env, chosen)
                _, _, terminated, truncated, _ = env.step_proposal(
                    self._propose(residual, chosen, env.snapshot, env.knobs))
                if terminated or truncated:
                    break
            slo = env.slo
            return sum(1 for r in env.finished_requests[start:]
                       if slo.for_priority(r.priority).met(r.ttft, r.tpot, r.e2el))  # each by its class
        finally:
            env.close()


def recent_arrivals(stream: RequestStream, now: float, span_s: float) -> RequestStream:
    """The requests that arrived in the last ``span_s`` before ``now``, each shifted ``span_s``
    later (so they arrive again in the next ``span_s``): a persistence forecast of the arrivals
    to come. Its request ids are its own (``f<i>``), so none meets one still in flight."""
    seen = stream.arrival_s[: len(stream) - stream.num_remaining]  # those popped so far
    idx = np.arange(int(np.searchsorted(seen, now - span_s, side="left")), seen.size)
    hashes = None if stream.prefix_hashes is None else [stream.prefix_hashes[i] for i in idx]
    return RequestStream(
        stream.arrival_s[idx] + span_s, stream.prompt_len[idx], stream.output_len[idx],
        duration_s=stream.duration_s, priority=stream.priority[idx], prefix_hashes=hashes,
        prefix_block_tokens=stream.prefix_block_tokens, id_prefix="f",
        max_tokens=None if stream.max_tokens is None else stream.max_tokens[idx],
    )


def build_lookahead(cfg: Any, max_num_seqs: int) -> LookaheadController:
    """The controller a ``kind: lookahead`` policy file describes (``slo`` filled by the caller)."""
    lc = from_node(LookaheadConfig, cfg, drop=("kind", "name"))
    slo = SLO() if lc.slo is None else SLO.from_metrics(lc.slo)
    return LookaheadController(lc, slo, max_num_seqs)
