"""Train a PPO policy: ``python scripts/train.py [overrides]`` (see docs/training.md).

Examples: ``train.total_timesteps=20000 logger=none``; a sweep:
``python scripts/train.py -m seed=0,1,2 train.learning_rate=1e-4,3e-4``; the same sweep on Ray:
``python scripts/train.py -m hydra/launcher=ray seed=0,1,2`` (docs/scaling.md).
"""

import sys

import hydra
from omegaconf import DictConfig

import batchpilot.schemas  # noqa: F401  (stores the config schemas before Hydra composes)
from batchpilot.cluster import ClusterUnavailable, require_ray
from batchpilot.policies.training import TrainConfigError, train


def check_launcher(argv: list[str]) -> None:
    """``hydra/launcher=ray`` without Ray installed: one line naming the fix, before Hydra
    starts (inside Hydra it would surface as a traceback from the launcher)."""
    if "hydra/launcher=ray" in argv:
        try:
            require_ray("hydra/launcher=ray")
        except ClusterUnavailable as e:
            print(f"train: error: {e}", file=sys.stderr)
            sys.exit(2)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        return train(cfg)
    except TrainConfigError as e:  # a configuration problem: one line, no traceback
        print(f"train: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    check_launcher(sys.argv[1:])
    main()
