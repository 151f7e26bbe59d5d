"""Live evaluation with vLLM's own benchmark client: ``python scripts/live_evaluate.py
[live_scenario=steady|kv_tight|burst] [rounds=5] [paths=[vllm_direct,static,pid,ppo]] out_dir=DIR``
(see conf/live_evaluate.yaml and docs/live_evaluation.md). ``twin_of=DIR``: only the simulated
twin of the finished live run in DIR (no vLLM), added to its results.md and twin.json."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

# One passive OpenMP thread per process on a small machine (the client and vLLM share the
# cores); must be set before torch loads (docs/sim_to_real.md).
from batchpilot.platform.vllm_cpu import small_machine_omp_defaults

small_machine_omp_defaults(os.environ)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import batchpilot.schemas  # noqa: E402,F401  (stores the config schemas before Hydra composes)
from batchpilot.evaluation.live import live_evaluate  # noqa: E402
from batchpilot.evaluation.live_errors import (  # noqa: E402
    LiveEvaluationError,
    LiveEvaluationInterrupted,
)


def exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, a CI cancel, ``kill``) as ``SystemExit(143)``: its default action
    ends the process at once, skipping the ``finally`` that stops the gateway and its vLLM. A
    second SIGTERM while that cleanup runs is ignored (SIGKILL still works: the reaper then
    ends the gateway)."""

    def _raise(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(2, b"live_evaluate: SIGTERM: stopping the gateway and vLLM\n")  # print() is not reentrant
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


@hydra.main(config_path="../conf", config_name="live_evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    exit_on_sigterm()
    try:
        if cfg.get("twin_of"):
            from batchpilot.evaluation.live_twin import twin_of

            try:
                twin_of(str(cfg.twin_of), speed_from=cfg.get("twin_speed_of"),
                        ingress_latency_s=float(cfg.twin_ingress_latency_s), hardware=str(cfg.twin_hardware))
            except (OSError, ValueError) as e:  # a folder without a finished run, or no speed to take
                raise LiveEvaluationError(str(e)) from None
            print(f"live_evaluate: simulated twin written to {cfg.twin_of}/results.md and twin.json", flush=True)
        else:
            live_evaluate(cfg)
    except LiveEvaluationError as e:  # a configuration or start-up problem: one line, no traceback
        print(f"live_evaluate: error: {e}", file=sys.stderr)
        sys.exit(2)
    except LiveEvaluationInterrupted as e:  # Ctrl-C: the gateway is stopped, the partial results written
        print(f"live_evaluate: {e}", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:  # Ctrl-C before the runs or after them (during the twin): no traceback
        print("live_evaluate: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
