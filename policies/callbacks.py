"""Training callbacks (stable-baselines3 ``BaseCallback`` subclasses) and the validation suite
they evaluate on.

- ``EpisodeMetricsCallback``: the environment's per-episode ``vllm bench serve`` metrics and
  reward parts, averaged into the training log (``rollout/*``).
- ``WandbCallback``: makes every value SB3 logs (``rollout/*``, ``train/*``, ``eval/*``, ...) a
  W&B history row as well, at the step it was dumped.
- ``ValidationCallback``: every ``eval_freq`` timesteps, runs the deterministic policy on the
  fixed validation workloads, compares it with the baseline controller (PID), logs the
  comparison and keeps the best model.

``ValidationSuite`` runs one controller or one policy over the fixed validation workloads
(fixed seeds, draining at truncation so every request's fate counts).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np
from omegaconf import DictConfig, OmegaConf
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.logger import KVWriter

from batchpilot.config import config_dirs, group_file, group_names
from batchpilot.core.controller import Controller
from batchpilot.core.telemetry import SLO
from batchpilot.envs.serving_env import ServingEnv
from batchpilot.nodes import plain
from batchpilot.policies.controllers import build_controller
from batchpilot.workload_config import workload_from_node

if TYPE_CHECKING:  # pragma: no cover
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.vec_env import VecNormalize

#: Columns of the comparison (console table, W&B table, REPRODUCE.md), in order.
COMPARE_METRICS: tuple[str, ...] = (
    "request_goodput",
    "slo_attainment",
    "request_throughput",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "p99_e2el_ms",
    "rejected",
    "preemptions",
)
#: Per-episode metrics averaged into the training log.
EPISODE_METRICS: tuple[str, ...] = (
    "request_goodput",
    "slo_attainment",
    "request_throughput",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "rejected",
    "preemptions",
    "shield_interventions",
)

Results = dict[str, dict[str, float]]  # workload name -> metric -> value


# --- validation suite ----------------------------------------------------------------------
def _mean_over_seeds(runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    keys = runs[0].keys()
    out: dict[str, float] = {}
    for k in keys:
        vals = [float(r[k]) for r in runs if not math.isnan(float(r[k]))]
        out[k] = float(np.mean(vals)) if vals else math.nan
    return out


@dataclass
class ValidationSuite:
    """The fixed validation workloads, each a ServingEnv (drain on truncation) with its own
    workload config and episode seeds.

    ``spec`` is ``train.validation``: ``{seeds: [...], workloads: {name: {group, overrides}}}``;
    ``group`` names a file in ``conf/workload/``.
    """

    base_cfg: DictConfig
    spec: Mapping[str, Any]
    envs: dict[str, ServingEnv] = field(init=False, default_factory=dict)
    seeds: tuple[int, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self.seeds = tuple(int(s) for s in self.spec["seeds"])
        if not self.seeds:
            raise ValueError("train.validation.seeds is empty: give at least one episode seed")
        workloads = dict(self.spec["workloads"])
        if not workloads:
            raise ValueError("train.validation.workloads is empty")
        for name, w in workloads.items():
            self.envs[name] = ServingEnv(cfg=validation_cfg(self.base_cfg, w["group"], w.get("overrides") or {}))

    @property
    def names(self) -> list[str]:
        return list(self.envs)

    @property
    def max_num_seqs(self) -> int:
        return next(iter(self.envs.values())).engine.capabilities().max_num_seqs

    def run_controller(
        self, make_controller: Callable[[ServingEnv], Controller], seeds: Sequence[int] | None = None
    ) -> Results:
        """A baseline controller (PID, AIMD, static) through ``step_proposal``, as deployed.
        ``seeds`` replaces the suite's episode seeds (held-out evaluation)."""
        out: Results = {}
        for name, env in self.envs.items():
            runs = []
            for seed in seeds or self.seeds:
                env.reset(seed=seed)
                ctl = make_controller(env)
                ctl.reset(env.knobs)
                done = False
                while not done:
                    _, _, term, trunc, _ = env.step_proposal(ctl.decide(env.snapshot, env.knobs))
                    done = term or trunc
                runs.append(env.episode_metrics())
            out[name] = _mean_over_seeds(runs)
        return out

    def run_policy(
        self, model: "MaskablePPO", vecnorm: "VecNormalize | None", seeds: Sequence[int] | None = None
    ) -> Results:
        """The policy, deterministic, with the env's action masks and training's normalisation."""
        out: Results = {}
        for name, env in self.envs.items():
            runs = []
            for seed in seeds or self.seeds:
                obs, _ = env.reset(seed=seed)
                done = False
                while not done:
                    x = vecnorm.normalize_obs(obs) if vecnorm is not None else obs
                    action, _ = model.predict(x, action_masks=env.action_masks(), deterministic=True)
                    obs, _, term, trunc, _ = env.step(action)
                    done = term or trunc
                runs.append(env.episode_metrics())
            out[name] = _mean_over_seeds(runs)
        return out

    def close(self) -> None:
        for env in self.envs.values():
            env.close()


def validation_cfg(base_cfg: DictConfig, group: str, overrides: Mapping[str, Any]) -> DictConfig:
    """``base_cfg`` with ``workload`` replaced by ``conf/workload/<group>.yaml`` + overrides and
    draining on truncation (evaluation wants every request's fate)."""
    dirs = config_dirs()
    path = group_file("workload", group, dirs)
    if path is None:
        known = group_names("workload", dirs)
        raise ValueError(f"validation workload group {group!r} not found in conf/workload/ (known: {known})")
    cfg = OmegaConf.create(OmegaConf.to_container(base_cfg, resolve=True))
    # The group file without its defaults list (the schema it extends, workload/schema_<kind>).
    workload = OmegaConf.merge(plain(OmegaConf.load(path)), OmegaConf.create(dict(overrides)))
    # Keep the training run's rate_scale (sized for its model/hardware) unless overridden.
    if "rate_scale" not in overrides and "rate_scale" in base_cfg.workload:
        workload.rate_scale = base_cfg.workload.rate_scale
    # Checked against its kind's schema now (a mistyped override fails before training starts).
    workload_from_node(workload, where=f"validation workload {group!r}: workload")
    cfg.workload = workload
    cfg.env.drain_on_truncate = True
    return cfg


def baseline_factory(policy_cfg: Any, slo: SLO) -> Callable[[ServingEnv], Controller]:
    """A fresh baseline controller per episode, bounded by that env's engine, steering on ``slo``."""

    def make(env: ServingEnv) -> Controller:
        return build_controller(policy_cfg, env.engine.capabilities().max_num_seqs, slo=slo)

    return make


def mean_over_workloads(results: Results, metric: str) -> float:
    vals = [r[metric] for r in results.values() if not math.isnan(r[metric])]
    return float(np.mean(vals)) if vals else math.nan


def slo_deficit(policy: Results, baseline: Results, tolerance: float = 0.0) -> float:
    """Largest shortfall of the policy's SLO attainment below the baseline's on any workload
    (0 = meets the SLO as often or more often everywhere)."""
    worst = 0.0
    for name, b in baseline.items():
        p_att, b_att = policy[name]["slo_attainment"], b["slo_attainment"]
        if math.isnan(b_att):
            continue
        p_att = 0.0 if math.isnan(p_att) else p_att
        worst = max(worst, b_att - tolerance - p_att)
    return worst


def selection_key(policy: Results, baseline: Results, tolerance: float = 0.0) -> tuple[int, float]:
    """Order of evaluations for best-model selection: feasible (SLO attainment >= baseline's on
    every workload) first, then by mean request_goodput; infeasible ones by smallest deficit."""
    deficit = slo_deficit(policy, baseline, tolerance)
    if deficit <= 0.0:
        return (1, mean_over_workloads(policy, "request_goodput"))
    return (0, -deficit)


# --- callbacks -----------------------------------------------------------------------------
class EpisodeMetricsCallback(BaseCallback):
    """Averages the env's end-of-episode metrics (``info["episode_metrics"]``) and the reward's
    parts (``info["reward_terms"]``) over each rollout into ``rollout/*``.

    Reads each sub-env's info dict directly (the env puts the metrics there at truncation), so
    it does not depend on how a vector env reports episode ends (Gymnasium 0.29 vs 1.x).
    """

    def __init__(self) -> None:
        super().__init__()
        self._episodes: list[dict[str, float]] = []
        self._terms: dict[str, list[float]] = {}

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", []):
            m = info.get("episode_metrics")
            if m is not None:
                self._episodes.append(m)
            for k, v in info.get("reward_terms", {}).items():
                self._terms.setdefault(k, []).append(float(v))
        return True

    def _on_rollout_end(self) -> None:
        if self._episodes:
            for k in EPISODE_METRICS:
                vals = [float(e[k]) for e in self._episodes if k in e and not math.isnan(float(e[k]))]
                if vals:
                    self.logger.record(f"rollout/{k}", float(np.mean(vals)))
            self.logger.record("rollout/episodes", len(self._episodes))
        for k, vals in self._terms.items():
            self.logger.record(f"reward/{k}", float(np.mean(vals)))
        self._episodes.clear()
        self._terms.clear()


class ObservationRangeCallback(BaseCallback):
    """The per-feature range of the raw (un-normalised) observations training saw. Exported
    with the policy: at run time an observation outside it hands the cap to PID
    (``PPOController.out_of_range``), since the policy never learnt what to do there."""

    def __init__(self) -> None:
        super().__init__()
        self.low: np.ndarray | None = None
        self.high: np.ndarray | None = None

    def _on_step(self) -> bool:
        env = self.training_env
        obs = env.get_original_obs() if hasattr(env, "get_original_obs") else self.locals.get("new_obs")
        if obs is None:
            return True
        obs = np.asarray(obs, dtype=np.float64).reshape(-1, np.asarray(obs).shape[-1])
        lo, hi = obs.min(axis=0), obs.max(axis=0)
        self.low = lo if self.low is None else np.minimum(self.low, lo)
        self.high = hi if self.high is None else np.maximum(self.high, hi)
        return True

    def as_dict(self) -> dict[str, list[float]] | None:
        if self.low is None or self.high is None:
            return None
        return {"low": [float(x) for x in self.low], "high": [float(x) for x in self.high]}


class _WandbWriter(KVWriter):
    """An SB3 logger output that sends each dump as one W&B history row."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def write(self, key_values: dict[str, Any], key_excluded: dict[str, Any], step: int = 0) -> None:
        row = {
            k: v
            for k, v in key_values.items()
            if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
        }
        if row:
            row["global_step"] = step
            self.run.log(row)

    def close(self) -> None:
        pass


class WandbCallback(BaseCallback):
    """Training curves to W&B: installs a writer on the model's logger at the start, so every
    value logged to TensorBoard/stdout also becomes a W&B history row (x-axis ``global_step``),
    including the final evaluation after ``learn``."""

    def __init__(self, run: Any) -> None:
        super().__init__()
        self.run = run
        self._writer = _WandbWriter(run)

    def _on_training_start(self) -> None:
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")
        self.logger.output_formats.append(self._writer)

    def _on_step(self) -> bool:
        return True
    # The writer stays installed after learn(): the final evaluation logs through it too.


@dataclass
class Evaluation:
    """One evaluation of the policy on the validation suite."""

    timesteps: int
    results: Results
    key: tuple[int, float]
    seconds: float


class ValidationCallback(BaseCallback):
    """Every ``eval_freq`` timesteps: run the policy on the validation suite, log
    ``eval/<workload>/<metric>`` and the means, compare with the baseline, and save the best
    model (``best/model.zip`` + ``best/vecnormalize.pkl``) by ``selection_key``."""

    def __init__(
        self,
        suite: ValidationSuite,
        baseline: Results,
        *,
        eval_freq: int,
        best_dir: Path,
        slo_tolerance: float = 0.0,
        on_evaluation: Callable[[Evaluation], None] | None = None,
        verbose: int = 0,
    ) -> None:
        super().__init__(verbose)
        self.suite = suite
        self.baseline = baseline
        self.eval_freq = int(eval_freq)
        self.best_dir = Path(best_dir)
        self.slo_tolerance = float(slo_tolerance)
        self.on_evaluation = on_evaluation
        self.history: list[Evaluation] = []
        self.best: Evaluation | None = None
        self._next = self.eval_freq

    def _on_step(self) -> bool:
        if self.eval_freq > 0 and self.num_timesteps >= self._next:
            self._next += self.eval_freq
            self.evaluate()
        return True

    def evaluate(self) -> Evaluation:
        """Evaluate the current model now (also called once more after ``learn``)."""
        if self.history and self.history[-1].timesteps == self.num_timesteps:
            return self.history[-1]
        t0 = time.perf_counter()
        vecnorm = self.model.get_vec_normalize_env()
        results = self.suite.run_policy(self.model, vecnorm)  # type: ignore[arg-type]
        ev = Evaluation(
            timesteps=self.num_timesteps,
            results=results,
            key=selection_key(results, self.baseline, self.slo_tolerance),
            seconds=time.perf_counter() - t0,
        )
        self.history.append(ev)
        self._log(ev)
        if self.best is None or ev.key > self.best.key:
            self.best = ev
            self.best_dir.mkdir(parents=True, exist_ok=True)
            self.model.save(self.best_dir / "model.zip")
            if vecnorm is not None:
                vecnorm.save(str(self.best_dir / "vecnormalize.pkl"))
            self.logger.record("eval/best_timesteps", ev.timesteps)
        if self.on_evaluation is not None:
            self.on_evaluation(ev)
        self.logger.dump(self.num_timesteps)
        return ev

    def _log(self, ev: Evaluation) -> None:
        for name, m in ev.results.items():
            for k in COMPARE_METRICS:
                self.logger.record(f"eval/{name}/{k}", m[k])
        gp = mean_over_workloads(ev.results, "request_goodput")
        gb = mean_over_workloads(self.baseline, "request_goodput")
        self.logger.record("eval/mean_request_goodput", gp)
        self.logger.record("eval/mean_slo_attainment", mean_over_workloads(ev.results, "slo_attainment"))
        self.logger.record("eval/goodput_vs_baseline", gp / gb if gb > 0 else math.nan)
        self.logger.record("eval/slo_deficit", slo_deficit(ev.results, self.baseline, self.slo_tolerance))
        self.logger.record("eval/seconds", ev.seconds)
