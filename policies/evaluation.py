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

from batchpilot.config import CONF_DIR
from batchpilot.core.knobs import BUCKETING_MODES, Knobs
from batchpilot.envs.engines import build_engine
from batchpilot.envs.workloads import build_workload
from batchpilot.policies.controllers import CONTROLLER_BUILDERS, Controller, build_controller
from batchpilot.policies.eval_report import ROW_KEYS, Timeline

BEST_STATIC = "best_static"


class EvaluationError(ValueError):
    """The evaluation cannot run as configured; the message names the setting and the fix."""


# --- config ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BestStaticConfig:
    """The grid ``best_static`` searches, and its objective (see the module docstring)."""

    #: Batch caps to try (values above the engine's max_num_seqs are clipped to it).
    batch_caps: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    bucketing: tuple[str, ...] = BUCKETING_MODES
    #: "auto" (16-bit) and/or 8-bit dtypes; ones the engine cannot run are skipped, said so.
    kv_dtypes: tuple[str, ...] = ("auto", "fp8")
    #: Only grid points at or above this SLO attainment compete on goodput.
    min_slo_attainment: float = 0.9
    #: The seed whose episode the grid is scored on (hindsight tuning).
    tune_seed: int = 0

    def __post_init__(self) -> None:
        if not self.batch_caps or min(self.batch_caps) < 1:
            raise EvaluationError(f"best_static.batch_caps must be non-empty and >= 1, got {list(self.batch_caps)}")
        bad = [b for b in self.bucketing if b not in BUCKETING_MODES]
        if not self.bucketing or bad:
            raise EvaluationError(f"best_static.bucketing must be a non-empty subset of {BUCKETING_MODES}, got {list(self.bucketing)}")
        if not self.kv_dtypes:
            raise EvaluationError("best_static.kv_dtypes must not be empty (e.g. [auto, fp8])")
        if not 0.0 <= self.min_slo_attainment <= 1.0:
            raise EvaluationError(f"best_static.min_slo_attainment must be in [0, 1], got {self.min_slo_attainment}")


LAUNCHERS = ("serial", "ray")


@dataclass(frozen=True, slots=True)
class LauncherConfig:
    """Where the cells run (``conf/launcher/<kind>.yaml``)."""

    kind: str = "serial"
    #: Ray cluster to join (``auto``, ``HOST:6379``, ``ray://HOST:10001``); None = start a
    #: local one for the run.
    address: str | None = None
    #: CPUs of a local cluster started for the run (None = all of this machine's).
    num_cpus: int | None = None
    #: CPUs Ray reserves per cell: a simulator episode is single-threaded.
    cpus_per_cell: float = 1.0
    #: Further ``ray.init`` keyword arguments (e.g. ``runtime_env``, ``object_store_memory``).
    init: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in LAUNCHERS:
            raise EvaluationError(f"launcher.kind must be one of {LAUNCHERS}, got {self.kind!r}")
        if self.cpus_per_cell <= 0:
            raise EvaluationError(f"launcher.cpus_per_cell must be > 0, got {self.cpus_per_cell}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise EvaluationError(f"launcher.num_cpus must be >= 1 or null, got {self.num_cpus}")

    @classmethod
    def from_node(cls, node: Any) -> "LauncherConfig":
        d = dict(OmegaConf.to_container(node, resolve=True)) if node is not None else {}  # type: ignore[arg-type]
        unknown = set(d) - {"kind", "address", "num_cpus", "cpus_per_cell", "init"}
        if unknown:
            raise EvaluationError(f"launcher: unknown keys {sorted(unknown)} (conf/launcher/*.yaml)")
        addr = d.get("address")
        return cls(
            kind=str(d.get("kind", "serial")),
            address=None if addr in (None, "") else str(addr),
            num_cpus=None if d.get("num_cpus") is None else int(d["num_cpus"]),
            cpus_per_cell=float(d.get("cpus_per_cell", 1.0)),
            init=dict(d.get("init") or {}),
        )


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """The run-wide settings of ``conf/evaluate.yaml`` (the groups are composed per workload)."""

    policies: tuple[str, ...]
    seeds: tuple[int, ...]
    out_dir: Path
    #: Names of ``conf/workload`` files; empty = the one ``workload`` group of the config.
    workloads: tuple[str, ...] = ()
    #: Workload name -> Hydra overrides it runs with (``["model=deepseek_v3", "hardware=h200"]``).
    workload_overrides: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: Policy name -> keys merged into ``conf/policy/<name>.yaml`` (e.g. ``{ppo: {path: DIR}}``).
    policy_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    best_static: BestStaticConfig = BestStaticConfig()
    plots: bool = True
    launcher: LauncherConfig = LauncherConfig()

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> "EvalConfig":
        pol = [str(p) for p in (cfg.policies or [])]
        seeds = [int(s) for s in (cfg.seeds or [])]
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
        wls = [str(w) for w in (cfg.get("workloads") or [])]
        for w in wls:
            if not (CONF_DIR / "workload" / f"{w}.yaml").is_file():
                known = sorted(f.stem for f in (CONF_DIR / "workload").glob("*.yaml"))
                raise EvaluationError(f"unknown workload {w!r} in workloads=[...]; known: {known}")
        bs = OmegaConf.to_container(cfg.best_static, resolve=True) if cfg.get("best_static") else {}
        bs = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(bs).items()}  # type: ignore[union-attr]
        wo = OmegaConf.to_container(cfg.get("workload_overrides") or {}, resolve=True)
        po = OmegaConf.to_container(cfg.get("policy_overrides") or {}, resolve=True)
        return cls(
            policies=tuple(pol),
            seeds=tuple(seeds),
            out_dir=Path(str(cfg.out_dir)),
            workloads=tuple(wls),
            workload_overrides={
                str(k): tuple(str(o) for o in (v or [])) for k, v in dict(wo).items()  # type: ignore[union-attr]
            },
            policy_overrides={str(k): dict(v or {}) for k, v in dict(po).items()},  # type: ignore[union-attr]
            best_static=BestStaticConfig(**bs),  # type: ignore[arg-type]
            plots=bool(cfg.get("plots", True)),
            launcher=LauncherConfig.from_node(cfg.get("launcher")),
        )


# --- composing one workload's config ------------------------------------------------------------
def _override_key(o: str) -> str:
    return o.split("=", 1)[0].lstrip("+~")


def workload_overrides(
    user: Sequence[str], name: str | None, extra: Sequence[str]
) -> list[str]:
    """The overrides one workload composes with: the user's (without ``workloads``, and without
    ``workload=`` when ``name`` comes from the list), then ``workload=<name>``, then the
    workload's own ``extra`` group choices unless the user set that group explicitly."""
    out = [o for o in user if _override_key(o) != "workloads" and not (name and _override_key(o) == "workload")]
    if name:
        out.append(f"workload={name}")
    user_keys = {_override_key(o) for o in user}
    out += [o for o in extra if _override_key(o) not in user_keys]
    return out


def compose_eval(overrides: Sequence[str]) -> tuple[DictConfig, dict[str, str]]:
    """``conf/evaluate.yaml`` composed with ``overrides``; also the group choices made."""
    gh = GlobalHydra.instance()
    if gh.is_initialized():
        gh.clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=list(overrides), return_hydra_config=True)
    choices = {str(k): str(v) for k, v in cfg.hydra.runtime.choices.items() if v is not None}
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, choices


@dataclass(slots=True)
class WorkloadPlan:
    """One workload, ready to run: its composed config, the engine's limits, episode length."""

    name: str
    cfg: DictConfig
    max_num_seqs: int
    max_model_len: int
    kv_runnable: dict[str, bool]
    kv_why_not: dict[str, str | None]
    episode_s: float
    num_requests: int

    @property
    def model(self) -> str:
        return str(self.cfg.model.get("name", "?"))

    @property
    def hardware(self) -> str:
        return str(self.cfg.hardware.get("name", "?"))


def extra_overrides(ecfg: EvalConfig, workload: str, engine_kind: str) -> tuple[str, ...]:
    """A workload's own group choices. They describe simulated GPUs; the live engine runs the
    model it was started with (engine=vllm picks its own), so they apply on the simulator only."""
    return tuple(ecfg.workload_overrides.get(workload, ())) if engine_kind == "sim" else ()


def plan_workload(user_overrides: Sequence[str], name: str | None, ecfg: EvalConfig) -> WorkloadPlan:
    """Compose, validate and size one workload: the trace is read (a bad path or a malformed
    file fails here, before any episode runs) and the episode length set to cover it."""
    base, ch = compose_eval(workload_overrides(user_overrides, name, ()))
    extra = extra_overrides(ecfg, name or ch.get("workload", ""), str(base.engine.kind))
    cfg, choices = compose_eval(workload_overrides(user_overrides, name, extra))
    label = name or choices.get("workload", "workload")
    if cfg.workload.get("kind") == "trace" and label == "trace":
        label = f"trace:{Path(str(cfg.workload.path)).stem}"
    engine = build_engine(cfg)
    try:
        caps = engine.capabilities()
    finally:
        engine.close()
    kv = {str(cfg.env.kv16_dtype), str(cfg.env.kv8_dtype), "auto"}
    try:
        stream = build_workload(cfg.workload, np.random.default_rng(0), caps.max_model_len)
    except (OSError, ValueError) as e:
        raise EvaluationError(f"workload {label!r}: {e}") from e
    interval = float(cfg.env.interval_s)
    episode_s = max(1, math.ceil(stream.duration_s / interval - 1e-9)) * interval
    return WorkloadPlan(
        name=label,
        cfg=cfg,
        max_num_seqs=caps.max_num_seqs,
        max_model_len=caps.max_model_len,
        kv_runnable={d: caps.can_run(d) for d in kv},
        kv_why_not={d: caps.why_not(d) for d in kv},
        episode_s=episode_s,
        num_requests=len(stream),
    )


# --- controllers ----------------------------------------------------------------------------
def policy_config(name: str, ecfg: EvalConfig, plan: WorkloadPlan) -> dict[str, Any]:
    """``conf/policy/<name>.yaml`` with ``policy_overrides[name]`` merged in."""
    node = OmegaConf.load(CONF_DIR / "policy" / f"{name}.yaml")
    d: dict[str, Any] = dict(OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]
    d.update(ecfg.policy_overrides.get(name, {}))
    if d.get("kind") == "ppo":  # the engine's limits normalise the policy's observation
        if d.get("kv_runnable") is None:
            d["kv_runnable"] = dict(plan.kv_runnable)
        if d.get("max_model_len") is None:
            d["max_model_len"] = plan.max_model_len
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
    try:
        return build_controller(dict(policy), plan.max_num_seqs, slo_ms=slo_ms)
    except (ImportError, ValueError) as e:
        hint = (
            " Ship/train one (scripts/train.py, scripts/export.py), point policy_overrides.ppo.path=DIR "
            "at an exported policy, or drop ppo from policies=[...]."
            if kind == "ppo"
            else ""
        )
        raise EvaluationError(f"policy {name!r} cannot be built: {e}.{hint}") from e


def start_knobs(policy: Mapping[str, Any], plan: WorkloadPlan) -> Knobs | None:
    """The knobs an episode starts with: a static setting from t=0 (vLLM started that way),
    PID/AIMD at their ``initial_batch_cap``; None = the environment's defaults (PPO, as trained)."""
    kind = policy.get("kind")
    if kind == "static":
        cap = policy.get("batch_cap")
        cap = plan.max_num_seqs if cap is None else min(int(cap), plan.max_num_seqs)
        return Knobs(max(1, cap), str(policy.get("bucketing", "fifo")), str(policy.get("kv_dtype", "auto")))
    if "initial_batch_cap" in policy:
        cap = min(int(policy["initial_batch_cap"]), plan.max_num_seqs)
        bucketing = str(policy.get("bucketing", plan.cfg.env.initial_bucketing))
        return Knobs(max(1, cap), bucketing, str(plan.cfg.engine.get("kv_dtype", "auto")))
    return None


# --- episodes -------------------------------------------------------------------------------
@dataclass(slots=True)
class Episode:
    metrics: dict[str, float]
    timeline: Timeline | None
    wall_s: float
    error: str = ""


def episode_config(plan: WorkloadPlan, knobs: Knobs | None) -> DictConfig:
    """The workload's config for an evaluation episode: drain at the end, cover the workload,
    start at ``knobs``."""
    c = copy.deepcopy(plan.cfg)
    with open_dict(c):
        c.env.drain_on_truncate = True
        c.env.episode_s = plan.episode_s
        if knobs is not None:
            c.env.initial_batch_cap = knobs.batch_cap
            c.env.initial_bucketing = knobs.bucketing
            c.engine.kv_dtype = knobs.kv_dtype
    return c


def run_episode(env: Any, controller: Controller, seed: int, *, record: bool = False) -> Episode:
    """One episode: reset with ``seed``, then decide → shield → one interval, until the
    environment truncates (after draining) or the engine fails."""
    t0 = time.perf_counter()
    env.reset(seed=seed)
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

    knobs = start_knobs(policy, plan)
    if knobs is not None and knobs.kv_dtype != "auto" and not plan.kv_runnable.get(knobs.kv_dtype, False):
        raise EvaluationError(
            f"policy {policy.get('name', policy.get('kind'))!r} wants kv_dtype {knobs.kv_dtype!r}, which this "
            f"engine cannot run: {plan.kv_why_not.get(knobs.kv_dtype)}"
        )
    env = ServingEnv(cfg=episode_config(plan, knobs))
    try:
        controller = make_controller(policy, plan)
        warm = plan.cfg.engine.get("warmup")
        if plan.cfg.engine.kind == "vllm" and warm and float(warm.get("seconds", 0)) > 0:
            # A fresh live engine runs ~3x slower through its first minute: warm it first
            # (the environment keeps a live engine across resets, so once per controller).
            from batchpilot.envs.vllm_engine import warm_up

            w = dict(warm)
            warm_up(env.engine, float(w.pop("seconds")), **w)
        for seed in seeds:
            ep = run_episode(env, controller, seed, record=seed == record_seed)
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
    request_goodput: float = math.nan
    slo_attainment: float = math.nan

    def policy(self) -> dict[str, Any]:
        return {
            "kind": "static", "name": BEST_STATIC,
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


def pick_best(points: Sequence[GridPoint], min_slo_attainment: float) -> GridPoint:
    """The objective: max goodput among points with attainment >= the floor; else max
    attainment (ties by goodput)."""
    def val(x: float) -> float:
        return x if math.isfinite(x) else -math.inf

    ok = [p for p in points if val(p.slo_attainment) >= min_slo_attainment]
    if ok:
        return max(ok, key=lambda p: (val(p.request_goodput), val(p.slo_attainment)))
    return max(points, key=lambda p: (val(p.slo_attainment), val(p.request_goodput)))


def row(plan: WorkloadPlan, policy: str, seed: int, ep: Episode, knobs: str = "") -> dict[str, Any]:
    r: dict[str, Any] = {
        "policy": policy,
        "workload": plan.name,
        "seed": seed,
        "model": plan.model,
        "hardware": plan.hardware,
        "engine": str(plan.cfg.engine.kind),
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
    the results table)."""

    workload: int
    name: str
    policy: Mapping[str, Any]
    seeds: tuple[int, ...]
    record_seed: int | None = None
    point: int | None = None

    @property
    def label(self) -> str:
        if self.point is not None:
            return f"{self.name} · grid point {self.point}"
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
    episodes: dict[tuple[int, str, int], Episode] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return any(str(p.cfg.engine.kind) == "vllm" for p in self.plans)

    def table_cells(self, wi: int, name: str, policy: Mapping[str, Any]) -> list[Cell]:
        return split_cells(wi, name, policy, self.ecfg.seeds, self.ecfg.seeds[0], self.live)

    def first_cells(self) -> list[Cell]:
        """Everything that can start at once: every grid point and every controller but
        best_static (whose seeds wait for its workload's grid)."""
        cells: list[Cell] = []
        tune = self.ecfg.best_static.tune_seed
        for wi, plan in enumerate(self.plans):
            for name in self.ecfg.policies:
                if name == BEST_STATIC:
                    self.grids[wi], self.notes[wi] = best_static_grid(self.ecfg.best_static, plan)
                    self.left[wi] = len(self.grids[wi])
                    grid = enumerate(self.grids[wi])
                    cells += [Cell(wi, name, p.policy(), (tune,), None, i) for i, p in grid]
                else:
                    cells += self.table_cells(wi, name, policy_config(name, self.ecfg, plan))
        return cells

    @property
    def total_episodes(self) -> int:
        grid = sum(len(g) for g in self.grids.values())
        return grid + len(self.plans) * len(self.ecfg.policies) * len(self.ecfg.seeds)

    def done(self, cell: Cell, result: CellResult, log: Callable[[str], None]) -> list[Cell]:
        """Record a finished cell; when it was a workload's last grid point, pick best_static
        there and return its seeds' cells."""
        wi, plan = cell.workload, self.plans[cell.workload]
        if cell.point is not None:
            point, ep = self.grids[wi][cell.point], result[0][1]
            point.request_goodput = ep.metrics["request_goodput"]
            point.slo_attainment = ep.metrics["slo_attainment"]
            self.left[wi] -= 1
            if self.left[wi]:
                return []
            best = self.best[wi] = pick_best(self.grids[wi], self.ecfg.best_static.min_slo_attainment)
            for note in self.notes[wi]:
                log(f"best_static on {plan.name}: {note}")
            seed0 = self.ecfg.best_static.tune_seed
            log(f"best_static on {plan.name}: {best.label} ({len(self.grids[wi])} grid points, seed {seed0})")
            return self.table_cells(wi, BEST_STATIC, best.policy())
        for seed, ep in result:
            if ep.error:
                log(f"[red]{plan.name} · {cell.name} · seed {seed}: engine failed: {ep.error}")
            self.episodes[(wi, cell.name, seed)] = ep
        return []

    def knobs(self, wi: int, name: str) -> str:
        if name == BEST_STATIC:
            return self.best[wi].label
        policy = policy_config(name, self.ecfg, self.plans[wi])
        k = start_knobs(policy, self.plans[wi]) if policy.get("kind") == "static" else None
        return f"cap={k.batch_cap} {k.bucketing} kv={k.kv_dtype}" if k else ""

    def rows(self) -> list[dict[str, Any]]:
        """The rows in the matrix's order (workload, controller, seed), however cells finished."""
        return [
            row(plan, name, seed, self.episodes[(wi, name, seed)], self.knobs(wi, name))
            for wi, plan in enumerate(self.plans)
            for name in self.ecfg.policies
            for seed in self.ecfg.seeds
        ]

    def timelines(self) -> dict[tuple[str, str], Timeline]:
        out: dict[tuple[str, str], Timeline] = {}
        for wi, plan in enumerate(self.plans):
            for name in self.ecfg.policies:
                tl = self.episodes[(wi, name, self.ecfg.seeds[0])].timeline
                if tl is not None:
                    out[(plan.name, name)] = tl
        return out

    def search(self) -> list[dict[str, Any]]:
        return [
            {"workload": self.plans[wi].name, **asdict(p), "chosen": p is self.best[wi]}
            for wi in sorted(self.grids)
            for p in self.grids[wi]
        ]


def evaluate(cfg: DictConfig, overrides: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run every controller × workload × seed and write results.json, results.csv,
    results.md (mean ± 95 % CI table), timelines.json, best_static_search.json and plots to
    ``cfg.out_dir`` (and to W&B when ``cfg.logger`` turns it on). ``overrides`` are the Hydra
    overrides ``cfg`` was composed with (read from Hydra inside ``scripts/evaluate.py``); each
    workload is recomposed from them. ``cfg.launcher`` says where the cells run. Returns the
    rows."""
    import json

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from batchpilot.policies import eval_report as rep

    ecfg = EvalConfig.from_cfg(cfg)
    require_launcher(ecfg.launcher)
    user = _user_overrides(overrides)
    console = Console(stderr=True)
    t_start = time.perf_counter()
    plans = [plan_workload(user, w, ecfg) for w in (ecfg.workloads or (None,))]
    names = [p.name for p in plans]
    if len(set(names)) != len(names):
        raise EvaluationError(f"workloads repeat a name: {names}")
    # Fail before any episode runs: every controller must build on every workload.
    for plan in plans:
        for name in ecfg.policies:
            if name != BEST_STATIC:
                make_controller(policy_config(name, ecfg, plan), plan, name)
    matrix = _Matrix(plans, ecfg)
    cells = matrix.first_cells()
    for plan in plans:
        console.log(
            f"workload {plan.name}: {plan.num_requests} requests over {plan.episode_s:.0f} s, "
            f"model {plan.model} on {plan.hardware}, engine {plan.cfg.engine.kind}"
        )

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("evaluating", total=matrix.total_episodes)

        def on_done(cell: Cell, result: CellResult) -> list[Cell]:
            where = f"{plans[cell.workload].name} · {cell.label}"
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
    (out / "best_static_search.json").write_text(json.dumps(search, indent=1) + "\n")
    table = rep.markdown_table(rows)
    headline = rep.markdown_table(rows, rep.HEADLINE_KEYS)
    picks = "".join(
        f"- best_static on {p['workload']}: cap={p['batch_cap']} {p['bucketing']} kv={p['kv_dtype']} "
        f"(seed {ecfg.best_static.tune_seed}: goodput {p['request_goodput']:.3g} req/s, "
        f"attainment {p['slo_attainment']:.3f}; {sum(q['workload'] == p['workload'] for q in search)} grid points)\n"
        for p in search
        if p["chosen"]
    )
    (out / "results.md").write_text(
        f"Mean ± 95 % CI (t-distribution) over seeds {list(ecfg.seeds)}.\n\n{table}\n\nHeadline:\n\n{headline}\n"
        + (f"\n{picks}" if picks else "")
    )
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
