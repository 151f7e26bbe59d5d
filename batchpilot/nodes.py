"""Config node -> dataclass: the generic helpers every layer uses to build its typed objects.

It imports nothing of batchpilot, so any package may use it without an import cycle: the
core's ``from_cfg`` constructors (``ShieldConfig``, ``AdmissionConfig``, ``ModelSpec``) build
themselves with ``from_node``, and ``batchpilot.schemas`` derives node schemas with
``node_schema``, while ``batchpilot.config.load_config`` (which registers those schemas) sits
above both. It lives beside ``config`` rather than in ``core`` because it is config plumbing
(OmegaConf), not control code."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

T = TypeVar("T")


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
    """Dataclass ``cls`` as a structured config (``batchpilot/schemas/`` stores these), writable
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
    checks. Both raise ``ConfigError`` (a ``ValueError``). ``drop`` names keys that select the
    class rather than configure it (``kind``)."""
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
