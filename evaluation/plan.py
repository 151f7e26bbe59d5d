"""Planning an evaluation: the run's settings, and each workload composed, checked and sized.

``EvalConfig`` reads ``conf/evaluate.yaml``; ``plan_matrix`` turns it into one ``WorkloadPlan``
per workload (x deployment): its composed config, the engine's limits, the episode length, each
seed's trace window and, with ``load.mode=probe``, the load scaled to the deployment's capacity.
Everything here runs before any episode, so a bad name, path or window fails in seconds;
``batchpilot.evaluation.matrix`` runs the episodes.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from batchpilot.config import CONF_DIR, config_dirs, group_file, group_names
from batchpilot.core.engine import EngineCapabilities
from batchpilot.envs.engines import build_engine
from batchpilot.envs.workloads import build_workload
from batchpilot.nodes import from_node
from batchpilot.schemas import check_app
from batchpilot.schemas.control import moved_key_note
from batchpilot.schemas.evaluate import BestStaticConfig, EvaluateApp, LoadConfig
from batchpilot.schemas.launcher import LauncherConfig

BEST_STATIC = "best_static"
#: The policy kind of vLLM tuned with its own flags (``conf/policy/vllm_tuned.yaml``): like
#: best_static, a grid tuned on ``best_static.tune_seeds`` before its scored seeds run.
VLLM_TUNED_KIND = "vllm_tuned"


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
    def parse(cls, text: str, dirs: Sequence[Path] = (CONF_DIR,)) -> "Deployment":
        """``MODEL/HARDWARE``, each a file of its group in one of ``dirs`` (``config_dirs``)."""
        model, sep, hardware = str(text).partition("/")
        if not sep or not model or not hardware:
            raise EvaluationError(f"deployments: {text!r} is not MODEL/HARDWARE (e.g. llama3_8b/h100)")
        for group, name in (("model", model), ("hardware", hardware)):
            if group_file(group, name, dirs) is None:
                raise EvaluationError(
                    f"deployments: unknown {group} {name!r} in {text!r}; known: {group_names(group, dirs)}")
        return cls(model, hardware)


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """The run-wide settings of ``conf/evaluate.yaml`` (the groups are composed per workload).
    Built by ``from_cfg`` from the composed config, whose keys and types ``schema/evaluate``
    (``batchpilot.schemas.evaluate.EvaluateApp``) checked at compose time; the values are the file's."""

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
    #: The seeds whose episodes keep a per-interval timeline (``timelines.json``); the first is plotted.
    timeline_seeds: tuple[int, ...]
    plots: bool
    launcher: LauncherConfig
    #: Longest episode (simulated seconds) a workload may ask for: a trace with one stray
    #: timestamp a year on would otherwise run for hours.
    max_episode_s: float = 86_400.0
    #: The config each workload is recomposed from (``--config-name`` of the run).
    config_name: str = "evaluate"
    #: Where group files are looked up: ``conf/`` and the run's ``hydra.searchpath`` folders.
    config_dirs: tuple[Path, ...] = (CONF_DIR,)
    #: The controllers tuned on ``best_static.tune_seeds`` first: best_static and every policy
    #: of kind ``vllm_tuned``.
    tuned: tuple[str, ...] = ()

    @property
    def all_seeds(self) -> tuple[int, ...]:
        """The scored seeds, then the tuning seeds when a tuned controller runs."""
        tune = self.best_static.tune_seeds if self.tuned else ()
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
        dirs = config_dirs()
        for p in pol:
            if p != BEST_STATIC and group_file("policy", p, dirs) is None:
                known = sorted([*group_names("policy", dirs), BEST_STATIC])
                raise EvaluationError(f"unknown policy {p!r} in policies=[...]; known: {known}")
        wls = [str(w) for w in (cfg.workloads or [])]
        for w in wls:
            if group_file("workload", w, dirs) is None:
                raise EvaluationError(f"unknown workload {w!r} in workloads=[...]; known: {group_names('workload', dirs)}")
        deps = [Deployment.parse(str(d), dirs) for d in (cfg.deployments or [])]
        if len(set(deps)) != len(deps):
            raise EvaluationError(f"deployments lists a pair twice: {[d.label for d in deps]}")
        tuned = [p for p in pol if p == BEST_STATIC or policy_kind(p, dirs) == VLLM_TUNED_KIND]
        if tuned:
            both = sorted(set(bsc.tune_seeds) & set(seeds))
            if both:
                raise EvaluationError(
                    f"best_static.tune_seeds {list(bsc.tune_seeds)} overlap seeds {seeds} at {both}: "
                    f"{' and '.join(tuned)} must be tuned on other seeds (trace windows) than those scored"
                )
        timeline_seeds = [seeds[0]] if cfg.timeline_seeds is None else [int(s) for s in cfg.timeline_seeds]
        stray = [s for s in timeline_seeds if s not in seeds]
        if not timeline_seeds or stray or len(set(timeline_seeds)) != len(timeline_seeds):
            raise EvaluationError(f"timeline_seeds must be distinct seeds of seeds={seeds} (null: the first), got "
                                  f"{timeline_seeds}" + (f": {stray} not scored" if stray else ""))
        stride = cfg.trace_window_stride_s
        if stride is not None and not float(stride) > 0:
            raise EvaluationError(f"trace_window_stride_s must be > 0 or null, got {stride}")
        if not float(cfg.max_episode_s) > 0:
            raise EvaluationError(f"max_episode_s must be > 0, got {cfg.max_episode_s}")
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
            timeline_seeds=tuple(timeline_seeds),
            plots=bool(cfg.plots),
            launcher=_launcher(cfg.launcher),
            max_episode_s=float(cfg.max_episode_s),
            config_dirs=dirs,
            tuned=tuple(tuned),
        )


def policy_kind(name: str, dirs: Sequence[Path]) -> str | None:
    """The ``kind`` of ``conf/policy/<name>.yaml`` (None: no such file, or unreadable; the
    caller that builds it names the problem)."""
    from batchpilot.config import load_group_file

    if name == BEST_STATIC or group_file("policy", name, dirs) is None:
        return None
    try:
        return str(load_group_file("policy", name, dirs).get("kind"))
    except (ValueError, OmegaConfBaseException):
        return None


# --- composing one workload's config ------------------------------------------------------------
def override_key(o: str) -> str:
    """The config key a Hydra override sets (``+a.b=1``, ``~a.b``, ``a/b@pkg=x`` -> ``a.b``)."""
    return o.split("=", 1)[0].lstrip("+~").split("@", 1)[0].replace("/", ".").strip()


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
        try:
            cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
        except (HydraException, OmegaConfBaseException) as e:
            raise EvaluationError(f"config: {e}{moved_key_note(e)}") from e
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
    #: What the run's log should say about this workload (the trace reader's report, warnings).
    notes: list[str] = field(default_factory=list)
    #: Why the shield's memory ceiling admits no request on this deployment (None: it does).
    no_room: str | None = None
    #: The KV dtype a policy with ``kv_start`` starts with here (``Shield.start_kv_dtype``).
    kv_start: str = "auto"
    #: Command-line edits of the model's / hardware's fields (``hardware.memory_gb=40``), so a
    #: result is not labelled with a file it no longer matches.
    tweaks: tuple[str, ...] = ()

    @property
    def model(self) -> str:
        return self._named("model")

    @property
    def hardware(self) -> str:
        return self._named("hardware")

    def _named(self, group: str) -> str:
        name = str(self.cfg[group].get("name", "?"))
        edits = [o.split("=", 1)[0].lstrip("+~").removeprefix(f"{group}.") + "=" + o.split("=", 1)[1]
                 for o in self.tweaks if override_key(o).startswith(f"{group}.") and "=" in o]
        return f"{name}({','.join(edits)})" if edits else name

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
            fits = (f"it has room for {room} windows of {dur:g} s from {base:g} s (seeds 0..{room - 1})" if room
                    else f"not even one window of {dur:g} s fits from {base:g} s")
            raise EvaluationError(
                f"workload {label!r}: seed {s} would replay trace seconds [{start:g}, {start + dur:g}), past "
                f"the trace's end ({span:.0f} s): {fits}; use other seeds/tune_seeds, a shorter "
                f"workload.duration_s, or trace_windows=false (every seed the same requests)"
            )
        out[int(s)] = start
    return out


def engine_capabilities(cfg: DictConfig) -> EngineCapabilities:
    """What the configured engine can do (built once to ask, then closed)."""
    return engine_facts(cfg).caps


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the configured engine can do, as the shield's memory model reads it."""

    caps: EngineCapabilities
    #: Why the memory ceiling admits no request on it (None: it admits some).
    no_room: str | None
    #: The KV dtype a controller that picks its start (``kv_start``) starts with
    #: (``Shield.start_kv_dtype``).
    kv_start: str


def engine_facts(cfg: DictConfig) -> EngineFacts:
    """The engine's ``EngineFacts``: built once to ask, then closed."""
    from batchpilot.core.shield import Shield, ShieldConfig

    engine = build_engine(cfg)
    try:
        caps = engine.capabilities()
        shield = Shield(ShieldConfig.from_cfg(cfg.shield), engine.memory_model(), caps)
        kv_start = shield.start_kv_dtype(str(cfg.env.kv16_dtype), str(cfg.env.kv8_dtype),
                                         float(cfg.hardware.get("kv8_speed_factor", 1.0)))
        return EngineFacts(caps, shield.no_room_reason(), kv_start)
    finally:
        engine.close()


def plan_from_caps(
    name: str, cfg: DictConfig, caps: EngineCapabilities, *, duration_s: float, num_requests: int, **extra: Any
) -> WorkloadPlan:
    """A plan with the engine's limits and KV dtypes, and an episode covering ``duration_s``."""
    kv = {str(cfg.env.kv16_dtype), str(cfg.env.kv8_dtype), "auto"}
    interval = float(cfg.control.interval_s)
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
    cfg: DictConfig, label: str, ecfg: EvalConfig, deployment: Deployment | None, multiplier: float,
    tweaks: tuple[str, ...] = (),
) -> WorkloadPlan:
    if multiplier != 1.0:
        with open_dict(cfg):
            cfg.workload.rate_scale = float(cfg.workload.get("rate_scale", 1.0)) * multiplier
    where = label if deployment is None else f"{label} @ {deployment.label}"
    try:
        facts = engine_facts(cfg)
        caps = facts.caps
    except (ValueError, OmegaConfBaseException) as e:  # a model/hardware/engine value, checked there
        raise EvaluationError(f"workload {where!r}: {e}") from e
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
    except EvaluationError:
        raise
    except (OSError, ValueError, OmegaConfBaseException) as e:
        raise EvaluationError(f"workload {label!r}: {e}") from e
    report = stream.info.get("report")
    notes = [] if report is None else [f"trace {report.summary()}"]
    if not len(stream):
        raise EvaluationError(
            f"workload {where!r}: no requests to replay"
            + (f" ({report.summary()}); check workload.start_s / duration_s / model against the trace"
               if report is not None else "")
        )
    if stream.duration_s > ecfg.max_episode_s:
        gap = (f"; its longest gap between two requests is {report.max_gap_s:,.0f} s, ending at "
               f"{report.max_gap_until_s:,.0f} s (a stray timestamp?)" if report is not None else "")
        raise EvaluationError(
            f"workload {where!r}: {len(stream)} requests over {stream.duration_s:,.0f} s, past max_episode_s="
            f"{ecfg.max_episode_s:g}{gap}; pick a window (workload.start_s, workload.duration_s) or raise "
            f"max_episode_s"
        )
    if report is not None and not windows and len(ecfg.all_seeds) > 1:
        notes.append("every seed replays the same requests (no workload.duration_s): the interval over "
                     "seeds only reflects the priorities each seed draws; set workload.duration_s for "
                     "distinct windows")
    return plan_from_caps(
        label, cfg, caps, duration_s=stream.duration_s, num_requests=len(stream),
        deployment=None if deployment is None else deployment.label, rate_multiplier=multiplier, windows=windows,
        notes=notes, no_room=facts.no_room, kv_start=facts.kv_start, tweaks=tweaks,
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
        if OmegaConf.is_missing(cfg.workload, "path"):
            raise EvaluationError("workload=trace needs workload.path=FILE (and workload.format: azure, "
                                  "mooncake or burstgpt)")
        label = f"trace:{Path(str(cfg.workload.path)).stem}"
    tweaks = tuple(o for o in user_overrides
                   if override_key(o).split(".", 1)[0] in ("model", "hardware") and "." in override_key(o))
    return _plan_from_cfg(cfg, label, ecfg, deployment, multiplier, tweaks)


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
                plan = _plan_from_cfg(plan.cfg, plan.name, ecfg, d, mult, plan.tweaks)
            log(f"load on {plan.key}: rate x{mult:.3g} ({why})")
            plans.append(plan)
    keys = [p.key for p in plans]
    if len(set(keys)) != len(keys):
        raise EvaluationError(f"workloads repeat a name: {keys}")
    return plans
