"""``scripts/export.py``'s top config (``conf/export.yaml``): which trained model is exported where."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ExportApp:
    """``conf/export.yaml`` (``scripts/export.py``)."""

    shield: Any
    slo: Any
    model_path: str
    vecnorm_path: str | None
    out_dir: str
    train_config_path: str | None
    parity_samples: int
