"""Dependency-light runtime for an exported policy: load an artifact, turn observations into
actions.

The gateway runs this on every control tick, so it imports only numpy, safetensors and the
standard library (no torch, no stable-baselines3) and does a few small float32 matmuls per
call. It replicates training exactly: VecNormalize's ``clip((obs - mean) / sqrt(var + eps))``,
the actor MLP, and sb3-contrib's deterministic masked choice (argmax per sub-action over the
allowed values). Anything wrong with the artifact or an observation raises, so the caller can
fall back to its baseline controller (PID).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from batchpilot.core.actions import ACTION_NVEC
from batchpilot.core.telemetry import FEATURE_NAMES, OBS_HIGH, OBS_LOW
from batchpilot.policies.artifact import Artifact, read_artifact

__all__ = ["PolicyRuntime", "benchmark_runtime"]


class PolicyRuntime:
    """A loaded policy. ``act`` is deterministic and side-effect free (safe to share between
    threads: it keeps no scratch buffers)."""

    def __init__(self, artifact: Artifact) -> None:
        self.artifact = artifact
        self.features: tuple[str, ...] = artifact.features
        self.nvec: tuple[int, ...] = artifact.nvec
        self.n_features = len(artifact.features)
        self.n_logits = int(sum(artifact.nvec))
        norm = artifact.normalization
        self._norm = norm is not None
        if norm is not None:
            self._mean = norm.mean.astype(np.float64)
            # Same expression VecNormalize evaluates, so the division is bit-identical.
            self._std = np.sqrt(norm.var + norm.epsilon)
            self._clip = float(norm.clip_obs)
        # Transposed, contiguous weights: h @ W.T without a per-call transpose.
        self._hidden = [(np.ascontiguousarray(w.T), b.copy()) for w, b in artifact.layers[:-1]]
        w_out, b_out = artifact.layers[-1]
        self._w_out = np.ascontiguousarray(w_out.T)
        self._b_out = b_out.copy()
        self._relu = artifact.activation == "relu"
        # Gather table (n_sub, max_n) into the logits padded with one -inf slot at the end, so
        # one argmax over axis -1 picks every sub-action at once.
        starts = np.concatenate([[0], np.cumsum(self.nvec)[:-1]]).astype(np.intp)
        self._starts = starts
        width = max(self.nvec)
        gather = np.full((len(self.nvec), width), self.n_logits, dtype=np.intp)
        for k, (s, n) in enumerate(zip(starts, self.nvec)):
            gather[k, :n] = np.arange(s, s + n)
        self._gather = gather

    @classmethod
    def from_dir(
        cls,
        path: str | os.PathLike[str],
        expected_features: Sequence[str] | None = FEATURE_NAMES,
        expected_nvec: Sequence[int] | None = ACTION_NVEC,
    ) -> "PolicyRuntime":
        """Load and verify an artifact folder; raises ``PolicyLoadError`` saying what is wrong."""
        art = read_artifact(
            path,
            expected_features=None if expected_features is None else tuple(expected_features),
            expected_nvec=None if expected_nvec is None else tuple(int(n) for n in expected_nvec),
        )
        return cls(art)

    @property
    def manifest(self) -> dict[str, Any]:
        return self.artifact.manifest

    # --- checks ------------------------------------------------------------------------------
    def _check_obs(self, obs: np.ndarray | Sequence[float]) -> np.ndarray:
        x = obs if isinstance(obs, np.ndarray) else np.asarray(obs, dtype=np.float32)
        if x.shape[-1:] != (self.n_features,) or x.ndim not in (1, 2):
            raise ValueError(
                f"observation shape {x.shape}: expected ({self.n_features},) or "
                f"(batch, {self.n_features}) in the order {self.features[:3]}..."
            )
        if x.dtype.kind not in "fiu":
            raise ValueError(f"observation dtype {x.dtype} is not numeric")
        if not np.isfinite(x).all():
            bad = np.flatnonzero(~np.isfinite(x).reshape(-1, self.n_features).all(axis=0))
            names = [self.features[i] for i in bad]
            raise ValueError(f"observation has NaN/inf at feature indices {bad.tolist()} {names}")
        return x

    def _check_mask(self, mask: np.ndarray | Sequence[bool], batch: int | None) -> np.ndarray:
        m = np.asarray(mask, dtype=bool)
        want = (self.n_logits,) if batch is None else (batch, self.n_logits)
        if m.shape != want and not (batch is not None and m.shape == (self.n_logits,)):
            raise ValueError(
                f"action mask shape {m.shape}: expected {want} (flat MaskablePPO layout)"
            )
        allowed = np.logical_or.reduceat(m, self._starts, axis=-1)
        if not allowed.all():
            per_sub = allowed.reshape(-1, len(self.nvec)).all(axis=0)
            dead = np.flatnonzero(~per_sub).tolist()
            raise ValueError(
                f"action mask allows no value for sub-action(s) {dead} of nvec {list(self.nvec)}"
            )
        return m

    # --- forward -----------------------------------------------------------------------------
    def normalize(self, obs: np.ndarray) -> np.ndarray:
        """Observation as the network saw it in training (float32)."""
        x = self._check_obs(obs)
        return self._normalize(x)

    def _normalize(self, x: np.ndarray) -> np.ndarray:
        if not self._norm:
            return x.astype(np.float32)
        z = (x - self._mean) / self._std
        np.minimum(z, self._clip, out=z)
        np.maximum(z, -self._clip, out=z)
        return z.astype(np.float32)

    def _logits(self, h: np.ndarray) -> np.ndarray:
        for w, b in self._hidden:
            h = h @ w
            h += b
            if self._relu:
                np.maximum(h, 0.0, out=h)
            else:
                np.tanh(h, out=h)
        out = h @ self._w_out
        out += self._b_out
        return out

    def logits(self, obs: np.ndarray) -> np.ndarray:
        """Unmasked action logits, flat in the MaskablePPO layout (for parity checks)."""
        return self._logits(self._normalize(self._check_obs(obs)))

    def act(self, obs: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """Deterministic action (one int per sub-action) for one observation ``(n_features,)``
        or a batch ``(n, n_features)``. ``mask`` is the flat MaskablePPO boolean mask; masked
        values are never chosen. Bad observations raise ``ValueError`` (fall back to PID)."""
        x = self._check_obs(obs)
        logits = self._logits(self._normalize(x))
        if not np.isfinite(logits).all():
            raise ValueError("the policy returned non-finite outputs (NaN/inf); its weights are broken")
        batch = None if x.ndim == 1 else x.shape[0]
        padded = np.empty(logits.shape[:-1] + (self.n_logits + 1,), dtype=logits.dtype)
        padded[..., :-1] = logits
        padded[..., -1] = -np.inf
        if mask is not None:
            m = self._check_mask(mask, batch)
            np.copyto(padded[..., :-1], -np.inf, where=~m)
        return padded[..., self._gather].argmax(axis=-1)


def benchmark_runtime(
    artifact_dir: str | os.PathLike[str],
    n_calls: int = 20_000,
    *,
    with_mask: bool = False,
    seed: int = 0,
) -> dict[str, float]:
    """Decision latency of ``act`` on single observations (the bench's ``policy`` target).

    Observations are drawn beforehand, uniform in the observation box, so only ``act`` is
    timed; the first 500 calls warm caches and are not counted."""
    if n_calls < 1:
        raise ValueError(f"n_calls must be >= 1, got {n_calls}")
    rt = PolicyRuntime.from_dir(Path(artifact_dir), expected_features=None, expected_nvec=None)
    rng = np.random.default_rng(seed)
    warm = 500
    obs = rng.uniform(OBS_LOW, OBS_HIGH, size=(n_calls + warm, rt.n_features)).astype(np.float32)
    mask = np.ones(rt.n_logits, dtype=bool) if with_mask else None
    times = np.empty(n_calls, dtype=np.float64)
    clock = time.perf_counter_ns
    for i in range(warm):
        rt.act(obs[i], mask)
    for i in range(n_calls):
        t0 = clock()
        rt.act(obs[warm + i], mask)
        times[i] = clock() - t0
    us = times / 1e3
    return {
        "n_calls": float(n_calls),
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "mean_us": float(us.mean()),
        "max_us": float(us.max()),
    }
