"""PPO training, top to bottom: ``train(cfg)`` builds the environments, the model and the
callbacks, learns, evaluates against the PID baseline, exports the best policy and prints the
comparison. ``scripts/train.py`` is its Hydra entry point.

What a run leaves in its Hydra output folder (``outputs/<date>/<time>/``, or
``multirun/<date>/<time>/<job>/`` under ``-m``)::

    .hydra/              the composed config, overrides (Hydra)
    tb/                  TensorBoard event files              (logger=wandb|tensorboard)
    wandb/               the W&B run, offline by default      (logger=wandb)
    checkpoints/         model_<steps>_steps.zip + VecNormalize statistics
    best/                model.zip + vecnormalize.pkl of the best evaluation
    policy/              the exported best policy (manifest.json + policy.safetensors)
    comparison.json      policy vs baseline on every validation workload
    policy_guards.json   action mode, the PID it corrects, the training range (for scripts/export.py)
    final/               model.zip + vecnormalize.pkl of the last model (train.export_select=final)
    init/                model.zip + vecnormalize.pkl as loaded, before any update (train.init_from)

``train.init_from=<exported policy>`` starts from an exported policy instead of from scratch
(``policies/warm_start.py``: actor and observation normalisation loaded, critic fresh), e.g. the
live fine-tune ``engine=vllm train=finetune_live train.init_from=policies/pretrained``
(docs/live_evaluation.md). ``train.validation.engine: sim`` runs the validation suite on the
simulated twin of a live engine (same scheduler limits, the calibrated cpu_tiny profile).

Algorithm: sb3-contrib ``MaskablePPO`` (the env's ``action_masks()`` switches off KV dtypes
the engine cannot run, so they are never sampled) with separate actor/critic MLPs, on
``SubprocVecEnv`` workers (``DummyVecEnv`` for one), observation and reward normalised by
``VecNormalize``. Every episode draws a fresh workload (``workload=randomized``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from batchpilot.config import CONF_DIR, config_dirs, group_file, group_names, load_group_file
from batchpilot.core.telemetry import SLO
from batchpilot.envs.serving_env import ServingEnv
from batchpilot.nodes import ConfigError
from batchpilot.policies.callbacks import (
    COMPARE_METRICS,
    EpisodeMetricsCallback,
    Evaluation,
    ObservationRangeCallback,
    Results,
    ValidationCallback,
    ValidationSuite,
    WandbCallback,
    baseline_factory,
    mean_over_workloads,
    slo_deficit,
)
from batchpilot.schemas.policy import with_policy_schema
from batchpilot.schemas.train import LoggerConfig, TrainConfig

# --- configuration -------------------------------------------------------------------------
# TrainConfig (conf/train) and LoggerConfig (conf/logger) are declared with their structured-config
# schemas in batchpilot/schemas/train.py.


# --- run folder and loggers ----------------------------------------------------------------
def run_output_dir() -> Path:
    """The Hydra run's output folder; the working directory outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path.cwd()


def start_wandb(lc: LoggerConfig, config: dict[str, Any], out_dir: Path) -> Any | None:
    """A W&B run under ``out_dir/wandb/`` (None when logger.wandb is off). Offline unless the
    user configured online: ``WANDB_MODE`` in the environment wins over ``logger.mode``."""
    if not lc.wandb:
        return None
    import wandb

    mode = os.environ.get("WANDB_MODE", lc.mode)
    job = config.get("_job", {})
    return wandb.init(
        project=lc.project,
        entity=lc.entity,
        group=lc.group or job.get("name"),
        name=job.get("run_name"),
        tags=list(lc.tags),
        config={k: v for k, v in config.items() if k != "_job"},
        dir=str(out_dir),
        mode=mode,
        job_type="train",
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
    )


def sb3_logger(out_dir: Path, lc: LoggerConfig, verbose: bool) -> Any:
    from stable_baselines3.common.logger import Logger, configure

    formats = (["stdout"] if verbose else []) + (["tensorboard"] if lc.tensorboard else [])
    if not formats:
        return Logger(folder=None, output_formats=[])  # logger=none: no files at all
    return configure(str(out_dir / "tb"), formats)


def job_info() -> dict[str, Any]:
    """Hydra job name / number (multirun) for naming the W&B run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {"name": "train", "run_name": None}
    hc = HydraConfig.get()
    num = hc.job.get("num", None)
    overrides = ",".join(hc.overrides.task) or "default"
    return {"name": hc.job.name, "run_name": overrides if num is None else f"{num}:{overrides}"}


# --- environments --------------------------------------------------------------------------
class TrainConfigError(ValueError):
    """The training configuration cannot run; found before any worker forks or any step is
    taken (``scripts/train.py`` prints it in one line)."""


def check_training_config(cfg: DictConfig, tc: TrainConfig) -> None:
    """One training environment built here, on the simulator, before the workers fork: a bad
    value (an SLO of NaN, a memory ceiling of 1.5) then fails with its own message, where in a
    ``SubprocVecEnv`` worker it surfaced as a ``ConnectionResetError``, or after the whole run."""
    from omegaconf.errors import OmegaConfBaseException

    baseline = str(tc.validation.get("baseline", "pid"))
    dirs = config_dirs()
    if group_file("policy", baseline, dirs) is None:
        known = group_names("policy", dirs)
        raise TrainConfigError(f"train.validation.baseline={baseline!r} is not in conf/policy; known: {known}")
    try:  # read now, not after the run has started (W&B, workers): a malformed file is named here
        with_policy_schema(load_group_file("policy", baseline, dirs), f"policy/{baseline}.yaml")
    except ConfigError as e:
        raise TrainConfigError(f"train.validation.baseline={baseline!r}: {e}") from None
    if str(cfg.engine.get("kind", "sim")) != "sim":
        return  # a live engine is started by the run itself, once
    try:
        ServingEnv(cfg=cfg).close()
    except (ValueError, OmegaConfBaseException) as e:
        raise TrainConfigError(f"the training environment cannot be built: {e}") from None


def make_env_fn(cfg: DictConfig) -> Callable[[], ServingEnv]:
    """A picklable constructor for one training env (runs inside a SubprocVecEnv worker)."""

    def make() -> ServingEnv:
        import batchpilot.envs  # noqa: F401  (registers the env id in the worker)

        return ServingEnv(cfg=cfg)

    return make


def build_train_env(cfg: DictConfig, tc: TrainConfig, seed: int) -> Any:
    """``n_envs`` workers (``SubprocVecEnv``; ``DummyVecEnv`` for one) under ``VecNormalize``.
    Worker ``i`` starts from seed ``seed + i``; later episodes continue its generator."""
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecMonitor, VecNormalize

    n = tc.num_envs()
    fns = [make_env_fn(cfg) for _ in range(n)]
    venv = SubprocVecEnv(fns, start_method="fork") if n > 1 else DummyVecEnv(fns)
    venv.seed(seed)
    venv = VecMonitor(venv)  # episode return/length for rollout/ep_rew_mean
    return VecNormalize(
        venv,
        norm_obs=tc.norm_obs,
        norm_reward=tc.norm_reward,
        clip_obs=tc.clip_obs,
        gamma=tc.gamma,
    )


def build_model(venv: Any, tc: TrainConfig, seed: int) -> Any:
    import torch.nn as nn
    from sb3_contrib import MaskablePPO

    arch = list(tc.net_arch)
    n_envs = venv.num_envs
    batch = min(tc.batch_size, tc.n_steps * n_envs)
    return MaskablePPO(
        "MlpPolicy",
        venv,
        learning_rate=tc.learning_rate,
        n_steps=tc.n_steps,
        batch_size=batch,
        n_epochs=tc.n_epochs,
        gamma=tc.gamma,
        gae_lambda=tc.gae_lambda,
        clip_range=tc.clip_range,
        ent_coef=tc.ent_coef,
        vf_coef=tc.vf_coef,
        max_grad_norm=tc.max_grad_norm,
        target_kl=tc.target_kl,
        policy_kwargs={
            "net_arch": {"pi": arch, "vf": arch},
            "activation_fn": {"tanh": nn.Tanh, "relu": nn.ReLU}[tc.activation],
        },
        seed=seed,
        device=tc.device,
        verbose=0,
    )


def start_at_baseline(model: Any, logit: float, bucketing: str | None = None) -> None:
    """Start a residual policy near PID: the untrained actor's outputs are ~0 (orthogonal init,
    gain 0.01), so a bias of ``logit`` on factor 1 and "keep" KV makes PID's cap and the
    engine's dtype the most likely action (e^2 / (e^2 + 4) = 65 % for the factor at 2.0) and
    exploration a perturbation of PID, instead of a uniformly random cap from the first step.
    The bucketing order gets no prior unless ``bucketing`` names one (``train.bucketing_prior``):
    a prior towards PID's own order (weighted) kept the policy from finding shortest_first in
    150k steps (validation draws: PID with shortest_first 16.4 req/s goodput vs 14.2 weighted)."""
    if logit == 0.0:
        return
    import torch

    from batchpilot.core.actions import ACTION_NVEC
    from batchpilot.core.knobs import BUCKETING_MODES

    # (sub-action offset in the flat logits, index): factor 1 (batch index 2), keep KV (index 0).
    biased = [(0, 2), (ACTION_NVEC[0] + ACTION_NVEC[1], 0)]
    if bucketing is not None:
        biased.append((ACTION_NVEC[0], BUCKETING_MODES.index(bucketing)))
    with torch.no_grad():
        bias = model.policy.action_net.bias
        for off, idx in biased:
            bias[off + idx] += logit


def validation_base_cfg(plain: DictConfig, spec: Any) -> DictConfig:
    """The config the validation suite's environments start from. ``train.validation.engine:
    sim`` on a live run (``engine=vllm``) swaps in the simulator with the live engine's
    scheduler limits (block size, token budget, sequences, KV block cap) on the calibrated
    profile of its model/hardware (``model=tiny_llama hardware=cpu_tiny`` under engine=vllm):
    the live engine's simulated twin, as ``evaluation/live_twin.py`` builds it. Validating live
    would cost one wall second per simulated interval (16 min per evaluation with the default
    suite) and a second vLLM engine in the process."""
    engine = spec.get("engine") if hasattr(spec, "get") else None
    if engine is None or engine == plain.engine.kind:
        return plain
    if engine != "sim":
        raise ValueError(f"train.validation.engine must be null or sim, got {engine!r}")
    twin = OmegaConf.create(OmegaConf.to_container(plain, resolve=True))
    sim = OmegaConf.load(CONF_DIR / "engine" / "sim.yaml")
    for key in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override",
                "kv_dtype", "enable_prefix_caching", "seed"):
        if key in plain.engine and key in sim:
            sim[key] = plain.engine[key]
    twin.engine = sim
    return twin


# --- reporting -----------------------------------------------------------------------------
def comparison_rows(policy: Results, baseline: Results, baseline_name: str) -> list[dict[str, Any]]:
    """Rows ``{workload, controller, <COMPARE_METRICS>}``, baseline then policy per workload,
    then the means over workloads."""
    rows: list[dict[str, Any]] = []
    for name in baseline:
        for ctl, res in ((baseline_name, baseline[name]), ("ppo", policy[name])):
            rows.append({"workload": name, "controller": ctl, **{k: float(res[k]) for k in COMPARE_METRICS}})
    for ctl, res in ((baseline_name, baseline), ("ppo", policy)):
        rows.append(
            {"workload": "mean", "controller": ctl, **{k: mean_over_workloads(res, k) for k in COMPARE_METRICS}}
        )
    return rows


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "-"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def print_comparison(rows: list[dict[str, Any]], title: str) -> str:
    """Print the comparison with rich; returns it as Markdown (for REPRODUCE.md / the log)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = ["workload", "controller", *COMPARE_METRICS]
    for c in cols:
        table.add_column(c, justify="left" if c in ("workload", "controller") else "right")
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["workload"], r["controller"], *(_fmt(r[k]) for k in COMPARE_METRICS)]
        style = "bold" if r["controller"] == "ppo" else None
        table.add_row(*cells, style=style)
        md.append("| " + " | ".join(cells) + " |")
    Console(width=200).print(table)
    return "\n".join(md)


def wandb_table(rows: list[dict[str, Any]], timesteps: int) -> Any:
    import wandb

    cols = ["timesteps", "workload", "controller", *COMPARE_METRICS]
    return wandb.Table(columns=cols, data=[[timesteps, r["workload"], r["controller"], *(r[k] for k in COMPARE_METRICS)] for r in rows])


def observation_scales(cfg: DictConfig, env: ServingEnv) -> dict[str, Any]:
    """What a gateway needs to rebuild the observation the policy was trained on (read by
    ``PPOController``): normalisation scales and the engine limits they divide by."""
    caps = env.engine.capabilities()
    return {
        "rate_scale": float(cfg.control.rate_scale),
        "token_rate_scale": float(cfg.control.token_rate_scale),
        "max_num_seqs": int(caps.max_num_seqs),
        "max_model_len": int(caps.max_model_len),
        "kv16_dtype": str(cfg.env.kv16_dtype),
        "kv8_dtype": str(cfg.env.kv8_dtype),
    }


def controller_record(env: ServingEnv) -> dict[str, Any]:
    """How the policy's actions become proposals (read by ``PPOController``): the action mode
    and, for a residual policy, the exact PID it corrects."""
    rec: dict[str, Any] = {"action_mode": env.action_mode}
    if env.residual is not None:
        rec["pid"] = dataclasses.asdict(env.residual.config)
    return rec


# --- the run -------------------------------------------------------------------------------
# ``train`` reads as the recipe; each step below it is one helper, in the order it runs.
def train(cfg: DictConfig) -> float:
    """Train, evaluate against the baseline, export the best policy. Returns the metric a sweep
    optimises: the exported policy's mean request_goodput on the validation workloads' held-out
    seeds, minus 10x its SLO-attainment shortfall below the baseline there (so runs that miss
    the SLO more often than PID rank last)."""
    import torch
    from stable_baselines3.common.utils import set_random_seed

    t_start = time.perf_counter()
    setup = _prepare_run(cfg)
    torch.set_num_threads(setup.tc.torch_threads)
    set_random_seed(setup.seed)

    venv = suite = run = None
    try:
        # 1. Environments: randomised training workers (forked before W&B starts its threads),
        #    fixed validation workloads, and the baseline's scores on them.
        venv = build_train_env(setup.plain, setup.tc, setup.seed)
        run = start_wandb(setup.lc, {**setup.config_dict, "_job": job_info()}, setup.out_dir)
        suite = ValidationSuite(validation_base_cfg(setup.plain, setup.tc.validation), setup.tc.validation)
        baseline = _run_baseline(cfg, setup.tc, suite)
        # 2. Model.
        model = _build_run_model(setup, venv)
        # 3. Callbacks: episode metrics, W&B curves, validation + best model, checkpoints.
        validation, obs_range, callbacks = _build_callbacks(setup, suite, baseline, run, venv.num_envs)
        # 4. Learn, then choose the model to export.
        final_steps = _learn(model, setup, validation, obs_range, callbacks)
        train_s = time.perf_counter() - t_start
        chosen_dir, chosen = _select_model(model, venv, validation, setup)
        # 5. Export the chosen model.
        best_model, best_vecnorm, policy_dir = _export_chosen(
            setup, chosen_dir, chosen, suite, obs_range, final_steps=final_steps, train_s=train_s)
        # 6. Report it against the baseline on held-out seeds.
        summary, rows = _report(setup, suite, baseline, best_model, best_vecnorm, chosen, validation,
                                train_s=train_s)
        print(f"[train] policy exported to {policy_dir} ; {time.perf_counter() - t_start:.0f}s total")
        if run is not None:
            _log_final_to_wandb(run, setup.lc, summary, rows, chosen.timesteps, policy_dir)
        return float(summary["mean_request_goodput"] - 10.0 * summary["slo_deficit"])
    finally:
        if venv is not None:
            venv.close()
        if suite is not None:
            suite.close()
        if run is not None:
            run.finish()


@dataclasses.dataclass(frozen=True)
class _RunSetup:
    """What every step of a run reads, fixed before any worker forks: the checked configs, the
    plain resolved config (picklable for the workers), the output folder and the warm start
    (None when training from scratch)."""

    tc: TrainConfig
    lc: LoggerConfig
    plain: DictConfig
    config_dict: dict[str, Any]
    seed: int
    out_dir: Path
    warm: Any | None


def _prepare_run(cfg: DictConfig) -> _RunSetup:
    """Everything checked before the run starts (a bad value fails here in one line, not after
    W&B and the workers have started)."""
    try:
        tc = TrainConfig.from_cfg(cfg.train)
        lc = LoggerConfig.from_cfg(cfg.logger)
    except ValueError as e:
        raise TrainConfigError(str(e)) from None
    seed = int(cfg.seed)
    out_dir = run_output_dir()
    # A plain, resolved copy: picklable for the workers, free of Hydra-only interpolations.
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if tc.deployments:  # the training workers and the validation suite draw deployments
        plain.env.deployments = list(tc.deployments)
    warm = _load_warm_start(tc, plain)
    check_training_config(plain, tc)
    config_dict: dict[str, Any] = OmegaConf.to_container(plain)  # type: ignore[assignment]
    return _RunSetup(tc=tc, lc=lc, plain=plain, config_dict=config_dict, seed=seed, out_dir=out_dir, warm=warm)


def _load_warm_start(tc: TrainConfig, plain: DictConfig) -> Any | None:
    """``train.init_from``: checked before any engine starts; the observation scales in
    ``plain.control`` become the source policy's (features must mean what they meant to it)."""
    if not tc.init_from:
        return None
    from batchpilot.policies import warm_start as ws_mod

    warm = ws_mod.load_warm_start(tc.init_from)
    ws_mod.check_compatible(warm, net_arch=tc.net_arch, activation=tc.activation,
                            action_mode=str(plain.env.get("action_mode")), clip_obs=tc.clip_obs,
                            norm_obs=tc.norm_obs)
    changed = ws_mod.apply_observation_scales(warm, plain)
    print(f"[train] warm start from {warm.artifact.path}: actor and observation normalisation loaded, "
          f"critic and reward normalisation fresh"
          + (f"; observation scales set to the policy's: {changed}" if changed else ""))
    return warm


@dataclasses.dataclass(frozen=True)
class _Baseline:
    """The controller the policy is compared with: its name, what builds it (again for the
    held-out seeds) and its scores on the selection seeds."""

    name: str
    policy_cfg: Any
    slo: SLO
    results: Results

    def factory(self) -> Callable[[ServingEnv], Any]:
        return baseline_factory(self.policy_cfg, self.slo)


def _run_baseline(cfg: DictConfig, tc: TrainConfig, suite: ValidationSuite) -> _Baseline:
    """The baseline on the validation suite's selection seeds, once: every evaluation during
    training is compared with these scores."""
    name = str(tc.validation.get("baseline", "pid"))
    # Over its schema, as the evaluation reads it (checked by check_training_config).
    policy_cfg = with_policy_schema(load_group_file("policy", name, config_dirs()), f"policy/{name}.yaml")
    slo = SLO.from_mapping(cfg.slo)
    t0 = time.perf_counter()
    results = suite.run_controller(baseline_factory(policy_cfg, slo))
    print(f"[train] baseline {name} on {suite.names}: {time.perf_counter() - t0:.1f}s, "
          f"mean request_goodput {mean_over_workloads(results, 'request_goodput'):.3f}/s")
    return _Baseline(name=name, policy_cfg=policy_cfg, slo=slo, results=results)


def _build_run_model(setup: _RunSetup, venv: Any) -> Any:
    """The model, started where the run says: the warm start's actor and normalisation (saved
    under ``init/`` as loaded, before any update, for a test or an audit to compare with the
    source), or a residual policy near PID, or scratch."""
    tc, out_dir, warm = setup.tc, setup.out_dir, setup.warm
    model = build_model(venv, tc, setup.seed)
    if warm is not None:
        from batchpilot.policies import warm_start as ws_mod

        ws_mod.load_actor(model, warm)
        ws_mod.load_obs_normalization(venv, warm)
        (out_dir / "init").mkdir(parents=True, exist_ok=True)
        model.save(out_dir / "init" / "model.zip")
        venv.save(str(out_dir / "init" / "vecnormalize.pkl"))
    elif setup.plain.env.get("action_mode") == "residual_pid":
        start_at_baseline(model, tc.baseline_prior_logit, tc.bucketing_prior)
    model.set_logger(sb3_logger(out_dir, setup.lc, verbose=False))
    return model


def _build_callbacks(
    setup: _RunSetup, suite: ValidationSuite, baseline: _Baseline, run: Any | None, n_envs: int
) -> tuple[ValidationCallback, ObservationRangeCallback, list[Any]]:
    """Episode metrics, W&B curves, validation + best model, checkpoints. The validation and
    observation-range callbacks are returned apart too: the run reads them after learning."""
    from stable_baselines3.common.callbacks import CheckpointCallback

    tc, out_dir = setup.tc, setup.out_dir

    def on_evaluation(ev: Evaluation) -> None:
        rows = comparison_rows(ev.results, baseline.results, baseline.name)
        gp, gb = (mean_over_workloads(r, "request_goodput") for r in (ev.results, baseline.results))
        print(f"[eval @ {ev.timesteps}] goodput ppo {gp:.3f} vs {baseline.name} {gb:.3f}/s, "
              f"slo deficit {slo_deficit(ev.results, baseline.results, tc.slo_tolerance):.3f} ({ev.seconds:.0f}s)")
        if run is not None:
            run.log({"eval/comparison": wandb_table(rows, ev.timesteps), "global_step": ev.timesteps})

    validation = ValidationCallback(
        suite, baseline.results, eval_freq=tc.eval_freq, best_dir=out_dir / "best",
        slo_tolerance=tc.slo_tolerance, on_evaluation=on_evaluation,
    )
    obs_range = ObservationRangeCallback()
    callbacks: list[Any] = [EpisodeMetricsCallback(), obs_range, validation]
    if run is not None:
        callbacks.insert(0, WandbCallback(run))
    if tc.checkpoint_freq > 0:
        callbacks.append(CheckpointCallback(
            save_freq=max(tc.checkpoint_freq // n_envs, 1),
            save_path=str(out_dir / "checkpoints"), name_prefix="model",
            save_vecnormalize=True,
        ))
    return validation, obs_range, callbacks


def _learn(
    model: Any,
    setup: _RunSetup,
    validation: ValidationCallback,
    obs_range: ObservationRangeCallback,
    callbacks: list[Any],
) -> int:
    """Learn ``train.total_timesteps`` steps (after a critic warm-up on a warm start), then
    evaluate the final model, a candidate too. Returns the steps learnt."""
    from stable_baselines3.common.callbacks import CallbackList

    tc, warm = setup.tc, setup.warm
    if tc.eval_on_start:
        validation.init_callback(model)
        validation.evaluate()
    remaining = tc.total_timesteps
    warmup = min(tc.critic_warmup_steps, tc.total_timesteps - 1) if warm is not None else 0
    if warmup > 0:
        from batchpilot.policies import warm_start as ws_mod

        # Critic warm-up: the loaded actor frozen, the fresh critic fitted to this env.
        t0 = time.perf_counter()
        ws_mod.set_actor_trainable(model, False)
        model.learn(total_timesteps=warmup, callback=CallbackList([EpisodeMetricsCallback(), obs_range]),
                    progress_bar=False)
        ws_mod.set_actor_trainable(model, True)
        remaining -= warmup
        print(f"[train] critic warm-up: {model.num_timesteps} steps, actor frozen ({time.perf_counter() - t0:.0f}s)")
    model.learn(total_timesteps=remaining, callback=CallbackList(callbacks),
                progress_bar=tc.progress_bar, reset_num_timesteps=warmup == 0)
    final_steps = model.num_timesteps
    validation.evaluate()  # the final model is a candidate too
    return final_steps


def _select_model(
    model: Any, venv: Any, validation: ValidationCallback, setup: _RunSetup
) -> tuple[Path, Evaluation]:
    """The folder and evaluation of the model to export: the best evaluation's (``best/``), or
    with ``train.export_select=final`` the last model, saved under ``final/`` first."""
    best = validation.best
    assert best is not None
    out_dir = setup.out_dir
    if setup.tc.export_select == "final":
        (out_dir / "final").mkdir(parents=True, exist_ok=True)
        model.save(out_dir / "final" / "model.zip")
        venv.save(str(out_dir / "final" / "vecnormalize.pkl"))
        return out_dir / "final", validation.history[-1]
    return out_dir / "best", best


def _export_chosen(
    setup: _RunSetup,
    chosen_dir: Path,
    chosen: Evaluation,
    suite: ValidationSuite,
    obs_range: ObservationRangeCallback,
    *,
    final_steps: int,
    train_s: float,
) -> tuple[Any, Any, Path]:
    """Export the chosen model, reloaded from disk (what is exported is what was saved), with
    the guards a gateway needs; ``policy_guards.json`` goes beside the checkpoints too, so
    ``scripts/export.py`` of any checkpoint records them. Returns the reloaded model, its
    VecNormalize (None without observation normalisation) and the policy folder."""
    from batchpilot.policies import warm_start as ws_mod
    from batchpilot.policies.export import export_policy, load_sb3

    tc, plain, out_dir, warm = setup.tc, setup.plain, setup.out_dir, setup.warm
    best_model, best_vecnorm = load_sb3(chosen_dir / "model.zip",
                                        chosen_dir / "vecnormalize.pkl" if tc.norm_obs else None)
    any_env = next(iter(suite.envs.values()))
    seen = obs_range.as_dict()
    guards = {"controller": controller_record(any_env),
              "observation_range": ws_mod.merge_observation_range(warm, seen) if warm is not None else seen}
    (out_dir / "policy_guards.json").write_text(json.dumps(guards) + "\n")
    train_config = {
        **setup.config_dict,
        "observation_scales": observation_scales(plain, any_env),
        **guards,
        "best_timesteps": chosen.timesteps,
        "export_select": tc.export_select,
        "final_timesteps": final_steps,
        "train_seconds": train_s,
        **({"init_from": warm.record} if warm is not None else {}),
    }
    policy_dir = export_policy(
        best_model, best_vecnorm, out_dir / "policy",
        shield=OmegaConf.to_container(plain.shield),  # type: ignore[arg-type]
        slo=OmegaConf.to_container(plain.slo),  # type: ignore[arg-type]
        train_config=train_config,
    )
    return best_model, best_vecnorm, policy_dir


def _report(
    setup: _RunSetup,
    suite: ValidationSuite,
    baseline: _Baseline,
    best_model: Any,
    best_vecnorm: Any,
    chosen: Evaluation,
    validation: ValidationCallback,
    *,
    train_s: float,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The exported policy and the baseline on held-out seeds of the validation workloads (the
    best model was chosen on ``seeds``, so those scores are optimistic): printed, and written
    to ``comparison.json``. Returns the summary and the held-out comparison rows."""
    tc, warm = setup.tc, setup.warm
    test_seeds = [int(s) for s in tc.validation.get("test_seeds") or []] or list(suite.seeds)
    test_baseline = suite.run_controller(baseline.factory(), seeds=test_seeds)
    test_policy = suite.run_policy(best_model, best_vecnorm, seeds=test_seeds)
    rows = comparison_rows(test_policy, test_baseline, baseline.name)
    deficit = slo_deficit(test_policy, test_baseline, tc.slo_tolerance)
    goodput = mean_over_workloads(test_policy, "request_goodput")
    base_goodput = mean_over_workloads(test_baseline, "request_goodput")
    title = (f"exported policy ({tc.export_select}, step {chosen.timesteps}) vs {baseline.name} on the validation workloads, "
             f"seeds {test_seeds} - trained {tc.total_timesteps} steps in {train_s / 60:.1f} min")
    md = print_comparison(rows, title)
    print(f"[train] on the selection seeds {list(suite.seeds)}: goodput ppo "
          f"{mean_over_workloads(chosen.results, 'request_goodput'):.3f} vs {baseline.name} "
          f"{mean_over_workloads(baseline.results, 'request_goodput'):.3f}/s")
    summary = {
        "best_timesteps": chosen.timesteps,
        "export_select": tc.export_select,
        "init_from": warm.record if warm is not None else None,
        "test_seeds": test_seeds,
        "mean_request_goodput": goodput,
        "baseline_mean_request_goodput": base_goodput,
        "slo_deficit": deficit,
        "beats_baseline": bool(deficit <= 0 and goodput > base_goodput),
        "train_seconds": train_s,
        "rows": rows,
        "markdown": md,
        "selection_rows": comparison_rows(chosen.results, baseline.results, baseline.name),
        "evaluations": [
            {"timesteps": e.timesteps, "mean_request_goodput": mean_over_workloads(e.results, "request_goodput"),
             "slo_deficit": slo_deficit(e.results, baseline.results, tc.slo_tolerance)}
            for e in validation.history
        ],
    }
    (setup.out_dir / "comparison.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    return summary, rows


def _log_final_to_wandb(
    run: Any, lc: LoggerConfig, summary: dict[str, Any], rows: list[dict[str, Any]], timesteps: int, policy_dir: Path
) -> None:
    """The summary (less its tables), the held-out comparison table and, with
    ``logger.log_policy_artifact``, the exported policy folder as a W&B model artifact."""
    run.summary.update({k: v for k, v in summary.items()
                        if k not in ("rows", "selection_rows", "markdown", "evaluations")})
    run.log({"final/comparison": wandb_table(rows, timesteps)})
    if lc.log_policy_artifact:
        import wandb

        art = wandb.Artifact(f"policy-{run.id}", type="model",
                             metadata={k: summary[k] for k in ("best_timesteps", "mean_request_goodput", "slo_deficit")})
        art.add_dir(str(policy_dir))
        run.log_artifact(art)
