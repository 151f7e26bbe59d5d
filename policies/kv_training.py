"""Train the KV-precision agent (``scripts/train_kv.py``, ``conf/train_kv.yaml``).

PPO (stable-baselines3) on ``KVPrecisionEnv``: each step is one epoch of a randomised
``ServingEnv`` episode on a drawn deployment, with the shipped batch policy as the fast
controller, so the agent learns on top of what serves. The agent is exported like the batch
policy (same artifact format and runtime, its own features and a two-valued action) and
checked on held-out seeds against the two fixed choices, never switching and switching to
8-bit at the first decision, per deployment.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Callable

import numpy as np
from omegaconf import DictConfig, OmegaConf

from batchpilot.core.controller import Controller
from batchpilot.core.kv_epoch import KV_FEATURE_NAMES
from batchpilot.envs.kv_env import KVPrecisionEnv
from batchpilot.envs.serving_env import ServingEnv
from batchpilot.policies.kv_agent import KV_AGENT_SUBDIR
from batchpilot.policies.ppo_controller import PPOController
from batchpilot.policies.training import run_output_dir, sb3_logger, start_wandb
from batchpilot.schemas import LoggerConfig


def fast_controller(fast_path: str | None, env: ServingEnv) -> Controller:
    """The batch policy for an episode's engine (no KV agent: the agent being trained decides)."""
    caps = env.engine.capabilities()
    return PPOController.from_dir(
        fast_path, max_num_seqs=caps.max_num_seqs, max_model_len=caps.max_model_len,
        kv_runnable={d: caps.can_run(d) for d in caps.kv_dtypes}, kv_agent=False,
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


def train_kv(cfg: DictConfig) -> float:
    """Train, export to ``<run>/kv_agent``, compare on held-out seeds; returns the agent's mean
    epoch reward minus the better fixed choice's, over the comparison (what a sweep maximises)."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.utils import set_random_seed
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecMonitor, VecNormalize

    from batchpilot.policies.export import export_policy

    t0 = time.perf_counter()
    kv = cfg.kv
    seed = int(cfg.seed)
    out_dir = run_output_dir()
    lc = LoggerConfig.from_cfg(cfg.logger)
    torch.set_num_threads(1)
    set_random_seed(seed)
    fns = [make_kv_env(cfg, list(kv.deployments), paired=bool(kv.paired)) for _ in range(int(kv.n_envs))]
    venv = SubprocVecEnv(fns, start_method="fork") if len(fns) > 1 else DummyVecEnv(fns)
    venv.seed(seed)
    venv = VecNormalize(VecMonitor(venv), norm_obs=True, norm_reward=True, clip_obs=10.0, gamma=float(kv.gamma))
    config_dict: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    run = start_wandb(lc, config_dict, out_dir)
    try:
        model = PPO(
            "MlpPolicy", venv, learning_rate=float(kv.learning_rate), n_steps=int(kv.n_steps),
            batch_size=int(kv.batch_size), n_epochs=int(kv.n_epochs), gamma=float(kv.gamma),
            gae_lambda=float(kv.gae_lambda), ent_coef=float(kv.ent_coef), seed=seed, device="cpu",
            policy_kwargs={"net_arch": {"pi": list(kv.net_arch), "vf": list(kv.net_arch)},
                           "activation_fn": torch.nn.Tanh},
        )
        # A fresh agent leans to "keep" (16-bit, as every engine starts): exploration tries a
        # switch now and then instead of flapping at random.
        with torch.no_grad():
            model.policy.action_net.bias[0] += float(kv.keep_prior_logit)
        model.set_logger(sb3_logger(out_dir, lc, verbose=False))
        model.learn(total_timesteps=int(kv.total_timesteps), progress_bar=bool(kv.progress_bar))
        train_s = time.perf_counter() - t0
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
                   "agent_minus_best_fixed": margin}
        (out_dir / "kv_comparison.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"[train_kv] agent exported to {policy_dir}; {time.perf_counter() - t0:.0f}s total")
        if run is not None:
            run.summary.update({"agent_minus_best_fixed": margin, "train_seconds": train_s})
        return margin
    finally:
        venv.close()
        if run is not None:
            run.finish()

