"""Export a trained policy to the artifact the gateway serves (no torch needed there).

    python scripts/export.py model_path=... vecnorm_path=... out_dir=...
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

import batchpilot.schemas  # noqa: F401  (stores the config schemas before Hydra composes)
from batchpilot.policies.export import ExportError

log = logging.getLogger("export")


def _training_config(cfg: DictConfig) -> tuple[dict[str, Any], str]:
    """The training run's resolved config and where it came from ({} if none is found)."""
    if cfg.train_config_path is not None:
        candidates = [Path(cfg.train_config_path)]
        if not candidates[0].is_file():
            raise FileNotFoundError(f"train_config_path={candidates[0]} does not exist")
    else:
        model_dir = Path(cfg.model_path).resolve().parent
        candidates = [d / ".hydra" / "config.yaml" for d in (model_dir, model_dir.parent)]
    for path in candidates:
        if path.is_file():
            loaded = OmegaConf.load(path)
            try:
                container = OmegaConf.to_container(loaded, resolve=True)
            except Exception:  # interpolations that only resolve inside the training app
                container = OmegaConf.to_container(loaded, resolve=False)
            return dict(container), str(path)  # type: ignore[arg-type]
    return {}, "none found"


def _policy_guards(cfg: DictConfig) -> dict[str, Any]:
    """The run's ``policy_guards.json`` (action mode, the PID a residual policy corrects, the
    observation range seen in training), found beside the model or one folder up; {} if none."""
    model_dir = Path(cfg.model_path).resolve().parent
    for d in (model_dir, model_dir.parent):
        path = d / "policy_guards.json"
        if path.is_file():
            log.info("policy guards: %s", path)
            return dict(json.loads(path.read_text()))
    log.warning("no policy_guards.json beside %s: the artifact has no training range (no hand-over "
                "to PID out of range) and its action mode comes from the training config", cfg.model_path)
    return {}


def _check_normalization(cfg: DictConfig, train_cfg: dict[str, Any]) -> None:
    """A policy trained on normalised observations exported without its statistics would see
    raw ones in production, and nothing would say so: refuse, naming the file to pass."""
    if cfg.vecnorm_path is not None:
        return
    model_dir = Path(cfg.model_path).resolve().parent
    found = [p for d in (model_dir, model_dir.parent) for p in [d / "vecnormalize.pkl"] if p.is_file()]
    norm_obs = (train_cfg.get("train") or {}).get("norm_obs")
    if found or norm_obs:
        why = f"{found[0]} lies beside the model" if found else "its training config says train.norm_obs=true"
        raise ExportError(f"the policy was trained on normalised observations ({why}): pass "
                          f"vecnorm_path={found[0] if found else 'RUN/vecnormalize.pkl'}; without it the artifact "
                          "would see raw observations")


def export(cfg: DictConfig) -> Path:
    from batchpilot.core.telemetry import FEATURE_NAMES
    from batchpilot.policies.export import export_policy, load_sb3
    from batchpilot.schemas import check_app
    from batchpilot.schemas.export import ExportApp

    check_app(ExportApp, cfg)  # a key added with +key=... (the rest was checked at compose)
    if int(cfg.parity_samples) < 1:
        raise ExportError(f"parity_samples must be >= 1 (observations the artifact is checked on), got {cfg.parity_samples}")
    train_cfg, source = _training_config(cfg)
    log.info("training config: %s", source)
    train_cfg.update(_policy_guards(cfg))
    _check_normalization(cfg, train_cfg)
    shield = train_cfg.get("shield") or OmegaConf.to_container(cfg.shield, resolve=True)
    slo = train_cfg.get("slo") or OmegaConf.to_container(cfg.slo, resolve=True)
    model, vecnorm = load_sb3(cfg.model_path, cfg.vecnorm_path)
    out = export_policy(
        model,
        vecnorm,
        cfg.out_dir,
        features=FEATURE_NAMES,
        shield=shield,  # type: ignore[arg-type]
        slo=slo,  # type: ignore[arg-type]
        train_config=train_cfg,
        parity_samples=int(cfg.parity_samples),
    )
    log.info("exported %s (parity checked on %d observations)", out, cfg.parity_samples)
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="export")
def main(cfg: DictConfig) -> None:
    try:
        export(cfg)
    except (ExportError, FileNotFoundError) as e:  # a bad input: one line, no traceback
        print(f"export: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
