"""``scripts/calibrate.py``'s app: the fit (``evaluation/calibration.py``), then the sim-to-real
report (``evaluation/sim_to_real.py``) when ``report=true``.

The entry point runs both, so it lives above both: in ``calibration.py`` it imported the report,
which imports the calibration's probe and error types, a cycle."""

from __future__ import annotations

import json
from typing import Any

from batchpilot.evaluation.calibration import CalibrationError, check_workloads, run_fit
from batchpilot.evaluation.sim_to_real import run_report


def main(cfg: Any) -> dict[str, float] | None:
    """``scripts/calibrate.py``: fit (unless ``fit=false``), then the report when ``report=true``."""
    from hydra.core.hydra_config import HydraConfig
    from rich.console import Console

    console = Console(width=160)
    if not (cfg.fit or cfg.report or cfg.served.enabled):
        raise SystemExit("calibrate: nothing to do (fit=false report=false served.enabled=false)")
    try:  # before the fit (minutes of vLLM) and the report
        check_workloads(cfg, list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else [])
    except CalibrationError as e:
        raise SystemExit(f"calibrate: error: {e}") from None
    if cfg.fit:
        run_fit(cfg, console)
    if not cfg.report:
        return None
    summary = run_report(cfg, console)
    print(json.dumps(summary), flush=True)
    return summary
