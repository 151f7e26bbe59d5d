"""Shared fixtures. Live-engine fixtures build the tiny random Llama once per session (a few
seconds, no download) and reuse it from the cache afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """Folder of the tiny random Llama (config, safetensors, tokenizer with chat template)."""
    from batchpilot.envs.tiny_model import build_tiny_model

    return build_tiny_model()
