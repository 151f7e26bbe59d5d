"""Start the batchpilot gateway in front of vLLM (``batchpilot serve ...`` runs this app).

    batchpilot serve serve.upstreams=[http://127.0.0.1:8001] serve.control.policy_dir=policies/pretrained
    batchpilot serve serve.managed=true serve.port=8000
    batchpilot serve serve.upstreams=[http://127.0.0.1:8001] serve.control.mode=shadow

A policy given (``serve.control.policy_dir``) starts policy mode; without one PID acts
(``serve.control.mode`` named on the command line wins either way).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

import batchpilot.schemas  # noqa: F401  (stores the config schemas before Hydra composes)
from batchpilot.config import CONF_DIR
from batchpilot.serving.gateway import GatewayStartFailed, ServeConfigError, serve


@hydra.main(config_path=str(CONF_DIR), config_name="serve_app", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        serve(cfg)
    except ServeConfigError as e:  # a configuration problem: one line, no traceback
        print(f"serve: error: {e}", file=sys.stderr)
        sys.exit(2)
    except GatewayStartFailed as e:  # an upstream never came up: one line, its log has the rest
        print(f"serve: error: {e}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
