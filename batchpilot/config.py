"""Loading the Hydra configuration outside a Hydra app (tests, ``gymnasium.make``)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

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


class ConfigError(ValueError):
    """A config mapping built in code that does not fit its schema (OmegaConf's message: the
    key, the value, the dataclass)."""


def plain(node: Any) -> dict[str, Any]:
    """A config node (DictConfig, resolved, or mapping) as a plain dict. A group file read
    without Hydra (``OmegaConf.load(conf/policy/pid.yaml)``) still holds its defaults list, the
    schema it extends: that ``defaults`` key is left out (no config dataclass has such a field)."""
    if node is None:
        return {}
    if isinstance(node, DictConfig):
        data = OmegaConf.to_container(node, resolve=True)
    elif isinstance(node, Mapping):
        data = dict(node)
    else:
        raise TypeError(f"expected a config mapping, got {type(node).__name__}")
    assert isinstance(data, dict)
    if isinstance(data.get("defaults"), list):
        del data["defaults"]
    return data  # type: ignore[return-value]


def schema_node(cls: type) -> DictConfig:
    """Dataclass ``cls`` as a structured config (``batchpilot/schemas.py`` stores these), writable
    even for a frozen dataclass: a composed config may be edited in code (``cfg.train.n_envs = 1``);
    the object built from it stays frozen."""
    node = OmegaConf.structured(cls)
    _writable(node)
    return node


def _writable(node: DictConfig) -> None:
    """Clear the read-only flag of ``node`` and of every nested dataclass node (a frozen one,
    e.g. ``AdmissionConfig`` inside ``ServeConfig``, sets its own)."""
    OmegaConf.set_readonly(node, False)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)


def from_node(cls: type[T], node: Any, drop: Sequence[str] = ()) -> T:
    """An instance of dataclass ``cls`` from a config node: a composed DictConfig (already
    checked against its schema at compose time) or a plain mapping built in code. The values
    are merged into ``cls``'s structured config, so a mapping that did not come through Hydra
    gets the same checks: an unknown key or a wrong type raises OmegaConf's error naming the
    key (``ConfigKeyError`` / ``ValidationError``); ``__post_init__`` then runs the domain
    checks. Both raise ``ConfigError`` (a ``ValueError``). ``drop`` names keys that select the class rather than configure it (``kind``)."""
    data = plain(node)
    for key in drop:
        data.pop(key, None)
    try:
        conf = OmegaConf.merge(schema_node(cls), data)
    except (ConfigKeyError, ValidationError) as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None
    return OmegaConf.to_object(conf)  # type: ignore[return-value]


def node_schema(cls: type, name: str, *, extra: Sequence[tuple[str, Any, Any]] = (),
                exclude: Sequence[str] = ()) -> type:
    """The schema of a config node that is dataclass ``cls`` plus keys that are not its fields:
    a dataclass named ``name`` with ``extra`` first (``(key, type, default or dataclasses.field)``;
    e.g. ``kind``, which selects the class) and then ``cls``'s init fields less ``exclude`` (keys
    filled from elsewhere, e.g. a PID's ``slo_ms`` from the top config's SLO). Derived from
    ``cls``, so each field keeps its one declaration, type and default; ``from_node(cls, node,
    drop=...)`` builds ``cls`` from such a node."""
    hints = typing.get_type_hints(cls)
    fields: list[tuple[str, Any, Any]] = list(extra)
    for f in dataclasses.fields(cls):
        if not f.init or f.name in exclude:
            continue
        if f.default_factory is not dataclasses.MISSING:
            spec = dataclasses.field(default_factory=f.default_factory)
        elif f.default is not dataclasses.MISSING:
            spec = dataclasses.field(default=f.default)
        else:
            spec = dataclasses.field()
        fields.append((f.name, hints[f.name], spec))
    return dataclasses.make_dataclass(name, fields)
