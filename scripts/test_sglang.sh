#!/usr/bin/env bash
# `make test-sglang`: the SGLang dispatcher against SGLang's real classes, in its own venv
# (.venv-sglang, ~3.5 GB).
#
# SGLang pins a CUDA build of torch and GPU kernel packages (DeepEP, DeepGEMM, FlashInfer, sgl-kernel,
# ...) that neither install nor load on a CPU machine and that its dispatcher code does not import. So:
# torch 2.13.0 first (the CPU build on a machine without CUDA), then SGLang with --no-deps, then the rest
# of its requirements less those packages (scripts/install_deps.py), then the Triton moe-comm's kernels
# are tested with. torchvision is left out too (its PyPI build needs CUDA torch); the tests replace it
# by an import placeholder (tests/sglang/cpu_shims.py).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV_SGLANG:-.venv-sglang}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
source scripts/serving_venv.sh

GPU_ONLY="torch torchaudio torchvision torchcodec flash-attn-4 flashinfer-python humming-kernels
          nvidia-cutlass-dsl nvidia-mathdx nvshmem4py-cu13 quack-kernels sgl-deep-ep sgl-deep-gemm
          sgl-flash-mla sglang-kernel tilelang torch-memory-saver timm cuda-python deepseek-recipe
          tml-renderers apache-tvm-ffi kernels"
serving_venv sglang "$SGLANG_VERSION" "$GPU_ONLY" ""
"$PY" -m pytest -q -ra -p no:cacheprovider tests/sglang "$@"
