"""Evaluate controllers on workloads: ``python scripts/evaluate.py policies=[pid,best_static]
workloads=[bursty,azure_conv] out_dir=DIR`` (see conf/evaluate.yaml)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from batchpilot.policies.evaluation import evaluate


@hydra.main(config_path="../conf", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    evaluate(cfg)


if __name__ == "__main__":
    main()
