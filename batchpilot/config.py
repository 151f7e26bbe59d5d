"""Loading the Hydra configuration outside a Hydra app (tests, ``gymnasium.make``). Building a
dataclass from a config node (``from_node``, ``ConfigError``, ...) is ``batchpilot.nodes``: it
imports nothing of batchpilot, so the core can use it without importing this module."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from batchpilot.nodes import ConfigError

#: The repository's ``conf/`` folder (the package is installed in editable mode from the repo).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
REPO_ROOT = CONF_DIR.parent


def load_config(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with Hydra overrides (``["model=llama3_70b", ...]``)."""
    if not CONF_DIR.is_dir():
        raise FileNotFoundError(f"batchpilot config folder not found at {CONF_DIR}")
    import batchpilot.schemas  # noqa: F401  (stores the structured-config schemas the groups extend)

    gh = GlobalHydra.instance()
    if gh.is_initialized():
        # Inside a running Hydra app or another compose: compose in a fresh context.
        gh.clear()
    from hydra.errors import HydraException

    from batchpilot.schemas.control import moved_key_note

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            return compose(config_name=config_name, overrides=list(overrides))
        except (HydraException, OmegaConfBaseException) as e:
            note = moved_key_note(e)
            if not note:
                raise
            raise ConfigError(f"{e}{note}") from e


def config_dirs() -> tuple[Path, ...]:
    """``conf/`` and, inside a running Hydra app, each folder its ``hydra.searchpath`` adds: a
    user's own model, hardware, workload or policy files kept outside ``conf/`` are names a
    command line may list (``deployments=[my_model/my_gpu]``), not only ``model=`` choices."""
    dirs = [CONF_DIR]
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        for src in HydraConfig.get().runtime.config_sources:
            path = Path(str(src.path)) if src.schema == "file" else None
            if path is not None and path.is_dir() and path.resolve() not in {d.resolve() for d in dirs}:
                dirs.append(path)
    return tuple(dirs)


def group_file(group: str, name: str, dirs: Sequence[Path] = (CONF_DIR,)) -> Path | None:
    """``<dir>/<group>/<name>.yaml`` in the first of ``dirs`` that has it (Hydra's order)."""
    for d in dirs:
        f = d / group / f"{name}.yaml"
        if f.is_file():
            return f
    return None


def load_group_file(group: str, name: str, dirs: Sequence[Path] = (CONF_DIR,)) -> DictConfig:
    """``<group>/<name>.yaml`` read without Hydra, as Hydra would compose it on its own: a
    ``defaults`` entry naming another file of the same group (``- pid`` in
    ``conf/policy/pid_sf.yaml``) is merged under it, so a variant says only what differs.
    Schema entries (``schema_*``) and ``_self_`` are left to the caller's schema checks."""
    return _load_group_file(group, name, tuple(dirs), ())


def _load_group_file(group: str, name: str, dirs: tuple[Path, ...], seen: tuple[str, ...]) -> DictConfig:
    path = group_file(group, name, dirs)
    if path is None:
        raise ConfigError(f"{group}/{name}.yaml not found in {[str(d) for d in dirs]}; "
                          f"known: {group_names(group, dirs)}")
    if name in seen:
        raise ConfigError(f"{group}/{name}.yaml: its defaults come back to itself ({' -> '.join([*seen, name])})")
    try:
        node = OmegaConf.load(path)
    except (OSError, yaml.YAMLError, OmegaConfBaseException) as e:  # unreadable, YAML syntax: name the file
        raise ConfigError(f"{path}: not a readable config file: {e}") from e
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: a config file must hold a mapping (key: value lines), got a {type(node).__name__}")
    parents = [d for d in (node.get("defaults") or []) if isinstance(d, str) and d != "_self_"
               and not d.startswith("schema")]
    merged = OmegaConf.create({})
    inherited: list[Any] = []
    for parent in parents:
        base = _load_group_file(group, parent, dirs, (*seen, name))
        inherited += list(base.get("defaults") or [])
        merged = OmegaConf.merge(merged, base)
    merged = OmegaConf.merge(merged, node)
    if parents:  # the schemas the chain extends, each once; the parents themselves are merged
        own = [d for d in node.defaults if d not in parents]
        merged.defaults = list(dict.fromkeys(str(d) for d in inherited + own))
    assert isinstance(merged, DictConfig)
    return merged


def group_names(group: str, dirs: Sequence[Path] = (CONF_DIR,)) -> list[str]:
    """Every option of a config group across ``dirs``, sorted (for "known: ..." messages)."""
    return sorted({f.stem for d in dirs for f in (d / group).glob("*.yaml")})
