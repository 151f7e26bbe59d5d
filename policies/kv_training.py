"""Train the KV-precision agent (``scripts/train_kv.py``, ``conf/train_kv.yaml``).

The environment is ``KVPrecisionEnv``: each step is one epoch of a randomised ``ServingEnv``
episode on a drawn deployment, with the shipped batch policy as the fast controller, so the
agent learns on top of what serves. Two ways to learn (``kv.method``):

* ``ppo``: stable-baselines3 PPO on the slow env (rare informative states: it stayed at "keep");
* ``counterfactual`` (default): the simulator is deterministic and its state can be copied, so
  at sampled decision points the episode is run on both ways for ``kv.horizon_epochs`` (switch
  now, or keep) and the actor is fitted to the better one, weighted by how much better: full
  information instead of one noisy return per choice.

The agent is exported like the batch policy (same artifact format and runtime, its own features
and a two-valued action) and checked on held-out seeds against the two fixed choices, never
switching and switching at the first decision, per deployment.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import multiprocessing
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from omegaconf import DictConfig, OmegaConf

from batchpilot.core.controller import Controller
from batchpilot.core.kv_epoch import KV_FEATURE_NAMES, kv_target
from batchpilot.envs.kv_env import KVPrecisionEnv
from batchpilot.envs.serving_env import ServingEnv
from batchpilot.policies.kv_agent import KV_AGENT_SUBDIR
from batchpilot.policies.ppo_controller import PPOController
from batchpilot.policies.training import run_output_dir, sb3_logger, start_wandb
from batchpilot.schemas.train import LoggerConfig


def fast_controller(fast_path: str | None, env: ServingEnv) -> Controller:
    """The batch policy for an episode's engine (no KV agent: the agent being trained decides)."""
    caps = env.engine.capabilities()
    return PPOController.from_dir(
        fast_path, max_num_seqs=caps.max_num_seqs, max_model_len=caps.max_model_len,
        kv_runnable={d: caps.can_run(d) for d in caps.kv_dtypes}, kv_agent=False, slo=env.slo,
    )


def episode_cfg(cfg: DictConfig, deployments: list[str]) -> DictConfig:
    """The ``ServingEnv`` config of one training or validation episode."""
    kv = cfg.kv
    episode_s = float(kv.epoch_s) * (int(kv.episode_epochs) + 1)
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    plain.env.episode_s = episode_s
    plain.workload.duration_s = episode_s
    plain.env.deployments = list(deployments)
    return plain


def make_kv_env(cfg: DictConfig, deployments: list[str], *, paired: bool = False) -> Callable[[], KVPrecisionEnv]:
    """A picklable constructor (``SubprocVecEnv`` workers)."""
    plain = episode_cfg(cfg, deployments)
    fast = functools.partial(fast_controller, cfg.kv.fast_policy)
    return functools.partial(KVPrecisionEnv, plain, fast, epoch_s=float(cfg.kv.epoch_s), paired=paired)


def run_fixed(env: KVPrecisionEnv, seed: int, choose: Callable[[np.ndarray], int]) -> dict[str, float]:
    """One episode with ``choose(obs) -> action``: its mean epoch reward and episode metrics."""
    obs, _ = env.reset(seed=seed)
    rewards, switched = [], 0
    while True:
        obs, r, term, trunc, info = env.step([choose(obs)])
        rewards.append(r)
        switched += int("kv_proposed" in info)
        if term or trunc:
            break
    m = dict(info.get("episode_metrics") or {})
    return {"reward": float(np.mean(rewards)), "request_goodput": float(m.get("request_goodput", 0.0)),
            "slo_attainment": float(m.get("slo_attainment", 0.0)), "dtype_switches": float(m.get("dtype_switches", 0.0)),
            "proposals": float(switched)}


def compare(cfg: DictConfig, model: Any, vecnorm: Any, seeds: list[int]) -> list[dict[str, Any]]:
    """Agent vs never switching vs 8-bit at once, per deployment, on held-out seeds."""
    rows = []
    for dep in list(cfg.kv.deployments) + list(cfg.kv.held_out_deployments):
        env = make_kv_env(cfg, [dep])()
        try:
            def agent(obs: np.ndarray) -> int:
                a, _ = model.predict(vecnorm.normalize_obs(obs[None]), deterministic=True)
                return int(np.asarray(a).reshape(-1)[0])

            for name, choose in (("never", lambda o: 0), ("8bit_at_once", lambda o: int(o[8] < 0.5)), ("agent", agent)):
                runs = [run_fixed(env, s, choose) for s in seeds]
                row = {"deployment": dep, "held_out": dep in cfg.kv.held_out_deployments, "controller": name}
                row.update({k: float(np.mean([r[k] for r in runs])) for k in runs[0]})
                rows.append(row)
        finally:
            env.close()
    return rows


def decision_points(rng: np.random.Generator, episode_epochs: int, horizon: int, n: int) -> set[int]:
    """The epochs of one episode whose switch-or-keep choice is labelled: the first always (a
    switch gains most right after start-up, and a gateway's agent decides there first), the rest
    drawn from those whose whole ``horizon`` fits before the episode ends. A later point would
    see a restart's cost but only part of its pay-back, and teach "keep" where a served engine,
    whose horizon never ends, should switch."""
    last = episode_epochs - horizon
    if last < 0:
        raise ValueError(f"kv.episode_epochs ({episode_epochs}) is shorter than kv.horizon_epochs ({horizon})")
    if not 1 <= n <= last + 1:
        raise ValueError(f"kv.samples_per_episode ({n}) must be 1..{last + 1}: the epochs whose "
                         f"{horizon}-epoch horizon fits in an episode of {episode_epochs}")
    rest = rng.choice(np.arange(1, last + 1), size=n - 1, replace=False) if n > 1 else []
    return {0, *(int(k) for k in rest)}


def counterfactual_samples(cfg: DictConfig, seed: int, n_episodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(observations, advantages of switching now over keeping, discounted over the horizon).

    Episodes follow "keep", switching at random with ``kv.explore_switch`` per epoch so 8-bit
    states are sampled too; ``kv.samples_per_episode`` decision points per episode are labelled
    (``decision_points``).
    """
    import copy

    kv = cfg.kv
    env = make_kv_env(cfg, list(kv.deployments))()
    rng = np.random.default_rng(seed)
    gamma, horizon = float(kv.gamma), int(kv.horizon_epochs)
    xs, advs = [], []
    try:
        for _ in range(n_episodes):
            obs, _ = env.reset(seed=int(rng.integers(2**31 - 1)))
            picks = decision_points(rng, int(kv.episode_epochs), horizon, int(kv.samples_per_episode))
            k = 0
            while True:
                if k in picks:
                    branch = env.branch
                    want = kv_target(1, branch.env.knobs.kv_dtype, kv16_dtype=branch.env.kv16_dtype,
                                     kv8_dtype=branch.env.kv8_dtype)
                    values = []
                    for first in (want, None):
                        b = copy.deepcopy(branch)
                        ret = 0.0
                        for i in range(horizon):
                            r, info = b.run_epoch(first if i == 0 else None)
                            ret += gamma**i * r
                            if info.get("terminated") or info.get("truncated"):
                                break
                        b.env.close()
                        values.append(ret)
                    xs.append(obs)
                    advs.append(values[0] - values[1])
                a = int(rng.random() < float(kv.explore_switch))
                obs, _, term, trunc, _ = env.step([a])
                k += 1
                if term or trunc:
                    break
    finally:
        env.close()
    return np.asarray(xs, dtype=np.float32), np.asarray(advs, dtype=np.float64)


def fit_counterfactual(model: Any, vecnorm: Any, x: np.ndarray, adv: np.ndarray, *, epochs: int, lr: float,
                       margin: float) -> dict[str, float]:
    """Fit the actor to the better choice per sample (cross-entropy weighted by |advantage|);
    observation normalisation from the samples. Switching is the label only where it beats
    keeping by more than ``margin``."""
    import torch

    vecnorm.obs_rms.mean = x.mean(axis=0).astype(np.float64)
    vecnorm.obs_rms.var = x.var(axis=0).astype(np.float64)
    vecnorm.obs_rms.count = float(len(x))
    xn = torch.as_tensor(vecnorm.normalize_obs(x), dtype=torch.float32)
    y = torch.as_tensor((adv > margin).astype(np.int64))
    w = torch.as_tensor(np.clip(np.abs(adv), 0.01, None), dtype=torch.float32)
    w = w / w.mean()
    policy = model.policy
    params = list(policy.mlp_extractor.policy_net.parameters()) + list(policy.action_net.parameters())
    opt = torch.optim.Adam(params, lr=lr)

    def actor_logits() -> Any:
        return policy.action_net(policy.mlp_extractor.forward_actor(policy.pi_features_extractor(xn)))

    for _ in range(epochs):
        logits = actor_logits()
        loss = (torch.nn.functional.cross_entropy(logits, y, reduction="none") * w).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pred = actor_logits().argmax(dim=1)
    regret = float(np.sum(np.where(pred.numpy() == y.numpy(), 0.0, np.abs(adv))) / len(adv))
    return {"samples": float(len(adv)), "switch_labels": float(y.sum()), "train_accuracy": float((pred == y).float().mean()),
            "mean_regret": regret, "loss": float(loss.item())}


def print_rows(rows: list[dict[str, Any]]) -> str:
    head = "| deployment | controller | mean epoch reward | request_goodput | slo_attainment | KV switches | proposals |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        dep = r["deployment"] + (" (held out)" if r["held_out"] else "")
        lines.append(f"| {dep} | {r['controller']} | {r['reward']:.3f} | {r['request_goodput']:.3f} | "
                     f"{r['slo_attainment']:.3f} | {r['dtype_switches']:.1f} | {r['proposals']:.1f} |")
    md = "\n".join(lines)
    print(md)
    return md


class KVConfigError(ValueError):
    """The ``kv`` settings cannot run; found before any worker starts (``scripts/train_kv.py``
    prints it in one line)."""


def check_kv_config(kv: DictConfig) -> None:
    """What the run reads of ``kv``, checked before it trains: a value that used to fail only
    at the end (no test seeds: after the whole run) or deep in a worker (fewer counterfactual
    episodes than workers: an ``IndexError`` in torch)."""
    if kv.method not in ("counterfactual", "ppo"):
        raise KVConfigError(f"kv.method must be counterfactual or ppo, got {kv.method!r}")
    for key in ("n_envs", "episode_epochs", "total_timesteps", "samples_per_episode", "horizon_epochs"):
        if int(kv[key]) < 1:
            raise KVConfigError(f"kv.{key} must be >= 1, got {kv[key]}")
    if not (math.isfinite(float(kv.epoch_s)) and float(kv.epoch_s) > 0):
        raise KVConfigError(f"kv.epoch_s must be a finite number of engine seconds > 0, got {kv.epoch_s}")
    if not list(kv.test_seeds):
        raise KVConfigError("kv.test_seeds is empty: the agent is compared with never / at-once switching on them")
    if not list(kv.deployments):
        raise KVConfigError("kv.deployments is empty: list the model/hardware pairs episodes draw from")
    if kv.method == "counterfactual" and int(kv.counterfactual_episodes) < int(kv.n_envs):
        raise KVConfigError(f"kv.counterfactual_episodes={kv.counterfactual_episodes} is split over kv.n_envs="
                            f"{kv.n_envs} processes: it must be at least that many")


def _kv_vec_env(cfg: DictConfig, seed: int) -> Any:
    """The training envs, monitored and normalised (observations and rewards): ``kv.n_envs``
    forked workers for PPO; one env for the counterfactual fit, which needs only its spaces."""
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecMonitor, VecNormalize

    kv = cfg.kv
    n_workers = int(kv.n_envs) if kv.method == "ppo" else 1  # counterfactual: the env only gives the spaces
    fns = [make_kv_env(cfg, list(kv.deployments), paired=bool(kv.paired)) for _ in range(n_workers)]
    venv = SubprocVecEnv(fns, start_method="fork") if len(fns) > 1 else DummyVecEnv(fns)
    venv.seed(seed)
    return VecNormalize(VecMonitor(venv), norm_obs=True, norm_reward=True, clip_obs=10.0, gamma=float(kv.gamma))


def _kv_model(kv: DictConfig, venv: Any, seed: int) -> Any:
    """The agent: an SB3 PPO actor-critic (tanh MLP of ``kv.net_arch``, on the CPU), whichever
    method trains it, so it exports in the batch policy's artifact format."""
    import torch
    from stable_baselines3 import PPO

    return PPO(
        "MlpPolicy", venv, learning_rate=float(kv.learning_rate), n_steps=int(kv.n_steps),
        batch_size=int(kv.batch_size), n_epochs=int(kv.n_epochs), gamma=float(kv.gamma),
        gae_lambda=float(kv.gae_lambda), ent_coef=float(kv.ent_coef), seed=seed, device="cpu",
        policy_kwargs={"net_arch": {"pi": list(kv.net_arch), "vf": list(kv.net_arch)},
                       "activation_fn": torch.nn.Tanh},
    )


def _fit_from_counterfactuals(cfg: DictConfig, seed: int, model: Any, venv: Any, out_dir: Path) -> dict[str, float]:
    """``kv.method=counterfactual``: draw the samples in ``kv.n_envs`` forked processes (saved to
    ``kv_samples.npz``), then fit the actor to them; returns the fit's figures."""
    kv = cfg.kv
    n_eps = int(kv.counterfactual_episodes)
    with concurrent.futures.ProcessPoolExecutor(max_workers=int(kv.n_envs),
                                                mp_context=multiprocessing.get_context("fork")) as pool:
        plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # picklable
        parts = list(pool.map(functools.partial(counterfactual_samples, plain),
                              [seed * 1000 + i for i in range(int(kv.n_envs))],
                              [n_eps // int(kv.n_envs)] * int(kv.n_envs)))
    x = np.concatenate([p[0] for p in parts])
    adv = np.concatenate([p[1] for p in parts])
    np.savez(out_dir / "kv_samples.npz", obs=x, advantage=adv)
    fit = fit_counterfactual(model, venv, x, adv, epochs=int(kv.fit_epochs), lr=float(kv.fit_lr),
                             margin=float(kv.switch_margin))
    print(f"[train_kv] counterfactual fit: {fit}")
    return fit


def _learn_kv(cfg: DictConfig, seed: int, model: Any, venv: Any, out_dir: Path, lc: LoggerConfig) -> dict[str, float]:
    """Train ``model`` by ``kv.method``; returns the counterfactual fit's figures (empty for PPO)."""
    import torch

    kv = cfg.kv
    if kv.method == "counterfactual":
        return _fit_from_counterfactuals(cfg, seed, model, venv, out_dir)
    if kv.method == "ppo":
        # A fresh agent leans to "keep" (16-bit, as every engine starts): exploration tries a
        # switch now and then instead of flapping at random.
        with torch.no_grad():
            model.policy.action_net.bias[0] += float(kv.keep_prior_logit)
        model.set_logger(sb3_logger(out_dir, lc, verbose=False))
        model.learn(total_timesteps=int(kv.total_timesteps), progress_bar=bool(kv.progress_bar))
        return {}
    raise ValueError(f"kv.method must be counterfactual or ppo, got {kv.method!r}")


def _export_and_compare(cfg: DictConfig, model: Any, venv: Any, out_dir: Path, config_dict: dict[str, Any],
                        train_s: float, fit: dict[str, float]) -> tuple[Path, float]:
    """Export the agent to ``<run>/kv_agent``, compare it with the fixed choices on
    ``kv.test_seeds`` and write ``kv_comparison.json``. Returns (policy dir, the agent's margin
    over the better fixed choice, averaged over the deployments)."""
    from batchpilot.policies.export import export_policy

    kv = cfg.kv
    venv.training = False
    venv.norm_reward = False
    policy_dir = export_policy(
        model, venv, out_dir / KV_AGENT_SUBDIR, features=KV_FEATURE_NAMES,
        shield=OmegaConf.to_container(cfg.shield, resolve=True),  # type: ignore[arg-type]
        slo=OmegaConf.to_container(cfg.slo, resolve=True),  # type: ignore[arg-type]
        train_config={**config_dict, "train_seconds": train_s},
    )
    seeds = [int(s) for s in kv.test_seeds]
    rows = compare(cfg, model, venv, seeds)
    md = print_rows(rows)
    by = {(r["deployment"], r["controller"]): r["reward"] for r in rows}
    deps = sorted({r["deployment"] for r in rows})
    margin = float(np.mean([by[(d, "agent")] - max(by[(d, "never")], by[(d, "8bit_at_once")]) for d in deps]))
    summary = {"rows": rows, "markdown": md, "test_seeds": seeds, "train_seconds": train_s,
               "agent_minus_best_fixed": margin, "method": str(kv.method), "fit": fit}
    (out_dir / "kv_comparison.json").write_text(json.dumps(summary, indent=2) + "\n")
    return policy_dir, margin


def train_kv(cfg: DictConfig) -> float:
    """Train, export to ``<run>/kv_agent``, compare on held-out seeds; returns the agent's mean
    epoch reward minus the better fixed choice's, over the comparison (what a sweep maximises)."""
    import torch
    from stable_baselines3.common.utils import set_random_seed

    t0 = time.perf_counter()
    check_kv_config(cfg.kv)
    seed = int(cfg.seed)
    out_dir = run_output_dir()
    lc = LoggerConfig.from_cfg(cfg.logger)
    torch.set_num_threads(1)
    set_random_seed(seed)
    venv = _kv_vec_env(cfg, seed)
    config_dict: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    run = start_wandb(lc, config_dict, out_dir)
    try:
        model = _kv_model(cfg.kv, venv, seed)
        fit = _learn_kv(cfg, seed, model, venv, out_dir, lc)
        train_s = time.perf_counter() - t0
        policy_dir, margin = _export_and_compare(cfg, model, venv, out_dir, config_dict, train_s, fit)
        print(f"[train_kv] agent exported to {policy_dir}; {time.perf_counter() - t0:.0f}s total")
        if run is not None:
            run.summary.update({"agent_minus_best_fixed": margin, "train_seconds": train_s})
        return margin
    finally:
        venv.close()
        if run is not None:
            run.finish()
