"""Loading the Hydra configuration outside a Hydra app (tests, ``gymnasium.make``)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

#: The repository's ``conf/`` folder (the package is installed in editable mode from the repo).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
REPO_ROOT = CONF_DIR.parent


def load_config(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with Hydra overrides (``["model=llama3_70b", ...]``)."""
    if not CONF_DIR.is_dir():
        raise FileNotFoundError(f"batchpilot config folder not found at {CONF_DIR}")
    gh = GlobalHydra.instance()
    if gh.is_initialized():
        # Inside a running Hydra app or another compose: compose in a fresh context.
        gh.clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def config_fields(cls: type, node: Any, where: str, drop: Sequence[str] = ()) -> dict[str, Any]:
    """A config node (DictConfig or mapping) as plain keyword arguments for dataclass ``cls``.

    Unknown keys raise, naming ``where`` and the known keys, so a typo in YAML never falls back
    to a default silently. ``drop`` names keys that select the class rather than configure it
    (e.g. ``kind``)."""
    if isinstance(node, DictConfig):
        data = OmegaConf.to_container(node, resolve=True)
    else:
        data = dict(node or {})
    if not isinstance(data, dict):
        raise TypeError(f"{where}: expected a mapping, got {type(node).__name__}")
    for key in drop:
        data.pop(key, None)
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} in {where}; known: {sorted(known)}")
    return data
