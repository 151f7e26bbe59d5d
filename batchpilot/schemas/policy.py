"""The ``policy`` group's dataclasses (``conf/policy/*.yaml``): the controllers' settings (AIMD,
static, PPO, lookahead, vLLM tuned) and each file's schema, the dataclass plus the ``kind`` that
selects its builder (``policies/controllers.py build_controller``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from batchpilot.core.pid import PIDConfig, check_common
from batchpilot.core.telemetry import DEFAULT_TPOT_MS, DEFAULT_TTFT_MS
from batchpilot.nodes import ConfigError, node_schema, schema_node
from batchpilot.schemas.engine import SCHEDULING_POLICIES


# --- policy: AIMD ------------------------------------------------------------------------------
@dataclass(slots=True)
class AIMDConfig:
    """Additive increase / multiplicative decrease on the cap (``conf/policy/aimd.yaml``)."""

    metric: str = "ttft"
    slo_ms: float = DEFAULT_TTFT_MS
    #: A breach is P99 above target_frac x SLO.
    target_frac: float = 1.0
    #: Added to the cap per interval while the SLO holds and requests wait.
    additive_increase: int = 4
    #: The cap's factor on a breach (within the shield's 30 % step).
    multiplicative_decrease: float = 0.75
    #: Treat preemptions in the interval as a breach too (memory pressure).
    decrease_on_preemption: bool = True
    #: As PIDConfig.queue_aware: judge the SLO on TPOT while the backlog exceeds the cap.
    queue_aware: bool = True
    tpot_slo_ms: float | None = DEFAULT_TPOT_MS
    initial_batch_cap: int = 32
    min_batch: int = 1
    max_batch: int = 256
    bucketing: str = "fifo"

    def __post_init__(self) -> None:
        check_common("aimd", {"metric": self.metric, "bucketing": self.bucketing})
        if self.additive_increase < 1 or not 0 < self.multiplicative_decrease < 1:
            raise ValueError(
                f"aimd: need additive_increase >= 1 and 0 < multiplicative_decrease < 1, got "
                f"{self.additive_increase}, {self.multiplicative_decrease}"
            )
        if not 1 <= self.min_batch <= self.initial_batch_cap <= self.max_batch:
            raise ValueError("aimd: need 1 <= min_batch <= initial_batch_cap <= max_batch")


# --- policy: static ----------------------------------------------------------------------------
@dataclass(slots=True)
class StaticConfig:
    """Fixed knobs (``conf/policy/static.yaml``; ``vllm_default.yaml`` = vLLM's defaults).
    ``batch_cap: null`` means the engine's ``max_num_seqs``."""

    batch_cap: int | None = 64
    bucketing: str = "fifo"
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_common("static", {"bucketing": self.bucketing})
        if self.batch_cap is not None and self.batch_cap < 1:
            raise ValueError(f"static.batch_cap must be >= 1 or null, got {self.batch_cap}")


@dataclass(frozen=True, slots=True)
class PPOPolicyConfig:
    """``conf/policy/ppo.yaml`` (``policies/ppo_controller.py build_ppo_controller``)."""

    #: Artifact folder; None = the shipped policy in policies/pretrained/.
    path: str | None = None
    #: KV dtypes the engine can run ({dtype: true/false}); None = only the 16-bit dtype.
    kv_runnable: dict[str, bool] | None = None
    #: The engine's max_model_len (normalises prompt lengths); None = the one recorded at training.
    max_model_len: int | None = None
    #: Widening of the training range beyond which an observation hands the interval to PID.
    ood_margin: float = 0.25
    #: Run the folder's KV-precision agent (``<path>/kv_agent``) when it has one.
    kv_agent: bool = True
    #: The engine's restart time for a KV switch, which the agent weighs (the shield's
    #: ``dtype_restart_s``); None: the KV agent is not run.
    kv_restart_s: float | None = None
    #: Start at the 8-bit KV dtype where the memory ceiling would bind at 16 bits (where the
    #: hardware reads 8-bit KV slower, ``hardware.kv8_speed_factor > 1``, only if it binds at 8
    #: bits too; ``Shield.start_kv_dtype``): before any traffic a switch costs no restart, and the
    #: shield's dwell then runs from the start, so the KV agent cannot pay a restart to undo it
    #: within minutes. Matrix (best_static tuned with both dtypes): 0.960x -> 0.989x best_static;
    #: deployments outside the repo on H100s: 0.71-0.78x -> 1.00x (docs/evaluation.md, "A KV
    #: dtype chosen at start-up"). The gateway applies the same rule in policy mode (its own
    #: ``kv_start`` setting). False: start at the engine's configured dtype, as every other
    #: controller does.
    kv_start: bool = True
    #: The SLO served, ``{"ttft": ms, "tpot": ms, "e2el": ms}`` (``build_controller`` fills it from
    #: the top config's ``slo``); None = the SLO the policy was trained at.
    slo: dict[str, float | None] | None = None


@dataclass(frozen=True, slots=True)
class LookaheadConfig:
    """``conf/policy/lookahead.yaml`` (``policies/lookahead.py``): an upper bound on what choosing
    among ``options`` every ``epoch_s`` could add over PID, found by trying each on a copy of the
    simulator. Not a controller to deploy: it sees the future."""

    #: How long a choice holds (engine seconds).
    epoch_s: float = 10.0
    #: How far each choice is judged: the option for ``epoch_s``, then ``1`` (PID's cap, the
    #: default order) for the rest.
    horizon_s: float = 40.0
    #: ``<cap>[/<bucketing>][/refuse[=<p>]|/keep][/early[=<slack>]|/early=off][/budget=<x>|none]``:
    #: the cap is a factor of the residual policy's action on PID's cap or ``max`` (the
    #: engine's max_num_seqs); the order defaults to ``bucketing``; the admission parts hold for
    #: the option's epoch only (``refuse``: ``ttft_deadline`` on above priority ``p``, default
    #: -1 = every request; ``keep``: off; ``early``: ``early_refusal`` on above -1; ``budget``:
    #: ``prefill_backlog_budgets``), the env's own admission configuration otherwise.
    options: list[str] = field(default_factory=lambda: ["0.7", "0.85", "1", "1.15", "1.3", "1/weighted",
                                                        "1/fifo", "max"])
    #: The order of ``1`` and of an option that names none (PID with shortest first: ``pid_sf``).
    bucketing: str = "shortest_first"
    #: The SLO served (``build_controller`` fills it from the top config's ``slo``).
    slo: dict[str, float | None] | None = None
    #: What the copies are fed: ``future`` (the episode's own arrivals: the bound) or ``recent``
    #: (the last ``horizon_s`` of arrivals, repeated: a forecast a deployed controller could make).
    arrivals: str = "future"


@dataclass(slots=True)
class VllmTunedConfig:
    """``conf/policy/vllm_tuned.yaml``: vLLM tuned with its own start-up flags, the yardstick an
    operator would deploy instead of batchpilot (``evaluation/matrix.py``). The grid is every
    combination of the lists; each point is a ``vllm serve`` started with those flags, scored on
    ``best_static.tune_seeds`` with best_static's objective (as vLLM's ``benchmarks/auto_tune``:
    restart per setting, keep the best that meets the latency objective)."""

    #: ``--max-num-seqs`` values (the running batch).
    max_num_seqs: list[int] = field(default_factory=lambda: [64, 128, 256])
    #: ``--max-num-batched-tokens`` values (the iteration's token budget); each must be >= the
    #: point's max_num_seqs, as vLLM requires (smaller pairs are skipped, said so).
    max_num_batched_tokens: list[int] = field(default_factory=lambda: [2048, 8192])
    #: ``--max-num-queued-tokens`` values, in tokens (null: no limit).
    max_num_queued_tokens: list[int | None] = field(default_factory=lambda: [None])
    #: ``--max-num-queued-tokens`` as factors of vLLM's docs' rule, the TTFT objective x the
    #: prefill throughput (measured at the point's max_num_seqs and token budget on the tuning
    #: seed's prompts); 1.0 is the docs' suggestion. Added to the values above. Below it pays
    #: here: with [0.25, 0.5, 1] on the evaluation matrix, 0.25 won in 15 of the 20 cells; on
    #: bursty, ramp and azure_conv_hot (Llama-3-8B/H100) 0.0625 to 0.25 were within 6 % of each
    #: other (0.03: up to 18 % less, 0.5: up to 39 % less). The prompt-token count is vLLM's:
    #: every request without a first token, the running prefills included.
    queued_tokens_ttft_factors: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5, 1.0])
    #: ``--max-num-queued-reqs`` values (unfinished requests, waiting + running; null: no limit).
    max_num_queued_reqs: list[int | None] = field(default_factory=lambda: [None])
    #: ``--max-num-active-seqs`` for every point (null: max_num_seqs); at most each max_num_seqs.
    max_num_active_seqs: int | None = None
    #: Prompts of the tuning seed's requests the prefill throughput is measured with.
    prefill_probe_requests: int = 256
    #: ``--scheduling-policy`` values (``fcfs``, ``priority``), crossed with the grid above where
    #: the workload has more than one priority class (its tuning seed's requests; vLLM's docs
    #: list ``priority`` with a per-request ``priority`` for traffic with classes). On a
    #: one-class workload ``priority`` orders nothing, so only fcfs points run (the grid as
    #: without this list). ``[fcfs]``: never try priority.
    scheduling_policies: list[str] = field(default_factory=lambda: ["fcfs", "priority"])

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_num_queued_tokens",
                     "queued_tokens_ttft_factors", "max_num_queued_reqs"):
            values = list(getattr(self, name))
            if len(set(values)) != len(values):
                raise ValueError(f"vllm_tuned.{name} lists a value twice: {values}")
        if not self.max_num_seqs or min(self.max_num_seqs) < 1:
            raise ValueError(f"vllm_tuned.max_num_seqs must be non-empty and >= 1, got {list(self.max_num_seqs)}")
        if not self.max_num_batched_tokens or min(self.max_num_batched_tokens) < 1:
            raise ValueError("vllm_tuned.max_num_batched_tokens must be non-empty and >= 1, got "
                             f"{list(self.max_num_batched_tokens)}")
        if not self.max_num_queued_tokens and not self.queued_tokens_ttft_factors:
            raise ValueError("vllm_tuned: max_num_queued_tokens and queued_tokens_ttft_factors are both empty; "
                             "list null in max_num_queued_tokens for no limit")
        if not self.max_num_queued_reqs:
            raise ValueError("vllm_tuned.max_num_queued_reqs is empty; [null] for no limit")
        for name in ("max_num_queued_tokens", "max_num_queued_reqs"):
            bad = [v for v in getattr(self, name) if v is not None and v < 0]
            if bad:
                raise ValueError(f"vllm_tuned.{name} must be >= 0 or null, got {bad}")
        bad_f = [f for f in self.queued_tokens_ttft_factors if not (f > 0 and math.isfinite(f))]
        if bad_f:
            raise ValueError(f"vllm_tuned.queued_tokens_ttft_factors must be > 0, got {bad_f}")
        if self.max_num_active_seqs is not None and self.max_num_active_seqs < 1:
            raise ValueError(f"vllm_tuned.max_num_active_seqs must be >= 1 or null, got {self.max_num_active_seqs}")
        if self.prefill_probe_requests < 1:
            raise ValueError(f"vllm_tuned.prefill_probe_requests must be >= 1, got {self.prefill_probe_requests}")
        pols = list(self.scheduling_policies)
        if not pols or any(p not in SCHEDULING_POLICIES for p in pols) or len(set(pols)) != len(pols):
            raise ValueError(f"vllm_tuned.scheduling_policies must list some of {SCHEDULING_POLICIES} once each, "
                             f"got {pols}")


# The conf/policy files' schemas: the controller's dataclass plus ``kind``, which selects the
# builder (``policies/controllers.py build_controller``), and a static controller's ``name``.
# PID's, AIMD's and PPO's leave out the SLO fields: build_controller fills them from the top
# config's ``slo`` group, and a schema default there would hide the SLO.
_SLO_FILLED = ("slo_ms", "tpot_slo_ms")
PIDPolicyNode = node_schema(PIDConfig, "PIDPolicyNode", extra=[("kind", str, "pid")], exclude=_SLO_FILLED)
AIMDPolicyNode = node_schema(AIMDConfig, "AIMDPolicyNode", extra=[("kind", str, "aimd")], exclude=_SLO_FILLED)
StaticPolicyNode = node_schema(StaticConfig, "StaticPolicyNode", extra=[("kind", str, "static"), ("name", str, "static")])
PPOPolicyNode = node_schema(PPOPolicyConfig, "PPOPolicyNode", extra=[("kind", str, "ppo")], exclude=("slo",))
LookaheadPolicyNode = node_schema(LookaheadConfig, "LookaheadPolicyNode", extra=[("kind", str, "lookahead")],
                                  exclude=("slo",))
VllmTunedPolicyNode = node_schema(VllmTunedConfig, "VllmTunedPolicyNode",
                                  extra=[("kind", str, "vllm_tuned"), ("name", str, "vllm_tuned")])

#: Each policy file's schema, by the name its ``defaults`` list gives it (``- schema_pid``);
#: ``batchpilot.schemas.SCHEMAS`` stores the same classes under these names for Hydra.
POLICY_SCHEMAS: dict[str, type] = {
    "schema_pid": PIDPolicyNode, "schema_aimd": AIMDPolicyNode, "schema_static": StaticPolicyNode,
    "schema_ppo": PPOPolicyNode, "schema_lookahead": LookaheadPolicyNode, "schema_vllm_tuned": VllmTunedPolicyNode,
}


def with_policy_schema(node: Any, where: str) -> DictConfig:
    """A policy file read without Hydra (``batchpilot.config.load_group_file``) merged over the
    schema its ``defaults`` name, as Hydra composes ``policy=<name>``: a key the file leaves out
    is the dataclass default, for the evaluation and the training baseline as for the gateway,
    so a file holds only what differs (tests/test_one_default.py). A file naming no schema, an
    unknown key or a wrong type raises ``ConfigError`` naming ``where`` (the file)."""
    data = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else dict(node)
    assert isinstance(data, dict)
    defaults = data.pop("defaults", None) or []
    names = [d for d in defaults if isinstance(d, str) and d in POLICY_SCHEMAS]
    if len(names) != 1:
        raise ConfigError(f"{where}: its defaults must name one policy schema of {sorted(POLICY_SCHEMAS)} "
                          f"(directly or through the file it extends), got {list(defaults)}")
    try:
        merged = OmegaConf.merge(schema_node(POLICY_SCHEMAS[names[0]]), data)
    except (ConfigKeyError, ValidationError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    assert isinstance(merged, DictConfig)
    return merged
