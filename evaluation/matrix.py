"""Evaluation: every controller on the same workloads and seeds, under the same shield.

``evaluate(cfg, overrides)`` runs each controller × workload × seed as one episode of
``ServingEnv`` (the simulator by default, the live engine with ``engine=vllm``), the
controller deciding once per control interval (``control.interval_s``) and the shield turning
its proposals into knobs, exactly as in training and serving. Evaluation episodes drain at the
end (``env.drain_on_truncate``), so every request's fate counts: finished, or rejected.

Controllers are named by ``conf/policy/<name>.yaml`` (``ppo``, ``pid``, ``aimd``,
``vllm_default``, ``static``) plus ``best_static``:

``vllm_tuned`` (``conf/policy/vllm_tuned.yaml``, kind ``vllm_tuned``) is vLLM tuned with its own
start-up flags, what an operator would deploy instead of batchpilot: a sweep over
``max_num_seqs`` × ``max_num_batched_tokens`` × vLLM's API-server queue limits
(``batchpilot.evaluation.vllm_tuned``), tuned on the same ``best_static.tune_seeds`` with the same
objective as best_static, and run with no batchpilot admission, shield or breaker
(``envs/server_env.py``); ``vllm_tuned_hindsight`` is its grid's best on the scored seeds.

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
That planning (``EvalConfig``, ``WorkloadPlan``, trace windows, load per deployment) is
``batchpilot.evaluation.plan``; this module runs the episodes.

The matrix is cut into cells (``Cell``: one controller's episodes on one workload; on the
simulator one seed each, since an episode depends only on its seed). A launcher runs them:
``launcher=serial`` (default) one after another in this process, ``launcher=ray`` as Ray tasks
on a local or remote cluster (docs/scaling.md). Both call the same ``run_cell`` and the rows are
assembled in the same order afterwards, so the files written do not depend on the launcher.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from batchpilot.config import group_file, group_names, load_group_file
from batchpilot.core.controller import Controller
from batchpilot.core.knobs import Knobs
from batchpilot.core.telemetry import SLO
from batchpilot.evaluation.plan import (
    BEST_STATIC,
    VLLM_TUNED_KIND,
    EvalConfig,
    EvaluationError,
    WorkloadPlan,
    override_key,
    plan_matrix,
)
from batchpilot.evaluation.report import ROW_KEYS, Timeline
from batchpilot.metrics import class_keys_in
from batchpilot.nodes import ConfigError
from batchpilot.policies.controllers import CONTROLLER_BUILDERS, build_controller
from batchpilot.schemas.evaluate import BestStaticConfig
from batchpilot.schemas.launcher import LauncherConfig
from batchpilot.schemas.policy import with_policy_schema

#: The grid's best point on the scored seeds themselves: an upper bound, not a baseline.
HINDSIGHT = "best_static_hindsight"
#: Policies run as shipped by default: no shield (no breaker, no shedding, no memory or step
#: limit) and no batchpilot admission limits in front of the engine (``policy_overrides.<name>.as_shipped=false`` puts them back).
AS_SHIPPED = ("vllm_default",)
AS_SHIPPED_KEY = "as_shipped"
#: A policy's ``engine.*`` settings for its episodes (vllm_tuned's flags: a server per setting).
ENGINE_KEY = "engine"


def hindsight_name(name: str) -> str:
    """The row name of a tuned controller's grid best on the scored seeds."""
    return HINDSIGHT if name == BEST_STATIC else f"{name}_hindsight"


# --- controllers ----------------------------------------------------------------------------
def policy_config(name: str, ecfg: EvalConfig, plan: WorkloadPlan) -> dict[str, Any]:
    """``conf/policy/<name>.yaml`` (or the run's ``hydra.searchpath`` copy) over its schema (a key
    the file leaves out is the dataclass default, as in a composed ``policy=<name>``) with
    ``policy_overrides[name]`` merged in."""
    if group_file("policy", name, ecfg.config_dirs) is None:
        raise EvaluationError(f"unknown policy {name!r}; known: {group_names('policy', ecfg.config_dirs)}")
    try:
        node = with_policy_schema(load_group_file("policy", name, ecfg.config_dirs), f"policy/{name}.yaml")
        d: dict[str, Any] = dict(OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]
    except (ConfigError, OmegaConfBaseException) as e:  # the file, named, in one line
        raise EvaluationError(f"policy {name!r}: {e}") from e
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
    slo = SLO.from_mapping(plan.cfg.slo)
    if kind == VLLM_TUNED_KIND:
        raise EvaluationError(f"policy {name!r} is a sweep of vLLM's flags: the evaluation tunes it (its grid points "
                              f"are static settings), it is no controller to build")
    d = {k: v for k, v in policy.items() if k not in (AS_SHIPPED_KEY, ENGINE_KEY)}
    try:
        return build_controller(d, engine_max_num_seqs(policy, plan), slo=slo)
    except (ImportError, ValueError) as e:
        hint = (
            " Ship/train one (scripts/train.py, scripts/export.py), point policy_overrides.ppo.path=DIR "
            "at an exported policy, or drop ppo from policies=[...]."
            if kind == "ppo"
            else ""
        )
        raise EvaluationError(f"policy {name!r} cannot be built: {e}.{hint}") from e


def engine_max_num_seqs(policy: Mapping[str, Any], plan: WorkloadPlan) -> int:
    """The episode engine's ``max_num_seqs``: the policy's own engine setting, else the plan's."""
    own = (policy.get(ENGINE_KEY) or {}).get("max_num_seqs")
    return plan.max_num_seqs if own is None else int(own)


def start_knobs(policy: Mapping[str, Any], plan: WorkloadPlan, controller: Controller | None = None) -> Knobs | None:
    """The knobs an episode starts with: a static setting from t=0 (vLLM started that way),
    PID/AIMD at their ``initial_batch_cap``; a residual policy at the cap of the PID it corrects
    (``controller.initial_batch_cap``: its factor 1 is that PID, so it starts where PID starts),
    and with ``kv_start`` at the KV dtype the memory model picks before any traffic
    (``plan.kv_start``); None = the environment's defaults (an absolute policy, as trained)."""
    kind = policy.get("kind")
    if kind == "static":
        top = engine_max_num_seqs(policy, plan)
        cap = policy.get("batch_cap")
        cap = top if cap is None else min(int(cap), top)
        return Knobs(max(1, cap), str(policy.get("bucketing", "fifo")), str(policy.get("kv_dtype", "auto")))
    start = policy.get("initial_batch_cap", getattr(controller, "initial_batch_cap", None))
    if start is None:
        return None
    cap = min(int(start), plan.max_num_seqs)
    bucketing = str(policy.get("bucketing", plan.cfg.control.initial_bucketing))
    configured = str(plan.cfg.engine.get("kv_dtype", "auto"))
    # kv_start picks only where the engine is configured at the 16-bit default: an explicit
    # engine.kv_dtype is the user's choice for every controller.
    chooses = bool(policy.get("kv_start")) and configured == str(plan.cfg.env.kv16_dtype)
    return Knobs(max(1, cap), bucketing, plan.kv_start if chooses else configured)


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
    queue length, wait deadline, early refusal, per-request memory check, prefill backlog) nor its order
    (on-time first) — vLLM's waiting queue has none. A start dtype other than the engine's
    configured one was the policy's choice (``kv_start``, a static setting): the shield's dwell
    runs from it."""
    c = copy.deepcopy(plan.cfg)
    with open_dict(c):
        c.env.drain_on_truncate = True
        c.env.episode_s = plan.episode_s
        c.env.start_dtype_dwell = knobs is not None and knobs.kv_dtype != str(c.engine.get("kv_dtype", "auto"))
        if knobs is not None:
            c.control.initial_batch_cap = knobs.batch_cap
            c.control.initial_bucketing = knobs.bucketing
            c.engine.kv_dtype = knobs.kv_dtype
        if as_shipped:
            c.env.admission.max_num_long = plan.max_num_seqs
            c.env.admission.max_queue_len = 2**31 - 1
            c.env.admission.max_wait_s = None
            c.env.admission.ttft_deadline = False
            c.env.admission.early_refusal = False
            c.env.admission.on_time_first = False  # vLLM's waiting queue is first come, first served
            c.env.admission.class_deadline_order = False  # across request classes too
            c.env.admission.prefill_backlog_budgets = None  # and it takes every request at once
            c.env.memory_admission = False
            c.env.shielded = False  # and no shield: the env is built without one
    return c


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
    then decide → shield → one interval, until the environment truncates (after draining) or the
    engine fails. ``shielded`` is what the caller built the env for (``env.shielded``: false for
    vLLM as shipped, ``episode_config(..., as_shipped=True)``); a mismatch is an error, never
    mended by swapping the env's shield."""
    t0 = time.perf_counter()
    if window_start_s is not None:
        with open_dict(env.cfg):
            env.cfg.workload.start_s = float(window_start_s)
    if bool(getattr(env, "shielded", True)) != shielded:
        raise ValueError(f"run_episode(shielded={shielded}) on an env built with env.shielded="
                         f"{getattr(env, 'shielded', True)}: build it from episode_config(..., as_shipped="
                         f"{not shielded}) (or set env.shielded) instead")
    env.reset(seed=seed)
    bind = getattr(controller, "bind", None)
    if bind is not None:  # a controller that tries its options on copies of the env (lookahead)
        bind(env)
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
    record_seeds: Collection[int] = (),
    on_episode: Callable[[], None] | None = None,
) -> Iterator[tuple[int, Episode]]:
    """Episodes of one controller on one workload, one per seed, on one environment (a live
    engine starts once per controller, not once per seed)."""
    from batchpilot.envs.server_env import VllmServerEnv
    from batchpilot.envs.serving_env import ServingEnv

    engine = policy.get(ENGINE_KEY)
    if engine and plan.cfg.engine.kind != "sim":
        raise EvaluationError(f"policy {policy.get('name', policy.get('kind'))!r} starts an engine per setting "
                              f"({dict(engine)}): run it with engine=sim; live, scripts/live_evaluate.py runs vLLM's "
                              f"flags on managed servers")
    controller = make_controller(policy, plan)
    if getattr(controller, "needs_simulator", False) and plan.cfg.engine.kind != "sim":
        raise EvaluationError(f"policy {policy.get('name', policy.get('kind'))!r} tries its options on copies of "
                              f"the simulator: run it with engine=sim, or drop it from policies=[...]")
    knobs = start_knobs(policy, plan, controller)
    if knobs is not None and knobs.kv_dtype != "auto" and not plan.kv_runnable.get(knobs.kv_dtype, False):
        raise EvaluationError(
            f"policy {policy.get('name', policy.get('kind'))!r} wants kv_dtype {knobs.kv_dtype!r}, which this "
            f"engine cannot run: {plan.kv_why_not.get(knobs.kv_dtype)}"
        )
    as_shipped = bool(policy.get(AS_SHIPPED_KEY, False))
    # As shipped: vLLM alone, no batchpilot admission gate, shield or breaker, by construction.
    if as_shipped:
        env: ServingEnv = VllmServerEnv(episode_config(plan, knobs, as_shipped), engine=engine)
    elif engine:
        raise EvaluationError(f"policy {policy.get('name', policy.get('kind'))!r}: engine settings are a server's "
                              f"flags, for a policy run as shipped (as_shipped: true)")
    else:
        env = ServingEnv(cfg=episode_config(plan, knobs))
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
                env, controller, seed, record=seed in record_seeds,
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
    for k in class_keys_in(ep.metrics):  # per priority class, where the workload has several
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
    #: The seeds whose episodes keep a timeline.
    record_seeds: tuple[int, ...] = ()
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
    return list(run_policy(plan, cell.policy, cell.seeds, record_seeds=cell.record_seeds))


def split_cells(
    workload: int,
    name: str,
    policy: Mapping[str, Any],
    seeds: Sequence[int],
    record_seeds: Collection[int],
    live: bool,
) -> list[Cell]:
    """A controller's seeds as cells: one per seed on the simulator (the finest unit that runs
    in parallel), all in one cell on a live engine (it starts once per controller, ~a minute)."""
    groups = [tuple(seeds)] if live else [(s,) for s in seeds]
    return [Cell(workload, name, dict(policy), g, tuple(s for s in g if s in record_seeds)) for g in groups]


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
    """The run's overrides each workload is recomposed with: the task's, and a
    ``hydra.searchpath`` given on the command line (a user's own model/hardware/workload files
    outside ``conf/``), which Hydra files with its own overrides."""
    if overrides is not None:
        return list(overrides)
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    hc = HydraConfig.get()
    search = [o for o in hc.overrides.hydra if override_key(o) == "hydra.searchpath"]
    return [*hc.overrides.task, *search]


#: (workload index, tuned controller's name): the key of a grid and its pick.
GridKey = tuple[int, str]


@dataclass(slots=True)
class _Matrix:
    """The run's cells and what came back: each tuned controller's grid points scored and its
    pick per workload (best_static, vllm_tuned), the episodes by (workload, controller, seed)."""

    plans: Sequence[WorkloadPlan]
    ecfg: EvalConfig
    grids: dict[GridKey, list[Any]] = field(default_factory=dict)
    notes: dict[GridKey, list[str]] = field(default_factory=dict)
    left: dict[GridKey, int] = field(default_factory=dict)
    best: dict[GridKey, Any] = field(default_factory=dict)
    hindsight: dict[GridKey, Any] = field(default_factory=dict)
    left_hindsight: dict[GridKey, int] = field(default_factory=dict)
    #: (workload, tuned controller, grid point, seed) -> episode on a scored seed.
    grid_episodes: dict[tuple[int, str, int, int], Episode] = field(default_factory=dict)
    episodes: dict[tuple[int, str, int], Episode] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return any(str(p.cfg.engine.kind) == "vllm" for p in self.plans)

    @property
    def bounds(self) -> dict[str, str]:
        """Hindsight row name -> the tuned controller it bounds."""
        return {hindsight_name(n): n for n in self.ecfg.tuned} if self.ecfg.best_static.hindsight else {}

    @property
    def names(self) -> list[str]:
        """The table's controllers: each tuned one's hindsight bound right after it."""
        out = []
        for n in self.ecfg.policies:
            out.append(n)
            if n in self.ecfg.tuned and self.ecfg.best_static.hindsight:
                out.append(hindsight_name(n))
        return out

    def table_cells(self, wi: int, name: str, policy: Mapping[str, Any]) -> list[Cell]:
        return split_cells(wi, name, policy, self.ecfg.seeds, self.ecfg.timeline_seeds, self.live)

    def grid(self, plan: WorkloadPlan, name: str) -> tuple[list[Any], list[str]]:
        """A tuned controller's grid points on this workload, and notes on what was skipped."""
        if name == BEST_STATIC:
            return best_static_grid(self.ecfg.best_static, plan)
        from batchpilot.evaluation.vllm_tuned import tuned_config, vllm_tuned_grid

        cfg = tuned_config(policy_config(name, self.ecfg, plan), name)
        return vllm_tuned_grid(cfg, plan, self.ecfg.best_static.tune_seeds[0])

    def first_cells(self) -> list[Cell]:
        """Everything that can start at once: every grid point (on the tuning seeds, and on
        the scored ones for the hindsight bound) and every controller but the tuned ones (whose
        seeds wait for their workload's grid)."""
        cells: list[Cell] = []
        bs = self.ecfg.best_static
        for wi, plan in enumerate(self.plans):
            for name in self.ecfg.policies:
                if name not in self.ecfg.tuned:
                    cells += self.table_cells(wi, name, policy_config(name, self.ecfg, plan))
                    continue
                key = (wi, name)
                self.grids[key], self.notes[key] = self.grid(plan, name)
                self.left[key] = len(self.grids[key])
                grid = list(enumerate(self.grids[key]))
                cells += [Cell(wi, name, p.policy(name), tuple(bs.tune_seeds), (), i) for i, p in grid]
                if bs.hindsight:
                    self.left_hindsight[key] = len(grid)
                    bound = hindsight_name(name)
                    cells += [Cell(wi, name, p.policy(bound), tuple(self.ecfg.seeds), (), i, True) for i, p in grid]
        return cells

    @property
    def total_episodes(self) -> int:
        bs = self.ecfg.best_static
        per_point = len(bs.tune_seeds) + (len(self.ecfg.seeds) if bs.hindsight else 0)
        grid = sum(len(g) for g in self.grids.values()) * per_point
        return grid + len(self.plans) * len(self.ecfg.policies) * len(self.ecfg.seeds)

    def done(self, cell: Cell, result: CellResult, log: Callable[[str], None]) -> list[Cell]:
        """Record a finished cell; when it was the last grid point of a tuned controller on a
        workload, pick its setting there and return its seeds' cells."""
        wi, plan = cell.workload, self.plans[cell.workload]
        if cell.point is None:
            for seed, ep in result:
                if ep.error:
                    log(f"[red]{plan.key} · {cell.name} · seed {seed}: engine failed: {ep.error}")
                self.episodes[(wi, cell.name, seed)] = ep
            return []
        floor = self.ecfg.best_static.min_slo_attainment
        key = (wi, cell.name)
        point = self.grids[key][cell.point]
        good = float(np.mean([ep.metrics["request_goodput"] for _, ep in result]))
        att = float(np.mean([ep.metrics["slo_attainment"] for _, ep in result]))
        if cell.hindsight:
            point.hindsight_goodput, point.hindsight_attainment = good, att
            for seed, ep in result:
                self.grid_episodes[(wi, cell.name, cell.point, seed)] = ep
            self.left_hindsight[key] -= 1
            if not self.left_hindsight[key]:
                self.hindsight[key] = pick_best(self.grids[key], floor, hindsight=True)
                log(f"{hindsight_name(cell.name)} on {plan.key}: {self.hindsight[key].label} (upper bound: picked "
                    f"on the scored seeds)")
            return []
        point.request_goodput, point.slo_attainment = good, att
        self.left[key] -= 1
        if self.left[key]:
            return []
        best = self.best[key] = pick_best(self.grids[key], floor)
        for note in self.notes[key]:
            log(f"{cell.name} on {plan.key}: {note}")
        tune = list(self.ecfg.best_static.tune_seeds)
        log(f"{cell.name} on {plan.key}: {best.label} ({len(self.grids[key])} grid points, tuning seeds {tune})")
        return self.table_cells(wi, cell.name, best.policy(cell.name))

    def episode(self, wi: int, name: str, seed: int) -> Episode:
        base = self.bounds.get(name)
        if base is not None:
            key = (wi, base)
            point = next(i for i, p in enumerate(self.grids[key]) if p is self.hindsight[key])
            return self.grid_episodes[(wi, base, point, seed)]
        return self.episodes[(wi, name, seed)]

    def knobs(self, wi: int, name: str) -> str:
        if name in self.ecfg.tuned:
            return self.best[(wi, name)].label
        if name in self.bounds:
            return self.hindsight[(wi, self.bounds[name])].label
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

    def timelines(self) -> dict[tuple[str, str, int], Timeline]:
        """(workload, controller, seed) -> the episode's timeline, for ``timeline_seeds``."""
        out: dict[tuple[str, str, int], Timeline] = {}
        for wi, plan in enumerate(self.plans):
            for name in self.ecfg.policies:
                for seed in self.ecfg.timeline_seeds:
                    tl = self.episodes[(wi, name, seed)].timeline
                    if tl is not None:
                        out[(plan.key, name, seed)] = tl
        return out

    def search(self, name: str = BEST_STATIC) -> list[dict[str, Any]]:
        """Every grid point of tuned controller ``name``, per workload, with its scores and
        whether it was picked (``chosen``) or is the hindsight bound (``hindsight_chosen``)."""
        return [
            {
                "workload": self.plans[wi].name, "deployment": f"{self.plans[wi].model}/{self.plans[wi].hardware}",
                **asdict(p), "chosen": p is self.best[(wi, n)], "hindsight_chosen": p is self.hindsight.get((wi, n)),
            }
            for wi, n in sorted(self.grids)
            if n == name
            for p in self.grids[(wi, n)]
        ]

    def picks(self, name: str) -> list[str]:
        """results.md's lines on a vllm_tuned controller's picks (best_static's are the report's)."""
        tune = list(self.ecfg.best_static.tune_seeds)
        out = []
        for wi, n in sorted(self.grids):
            if n != name:
                continue
            best, bound = self.best[(wi, n)], self.hindsight.get((wi, n))
            out.append(f"- {name} on {self.plans[wi].key}: {best.label} (tuning seeds {tune}: goodput "
                       f"{best.request_goodput:.3g} req/s, attainment {best.slo_attainment:.3g}; "
                       f"{len(self.grids[(wi, n)])} grid points)")
            if bound is not None:
                out.append(f"- {hindsight_name(name)} on {self.plans[wi].key}: {bound.label} (scored seeds: goodput "
                           f"{bound.hindsight_goodput:.3g} req/s, attainment {bound.hindsight_attainment:.3g})")
        return out


def _config_name(config_name: str | None) -> str:
    if config_name is not None:
        return config_name
    from hydra.core.hydra_config import HydraConfig

    return str(HydraConfig.get().job.config_name) if HydraConfig.initialized() else "evaluate"


def check_policies(plans: Sequence[WorkloadPlan], ecfg: EvalConfig) -> None:
    """Fail before any episode runs: every controller must build on every workload and find
    room (a vllm_tuned sweep must read, and needs the simulator)."""
    from batchpilot.evaluation.vllm_tuned import tuned_config

    for plan in plans:
        for name in ecfg.policies:
            if name == BEST_STATIC:
                policy: dict[str, Any] = {}
            elif name in ecfg.tuned:  # a vllm_tuned sweep: vLLM alone, as shipped by construction
                tuned_config(policy_config(name, ecfg, plan), name)
                if str(plan.cfg.engine.kind) != "sim":
                    raise EvaluationError(
                        f"policy {name!r} starts a server per setting of its grid: run it with engine=sim; live, "
                        f"scripts/live_evaluate.py runs vLLM's flags on managed servers")
                continue
            else:
                policy = policy_config(name, ecfg, plan)
                make_controller(policy, plan, name)
            if plan.no_room and not policy.get(AS_SHIPPED_KEY, False):
                raise EvaluationError(
                    f"workload {plan.key!r}, policy {name!r}: {plan.no_room} (only a policy run as shipped, "
                    f"without the shield, e.g. vllm_default, could run there)")


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
    from rich.console import Console

    from batchpilot.evaluation import report as rep

    ecfg = dataclasses.replace(EvalConfig.from_cfg(cfg), config_name=_config_name(config_name))
    require_launcher(ecfg.launcher)
    user = _user_overrides(overrides)
    console = Console(stderr=True)
    t_start = time.perf_counter()
    plans = plan_matrix(user, ecfg, console.log)
    check_policies(plans, ecfg)
    matrix = _Matrix(plans, ecfg)
    cells = matrix.first_cells()
    _log_plans(plans, console.log)
    _run_matrix(plans, matrix, cells, ecfg, console)
    rows, timelines = _write_matrix(matrix, ecfg)
    out = ecfg.out_dir
    table = rep.markdown_table(rows)
    plots = _plot_matrix(rows, timelines, plans, ecfg) if ecfg.plots else []
    wall = time.perf_counter() - t_start
    run_cfg = {"eval": OmegaConf.to_container(cfg, resolve=False), "overrides": user, "wall_s": wall}
    wandb_dir = rep.log_to_wandb(dict(cfg.get("logger") or {}), run_cfg, rows, table, plots, out)
    print(table)
    for line in rep.episode_comparison(rows):
        console.log(line)
    wrote = "results.json, results.csv, results.md" + (f", plots/ ({len(plots)})" if plots else "")
    console.log(f"{len(rows)} rows in {wall:.1f} s → {out}: {wrote}" + (f"; W&B run in {wandb_dir}" if wandb_dir else ""))
    return rows


def _log_plans(plans: Sequence[WorkloadPlan], log: Callable[[str], None]) -> None:
    """Each workload as planned (requests, episode length, model, hardware, engine, load, trace
    windows, notes), before any cell runs: what a long matrix is about to spend its time on."""
    for plan in plans:
        win = (
            f", trace windows from {sorted(plan.windows.values())} s (seeds {sorted(plan.windows)})"
            if plan.windows else ""
        )
        log(
            f"workload {plan.name}: {plan.num_requests} requests over {plan.episode_s:.0f} s (first seed), "
            f"model {plan.model} on {plan.hardware}, engine {plan.cfg.engine.kind}, "
            f"load x{plan.rate_multiplier:.3g}{win}"
        )
        for note in plan.notes:
            log(f"workload {plan.key}: {note}")


def _run_matrix(plans: Sequence[WorkloadPlan], matrix: _Matrix, cells: list[Cell], ecfg: EvalConfig,
                console: Any) -> None:
    """``cells`` and every cell they release (the tuned baselines' later stages), serially or on
    Ray (``ecfg.launcher``), a progress bar advanced per episode."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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


def _write_matrix(matrix: _Matrix, ecfg: EvalConfig) -> tuple[list[dict[str, Any]], dict]:
    """results.json/csv, timelines.json, each tuned baseline's search and results.md into
    ``ecfg.out_dir``; returns the rows and the timelines (the plots read them)."""
    import json

    from batchpilot.evaluation import report as rep

    rows = matrix.rows()
    timelines = matrix.timelines()
    search = matrix.search()
    out = ecfg.out_dir
    rep.write_rows(rows, out)
    rep.write_timelines(timelines, out)
    (out / "best_static_search.json").write_text(json.dumps(rep.jsonable(search), indent=1) + "\n")
    md = rep.results_markdown(rows, search, ecfg.seeds, ecfg.best_static.tune_seeds)
    for name in ecfg.tuned:
        if name != BEST_STATIC:  # vllm_tuned: its grid and picks beside best_static's
            (out / f"{name}_search.json").write_text(json.dumps(rep.jsonable(matrix.search(name)), indent=1) + "\n")
            md += "\n" + "\n".join(matrix.picks(name)) + "\n"
    (out / "results.md").write_text(md)
    return rows, timelines


def _plot_matrix(rows: Sequence[dict[str, Any]], timelines: Mapping[Any, Any], plans: Sequence[WorkloadPlan],
                 ecfg: EvalConfig) -> list[Path]:
    """plots/: the first timeline seed's timelines, goodput against the SLO, and the per-episode
    ratios when there are any."""
    from batchpilot.evaluation import report as rep

    out = ecfg.out_dir
    slo_ttft = plans[0].cfg.slo.get("ttft_ms")
    first = ecfg.timeline_seeds[0]
    plotted = {(wl, pol): tl for (wl, pol, seed), tl in timelines.items() if seed == first}
    plots = rep.plot_timelines(plotted, out / "plots", None if slo_ttft is None else float(slo_ttft), first)
    plots.append(rep.plot_goodput_vs_slo(rows, out / "plots"))
    per_episode = rep.plot_episode_ratios(rows, out / "plots")
    if per_episode is not None:
        plots.append(per_episode)
    return plots
