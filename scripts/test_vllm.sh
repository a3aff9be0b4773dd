#!/usr/bin/env bash
# `make test-vllm`: the vLLM adapter against vLLM's real classes, in its own venv (.venv-vllm, ~6 GB).
#
# vLLM 0.32.0 is installed over torch 2.13.0 (the CPU build on a machine without CUDA). torchvision,
# torchaudio and torchcodec come along as vLLM dependencies but their builds do not load against the
# CPU torch, and the MoE code never needs them: they are removed. vLLM pulls in a newer Triton than the one
# moe-comm's kernels are tested with; that one is put back. moe-comm goes in editable with
# --no-deps so that nothing it lists can move the torch that vLLM was installed against.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV_VLLM:-.venv-vllm}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TRITON_VERSION=${TRITON_VERSION:-3.6.0}  # the Triton moe-comm is tested with (vLLM itself does not pin one)
PY="$VENV/bin/python"

if [ ! -f "$VENV/.ready-$VLLM_VERSION" ]; then
    "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "torch==$TORCH_VERSION"
    "$PY" -m pip install -q "vllm==$VLLM_VERSION"
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    "$PY" -m pip install -q "triton==$TRITON_VERSION"
    "$PY" -m pip install -q pytest pytest-timeout
    touch "$VENV/.ready-$VLLM_VERSION"
fi
"$PY" -m pip install -q --no-deps -e .   # every run: picks up entry-point changes in pyproject.toml
"$PY" -c "import vllm.model_executor.layers.fused_moe.modular_kernel" 2>/dev/null
"$PY" -m pytest -q -ra tests/vllm "$@"
