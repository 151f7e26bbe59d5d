"""Train the KV-precision agent: ``python scripts/train_kv.py [overrides]`` (docs/training.md).

Example: ``kv.total_timesteps=2048 logger=none``. The exported agent lands in
``<run>/kv_agent``; copy it into a policy folder (``policies/pretrained/kv_agent``) to ship it
with that batch policy.
"""

import sys

import hydra
from omegaconf import DictConfig

import batchpilot.schemas  # noqa: F401  (stores the config schemas before Hydra composes)
from batchpilot.policies.kv_training import KVConfigError, train_kv


@hydra.main(config_path="../conf", config_name="train_kv", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        return train_kv(cfg)
    except KVConfigError as e:  # a configuration problem: one line, no traceback
        print(f"train_kv: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
