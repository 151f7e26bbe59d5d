"""The exported-policy artifact: a folder with ``manifest.json`` and ``policy.safetensors``.

This module owns the format — its schema, writing it, and reading it back with every check —
so the exporter (training side) and the runtime (serving side) cannot drift apart. It imports
only numpy, safetensors.numpy and the standard library: a gateway loads a policy without torch
or stable-baselines3. Nothing is pickled; the manifest is JSON and the weights safetensors.

Manifest (``format_version`` 1)::

    format              "batchpilot-policy"
    format_version      1
    batchpilot_version  package version at export
    created             ISO-8601 UTC timestamp
    observation         {features: [names], low, high,
                         normalization: null | {mean: [..], var: [..], epsilon, clip_obs}}
    action              {type: "MultiDiscrete", nvec, names, batch_steps, meaning: {name: [..]}}
    network             {activation: "tanh"|"relu",
                         layers: [{weight, bias, shape: [out, in]}, ...]}  # last = action_net
    shield              {max_step_frac, memory_ceiling, ...}
    slo                 {ttft_ms, tpot_ms, e2el_ms}
    training            {config: {...resolved...}, config_sha256}
    library_versions    {numpy, torch, stable-baselines3, sb3-contrib, gymnasium, safetensors}
    weights             {file: "policy.safetensors", sha256, bytes}
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as _st_load
from safetensors.numpy import save as _st_save

FORMAT_NAME = "batchpilot-policy"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "policy.safetensors"
ACTIVATIONS: tuple[str, ...] = ("tanh", "relu")
REQUIRED_KEYS: tuple[str, ...] = (
    "format",
    "format_version",
    "batchpilot_version",
    "created",
    "observation",
    "action",
    "network",
    "shield",
    "slo",
    "training",
    "library_versions",
    "weights",
)
_LIBRARIES = ("numpy", "torch", "stable-baselines3", "sb3-contrib", "gymnasium", "safetensors")


class PolicyLoadError(ValueError):
    """An artifact that must not be used: the caller keeps its fallback controller."""


@dataclass(frozen=True, slots=True)
class Normalization:
    """VecNormalize's observation statistics, applied as
    ``clip((obs - mean) / sqrt(var + epsilon), -clip_obs, clip_obs)``."""

    mean: np.ndarray  # float64, (n_features,)
    var: np.ndarray  # float64, (n_features,)
    epsilon: float
    clip_obs: float


@dataclass(frozen=True, slots=True)
class Artifact:
    """A loaded, fully checked artifact: the manifest plus the actor's layers in order."""

    path: Path
    manifest: dict[str, Any]
    features: tuple[str, ...]
    normalization: Normalization | None
    nvec: tuple[int, ...]
    activation: str
    #: (weight (out, in), bias (out,)) per Linear, in order; the last one is action_net.
    layers: tuple[tuple[np.ndarray, np.ndarray], ...]


# --- helpers shared by writer and reader ----------------------------------------------------
def config_sha256(config: dict[str, Any]) -> str:
    """Hash of a resolved config, independent of key order (canonical JSON)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def library_versions() -> dict[str, str | None]:
    """Installed versions, read from package metadata so nothing heavy gets imported."""
    out: dict[str, str | None] = {}
    for name in _LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _batchpilot_version() -> str:
    try:
        return metadata.version("batchpilot")
    except metadata.PackageNotFoundError:  # pragma: no cover - source checkout without install
        return "unknown"


def layer_tensor_names(n_layers: int) -> list[tuple[str, str]]:
    """Tensor names for ``n_layers`` Linear layers; the last one is the action head."""
    names = [(f"policy_net.{i}.weight", f"policy_net.{i}.bias") for i in range(n_layers - 1)]
    return names + [("action_net.weight", "action_net.bias")]


# --- writing -------------------------------------------------------------------------------
def write_artifact(
    out_dir: str | os.PathLike[str],
    *,
    features: list[str] | tuple[str, ...],
    normalization: Normalization | None,
    action: dict[str, Any],
    activation: str,
    layers: list[tuple[np.ndarray, np.ndarray]],
    shield: dict[str, Any],
    slo: dict[str, Any],
    train_config: dict[str, Any],
    obs_bounds: tuple[float, float] = (0.0, 10.0),
) -> Path:
    """Write the weights, then the manifest that pins their hash (manifest last and atomic,
    so a half-written folder never looks complete)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} not supported; use one of {ACTIVATIONS}")
    if not layers:
        raise ValueError("layers is empty: the actor needs at least the action_net layer")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    layer_meta: list[dict[str, Any]] = []
    for (wn, bn), (w, b) in zip(layer_tensor_names(len(layers)), layers):
        w = np.ascontiguousarray(w, dtype=np.float32)
        b = np.ascontiguousarray(b, dtype=np.float32)
        if w.ndim != 2 or b.shape != (w.shape[0],):
            raise ValueError(
                f"layer {wn}: weight {w.shape} and bias {b.shape} do not form a Linear"
            )
        tensors[wn], tensors[bn] = w, b
        layer_meta.append({"weight": wn, "bias": bn, "shape": list(w.shape)})
    blob = _st_save(tensors, metadata={"format": FORMAT_NAME})
    weights_path = out / WEIGHTS_FILE
    _atomic_write(weights_path, blob)

    norm_json = None
    if normalization is not None:
        norm_json = {
            "mean": [float(x) for x in normalization.mean],
            "var": [float(x) for x in normalization.var],
            "epsilon": float(normalization.epsilon),
            "clip_obs": float(normalization.clip_obs),
        }
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "batchpilot_version": _batchpilot_version(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "observation": {
            "features": list(features),
            "low": float(obs_bounds[0]),
            "high": float(obs_bounds[1]),
            "normalization": norm_json,
        },
        "action": action,
        "network": {"activation": activation, "layers": layer_meta},
        "shield": shield,
        "slo": slo,
        "training": {"config": train_config, "config_sha256": config_sha256(train_config)},
        "library_versions": library_versions(),
        "weights": {
            "file": WEIGHTS_FILE,
            "sha256": hashlib.sha256(blob).hexdigest(),
            "bytes": len(blob),
        },
    }
    text = json.dumps(manifest, indent=2, allow_nan=False, default=str) + "\n"
    _atomic_write(out / MANIFEST_FILE, text.encode("utf-8"))
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --- reading -------------------------------------------------------------------------------
def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name} in JSON")


def _fail(path: Path, msg: str) -> PolicyLoadError:
    return PolicyLoadError(f"policy artifact {path}: {msg}")


def _features_diff(got: list[str], want: list[str]) -> str:
    missing = [f for f in want if f not in got]
    extra = [f for f in got if f not in want]
    parts = []
    if missing:
        parts.append(f"missing from artifact {missing}")
    if extra:
        parts.append(f"not expected {extra}")
    if not parts:
        moved = [
            f"{i}: artifact {g!r} vs expected {w!r}"
            for i, (g, w) in enumerate(zip(got, want))
            if g != w
        ]
        parts.append("same features in a different order (" + "; ".join(moved) + ")")
    return ", ".join(parts)


def read_artifact(
    path: str | os.PathLike[str],
    *,
    expected_features: list[str] | tuple[str, ...] | None,
    expected_nvec: tuple[int, ...] | None = None,
) -> Artifact:
    """Load and check everything; any problem raises ``PolicyLoadError`` saying what and where.

    ``expected_features=None`` skips the feature-list check (tools that only inspect)."""
    root = Path(path)
    manifest = _read_manifest(root)
    sec = _manifest_sections(root, manifest)
    _check_expected(root, sec, expected_features, expected_nvec)
    normalization = _read_normalization(root, sec.norm_raw, len(sec.features))
    tensors = _read_weights(root, sec.wmeta, sec.wfile, sec.wsha)
    layers = _read_layers(root, tensors, sec)
    return Artifact(
        path=root,
        manifest=manifest,
        features=tuple(sec.features),
        normalization=normalization,
        nvec=sec.nvec,
        activation=sec.activation,
        layers=tuple(layers),
    )


@dataclass(frozen=True, slots=True)
class _Sections:
    """The manifest fields the reader uses, pulled out once (a missing or mistyped one is a
    single "malformed section" error) and checked by the steps after."""

    features: list[str]
    norm_raw: Any
    nvec: tuple[int, ...]
    activation: Any
    layer_meta: Any
    wmeta: Any
    wfile: str
    wsha: str


def _read_manifest(root: Path) -> dict[str, Any]:
    """The manifest as a JSON object with every required key, of this format and version:
    checked before anything in it is trusted."""
    if not root.is_dir():
        raise _fail(root, "not a directory")
    mpath = root / MANIFEST_FILE
    if not mpath.is_file():
        raise _fail(root, f"missing {MANIFEST_FILE}")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise _fail(root, f"{MANIFEST_FILE} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict):
        raise _fail(root, f"{MANIFEST_FILE} must hold a JSON object, got {type(manifest).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise _fail(root, f"{MANIFEST_FILE} lacks required keys {missing}")
    if manifest["format"] != FORMAT_NAME:
        raise _fail(root, f"format is {manifest['format']!r}, expected {FORMAT_NAME!r}")
    if manifest["format_version"] != FORMAT_VERSION:
        raise _fail(
            root,
            f"format_version {manifest['format_version']!r} not supported by this runtime "
            f"(supports {FORMAT_VERSION}); re-export the policy or upgrade batchpilot",
        )
    return manifest


def _manifest_sections(root: Path, manifest: dict[str, Any]) -> _Sections:
    """The sections' fields, read in one place so any missing key or wrong type names the
    manifest as malformed."""
    try:
        obs = manifest["observation"]
        features = [str(f) for f in obs["features"]]
        norm_raw = obs["normalization"]
        act = manifest["action"]
        nvec = tuple(int(n) for n in act["nvec"])
        net = manifest["network"]
        activation = net["activation"]
        layer_meta = net["layers"]
        wmeta = manifest["weights"]
        wfile, wsha = str(wmeta["file"]), str(wmeta["sha256"])
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(root, f"{MANIFEST_FILE} malformed section: {type(e).__name__}: {e}") from e
    return _Sections(features, norm_raw, nvec, activation, layer_meta, wmeta, wfile, wsha)


def _check_expected(
    root: Path,
    sec: _Sections,
    expected_features: list[str] | tuple[str, ...] | None,
    expected_nvec: tuple[int, ...] | None,
) -> None:
    """The policy's interface against what the caller will feed it and read from it (features,
    action sizes), and a network this runtime can evaluate."""
    if expected_features is not None and sec.features != list(expected_features):
        diff = _features_diff(sec.features, list(expected_features))
        raise _fail(root, f"observation features differ: {diff}")
    if expected_nvec is not None and sec.nvec != tuple(expected_nvec):
        raise _fail(
            root, f"action nvec {list(sec.nvec)} differs from the expected {list(expected_nvec)}"
        )
    if sec.activation not in ACTIVATIONS:
        raise _fail(root, f"network.activation {sec.activation!r} not one of {ACTIVATIONS}")
    if not isinstance(sec.layer_meta, list) or not sec.layer_meta:
        raise _fail(root, "network.layers must be a non-empty list")


def _read_normalization(root: Path, norm_raw: Any, n: int) -> Normalization | None:
    """VecNormalize's statistics (None when the policy was trained without them), one value
    per feature and usable: a negative variance or a non-finite clip would corrupt every
    observation."""
    if norm_raw is None:
        return None
    try:
        mean = np.asarray(norm_raw["mean"], dtype=np.float64)
        var = np.asarray(norm_raw["var"], dtype=np.float64)
        eps, clip = float(norm_raw["epsilon"]), float(norm_raw["clip_obs"])
    except (KeyError, TypeError, ValueError) as e:
        msg = f"observation.normalization malformed: {type(e).__name__}: {e}"
        raise _fail(root, msg) from e
    if mean.shape != (n,) or var.shape != (n,):
        raise _fail(
            root, f"normalization mean {mean.shape}/var {var.shape} must both be ({n},)"
        )
    if (var < 0).any() or not (eps > 0 and clip > 0 and math.isfinite(clip)):
        raise _fail(root, "normalization needs var >= 0, epsilon > 0 and a finite clip_obs > 0")
    return Normalization(mean, var, eps, clip)


def _read_weights(root: Path, wmeta: Any, wfile: str, wsha: str) -> dict[str, np.ndarray]:
    """The weight tensors. Hashes the bytes it is about to parse, so what is checked is what is
    used; a mismatch says whether the file looks truncated."""
    if Path(wfile).name != wfile:
        raise _fail(root, f"weights.file {wfile!r} must be a plain file name inside the artifact")
    wpath = root / wfile
    if not wpath.is_file():
        raise _fail(root, f"missing weights file {wfile}")
    blob = wpath.read_bytes()
    got_sha = hashlib.sha256(blob).hexdigest()
    if got_sha != wsha:
        size_note = ""
        if "bytes" in wmeta and wmeta["bytes"] != len(blob):
            size_note = f"; file has {len(blob)} bytes, manifest says {wmeta['bytes']} (truncated?)"
        raise _fail(
            root,
            f"weights {wfile} sha256 mismatch: manifest {wsha[:16]}…, file {got_sha[:16]}… "
            f"(corrupted or replaced{size_note})",
        )
    try:
        return _st_load(blob)
    except Exception as e:  # safetensors raises its own error type
        raise _fail(root, f"weights {wfile} unreadable as safetensors: {e}") from e


def _read_layers(
    root: Path, tensors: dict[str, np.ndarray], sec: _Sections
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The actor's Linear layers in order, each present, finite and chained (its input size is
    the previous output's, the first the feature count), the last giving one logit per action
    choice (``sum(nvec)``)."""
    layers: list[tuple[np.ndarray, np.ndarray]] = []
    in_dim = len(sec.features)
    for i, meta in enumerate(sec.layer_meta):
        try:
            wn, bn = meta["weight"], meta["bias"]
        except (KeyError, TypeError) as e:
            raise _fail(root, f"network.layers[{i}] needs 'weight' and 'bias' names") from e
        for name in (wn, bn):
            if name not in tensors:
                raise _fail(root, f"tensor {name!r} (network.layers[{i}]) missing from {sec.wfile}")
        w, b = tensors[wn], tensors[bn]
        if w.ndim != 2 or w.shape[1] != in_dim or b.shape != (w.shape[0],):
            raise _fail(
                root,
                f"tensor shapes of network.layers[{i}] wrong: {wn} {w.shape}, {bn} {b.shape}; "
                f"expected (out, {in_dim}) and (out,)",
            )
        if not (np.isfinite(w).all() and np.isfinite(b).all()):
            raise _fail(root, f"non-finite values (NaN/inf) in {wn} or {bn}")
        layers.append((w.astype(np.float32), b.astype(np.float32)))
        in_dim = w.shape[0]
    if in_dim != sum(sec.nvec):
        raise _fail(
            root, f"action head has {in_dim} outputs but sum(nvec {list(sec.nvec)}) = {sum(sec.nvec)}"
        )
    return layers
