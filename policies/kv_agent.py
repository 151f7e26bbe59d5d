"""``KVAgent``: the exported KV-precision policy, deciding once per epoch of engine time.

Trained by ``policies/kv_training.py`` on ``envs/kv_env.py`` and shipped beside the batch
policy (``<policy folder>/kv_agent``); ``PPOController`` runs it when the folder has one, so
evaluation and the gateway take the same decisions the agent was trained on: every control
interval adds the snapshot to the epoch's summary (``batchpilot.core.kv_epoch``), and when the
epoch is complete the agent proposes a KV precision, which the shield then judges (runnable,
dwell, memory, gain) like any other proposal.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from batchpilot.core.knobs import Knobs
from batchpilot.core.kv_epoch import KV_FEATURE_NAMES, KVEpoch, kv_target
from batchpilot.core.telemetry import Snapshot
from batchpilot.policies.artifact import PolicyLoadError
from batchpilot.policies.runtime import PolicyRuntime

#: Where a policy folder keeps its KV agent.
KV_AGENT_SUBDIR = "kv_agent"
KV_NVEC = (2,)


class KVAgent:
    """The KV agent for one stream of decisions (one engine: an env, a gateway lane).

    ``restart_s`` is the engine's restart time for a switch (the shield's ``dtype_restart_s``):
    the agent weighs it, so it must be the deployment's, not the training's.
    """

    def __init__(self, runtime: PolicyRuntime, *, restart_s: float, kv16_dtype: str = "auto",
                 kv8_dtype: str = "fp8") -> None:
        self.runtime = runtime
        kv = runtime.manifest.get("training", {}).get("config", {}).get("kv") or {}
        try:
            epoch_s = float(kv["epoch_s"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PolicyLoadError(f"KV agent {runtime.artifact.path}: manifest lacks training.config.kv.epoch_s") from exc
        self.epoch = KVEpoch(epoch_s)
        self.restart_s = float(restart_s)
        self.kv16_dtype, self.kv8_dtype = kv16_dtype, kv8_dtype
        self.num_decisions = 0
        self.last_choice: str | None = None

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], **kwargs: Any) -> "KVAgent":
        """Load and verify an exported agent; raises ``PolicyLoadError`` saying what is wrong."""
        runtime = PolicyRuntime.from_dir(Path(path), expected_features=KV_FEATURE_NAMES, expected_nvec=KV_NVEC)
        return cls(runtime, **kwargs)

    def fresh(self) -> "KVAgent":
        """The same weights with its own epoch (another lane)."""
        return KVAgent(self.runtime, restart_s=self.restart_s, kv16_dtype=self.kv16_dtype, kv8_dtype=self.kv8_dtype)

    def reset(self) -> None:
        self.epoch.clear(None)

    def decide(self, snapshot: Snapshot, knobs: Knobs) -> str | None:
        """The KV dtype to propose this interval (None: keep; only at an epoch's end)."""
        if not self.epoch.add(snapshot):
            return None
        obs = self.epoch.observation(self.restart_s)
        self.epoch.clear(snapshot.time)
        self.num_decisions += 1
        want = kv_target(int(self.runtime.act(obs)[0]), knobs.kv_dtype,
                         kv16_dtype=self.kv16_dtype, kv8_dtype=self.kv8_dtype)
        self.last_choice = want
        return want
