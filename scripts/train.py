"""Train a PPO policy: ``python scripts/train.py [overrides]`` (see docs/training.md).

Examples: ``train.total_timesteps=20000 logger=none``; a sweep:
``python scripts/train.py -m seed=0,1,2 train.learning_rate=1e-4,3e-4``.
"""

import hydra
from omegaconf import DictConfig

from batchpilot.policies.training import train


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    return train(cfg)


if __name__ == "__main__":
    main()
