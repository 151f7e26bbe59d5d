"""``KVPrecisionEnv``: the KV-precision knob on its own, slow timescale.

One step is one epoch (``kv.epoch_s`` of engine time) of a ``ServingEnv`` episode in which a
fast controller (the shipped batch policy, injected by the caller) sets the cap and the order
every interval, as it does in front of vLLM. The agent picks the KV precision once per epoch;
its choice is the KV part of the fast controller's first proposal of the epoch and goes through
the same shield (runnable, dwell, memory, gain). The reward is the epoch's goodput relative to
its arrivals (SLO-meeting finishes / arrivals, at most 2), minus the model's 8-bit quality cost
for the share of the epoch on 8-bit, judged over a horizon a restart fits into (``kv.gamma``
per epoch; at 0.97 per 1 s interval no restart of 35-600 s can pay, docs/training.md). Not the
fast env's shaped reward: it barely charges an engine that is down (nothing finishes, so
nothing misses the SLO), and a 600 s DeepSeek-V3 restart *raised* its epoch mean from 0.076 to
0.163 while goodput fell (measured on the training distribution).

The first epoch of an episode runs at the engine's starting dtype before the agent is asked
(it has seen nothing yet), as in production, where the agent's first decision comes one epoch
after start-up.

``paired=True`` (training) also runs the same episode (same seed, same fast controller) without
any KV switch and pays the difference: the switch's own effect, with the workload's variation
taken out. The never-switch episode does not depend on the agent's actions, so the best policy
is the same; only the noise goes (unpaired, 6,144 epochs of PPO left the actor at its prior).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import gymnasium as gym
import numpy as np
from omegaconf import DictConfig

from batchpilot.core.controller import Controller
from batchpilot.core.engine import KV_DTYPES_8BIT
from batchpilot.core.kv_epoch import KV_FEATURE_NAMES, KVEpoch, kv_target
from batchpilot.envs.serving_env import ServingEnv

#: Builds the fast controller for an episode's engine (called after each ``ServingEnv.reset``).
FastFactory = Callable[[ServingEnv], Controller]


class _Branch:
    """One ``ServingEnv`` episode with its fast controller and the current epoch's summary."""

    def __init__(self, cfg: DictConfig, make_fast: FastFactory, epoch_s: float) -> None:
        self.env = ServingEnv(cfg=cfg)
        self.make_fast = make_fast
        self.epoch = KVEpoch(epoch_s)
        self.fast: Controller | None = None

    def reset(self, seed: int) -> None:
        self.env.reset(seed=seed)
        self.fast = self.make_fast(self.env)
        self.fast.reset(self.env.knobs)

    def run_epoch(self, want: str | None) -> tuple[float, dict[str, Any]]:
        """Intervals until the epoch is complete or the episode ends. Returns the epoch's reward
        (goodput / arrivals, at most 2, minus the 8-bit quality cost for its share on 8-bit)."""
        env, fast = self.env, self.fast
        assert fast is not None, "reset() first"
        self.epoch.clear(env.engine.now)
        n = on_8bit = 0
        first = True
        info: dict[str, Any] = {}
        while True:
            proposal = fast.decide(env.snapshot, env.knobs)
            kv = want if first else None
            proposal = dataclasses.replace(proposal, kv_dtype=kv)
            if kv is not None:
                info["kv_proposed"] = kv
            first = False
            _, _, term, trunc, step_info = env.step_proposal(proposal)
            n += 1
            on_8bit += int(env.knobs.kv_dtype in KV_DTYPES_8BIT)
            refused = {k: v for k, v in step_info["shield"].items() if k.startswith("dtype_")}
            if refused:
                info.setdefault("kv_refused", refused)
            done_epoch = self.epoch.add(env.snapshot)
            if term or trunc:
                info.update(terminated=term, truncated=trunc, episode_metrics=step_info.get("episode_metrics"))
                break
            if done_epoch:
                break
        info["kv_dtype"] = env.knobs.kv_dtype
        quality = env.reward_cfg.quality_cost_8bit * on_8bit / max(n, 1)
        return min(self.epoch.served_per_arrival, 2.0) - quality, info


class KVPrecisionEnv(gym.Env):
    """See the module docstring."""

    metadata = {"render_modes": []}

    def __init__(self, cfg: DictConfig, make_fast: FastFactory, *, epoch_s: float = 60.0,
                 paired: bool = False) -> None:
        self.branch = _Branch(cfg, make_fast, epoch_s)
        self.inner = self.branch.env
        if self.inner.interval_s > epoch_s:
            raise ValueError(f"kv epoch_s ({epoch_s}) is shorter than one control interval ({self.inner.interval_s})")
        #: The same episode without switches, whose reward is subtracted (``paired``).
        self.never = _Branch(cfg, make_fast, epoch_s) if paired else None
        self.observation_space = gym.spaces.Box(low=0.0, high=2.0, shape=(len(KV_FEATURE_NAMES),), dtype=np.float32)
        self.action_space = gym.spaces.MultiDiscrete([2])
        self._started = False

    @property
    def epoch(self) -> KVEpoch:
        return self.branch.epoch

    @property
    def restart_s(self) -> float:
        return float(self.inner.shield_cfg.dtype_restart_s)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        # One explicit seed per episode, so the paired episode draws the same deployment and load.
        episode_seed = int(self.np_random.integers(2**31 - 1)) if seed is None else int(seed)
        self._started = True
        reward, info = self._epoch(None, reset_seed=episode_seed)
        return self.epoch.observation(self.restart_s), {**info, "epoch_reward": reward}

    def step(self, action):
        if not self._started:
            raise RuntimeError("call reset() before step()")
        a = int(np.asarray(action).reshape(-1)[0])
        want = kv_target(a, self.inner.knobs.kv_dtype, kv16_dtype=self.inner.kv16_dtype,
                         kv8_dtype=self.inner.kv8_dtype)
        reward, info = self._epoch(want)
        obs = self.epoch.observation(self.restart_s)
        return obs, reward, bool(info.get("terminated")), bool(info.get("truncated")), info

    def _epoch(self, want: str | None, reset_seed: int | None = None) -> tuple[float, dict[str, Any]]:
        branches = [self.branch] + ([self.never] if self.never is not None else [])
        if reset_seed is not None:
            for b in branches:
                b.reset(reset_seed)
        reward, info = self.branch.run_epoch(want)
        if self.never is not None:
            base, _ = self.never.run_epoch(None)
            info["unpaired_reward"] = reward
            reward -= base
        return reward, info

    def close(self) -> None:
        self.inner.close()
        if self.never is not None:
            self.never.env.close()
