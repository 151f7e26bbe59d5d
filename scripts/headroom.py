"""Join evaluation runs into the headroom table: ``python scripts/headroom.py
runs=[DIR_A,DIR_B] labels=[base,refuse] columns=[pid_sf,pid_sf+refuse] out=FILE`` (conf/headroom.yaml)."""

from __future__ import annotations

import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from batchpilot.evaluation.headroom import HeadroomConfig, HeadroomError, write_headroom

ConfigStore.instance().store(group="schema", name="headroom", node=HeadroomConfig)


@hydra.main(config_path="../conf", config_name="headroom", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        print(write_headroom(HeadroomConfig(**OmegaConf.to_container(cfg, resolve=True))))  # type: ignore[arg-type]
    except HeadroomError as e:  # a run or column it cannot use: one line, no traceback
        print(f"headroom: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
