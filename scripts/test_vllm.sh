#!/usr/bin/env bash
# `make test-vllm`: the vLLM adapter against vLLM's real classes, in its own venv (.venv-vllm, ~4 GB).
#
# vLLM pins a CUDA build of torch and GPU kernel packages that neither install nor load on a CPU machine
# and that its MoE layer code does not import. So: torch 2.13.0 first (the CPU build on a machine without
# CUDA), then vLLM with --no-deps, then the rest of vLLM's requirements less those packages
# (scripts/install_deps.py), then the Triton moe-comm's kernels are tested with. moe-comm goes in editable
# with --no-deps, so that nothing it lists can move that torch. VLLM_VERSION=0.32.0 tests the older
# interface.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV_VLLM:-.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
source scripts/serving_venv.sh

GPU_ONLY="torch torchaudio torchvision torchcodec PyNvVideoCodec flashinfer-python apache-tvm-ffi tilelang
          nvidia-cudnn-frontend nvtx fastsafetensors instanttensor nvidia-cutlass-dsl quack-kernels
          tokenspeed-mla humming-kernels"
# certifi: vLLM 0.33.0 asks for a release newer than the index has; any recent one serves the tests.
serving_venv vllm "$VLLM_VERSION" "$GPU_ONLY" "certifi"
"$PY" -c "import vllm.model_executor.layers.fused_moe.modular_kernel" 2>/dev/null
"$PY" -m pytest -q -ra -p no:cacheprovider tests/vllm "$@"
