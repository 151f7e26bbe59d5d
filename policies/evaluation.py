"""Evaluation: every controller on the same workloads and seeds, under the same shield.

``evaluate(cfg, overrides)`` runs each controller × workload × seed as one episode of
``ServingEnv`` (the simulator by default, the live engine with ``engine=vllm``), the
controller deciding once per control interval (``env.interval_s``) and the shield turning
its proposals into knobs, exactly as in training and serving. Evaluation episodes drain at the
end (``env.drain_on_truncate``), so every request's fate counts: finished, or rejected.

Controllers are named by ``conf/policy/<name>.yaml`` (``ppo``, ``pid``, ``aimd``,
``vllm_default``, ``static``) plus ``best_static``:

``best_static`` is the best fixed configuration *for that workload*, found by a grid search
over batch cap × bucketing × KV dtype (``best_static:`` in ``conf/evaluate.yaml``). Each grid
point runs one episode on the tuning seed (seed 0 by default) — so it is tuned with
hindsight on the very trace it is then scored on. Objective: the highest ``request_goodput``
among points whose ``slo_attainment`` is at least ``min_slo_attainment``; if none reaches it,
the highest ``slo_attainment`` (ties: goodput). Goodput alone already counts only requests
meeting the SLO; the attainment floor keeps the pick comparable at "equal or better SLO
attainment", the comparison the table is read by.

Each workload is composed afresh from ``conf/evaluate.yaml`` plus the run's overrides plus
``workload_overrides[<name>]`` (e.g. Mooncake on ``model=deepseek_v3 hardware=h200``); a group
the user set explicitly on the command line wins over the workload's default.

The matrix is cut into cells (``Cell``: one controller's episodes on one workload; on the
simulator one seed each, since an episode depends only on its seed). A launcher runs them:
``launcher=serial`` (default) one after another in this process, ``launcher=ray`` as Ray tasks
on a local or remote cluster (docs/scaling.md). Both call the same ``run_cell`` and the rows are
assembled in the same order afterwards, so the files written do not depend on the launcher.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf, open_dict

from batchpilot.config import CONF_DIR, from_node
from batchpilot.core.engine import EngineCapabilities
from batchpilot.core.knobs import Knobs
from batchpilot.envs.engines import build_engine
from batchpilot.envs.workloads import build_workload
from batchpilot.policies.controllers import CONTROLLER_BUILDERS, Controller, build_controller
from batchpilot.policies.eval_report import ROW_KEYS, Timeline

# Declared there (the evaluate schema and launcher/schema type them); re-exported here.
from batchpilot.schemas import (  # noqa: F401
    LAUNCHERS,
    LOAD_MODES,
    BestStaticConfig,
    EvaluateApp,
    LauncherConfig,
    LoadConfig,
    check_app,
)

BEST_STATIC = "best_static"
#: The grid's best point on the scored seeds themselves: an upper bound, not a baseline.
HINDSIGHT = "best_static_hindsight"
#: Policies run as shipped by default: no shield (no breaker, no shedding, no memory or step
#: limit) and no batchpilot admission limits in front of the engine (``policy_overrides.<name>.as_shipped=false`` puts them back).
AS_SHIPPED = ("vllm_default",)
AS_SHIPPED_KEY = "as_shipped"


class EvaluationError(ValueError):
    """The evaluation cannot run as configured; the message names the setting and the fix."""


# --- config ----------------------------------------------------------------------------------
def _launcher(node: Any) -> LauncherConfig:
    """``launcher`` (``conf/launcher/*.yaml``, checked against ``launcher/schema`` at compose)."""
    try:
        return LauncherConfig.from_cfg(node)
    except ValueError as e:
        raise EvaluationError(str(e)) from None


@dataclass(frozen=True, slots=True)
class Deployment:
    """A model on a hardware (``conf/model/<model>.yaml`` on ``conf/hardware/<hardware>.yaml``)."""

    model: str
    hardware: str

    @property
    def label(self) -> str:
        return f"{self.model}/{self.hardware}"

    @classmethod
    def parse(cls, text: str) -> "Deployment":
        model, sep, hardware = str(text).partition("/")
        if not sep or not model or not hardware:
            raise EvaluationError(f"deployments: {text!r} is not MODEL/HARDWARE (e.g. llama3_8b/h100)")
        for group, name in (("model", model), ("hardware", hardware)):
            if not (CONF_DIR / group / f"{name}.yaml").is_file():
                known = sorted(f.stem for f in (CONF_DIR / group).glob("*.yaml"))
                raise EvaluationError(f"deployments: unknown {group} {name!r} in {text!r}; known: {known}")
        return cls(model, hardware)


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """The run-wide settings of ``conf/evaluate.yaml`` (the groups are composed per workload).
    Built by ``from_cfg`` from the composed config, whose keys and types ``schema/evaluate``
    (``batchpilot.schemas.EvaluateApp``) checked at compose time; the values are the file's."""

    policies: tuple[str, ...]
    seeds: tuple[int, ...]
    out_dir: Path
    #: Names of ``conf/workload`` files; empty = the one ``workload`` group of the config.
    workloads: tuple[str, ...]
    #: Model/hardware pairs every workload runs on; empty = each workload's own
    #: (``workload_overrides``, else the ``model``/``hardware`` groups).
    deployments: tuple[Deployment, ...]
    #: Workload name -> Hydra overrides it runs with (``["model=deepseek_v3", "hardware=h200"]``).
    workload_overrides: Mapping[str, tuple[str, ...]]
    #: Policy name -> keys merged into ``conf/policy/<name>.yaml`` (e.g. ``{ppo: {path: DIR}}``).
    policy_overrides: Mapping[str, Mapping[str, Any]]
    best_static: BestStaticConfig
    load: LoadConfig
    #: Traces with a ``duration_s``: seed k replays the window starting at
    #: ``start_s + k * stride`` (stride = ``trace_window_stride_s`` or the window's length).
    trace_windows: bool
    trace_window_stride_s: float | None
    plots: bool
    launcher: LauncherConfig
    #: The config each workload is recomposed from (``--config-name`` of the run).
    config_name: str = "evaluate"

    @property
    def all_seeds(self) -> tuple[int, ...]:
        """The scored seeds, then best_static's tuning seeds when it runs."""
        tune = self.best_static.tune_seeds if BEST_STATIC in self.policies else ()
        return (*self.seeds, *tune)

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> "EvalConfig":
        """From the composed config. The keys and types are the schema's (a key added with
        ``+key=...`` is named here); this checks what a type cannot say: names that must exist,
        lists without repeats, tuning seeds apart from the scored ones, value ranges."""
        try:
            check_app(EvaluateApp, cfg)
            bsc = from_node(BestStaticConfig, cfg.best_static)
            load = from_node(LoadConfig, cfg.load)
        except ValueError as e:
            raise EvaluationError(str(e)) from None
        pol = [str(p) for p in cfg.policies]
        seeds = [int(s) for s in cfg.seeds]
        if not pol:
            raise EvaluationError("policies is empty: list controllers, e.g. policies=[pid,best_static]")
        if len(set(pol)) != len(pol):
            raise EvaluationError(f"policies lists a controller twice: {pol}")
        if not seeds or len(set(seeds)) != len(seeds):
            raise EvaluationError(f"seeds must be a non-empty list of distinct ints, got {seeds}")
        for p in pol:
            if p != BEST_STATIC and not (CONF_DIR / "policy" / f"{p}.yaml").is_file():
                known = sorted([f.stem for f in (CONF_DIR / "policy").glob("*.yaml")] + [BEST_STATIC])
                raise EvaluationError(f"unknown policy {p!r} in policies=[...]; known: {known}")
        wls = [str(w) for w in (cfg.workloads or [])]
        for w in wls:
            if not (CONF_DIR / "workload" / f"{w}.yaml").is_file():
                known = sorted(f.stem for f in (CONF_DIR / "workload").glob("*.yaml"))
                raise EvaluationError(f"unknown workload {w!r} in workloads=[...]; known: {known}")
        deps = [Deployment.parse(str(d)) for d in (cfg.deployments or [])]
        if len(set(deps)) != len(deps):
            raise EvaluationError(f"deployments lists a pair twice: {[d.label for d in deps]}")
        if BEST_STATIC in pol:
            both = sorted(set(bsc.tune_seeds) & set(seeds))
            if both:
                raise EvaluationError(
                    f"best_static.tune_seeds {list(bsc.tune_seeds)} overlap seeds {seeds} at {both}: "
                    f"best_static must be tuned on other seeds (trace windows) than those it is scored on"
                )
        stride = cfg.trace_window_stride_s
        if stride is not None and not float(stride) > 0:
            raise EvaluationError(f"trace_window_stride_s must be > 0 or null, got {stride}")
        wo = OmegaConf.to_container(cfg.workload_overrides, resolve=True)
        po = OmegaConf.to_container(cfg.policy_overrides, resolve=True)
        return cls(
            policies=tuple(pol),
            seeds=tuple(seeds),
            out_dir=Path(str(cfg.out_dir)),
            workloads=tuple(wls),
            deployments=tuple(deps),
            workload_overrides={str(k): tuple(str(o) for o in v) for k, v in dict(wo).items()},  # type: ignore[arg-type]
            policy_overrides={str(k): dict(v or {}) for k, v in dict(po).items()},  # type: ignore[arg-type]
            best_static=bsc,
            load=load,
            trace_windows=bool(cfg.trace_windows),
            trace_window_stride_s=None if stride is None else float(stride),
            plots=bool(cfg.plots),
            launcher=_launcher(cfg.launcher),
        )


# --- composing one workload's config ------------------------------------------------------------
def override_key(o: str) -> str:
    """The config key a Hydra override sets (``+a.b=1``, ``~a.b`` -> ``a.b``)."""
    return o.split("=", 1)[0].lstrip("+~")


def workload_overrides(
    user: Sequence[str], name: str | None, extra: Sequence[str]
) -> list[str]:
    """The overrides one workload composes with: the user's (without ``workloads``, and without
    ``workload=`` when ``name`` comes from the list), then ``workload=<name>``, then the
    workload's own ``extra`` group choices unless the user set that group explicitly."""
    out = [o for o in user if override_key(o) != "workloads" and not (name and override_key(o) == "workload")]
    if name:
        out.append(f"workload={name}")
    user_keys = {override_key(o) for o in user}
    out += [o for o in extra if override_key(o) not in user_keys]
    return out


def compose_eval(overrides: Sequence[str], config_name: str = "evaluate") -> tuple[DictConfig, dict[str, str]]:
    """``conf/<config_name>.yaml`` (``evaluate``, or a preset built on it such as
    ``evaluate_matrix``) composed with ``overrides``; also the group choices made."""
    import batchpilot.schemas  # noqa: F401  (stores the structured-config schemas the groups extend)

    gh = GlobalHydra.instance()
    if gh.is_initialized():
        gh.clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    choices = {str(k): str(v) for k, v in cfg.hydra.runtime.choices.items() if v is not None}
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, choices


@dataclass(slots=True)
class WorkloadPlan:
    """One workload on one deployment, ready to run: its composed config, the engine's limits,
    episode length, the load multiplier applied and, for a trace, each seed's window."""

    name: str
    cfg: DictConfig
    max_num_seqs: int
    max_model_len: int
    kv_runnable: dict[str, bool]
    kv_why_not: dict[str, str | None]
    episode_s: float
    num_requests: int
    #: "model/hardware" when the run has a deployments axis (None: the workload's own).
    deployment: str | None = None
    #: What the workload's ``rate_scale`` was multiplied by for this deployment.
    rate_multiplier: float = 1.0
    #: Seed -> trace window start (trace seconds); empty = every seed replays the same requests.
    windows: dict[int, float] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return str(self.cfg.model.get("name", "?"))

    @property
    def hardware(self) -> str:
        return str(self.cfg.hardware.get("name", "?"))

    @property
    def key(self) -> str:
        """Unique within a run: the workload, and the deployment when there is an axis."""
        return self.name if self.deployment is None else f"{self.name} @ {self.deployment}"


def extra_overrides(ecfg: EvalConfig, workload: str, engine_kind: str) -> tuple[str, ...]:
    """A workload's own group choices. They describe simulated GPUs; the live engine runs the
    model it was started with (engine=vllm picks its own), so they apply on the simulator only."""
    return tuple(ecfg.workload_overrides.get(workload, ())) if engine_kind == "sim" else ()


def deployment_overrides(extra: Sequence[str], deployment: Deployment | None) -> list[str]:
    """``extra`` with its model/hardware choices replaced by ``deployment``'s (other keys, e.g.
    a window length, stay)."""
    if deployment is None:
        return list(extra)
    kept = [o for o in extra if override_key(o) not in ("model", "hardware")]
    return [*kept, f"model={deployment.model}", f"hardware={deployment.hardware}"]


@functools.lru_cache(maxsize=16)
def trace_span_s(path: str, fmt: str, spread_quantum_s: float | None, model: str | None) -> float:
    """Seconds from a trace's first request to its last (trace clock)."""
    from batchpilot.envs.traces import TraceOptions, read_trace

    tr = read_trace(path, fmt, TraceOptions(spread_quantum_s=spread_quantum_s, model=model))
    return float(tr.arrival_s[-1]) if len(tr.arrival_s) else 0.0


def trace_windows(
    workload: DictConfig, seeds: Sequence[int], stride_s: float | None, label: str
) -> dict[int, float]:
    """Seed k's window of a trace: ``start_s + k * stride`` (stride: the window's length, so
    windows do not overlap). Empty when the workload has no ``duration_s`` (the whole trace);
    an ``EvaluationError`` when a seed's window runs past the trace's end."""
    if workload.get("duration_s") is None:
        return {}
    from batchpilot.envs.workloads import _resolve_path

    dur = float(workload.duration_s)
    base = float(workload.get("start_s", 0.0) or 0.0)
    stride = float(stride_s) if stride_s is not None else dur
    q = workload.get("spread_quantum_s")
    span = trace_span_s(
        str(_resolve_path(str(workload.path))), str(workload.format),
        None if q is None else float(q), workload.get("model"),
    )
    room = max(0, int(math.floor((span + 0.01 * dur - base - dur) / stride + 1e-9)) + 1)
    out = {}
    for s in seeds:
        start = base + s * stride
        if s < 0 or start + dur > span + 0.01 * dur:
            raise EvaluationError(
                f"workload {label!r}: seed {s} would replay trace seconds [{start:g}, {start + dur:g}), past "
                f"the trace's end ({span:.0f} s): it has room for {room} windows of {dur:g} s from "
                f"{base:g} s (seeds 0..{room - 1}); use other seeds/tune_seeds, a shorter "
                f"workload.duration_s, or trace_windows=false (every seed the same requests)"
            )
        out[int(s)] = start
    return out


def engine_capabilities(cfg: DictConfig) -> EngineCapabilities:
    """What the configured engine can do (built once to ask, then closed)."""
    engine = build_engine(cfg)
    try:
        return engine.capabilities()
    finally:
        engine.close()


def plan_from_caps(
    name: str, cfg: DictConfig, caps: EngineCapabilities, *, duration_s: float, num_requests: int, **extra: Any
) -> WorkloadPlan:
    """A plan with the engine's limits and KV dtypes, and an episode covering ``duration_s``."""
    kv = {str(cfg.env.kv16_dtype), str(cfg.env.kv8_dtype), "auto"}
    interval = float(cfg.env.interval_s)
    return WorkloadPlan(
        name=name,
        cfg=cfg,
        max_num_seqs=caps.max_num_seqs,
        max_model_len=caps.max_model_len,
        kv_runnable={d: caps.can_run(d) for d in kv},
        kv_why_not={d: caps.why_not(d) for d in kv},
        episode_s=max(1, math.ceil(duration_s / interval - 1e-9)) * interval,
        num_requests=num_requests,
        **extra,
    )


def _plan_from_cfg(
    cfg: DictConfig, label: str, ecfg: EvalConfig, deployment: Deployment | None, multiplier: float
) -> WorkloadPlan:
    if multiplier != 1.0:
        with open_dict(cfg):
            cfg.workload.rate_scale = float(cfg.workload.get("rate_scale", 1.0)) * multiplier
    caps = engine_capabilities(cfg)
    windows: dict[int, float] = {}
    try:
        if cfg.workload.get("kind") == "trace" and ecfg.trace_windows:
            windows = trace_windows(cfg.workload, ecfg.all_seeds, ecfg.trace_window_stride_s, label)
        wl = cfg.workload
        if windows:
            wl = copy.deepcopy(cfg.workload)
            with open_dict(wl):
                wl.start_s = windows[ecfg.seeds[0]]
        stream = build_workload(wl, np.random.default_rng(0), caps.max_model_len)
    except (OSError, ValueError) as e:
        raise EvaluationError(f"workload {label!r}: {e}") from e
    return plan_from_caps(
        label, cfg, caps, duration_s=stream.duration_s, num_requests=len(stream),
        deployment=None if deployment is None else deployment.label, rate_multiplier=multiplier, windows=windows,
    )


def plan_workload(
    user_overrides: Sequence[str],
    name: str | None,
    ecfg: EvalConfig,
    deployment: Deployment | None = None,
    multiplier: float = 1.0,
) -> WorkloadPlan:
    """Compose, validate and size one workload (on ``deployment`` when given, its load times
    ``multiplier``): the trace is read (a bad path or a malformed file fails here, before any
    episode runs), the episode length set to cover it and each seed's trace window chosen."""
    base, ch = compose_eval(workload_overrides(user_overrides, name, ()), ecfg.config_name)
    if deployment is not None and str(base.engine.kind) != "sim":
        raise EvaluationError("deployments=[...] needs the simulator (engine=sim): the live engine runs its own model")
    extra = extra_overrides(ecfg, name or ch.get("workload", ""), str(base.engine.kind))
    overrides = workload_overrides(user_overrides, name, deployment_overrides(extra, deployment))
    cfg, choices = compose_eval(overrides, ecfg.config_name)
    label = name or choices.get("workload", "workload")
    if cfg.workload.get("kind") == "trace" and label == "trace":
        label = f"trace:{Path(str(cfg.workload.path)).stem}"
    return _plan_from_cfg(cfg, label, ecfg, deployment, multiplier)


# --- load per deployment ----------------------------------------------------------------------
def probe_capacity(plan: WorkloadPlan, completions: int = 300) -> float:
    """Requests/s the simulated deployment finishes when saturated with this workload's own
    requests (first scored seed; all caps at ``max_num_seqs``, FIFO, 16-bit KV, no shield;
    ``envs/capacity.py``)."""
    from batchpilot.envs.capacity import CapacityProbeError, saturated_rate

    if str(plan.cfg.engine.kind) != "sim":
        raise EvaluationError("load.mode=probe needs the simulator (engine=sim)")
    wl = copy.deepcopy(plan.cfg.workload)
    if plan.windows:
        with open_dict(wl):
            wl.start_s = next(iter(plan.windows.values()))
    stream = build_workload(wl, np.random.default_rng(0), plan.max_model_len)
    engine = build_engine(plan.cfg)
    try:
        return saturated_rate(engine, stream.pop_until(math.inf), plan.max_num_seqs, completions)
    except CapacityProbeError as exc:
        raise EvaluationError(f"workload {plan.name!r} on {plan.deployment}: {exc}") from exc
    finally:
        engine.close()


def deployment_multiplier(
    load: LoadConfig, ref: WorkloadPlan, plan: WorkloadPlan, cache: dict[tuple[str, str], float]
) -> tuple[float, str]:
    """The load multiplier for ``plan``'s deployment and how it was found."""
    if plan.deployment in load.table:
        return float(load.table[plan.deployment]), "load.table"
    if load.mode != "probe" or (plan.model, plan.hardware) == (ref.model, ref.hardware):
        return 1.0, "its own deployment" if load.mode == "probe" else f"load.mode={load.mode}"
    for p in (ref, plan):
        k = (p.name, f"{p.model}/{p.hardware}")
        if k not in cache:
            cache[k] = probe_capacity(p, load.probe_completions)
    cap_ref = cache[(ref.name, f"{ref.model}/{ref.hardware}")]
    cap = cache[(plan.name, f"{plan.model}/{plan.hardware}")]
    return cap / cap_ref, (
        f"probe: {cap:.3g} req/s saturated vs {cap_ref:.3g} on {ref.model}/{ref.hardware}"
    )


def plan_matrix(user: Sequence[str], ecfg: EvalConfig, log: Callable[[str], None]) -> list[WorkloadPlan]:
    """Every workload (× deployment) of the run, load sized per deployment."""
    if ecfg.deployments:
        clash = sorted({override_key(o) for o in user} & {"model", "hardware"})
        if clash:
            raise EvaluationError(
                f"deployments=[...] sets model and hardware per cell; drop {clash} from the command line"
            )
    plans: list[WorkloadPlan] = []
    cache: dict[tuple[str, str], float] = {}
    for w in ecfg.workloads or (None,):
        ref = plan_workload(user, w, ecfg)
        if not ecfg.deployments:
            plans.append(ref)
            continue
        for d in ecfg.deployments:
            plan = plan_workload(user, w, ecfg, d)
            mult, why = deployment_multiplier(ecfg.load, ref, plan, cache)
            if mult != 1.0:
                plan = _plan_from_cfg(plan.cfg, plan.name, ecfg, d, mult)
            log(f"load on {plan.key}: rate x{mult:.3g} ({why})")
            plans.append(plan)
    keys = [p.key for p in plans]
    if len(set(keys)) != len(keys):
        raise EvaluationError(f"workloads repeat a name: {keys}")
    return plans


# --- controllers ----------------------------------------------------------------------------
def policy_config(name: str, ecfg: EvalConfig, plan: WorkloadPlan) -> dict[str, Any]:
    """``conf/policy/<name>.yaml`` with ``policy_overrides[name]`` merged in."""
    node = OmegaConf.load(CONF_DIR / "policy" / f"{name}.yaml")
    d: dict[str, Any] = dict(OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]
    if name in AS_SHIPPED:
        d[AS_SHIPPED_KEY] = True
    d.update(ecfg.policy_overrides.get(name, {}))
    if d.get("kind") == "ppo":  # the engine's limits normalise the policy's observation
        if d.get("kv_runnable") is None:
            d["kv_runnable"] = dict(plan.kv_runnable)
        if d.get("max_model_len") is None:
            d["max_model_len"] = plan.max_model_len
        if d.get("kv_restart_s") is None:  # what a KV switch costs on this deployment
            d["kv_restart_s"] = float(plan.cfg.shield.dtype_restart_s)
    return d


def _ensure_kind(kind: str, name: str) -> None:
    """Load the module that registers ``kind`` with ``build_controller`` (PPO lives apart)."""
    if kind in CONTROLLER_BUILDERS:
        return
    if kind == "ppo":
        try:
            import batchpilot.policies.ppo_controller  # noqa: F401  (registers "ppo")
        except ImportError as e:
            raise EvaluationError(
                f"policy {name!r} (kind ppo) needs batchpilot.policies.ppo_controller and the "
                f"shipped policy in policies/pretrained/ (the training issue): {e}. Drop it from "
                f"policies=[...] to evaluate the other controllers."
            ) from e
    if kind not in CONTROLLER_BUILDERS:
        known = sorted(CONTROLLER_BUILDERS)
        raise EvaluationError(f"policy {name!r}: no controller of kind {kind!r}; known: {known}")


def make_controller(policy: Mapping[str, Any], plan: WorkloadPlan, name: str | None = None) -> Controller:
    """The controller ``policy`` describes, for this workload's engine and SLO."""
    kind = str(policy.get("kind"))
    name = name or str(policy.get("name", kind))
    _ensure_kind(kind, name)
    slo = plan.cfg.slo
    slo_ms = {"ttft": slo.get("ttft_ms"), "tpot": slo.get("tpot_ms"), "e2el": slo.get("e2el_ms")}
    d = {k: v for k, v in policy.items() if k != AS_SHIPPED_KEY}
    try:
        return build_controller(d, plan.max_num_seqs, slo_ms=slo_ms)
    except (ImportError, ValueError) as e:
        hint = (
            " Ship/train one (scripts/train.py, scripts/export.py), point policy_overrides.ppo.path=DIR "
            "at an exported policy, or drop ppo from policies=[...]."
            if kind == "ppo"
            else ""
        )
        raise EvaluationError(f"policy {name!r} cannot be built: {e}.{hint}") from e


def start_knobs(policy: Mapping[str, Any], plan: WorkloadPlan, controller: Controller | None = None) -> Knobs | None:
    """The knobs an episode starts with: a static setting from t=0 (vLLM started that way),
    PID/AIMD at their ``initial_batch_cap``; a residual policy at the cap of the PID it corrects
    (``controller.initial_batch_cap``: its factor 1 is that PID, so it starts where PID starts);
    None = the environment's defaults (an absolute policy, as trained)."""
    kind = policy.get("kind")
    if kind == "static":
        cap = policy.get("batch_cap")
        cap = plan.max_num_seqs if cap is None else min(int(cap), plan.max_num_seqs)
        return Knobs(max(1, cap), str(policy.get("bucketing", "fifo")), str(policy.get("kv_dtype", "auto")))
    start = policy.get("initial_batch_cap", getattr(controller, "initial_batch_cap", None))
    if start is None:
        return None
    cap = min(int(start), plan.max_num_seqs)
    bucketing = str(policy.get("bucketing", plan.cfg.env.initial_bucketing))
    return Knobs(max(1, cap), bucketing, str(plan.cfg.engine.get("kv_dtype", "auto")))


# --- episodes -------------------------------------------------------------------------------
@dataclass(slots=True)
class Episode:
    metrics: dict[str, float]
    timeline: Timeline | None
    wall_s: float
    error: str = ""


def episode_config(plan: WorkloadPlan, knobs: Knobs | None, as_shipped: bool = False) -> DictConfig:
    """The workload's config for an evaluation episode: drain at the end, cover the workload,
    start at ``knobs``. ``as_shipped``: none of batchpilot's admission limits (long-prompt cap,
    queue length, wait deadline, per-request memory check, prefill backlog) nor its order
    (on-time first) — vLLM's waiting queue has none."""
    c = copy.deepcopy(plan.cfg)
    with open_dict(c):
        c.env.drain_on_truncate = True
        c.env.episode_s = plan.episode_s
        if knobs is not None:
            c.env.initial_batch_cap = knobs.batch_cap
            c.env.initial_bucketing = knobs.bucketing
            c.engine.kv_dtype = knobs.kv_dtype
        if as_shipped:
            c.env.admission.max_num_long = plan.max_num_seqs
            c.env.admission.max_queue_len = 2**31 - 1
            c.env.admission.max_wait_s = None
            c.env.admission.ttft_deadline = False
            c.env.admission.on_time_first = False  # vLLM's waiting queue is first come, first served
            c.env.admission.prefill_backlog_budgets = None  # and it takes every request at once
            c.env.memory_admission = False
    return c


class Unshielded:
    """A shield that lets every proposal through as it is: vLLM as shipped has no breaker, no
    shedding, no step or memory limit in front of it. It keeps the real shield's other duties
    (memory predictions for telemetry) by delegating them."""

    def __init__(self, shield: Any) -> None:
        self._shield = shield

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shield, name)

    def apply(self, proposal: Any, current: Knobs, inputs: Any, now: float) -> Any:
        from batchpilot.core.shield import Decision

        knobs = Knobs(
            batch_cap=current.batch_cap if proposal.batch_cap is None else int(proposal.batch_cap),
            bucketing=proposal.bucketing or current.bucketing,
            kv_dtype=proposal.kv_dtype or current.kv_dtype,
        )
        return Decision(
            knobs=knobs,
            predicted_memory_fraction=self._shield.predicted_fraction(knobs.batch_cap, knobs.kv_dtype),
            dtype_switched=knobs.kv_dtype != current.kv_dtype,
        )


def run_episode(
    env: Any,
    controller: Controller,
    seed: int,
    *,
    record: bool = False,
    window_start_s: float | None = None,
    shielded: bool = True,
) -> Episode:
    """One episode: reset with ``seed`` (on the trace window starting at ``window_start_s``),
    then decide → shield (``Unshielded`` when not ``shielded``) → one interval, until the
    environment truncates (after draining) or the engine fails."""
    t0 = time.perf_counter()
    if window_start_s is not None:
        with open_dict(env.cfg):
            env.cfg.workload.start_s = float(window_start_s)
    env.reset(seed=seed)
    if not shielded:
        env.shield = Unshielded(env.shield)
    controller.reset(env.knobs)
    timeline = Timeline() if record else None
    while True:
        proposal = controller.decide(env.snapshot, env.knobs)
        _, _, terminated, truncated, info = env.step_proposal(proposal)
        if timeline is not None and not truncated:  # the truncating step is the drain: left out
            timeline.add(info)
        if terminated or truncated:
            metrics = info.get("episode_metrics") or env.episode_metrics()
            return Episode(dict(metrics), timeline, time.perf_counter() - t0, str(info.get("error", "")))


def run_policy(
    plan: WorkloadPlan,
    policy: Mapping[str, Any],
    seeds: Sequence[int],
    *,
    record_seed: int | None = None,
    on_episode: Callable[[], None] | None = None,
) -> Iterator[tuple[int, Episode]]:
    """Episodes of one controller on one workload, one per seed, on one environment (a live
    engine starts once per controller, not once per seed)."""
    from batchpilot.envs.serving_env import ServingEnv

    controller = make_controller(policy, plan)
    knobs = start_knobs(policy, plan, controller)
    if knobs is not None and knobs.kv_dtype != "auto" and not plan.kv_runnable.get(knobs.kv_dtype, False):
        raise EvaluationError(
            f"policy {policy.get('name', policy.get('kind'))!r} wants kv_dtype {knobs.kv_dtype!r}, which this "
            f"engine cannot run: {plan.kv_why_not.get(knobs.kv_dtype)}"
        )
    as_shipped = bool(policy.get(AS_SHIPPED_KEY, False))
    env = ServingEnv(cfg=episode_config(plan, knobs, as_shipped))
    try:
        warm = plan.cfg.engine.get("warmup")
        if plan.cfg.engine.kind == "vllm" and warm and float(warm.get("seconds", 0)) > 0:
            # A fresh live engine runs ~3x slower through its first minute: warm it first
            # (the environment keeps a live engine across resets, so once per controller).
            from batchpilot.envs.vllm_engine import warm_up

            w = dict(warm)
            warm_up(env.engine, float(w.pop("seconds")), **w)
        for seed in seeds:
            ep = run_episode(
                env, controller, seed, record=seed == record_seed,
                window_start_s=plan.windows.get(seed) if plan.windows else None, shielded=not as_shipped,
            )
            if on_episode is not None:
                on_episode()
            yield seed, ep
    finally:
        env.close()


# --- best_static ----------------------------------------------------------------------------
@dataclass(slots=True)
class GridPoint:
    batch_cap: int
    bucketing: str
    kv_dtype: str
    #: Means over the tuning seeds.
    request_goodput: float = math.nan
    slo_attainment: float = math.nan
    #: Means over the scored seeds (``best_static.hindsight``).
    hindsight_goodput: float = math.nan
    hindsight_attainment: float = math.nan

    def policy(self, name: str = BEST_STATIC) -> dict[str, Any]:
        return {
            "kind": "static", "name": name,
            "batch_cap": self.batch_cap, "bucketing": self.bucketing, "kv_dtype": self.kv_dtype,
        }

    @property
    def label(self) -> str:
        return f"cap={self.batch_cap} {self.bucketing} kv={self.kv_dtype}"


def best_static_grid(bs: BestStaticConfig, plan: WorkloadPlan) -> tuple[list[GridPoint], list[str]]:
    """Grid points runnable on this engine, and notes on what was skipped."""
    caps = sorted({min(c, plan.max_num_seqs) for c in bs.batch_caps})
    notes, kvs = [], []
    for d in bs.kv_dtypes:
        if d == "auto" or plan.kv_runnable.get(d, False):
            kvs.append(d)
        else:
            notes.append(f"kv_dtype {d} skipped: {plan.kv_why_not.get(d) or 'not runnable here'}")
    if not kvs:
        raise EvaluationError(f"best_static.kv_dtypes {list(bs.kv_dtypes)}: none runs on this engine ({notes})")
    return [GridPoint(c, b, d) for c in caps for b in bs.bucketing for d in kvs], notes


def pick_best(points: Sequence[GridPoint], min_slo_attainment: float, hindsight: bool = False) -> GridPoint:
    """The objective: max goodput among points with attainment >= the floor; else max
    attainment (ties by goodput). On the tuning seeds' means, or the scored seeds' with
    ``hindsight``."""
    def val(x: float) -> float:
        return x if math.isfinite(x) else -math.inf

    def good(p: GridPoint) -> float:
        return val(p.hindsight_goodput if hindsight else p.request_goodput)

    def att(p: GridPoint) -> float:
        return val(p.hindsight_attainment if hindsight else p.slo_attainment)

    ok = [p for p in points if att(p) >= min_slo_attainment]
    if ok:
        return max(ok, key=lambda p: (good(p), att(p)))
    return max(points, key=lambda p: (att(p), good(p)))


def row(plan: WorkloadPlan, policy: str, seed: int, ep: Episode, knobs: str = "") -> dict[str, Any]:
    r: dict[str, Any] = {
        "policy": policy,
        "workload": plan.name,
        "seed": seed,
        "model": plan.model,
        "hardware": plan.hardware,
        "engine": str(plan.cfg.engine.kind),
        "window_start_s": plan.windows.get(seed, math.nan) if plan.windows else math.nan,
        "rate_multiplier": plan.rate_multiplier,
    }
    for k in ROW_KEYS:
        if k not in r and k in ep.metrics:
            r[k] = float(ep.metrics[k])
    r.update(knobs=knobs, wall_s=round(ep.wall_s, 3), error=ep.error)
    missing = [k for k in ROW_KEYS if k not in r]
    if missing:
        raise RuntimeError(f"episode metrics lack {missing}: the environment's episode_metrics changed")
    return r


# --- cells and launchers ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Cell:
    """One controller's episodes on one workload: the unit a launcher runs (one Ray task).

    ``point`` is the index of the best_static grid point the cell scores (None for a cell of
    the results table); ``hindsight``: on the scored seeds (for ``best_static_hindsight``),
    else on the tuning seeds."""

    workload: int
    name: str
    policy: Mapping[str, Any]
    seeds: tuple[int, ...]
    record_seed: int | None = None
    point: int | None = None
    hindsight: bool = False

    @property
    def label(self) -> str:
        if self.point is not None:
            return f"{self.name} · grid point {self.point}" + (" (scored seeds)" if self.hindsight else "")
        return f"{self.name} · seed {','.join(map(str, self.seeds))}"


CellResult = list[tuple[int, Episode]]
#: Called as each cell finishes; returns the cells that can start because of it.
OnDone = Callable[[Cell, CellResult], list[Cell]]


def run_cell(plan: WorkloadPlan, cell: Cell) -> CellResult:
    """A cell's episodes. Every launcher runs cells through this one function, so where a cell
    ran cannot change its result."""
    return list(run_policy(plan, cell.policy, cell.seeds, record_seed=cell.record_seed))


def split_cells(
    workload: int,
    name: str,
    policy: Mapping[str, Any],
    seeds: Sequence[int],
    record_seed: int | None,
    live: bool,
) -> list[Cell]:
    """A controller's seeds as cells: one per seed on the simulator (the finest unit that runs
    in parallel), all in one cell on a live engine (it starts once per controller, ~a minute)."""
    groups = [tuple(seeds)] if live else [(s,) for s in seeds]
    return [Cell(workload, name, dict(policy), g, record_seed if record_seed in g else None) for g in groups]


def run_serial(plans: Sequence[WorkloadPlan], cells: Sequence[Cell], on_done: OnDone) -> None:
    """Cells one after another in this process; a cell's follow-ups run next (the order the
    evaluation always had: a workload's best_static grid, then its seeds)."""
    queue = deque(cells)
    while queue:
        cell = queue.popleft()
        queue.extendleft(reversed(on_done(cell, run_cell(plans[cell.workload], cell))))


def require_launcher(launcher: LauncherConfig) -> Any:
    """The ``ray`` module when the launcher needs it (None for serial); its absence is an
    ``EvaluationError`` naming the extra to install, raised before any episode runs."""
    if launcher.kind != "ray":
        return None
    from batchpilot.cluster import ClusterUnavailable, require_ray

    try:
        return require_ray("launcher=ray")
    except ClusterUnavailable as e:
        raise EvaluationError(str(e)) from None


def run_on_ray(
    plans: Sequence[WorkloadPlan],
    cells: Sequence[Cell],
    on_done: OnDone,
    launcher: LauncherConfig,
    log: Callable[[str], None],
) -> None:
    """Cells as Ray tasks (``launcher.cpus_per_cell`` CPUs each), handled as they finish; each
    workload's plan goes to the object store once."""
    from batchpilot.cluster import ClusterUnavailable, ray_session

    ray = require_launcher(launcher)
    with ExitStack() as stack:
        try:
            resources = stack.enter_context(ray_session(ray, launcher.address, launcher.num_cpus, launcher.init))
        except ClusterUnavailable as e:  # e.g. no cluster at launcher.address
            raise EvaluationError(str(e)) from None
        cpus = resources.get("CPU", 0.0)
        per = launcher.cpus_per_cell
        log(f"Ray cluster: {cpus:g} CPUs, {len(cells)} cells to start, {per:g} CPU per cell")
        # Ray's default retries re-run a cell whose worker died (an episode is a pure function
        # of its seed); a cell's own error is not retried.
        task = ray.remote(run_cell).options(num_cpus=launcher.cpus_per_cell)
        refs = [ray.put(p) for p in plans]
        running: dict[Any, Cell] = {}

        def submit(batch: Sequence[Cell]) -> None:
            for c in batch:
                running[task.remote(refs[c.workload], c)] = c

        submit(cells)
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            cell = running.pop(done[0])
            try:
                result = ray.get(done[0])
            except ray.exceptions.RayTaskError as e:  # the cell's own error, not Ray's wrapper
                for ref in running:
                    ray.cancel(ref)
                raise (e.cause if isinstance(e.cause, Exception) else e) from None
            submit(on_done(cell, result))


# --- the whole run ----------------------------------------------------------------------------
def _user_overrides(overrides: Sequence[str] | None) -> list[str]:
    if overrides is not None:
        return list(overrides)
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


@dataclass(slots=True)
class _Matrix:
    """The run's cells and what came back: the grid points scored, best_static's pick per
    workload, the episodes by (workload, controller, seed)."""

    plans: Sequence[WorkloadPlan]
    ecfg: EvalConfig
    grids: dict[int, list[GridPoint]] = field(default_factory=dict)
    notes: dict[int, list[str]] = field(default_factory=dict)
    left: dict[int, int] = field(default_factory=dict)
    best: dict[int, GridPoint] = field(default_factory=dict)
    hindsight: dict[int, GridPoint] = field(default_factory=dict)
    left_hindsight: dict[int, int] = field(default_factory=dict)
    #: (workload, grid point, seed) -> episode on a scored seed.
    grid_episodes: dict[tuple[int, int, int], Episode] = field(default_factory=dict)
    episodes: dict[tuple[int, str, int], Episode] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return any(str(p.cfg.engine.kind) == "vllm" for p in self.plans)

    @property
    def names(self) -> list[str]:
        """The table's controllers: best_static_hindsight right after best_static."""
        out = []
        for n in self.ecfg.policies:
            out.append(n)
            if n == BEST_STATIC and self.ecfg.best_static.hindsight:
                out.append(HINDSIGHT)
        return out

    def table_cells(self, wi: int, name: str, policy: Mapping[str, Any]) -> list[Cell]:
        return split_cells(wi, name, policy, self.ecfg.seeds, self.ecfg.seeds[0], self.live)

    def first_cells(self) -> list[Cell]:
        """Everything that can start at once: every grid point (on the tuning seeds, and on
        the scored ones for the hindsight bound) and every controller but best_static (whose
        seeds wait for its workload's grid)."""
        cells: list[Cell] = []
        bs = self.ecfg.best_static
        for wi, plan in enumerate(self.plans):
            for name in self.ecfg.policies:
                if name == BEST_STATIC:
                    self.grids[wi], self.notes[wi] = best_static_grid(bs, plan)
                    self.left[wi] = len(self.grids[wi])
                    grid = list(enumerate(self.grids[wi]))
                    cells += [Cell(wi, name, p.policy(), tuple(bs.tune_seeds), None, i) for i, p in grid]
                    if bs.hindsight:
                        self.left_hindsight[wi] = len(self.grids[wi])
                        cells += [
                            Cell(wi, name, p.policy(HINDSIGHT), tuple(self.ecfg.seeds), None, i, True)
                            for i, p in grid
                        ]
                else:
                    cells += self.table_cells(wi, name, policy_config(name, self.ecfg, plan))
        return cells

    @property
    def total_episodes(self) -> int:
        bs = self.ecfg.best_static
        per_point = len(bs.tune_seeds) + (len(self.ecfg.seeds) if bs.hindsight else 0)
        grid = sum(len(g) for g in self.grids.values()) * per_point
        return grid + len(self.plans) * len(self.ecfg.policies) * len(self.ecfg.seeds)

    def done(self, cell: Cell, result: CellResult, log: Callable[[str], None]) -> list[Cell]:
        """Record a finished cell; when it was a workload's last grid point, pick best_static
        there and return its seeds' cells."""
        wi, plan = cell.workload, self.plans[cell.workload]
        floor = self.ecfg.best_static.min_slo_attainment
        if cell.point is not None:
            point = self.grids[wi][cell.point]
            good = float(np.mean([ep.metrics["request_goodput"] for _, ep in result]))
            att = float(np.mean([ep.metrics["slo_attainment"] for _, ep in result]))
            if cell.hindsight:
                point.hindsight_goodput, point.hindsight_attainment = good, att
                for seed, ep in result:
                    self.grid_episodes[(wi, cell.point, seed)] = ep
                self.left_hindsight[wi] -= 1
                if not self.left_hindsight[wi]:
                    self.hindsight[wi] = pick_best(self.grids[wi], floor, hindsight=True)
                    log(f"{HINDSIGHT} on {plan.key}: {self.hindsight[wi].label} (upper bound: picked on the scored seeds)")
                return []
            point.request_goodput, point.slo_attainment = good, att
            self.left[wi] -= 1
            if self.left[wi]:
                return []
            best = self.best[wi] = pick_best(self.grids[wi], floor)
            for note in self.notes[wi]:
                log(f"best_static on {plan.key}: {note}")
            tune = list(self.ecfg.best_static.tune_seeds)
            log(f"best_static on {plan.key}: {best.label} ({len(self.grids[wi])} grid points, tuning seeds {tune})")
            return self.table_cells(wi, BEST_STATIC, best.policy())
        for seed, ep in result:
            if ep.error:
                log(f"[red]{plan.key} · {cell.name} · seed {seed}: engine failed: {ep.error}")
            self.episodes[(wi, cell.name, seed)] = ep
        return []

    def episode(self, wi: int, name: str, seed: int) -> Episode:
        if name == HINDSIGHT:
            return self.grid_episodes[(wi, self.grids[wi].index(self.hindsight[wi]), seed)]
        return self.episodes[(wi, name, seed)]

    def knobs(self, wi: int, name: str) -> str:
        if name == BEST_STATIC:
            return self.best[wi].label
        if name == HINDSIGHT:
            return self.hindsight[wi].label
        policy = policy_config(name, self.ecfg, self.plans[wi])
        k = start_knobs(policy, self.plans[wi]) if policy.get("kind") == "static" else None
        return f"cap={k.batch_cap} {k.bucketing} kv={k.kv_dtype}" if k else ""

    def rows(self) -> list[dict[str, Any]]:
        """The rows in the matrix's order (workload × deployment, controller, seed), however
        cells finished."""
        return [
            row(plan, name, seed, self.episode(wi, name, seed), self.knobs(wi, name))
            for wi, plan in enumerate(self.plans)
            for name in self.names
            for seed in self.ecfg.seeds
        ]

    def timelines(self) -> dict[tuple[str, str], Timeline]:
        out: dict[tuple[str, str], Timeline] = {}
        for wi, plan in enumerate(self.plans):
            for name in self.ecfg.policies:
                tl = self.episodes[(wi, name, self.ecfg.seeds[0])].timeline
                if tl is not None:
                    out[(plan.key, name)] = tl
        return out

    def search(self) -> list[dict[str, Any]]:
        return [
            {
                "workload": self.plans[wi].name, "deployment": f"{self.plans[wi].model}/{self.plans[wi].hardware}",
                **asdict(p), "chosen": p is self.best[wi], "hindsight_chosen": p is self.hindsight.get(wi),
            }
            for wi in sorted(self.grids)
            for p in self.grids[wi]
        ]


def _config_name(config_name: str | None) -> str:
    if config_name is not None:
        return config_name
    from hydra.core.hydra_config import HydraConfig

    return str(HydraConfig.get().job.config_name) if HydraConfig.initialized() else "evaluate"


def evaluate(
    cfg: DictConfig, overrides: Sequence[str] | None = None, config_name: str | None = None
) -> list[dict[str, Any]]:
    """Run every controller × workload × seed and write results.json, results.csv,
    results.md (mean ± 95 % CI table), timelines.json, best_static_search.json and plots to
    ``cfg.out_dir`` (and to W&B when ``cfg.logger`` turns it on). ``overrides`` are the Hydra
    overrides ``cfg`` was composed with (read from Hydra inside ``scripts/evaluate.py``); each
    workload is recomposed from them and ``config_name`` (default: the Hydra app's
    ``--config-name``, else ``evaluate``). ``cfg.launcher`` says where the cells run. Returns
    the rows."""
    import json

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from batchpilot.policies import eval_report as rep

    ecfg = dataclasses.replace(EvalConfig.from_cfg(cfg), config_name=_config_name(config_name))
    require_launcher(ecfg.launcher)
    user = _user_overrides(overrides)
    console = Console(stderr=True)
    t_start = time.perf_counter()
    plans = plan_matrix(user, ecfg, console.log)
    # Fail before any episode runs: every controller must build on every workload.
    for plan in plans:
        for name in ecfg.policies:
            if name != BEST_STATIC:
                make_controller(policy_config(name, ecfg, plan), plan, name)
    matrix = _Matrix(plans, ecfg)
    cells = matrix.first_cells()
    for plan in plans:
        win = (
            f", trace windows from {sorted(plan.windows.values())} s (seeds {sorted(plan.windows)})"
            if plan.windows else ""
        )
        console.log(
            f"workload {plan.name}: {plan.num_requests} requests over {plan.episode_s:.0f} s (first seed), "
            f"model {plan.model} on {plan.hardware}, engine {plan.cfg.engine.kind}, "
            f"load x{plan.rate_multiplier:.3g}{win}"
        )

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("evaluating", total=matrix.total_episodes)

        def on_done(cell: Cell, result: CellResult) -> list[Cell]:
            where = f"{plans[cell.workload].key} · {cell.label}"
            progress.update(task, advance=len(result), description=where)
            return matrix.done(cell, result, console.log)

        if ecfg.launcher.kind == "ray":
            run_on_ray(plans, cells, on_done, ecfg.launcher, console.log)
        else:
            run_serial(plans, cells, on_done)

    rows = matrix.rows()
    timelines = matrix.timelines()
    search = matrix.search()
    out = ecfg.out_dir
    rep.write_rows(rows, out)
    rep.write_timelines(timelines, out)
    (out / "best_static_search.json").write_text(json.dumps(rep.jsonable(search), indent=1) + "\n")
    (out / "results.md").write_text(rep.results_markdown(rows, search, ecfg.seeds, ecfg.best_static.tune_seeds))
    table = rep.markdown_table(rows)
    plots: list[Path] = []
    if ecfg.plots:
        slo_ttft = plans[0].cfg.slo.get("ttft_ms")
        plots = rep.plot_timelines(timelines, out / "plots", None if slo_ttft is None else float(slo_ttft))
        plots.append(rep.plot_goodput_vs_slo(rows, out / "plots"))
    wall = time.perf_counter() - t_start
    run_cfg = {"eval": OmegaConf.to_container(cfg, resolve=False), "overrides": user, "wall_s": wall}
    wandb_dir = rep.log_to_wandb(dict(cfg.get("logger") or {}), run_cfg, rows, table, plots, out)
    print(table)
    wrote = "results.json, results.csv, results.md" + (f", plots/ ({len(plots)})" if plots else "")
    console.log(f"{len(rows)} rows in {wall:.1f} s → {out}: {wrote}" + (f"; W&B run in {wandb_dir}" if wandb_dir else ""))
    return rows
