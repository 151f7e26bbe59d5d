"""The gateway's configuration as validated dataclasses (``conf/serve/default.yaml``).

Declared in ``batchpilot/schemas/serve.py`` (stored as ``serve/schema``, so a mistyped key or a
wrong type in the ``serve`` node fails at compose time) and re-exported here. Built once with
``ServeConfig.from_cfg``; out-of-range values raise with the full key, the value and the fix,
so a typo never starts a half-configured gateway.
"""

from __future__ import annotations

from batchpilot.schemas.serve import (
    CONTROL_MODES,
    TOKENIZER_MODES,
    ControlConfig,
    ControlMode,
    QualityGuardConfig,
    ServeConfig,
    WarmupConfig,
)

__all__ = ["CONTROL_MODES", "TOKENIZER_MODES", "ControlConfig", "ControlMode", "QualityGuardConfig",
           "ServeConfig", "WarmupConfig"]
