"""Evaluate controllers on workloads: ``python scripts/evaluate.py policies=[pid,best_static]
workloads=[bursty,azure_conv] out_dir=DIR`` (see conf/evaluate.yaml and docs/evaluation.md); the
issue-15 matrix: ``python scripts/evaluate.py --config-name evaluate_matrix out_dir=DIR``."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

import batchpilot.schemas  # noqa: F401  (stores the config schemas before Hydra composes)
from batchpilot.evaluation.matrix import evaluate
from batchpilot.evaluation.plan import EvaluationError


@hydra.main(config_path="../conf", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        evaluate(cfg)
    except EvaluationError as e:  # a configuration problem: say it in one line, no traceback
        print(f"evaluate: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
