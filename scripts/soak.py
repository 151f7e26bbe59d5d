"""Soak the gateway: mixed traffic through it in front of a managed tiny ``vllm serve``, a fault
every few minutes (engine SIGSTOP/SIGCONT, SIGKILL, huge bodies, slow clients), then the figures
(``serving/soak.py``): requests sent, answers by status, answers that crossed clients, p99 of
normal requests during each fault. The last line printed is one JSON object with all of them.

    .venv/bin/python scripts/soak.py                                   # 30 minutes
    .venv/bin/python scripts/soak.py duration_s=600 fault_every_s=60   # 10 minutes
"""

from __future__ import annotations

import json
import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

import batchpilot.schemas  # noqa: F401  (stores the config schemas before Hydra composes)
from batchpilot.config import CONF_DIR
from batchpilot.nodes import from_node, schema_node
from batchpilot.serving.soak import SoakConfig, soak

ConfigStore.instance().store(group="schema", name="soak", node=schema_node(SoakConfig))


def _table(out: dict) -> str:
    lines = [f"sent {out['sent']} in {out['wall_s']} s; by status {out['by_status']}; crossed {out['crossed']}; "
             f"p99 of 200s outside faults {out['p99_calm_s']} s"]
    for f in out["faults"]:
        lines.append(f"  {f['kind']:<12} at {f['at_s']:>7} s, {f['lasted_s']:>5} s: {f['requests']:>5} normal "
                     f"requests {f['statuses']}, p99 {f['p99_s']} s (200s: {f['p99_ok_s']} s)")
    return "\n".join(lines)


@hydra.main(config_path=str(CONF_DIR), config_name="soak", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        scfg = from_node(SoakConfig, cfg)
    except ValueError as e:  # a configuration problem: one line, no traceback
        print(f"soak: error: {e}", file=sys.stderr)
        sys.exit(2)
    out = soak(scfg)
    print(_table(out))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
