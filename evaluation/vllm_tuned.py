"""``vllm_tuned``: vLLM tuned with its own start-up flags, the yardstick an operator would deploy
instead of batchpilot (issue 53).

The sweep is what vLLM's ``benchmarks/auto_tune`` and ``vllm bench sweep serve_sla`` do: one
server per setting of ``--max-num-seqs`` × ``--max-num-batched-tokens`` × the API server's
``--max-num-queued-tokens`` / ``--max-num-queued-reqs`` (``conf/policy/vllm_tuned.yaml``), each
scored on traffic other than the traffic it is then judged on, keeping the best that meets the
latency objective. The evaluation (``evaluation/matrix.py``) runs the grid through the same
cells, tuning seeds and objective as best_static; this module builds the grid.

A queued-tokens limit may be given as vLLM's docs put it, the TTFT objective × the prefill
throughput (``queued_tokens_ttft_factors``). The throughput is measured as an operator would:
at the point's ``max_num_seqs`` and token budget, on prompts of the tuning seed's own requests
(never the scored seeds'), as prompt tokens per second of a saturated prefill-only run.

Where the workload has more than one priority class (``slo.classes``' request classes), every
point is also tried with ``--scheduling-policy priority`` (``scheduling_policies``): vLLM then
serves and keeps the smaller priority numbers first, each request carrying its class as the
body's ``priority``. On a one-class workload the grid is the fcfs one, point for point.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from omegaconf import open_dict

from batchpilot.core.engine import RequestRejected
from batchpilot.core.telemetry import SLO
from batchpilot.evaluation.plan import EvaluationError, WorkloadPlan
from batchpilot.nodes import from_node
from batchpilot.schemas.policy import VllmTunedConfig

#: The policy keys ``from_node`` must not pass to ``VllmTunedConfig`` (they select the class),
#: and the evaluation's own (``policy_overrides`` may carry ``as_shipped``: vLLM tuned is
#: always run as shipped).
_NOT_SETTINGS = ("kind", "name", "as_shipped")


def tuned_config(policy: Mapping[str, Any], name: str) -> VllmTunedConfig:
    """The sweep ``policy`` (a ``conf/policy`` file of kind vllm_tuned, overrides merged)
    describes; a bad value is an ``EvaluationError`` naming the policy."""
    try:
        return from_node(VllmTunedConfig, dict(policy), drop=_NOT_SETTINGS)
    except ValueError as e:
        raise EvaluationError(f"policy {name!r}: {e}") from None


@dataclass(slots=True)
class EngineGridPoint:
    """One ``vllm serve`` setting of the sweep, and how it scored."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_num_queued_tokens: int | None = None
    max_num_queued_reqs: int | None = None
    max_num_active_seqs: int | None = None
    #: ``--scheduling-policy``: ``fcfs`` (vLLM's default) or ``priority``.
    scheduling_policy: str = "fcfs"
    #: ``max_num_queued_tokens`` = this × TTFT objective × ``prefill_tokens_per_s`` (None: the
    #: limit was given in tokens).
    ttft_factor: float | None = None
    prefill_tokens_per_s: float | None = None
    #: Means over the tuning seeds.
    request_goodput: float = math.nan
    slo_attainment: float = math.nan
    #: Means over the scored seeds (the hindsight bound).
    hindsight_goodput: float = math.nan
    hindsight_attainment: float = math.nan

    def engine(self) -> dict[str, Any]:
        """The flags as ``engine.*`` settings (``SimEngineConfig``'s names are vLLM's; the
        scheduling policy only when it is not vLLM's default, so fcfs points are as before)."""
        out: dict[str, Any] = {
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_queued_tokens": self.max_num_queued_tokens, "max_num_queued_reqs": self.max_num_queued_reqs,
            "max_num_active_seqs": self.max_num_active_seqs,
        }
        if self.scheduling_policy != "fcfs":
            out["scheduling_policy"] = self.scheduling_policy
        return out

    def policy(self, name: str = "vllm_tuned") -> dict[str, Any]:
        """A static controller on a server started with these flags, run as shipped."""
        return {
            "kind": "static", "name": name, "batch_cap": self.max_num_active_seqs or self.max_num_seqs,
            "bucketing": "fifo", "kv_dtype": "auto", "as_shipped": True, "engine": self.engine(),
        }

    @property
    def label(self) -> str:
        parts = [f"--max-num-seqs {self.max_num_seqs}", f"--max-num-batched-tokens {self.max_num_batched_tokens}"]
        if self.max_num_active_seqs is not None:
            parts.append(f"--max-num-active-seqs {self.max_num_active_seqs}")
        if self.max_num_queued_tokens is not None:
            how = f" ({self.ttft_factor:g}x TTFT x prefill)" if self.ttft_factor is not None else ""
            parts.append(f"--max-num-queued-tokens {self.max_num_queued_tokens}{how}")
        if self.max_num_queued_reqs is not None:
            parts.append(f"--max-num-queued-reqs {self.max_num_queued_reqs}")
        if self.scheduling_policy != "fcfs":
            parts.append(f"--scheduling-policy {self.scheduling_policy}")
        return " ".join(parts)


def _engine_cfg(plan: WorkloadPlan, seqs: int, tokens: int) -> Any:
    c = copy.deepcopy(plan.cfg)
    with open_dict(c):
        c.engine.max_num_seqs = seqs
        c.engine.max_num_batched_tokens = tokens
        c.engine.kv_dtype = "auto"
    return c


def tuning_prompts(plan: WorkloadPlan, tune_seed: int, limit: int | None) -> list[Any]:
    """The first ``limit`` requests (None: all) of the tuning seed's episode (its trace window),
    as an operator samples their own traffic to measure the prefill throughput."""
    from batchpilot.envs.workloads import build_workload

    wl = copy.deepcopy(plan.cfg.workload)
    with open_dict(wl):
        if plan.windows:
            wl.start_s = plan.windows[tune_seed]
    offset = int(wl.get("seed_offset", 0) or 0)
    stream = build_workload(wl, np.random.default_rng(tune_seed + offset), plan.max_model_len)
    return stream.pop_until(math.inf)[:limit]


def scheduling_policies(cfg: VllmTunedConfig, plan: WorkloadPlan, tune_seed: int) -> list[str]:
    """The ``--scheduling-policy`` values the sweep tries on this workload: ``priority`` only
    where the tuning seed's requests fall in more than one class with objectives of its own
    (``slo.classes``), else fcfs alone, silently: a workload whose priorities share one
    objective (``bursty``'s core and untagged traffic) keeps its grid, notes and rows as they
    were before the option, as the class rules of admission do."""
    wanted = list(cfg.scheduling_policies)
    if "priority" not in wanted:
        return wanted
    slo = SLO.from_mapping(plan.cfg.slo)
    if not slo.classes:
        return ["fcfs"]
    objectives = {(o.ttft_ms, o.tpot_ms, o.e2el_ms)
                  for o in (slo.for_priority(int(r.priority)) for r in tuning_prompts(plan, tune_seed, None))}
    return wanted if len(objectives) > 1 else ["fcfs"]


def prefill_throughput(plan: WorkloadPlan, seqs: int, tokens: int, requests: list[Any]) -> float:
    """Prompt tokens per second of a prefill-only run (every request asks for one token) of
    ``requests``, all queued at once, on the simulated engine at ``seqs`` × ``tokens``."""
    from batchpilot.envs.engines import build_engine

    engine = build_engine(_engine_cfg(plan, seqs, tokens))
    try:
        total = 0
        for i, r in enumerate(requests):
            one = {"output_len": 1, "arrival_time": 0.0, "request_id": f"prefill-probe-{i}"}
            if hasattr(r, "max_tokens"):
                one["max_tokens"] = 1
            try:
                engine.add_request(dataclasses.replace(r, **one))
            except RequestRejected:  # too long for this engine: vLLM refuses it too
                continue
            total += r.prompt_len
        while engine.num_running or engine.num_waiting:
            engine.step()
        return total / engine.now if engine.now > 0 else math.nan
    finally:
        engine.close()


def _fits(plan: WorkloadPlan, seqs: int, tokens: int) -> str | None:
    """Why the deployment cannot start at ``seqs`` × ``tokens`` (None: it can)."""
    from batchpilot.envs.engines import build_engine

    try:
        build_engine(_engine_cfg(plan, seqs, tokens)).close()
    except ValueError as e:
        return str(e)
    return None


def vllm_tuned_grid(
    cfg: VllmTunedConfig, plan: WorkloadPlan, tune_seed: int
) -> tuple[list[EngineGridPoint], list[str]]:
    """The sweep's settings on this deployment, and notes on what was skipped or measured.
    ``tune_seed``'s prompts measure the prefill throughput of the TTFT-rule limits."""
    notes: list[str] = []
    factors = list(cfg.queued_tokens_ttft_factors)
    ttft_ms = plan.cfg.slo.get("ttft_ms")
    if factors and ttft_ms is None:
        notes.append("queued_tokens_ttft_factors skipped: the SLO has no ttft_ms")
        factors = []
    prompts = tuning_prompts(plan, tune_seed, cfg.prefill_probe_requests) if factors else []
    policies = scheduling_policies(cfg, plan, tune_seed)
    points: list[EngineGridPoint] = []
    rates: list[str] = []
    for seqs in sorted(cfg.max_num_seqs):
        for tokens in sorted(cfg.max_num_batched_tokens):
            if tokens < seqs:
                notes.append(f"--max-num-seqs {seqs} with --max-num-batched-tokens {tokens} skipped: vLLM "
                             f"needs max_num_batched_tokens >= max_num_seqs")
                continue
            why = _fits(plan, seqs, tokens)
            if why is not None:
                notes.append(f"--max-num-seqs {seqs} --max-num-batched-tokens {tokens} skipped: {why}")
                continue
            active = None if cfg.max_num_active_seqs is None else min(cfg.max_num_active_seqs, seqs)
            limits: list[tuple[int | None, float | None]] = [(t, None) for t in cfg.max_num_queued_tokens]
            rate = prefill_throughput(plan, seqs, tokens, prompts) if factors and prompts else math.nan
            if math.isfinite(rate):
                limits += [(max(1, round(f * float(ttft_ms) / 1000.0 * rate)), f) for f in factors]
                rates.append(f"{seqs} x {tokens}: {rate:,.0f}")
            for policy in policies:
                for queued_tokens, factor in limits:
                    for queued_reqs in cfg.max_num_queued_reqs:
                        points.append(EngineGridPoint(
                            seqs, tokens, queued_tokens, queued_reqs, active, policy, factor,
                            rate if factor is not None else None))
    if rates:
        notes.append(f"prefill throughput, prompt tokens/s at max_num_seqs x max_num_batched_tokens (tuning seed "
                     f"{tune_seed}'s first {len(prompts)} prompts): {'; '.join(rates)}")
    if not points:
        raise EvaluationError(f"vllm_tuned on {plan.key!r}: no setting of the grid runs here ({'; '.join(notes)})")
    return points, notes
