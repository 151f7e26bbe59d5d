"""One source per default (issue 54): a YAML file under conf/ holds only what differs from what
it extends. Each group file loads its structured schema first (``defaults: [schema, _self_]``),
so a key it leaves out gets the dataclass default; a key set to that same value is a second home
for the default, which drifts unnoticed when the dataclass changes. This test names every such
key so the duplication cannot come back.

What a file extends, in its ``defaults`` order: its schema (``schema`` / ``schema_<kind>`` of its
group, ``/schema/<name>@<package>``), the files of its own group it names (``- refuse_late`` in
``conf/serve/refuse_early.yaml``: those values, not the dataclass's, are what it would get) and, in
an app config, the group options it picks (``- shield: default``: a ``shield:`` section there
overrides that file). An app config extending another app config (``evaluate_matrix.yaml`` over
``evaluate.yaml``) may restate what that one sets: an experiment pins its own settings. A few keys are kept on purpose because code reads the file itself, not the
composed config (``KEPT``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

import batchpilot.schemas  # noqa: F401  (stores the schemas the files extend)
from batchpilot.config import CONF_DIR

#: (file under conf/, dotted key) kept although equal to what the file extends: code reads these
#: files with ``OmegaConf.load``, without the schema, and needs the key present.
KEPT: dict[tuple[str, str], str] = {
    # policies/training.py validation twin: copies the training engine's value only for the keys
    # sim.yaml itself lists (``if key in plain.engine and key in sim``).
    **{("engine/sim.yaml", k): "read raw by policies/training.py (validation twin)"
       for k in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override",
                 "kv_dtype", "enable_prefix_caching", "seed")},
    # evaluation/live_tuned.py base_engine_settings: int(serve.max_num_seqs) of the file itself.
    ("serve/default.yaml", "max_num_seqs"): "read raw by evaluation/live_tuned.py",
}

#: Keys that say which class a file builds (``kind: pid``, ``name: static``): code that reads a
#: file without its schema (``load_group_file``, the validation workloads) dispatches on them.
SELECTORS = {"kind", "name"}

#: Groups not checked, and why. (Policy files are checked: the evaluation and the training
#: baseline read them over their schema, ``batchpilot.schemas.policy.with_policy_schema``, as
#: Hydra composes ``policy=<name>``, so a key a file leaves out is the dataclass default there
#: too.) Hardware and model files are data sheets and fits, not settings:
#: ``scripts/calibrate.py`` writes a hardware file whole (evaluation/calibration.py
#: ``profile_yaml``), and a device's measured or published value (an A100's 300 GB/s NVLink)
#: must not change when a default does. ``hydra``: Hydra's own settings.
SKIP_DIRS = {"hydra", "hardware", "model"}


def _schema(path: str) -> DictConfig | None:
    """A stored schema (``shield/schema``, ``schema/evaluate``) as a config node, or None."""
    try:
        node = ConfigStore.instance().load(config_path=f"{path}.yaml").node
    except Exception:  # noqa: BLE001  (not a stored schema: a file of the conf folder)
        return None
    return OmegaConf.create(OmegaConf.to_container(node, resolve=False))


def _at(package: str, node: Any) -> DictConfig:
    """``node`` placed at ``package`` (``_here_`` = the file's own root)."""
    if package in ("", "_here_"):
        return node
    out: Any = node
    for part in reversed(package.split(".")):
        out = {part: out}
    return OmegaConf.create(out)


def _parse_default(entry: Any) -> tuple[str, str, str] | None:
    """``(kind, name, package)`` of one ``defaults`` entry: kind is ``abs`` (``/group/name``),
    ``rel`` (a name in the same folder) or ``group`` (``group: option``); None for ``_self_``
    and ``override`` entries (they change Hydra's own configs)."""
    if isinstance(entry, str):
        if entry == "_self_":
            return None
        name, _, pkg = entry.partition("@")
        return ("abs", name.lstrip("/"), pkg) if name.startswith("/") else ("rel", name, pkg)
    if isinstance(entry, (dict, DictConfig)):
        ((key, value),) = entry.items()
        if str(key).startswith("override ") or value is None:
            return None
        group, _, pkg = str(key).partition("@")
        return "group", f"{group.lstrip('/')}/{value}", pkg or group.lstrip("/").replace("/", ".")
    return None


def baseline(rel: str, conf: Path = CONF_DIR) -> DictConfig:
    """What ``conf/<rel>`` extends, merged in its ``defaults`` order, without its own keys: a key
    of the file whose value equals this one's is a duplicate."""
    node = OmegaConf.load(conf / rel)
    folder = Path(rel).parent
    merged: Any = OmegaConf.create({})
    for entry in node.get("defaults") or []:
        parsed = _parse_default(entry)
        if parsed is None:
            continue
        kind, name, pkg = parsed
        if kind == "rel" and str(folder) == ".":  # an app config extending another (an experiment
            continue                              # pins its own seeds, whatever evaluate.yaml says)
        target = name if kind != "rel" else str(folder / name)
        part = _schema(target)
        if part is None and (conf / f"{target}.yaml").is_file():
            part = _full(f"{target}.yaml", conf)
        if part is not None:
            merged = OmegaConf.merge(merged, _at(pkg, part))
    return merged


def _full(rel: str, conf: Path) -> DictConfig:
    """``conf/<rel>`` as composed on its own: what it extends with its own keys on top."""
    own = OmegaConf.load(conf / rel)
    own.pop("defaults", None)
    return OmegaConf.merge(baseline(rel, conf), own)


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every value a file sets; a mapping is walked, a list is one value."""
    for key, value in node.items_ex(resolve=False) if isinstance(node, DictConfig) else node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, DictConfig) and len(value) > 0:
            yield from _leaves(value, dotted + ".")
        else:
            yield dotted, value


def _plain(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=False)
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same kind (``true`` is not ``1``, ``1`` is ``1.0``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def duplicates(rel: str, conf: Path = CONF_DIR) -> list[tuple[str, Any]]:
    """(dotted key, value) of every key of ``<conf>/<rel>`` equal to what the file extends."""
    own = OmegaConf.load(conf / rel)
    own.pop("defaults", None)
    base = baseline(rel, conf)
    out = []
    for key, value in _leaves(own):
        if (rel, key) in KEPT or key.rpartition(".")[2] in SELECTORS:
            continue
        parent, _, last = key.rpartition(".")
        holder = OmegaConf.select(base, parent) if parent else base
        if not isinstance(holder, DictConfig) or last not in holder or OmegaConf.is_missing(holder, last):
            continue
        default = _plain(holder._get_node(last)._value()) if OmegaConf.is_interpolation(holder, last) \
            else _plain(holder[last])
        if _same(_plain(value), default):
            out.append((key, _plain(value)))
    return out


def conf_files() -> list[str]:
    """Every YAML file under conf/ that this test checks (relative paths)."""
    return sorted(str(p.relative_to(CONF_DIR)) for p in CONF_DIR.rglob("*.yaml")
                  if p.relative_to(CONF_DIR).parts[0] not in SKIP_DIRS)


@pytest.mark.parametrize("rel", conf_files())
def test_no_yaml_key_restates_its_default(rel: str) -> None:
    dups = duplicates(rel)
    assert not dups, (f"conf/{rel} sets keys to the value they already have (the dataclass default or "
                      f"the file it extends); remove them so the default has one home: "
                      + "; ".join(f"{k}: {v!r}" for k, v in dups))


def test_kept_keys_are_still_in_their_files() -> None:
    """A ``KEPT`` entry whose key left its file is stale: the exception no longer applies."""
    for rel, key in KEPT:
        node = OmegaConf.load(CONF_DIR / rel)
        assert OmegaConf.select(node, key, default="<absent>") != "<absent>", \
            f"KEPT names conf/{rel}:{key}, which the file no longer sets; remove it from KEPT"


def _planted(tmp_path: Path, rel: str, key: str, value: Any) -> list[tuple[str, Any]]:
    """``duplicates`` of a copy of conf/ whose ``rel`` also sets ``key`` to ``value``."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    node = OmegaConf.load(conf / rel)
    OmegaConf.update(node, key, value, merge=True)
    OmegaConf.save(node, conf / rel)
    return duplicates(rel, conf)


@pytest.mark.parametrize("rel,key,value,found", [
    # a dataclass default restated (ShieldConfig.memory_ceiling), and another value (kept)
    ("shield/default.yaml", "memory_ceiling", 0.8, True),
    ("shield/default.yaml", "memory_ceiling", 0.7, False),
    # false is not 0: a bool key is compared as a bool
    ("logger/none.yaml", "wandb", False, True),
    ("logger/none.yaml", "wandb", 0, False),
    # a nested default (AdmissionConfig in the env's admission node)
    ("env/default.yaml", "admission.max_num_long", 32, True),
    # a variant restating what the file it extends sets (refuse_early extends refuse_late)
    ("serve/refuse_early.yaml", "admission.ttft_deadline", True, True),
    # an app config restating its schema's default (GatewayBenchConfig.num_pairs), and a group
    # option's value in the app's section for that group (serve_app.yaml's shield: over
    # shield/default.yaml and ShieldConfig)
    ("bench.yaml", "gateway_bench.num_pairs", 1500, True),
    ("serve_app.yaml", "shield.max_step_frac", 0.3, True),
    # an app config over another pins its own values (evaluate_matrix.yaml over evaluate.yaml)
    ("evaluate_matrix.yaml", "best_static.hindsight", True, False),
    # a KEPT key (read raw by the training's validation twin) is not reported
    ("engine/sim.yaml", "block_size", 16, False),
])
def test_a_restated_default_is_found(tmp_path: Path, rel: str, key: str, value: Any, found: bool) -> None:
    dups = _planted(tmp_path, rel, key, value)
    assert ((key, value) in dups) is found, dups
