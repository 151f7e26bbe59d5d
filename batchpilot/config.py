"""Loading the Hydra configuration outside a Hydra app (tests, ``gymnasium.make``)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

#: The repository's ``conf/`` folder (the package is installed in editable mode from the repo).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
REPO_ROOT = CONF_DIR.parent

T = TypeVar("T")


def load_config(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with Hydra overrides (``["model=llama3_70b", ...]``)."""
    if not CONF_DIR.is_dir():
        raise FileNotFoundError(f"batchpilot config folder not found at {CONF_DIR}")
    import batchpilot.schemas  # noqa: F401  (stores the structured-config schemas the groups extend)

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


class ConfigError(ValueError):
    """A config mapping built in code that does not fit its schema (OmegaConf's message: the
    key, the value, the dataclass)."""


def _plain(node: Any) -> dict[str, Any]:
    if node is None:
        return {}
    if isinstance(node, DictConfig):
        data = OmegaConf.to_container(node, resolve=True)
    elif isinstance(node, Mapping):
        data = dict(node)
    else:
        raise TypeError(f"expected a config mapping, got {type(node).__name__}")
    assert isinstance(data, dict)
    return data  # type: ignore[return-value]


def schema_node(cls: type) -> DictConfig:
    """Dataclass ``cls`` as a structured config (``batchpilot/schemas.py`` stores these), writable
    even for a frozen dataclass: a composed config may be edited in code (``cfg.train.n_envs = 1``);
    the object built from it stays frozen."""
    node = OmegaConf.structured(cls)
    OmegaConf.set_readonly(node, False)
    return node


def from_node(cls: type[T], node: Any, drop: Sequence[str] = ()) -> T:
    """An instance of dataclass ``cls`` from a config node: a composed DictConfig (already
    checked against its schema at compose time) or a plain mapping built in code. The values
    are merged into ``cls``'s structured config, so a mapping that did not come through Hydra
    gets the same checks: an unknown key or a wrong type raises OmegaConf's error naming the
    key (``ConfigKeyError`` / ``ValidationError``); ``__post_init__`` then runs the domain
    checks. Both raise ``ConfigError`` (a ``ValueError``). ``drop`` names keys that select the class rather than configure it (``kind``)."""
    data = _plain(node)
    for key in drop:
        data.pop(key, None)
    try:
        conf = OmegaConf.merge(schema_node(cls), data)
    except (ConfigKeyError, ValidationError) as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None
    return OmegaConf.to_object(conf)  # type: ignore[return-value]
