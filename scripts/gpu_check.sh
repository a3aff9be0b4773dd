#!/usr/bin/env bash
# GPU check, offline, from the source tree (see ../shared/gpu.md): GPU tests, kernel benchmark, decode
# benchmark, a profile of the decode step's parts, then a one-screen summary. Everything produced goes
# under OUT.
#
#   scripts/gpu_check.sh OUT            (or: make gpu-check OUT=dir)
#
# Without a GPU it still runs, as a dry run (CPU interpreter, tiny shapes, numbers labelled as not GPU
# measurements): the GPU tests skip, bench/kernels.py gets --dry, the decode benchmark a small CPU setting.
#
# Env: PYTHON (default python3); GPU_CHECK_STEPS (default "pytest kernels ep_rank profile decode emulate":
# ep_rank = bench/kernels.py's one-rank-of-EP-N section, a step of its own; the
# profile first, so the decode report can split each difference into communication and graphs + host;
# "emulate" = one rank of EP8 per config, GPU_CHECK_EMULATE_CONFIGS, default Scout, Maverick, DeepSeek-V3);
# GPU_CHECK_MARK (pytest -m expression, default "gpu"; "gpu and not slow" leaves out the soak);
# GPU_CHECK_DECODE_CONFIGS (default "llama4-scout deepseek-v3", batches 1-256); GPU_CHECK_DECODE_ATTENTION
# (default "triton", the GPU default; "torch triton" runs the decode benchmark and profile once per kernel);
# GPU_CHECK_PYTEST_ARGS / GPU_CHECK_KERNEL_ARGS / GPU_CHECK_DECODE_ARGS (extra words for each step);
# GPU_CHECK_STEP_TIMEOUT (seconds per step, default 1800); GPU_CHECK_SANITIZE_K (the pytest -k selection
# the "sanitize" step runs under compute-sanitizer's memcheck, racecheck and synccheck: small shapes, since
# it is slow). A step that fails or times out is recorded and the next one still runs; the exit status is
# the first failure's. "sanitize" is not in the default steps: add it (GPU_CHECK_STEPS="pytest sanitize").
set -u
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
: > "$LOG"
say() { echo "== $*" | tee -a "$LOG"; }

# nvshmem4py is not installed on the GPU machine: install the carried wheel into /tmp/site.
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/nvshmem ]; then
    say "installing $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')into /tmp/site"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none}

status=0
step() {  # step NAME CMD...: run (output to the screen and OUT/NAME.log), remember the first failure
    local name=$1; shift
    say "$name: $*"
    local t0=$SECONDS
    timeout --kill-after=30 "${GPU_CHECK_STEP_TIMEOUT:-1800}" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    say "$name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
    return 0
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.is_available())"
  git rev-parse HEAD 2>/dev/null; git status --short --untracked-files=no 2>/dev/null; } > "$OUT/environment.txt" 2>&1
tee -a "$LOG" < "$OUT/environment.txt"

KERNEL_DRY=""
DECODE_DEFAULTS="--batches 1,2,4,8,16,32,64,128,256"
DECODE_CONFIGS=${GPU_CHECK_DECODE_CONFIGS:-llama4-scout deepseek-v3}
if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "no GPU: dry run, CPU interpreter, not a GPU measurement"
    KERNEL_DRY="--dry"
    DECODE_DEFAULTS="--batches 1,2 --world 2 --steps 3 --warmup 1 --check-steps 2"
    DECODE_CONFIGS=${GPU_CHECK_DECODE_CONFIGS:-llama4-scout}
fi

STEPS=" ${GPU_CHECK_STEPS:-pytest kernels ep_rank profile decode emulate} "
# shellcheck disable=SC2086  (the extra-args variables are word lists on purpose)
[[ $STEPS == *" pytest "* ]] && step pytest-gpu $PY -m pytest -m "${GPU_CHECK_MARK:-gpu}" tests/gpu -q -ra \
    -p no:cacheprovider --junitxml="$OUT/pytest-gpu.xml" ${GPU_CHECK_PYTEST_ARGS:-}
if [[ $STEPS == *" sanitize "* ]]; then
    SANITIZE_K=${GPU_CHECK_SANITIZE_K:-small or (loopback_compiled and 2) or graphs_recover or replay_with_new_counts}
    for tool in memcheck racecheck synccheck; do
        step "sanitize-$tool" compute-sanitizer --tool "$tool" --error-exitcode 1 --target-processes all \
            $PY -m pytest -m "gpu and not slow" tests/gpu -q -ra -p no:cacheprovider -k "$SANITIZE_K"
    done
fi
# shellcheck disable=SC2086
[[ $STEPS == *" kernels "* ]] && step kernels $PY bench/kernels.py $KERNEL_DRY --out-dir "$OUT" ${GPU_CHECK_KERNEL_ARGS:-}
# One step per world (each compiles its own kernel variants; all four in one step would pass the limit).
if [[ $STEPS == *" ep_rank "* ]]; then
    RANK_WORLDS="8 16 32 64"
    [ -n "$KERNEL_DRY" ] && RANK_WORLDS="2 4"
    for w in $RANK_WORLDS; do
        # shellcheck disable=SC2086
        step "ep-rank-w$w" $PY bench/kernels.py $KERNEL_DRY --sections floor,ep_rank --rank-worlds "$w" \
            --out-dir "$OUT" ${GPU_CHECK_KERNEL_ARGS:-}
    done
fi
ATTENTION=${GPU_CHECK_DECODE_ATTENTION:-triton}
if [[ $STEPS == *" profile "* ]]; then
    PROFILE_ARGS="--batches 1,64,256 --steps 20 --warmup 3"
    [ -n "$KERNEL_DRY" ] && PROFILE_ARGS="--batches 1,2 --steps 2 --warmup 1"
    for cfg in ${DECODE_CONFIGS}; do
        for attn in ${ATTENTION}; do
            # shellcheck disable=SC2086
            step "profile-$cfg-attn-$attn" $PY bench/decode_latency.py --profile --world 1 --config "$cfg" \
                --attention "$attn" $PROFILE_ARGS --out-dir "$OUT"
        done
    done
fi
if [[ $STEPS == *" decode "* ]]; then
    for cfg in ${DECODE_CONFIGS}; do
        for attn in ${ATTENTION}; do
            # shellcheck disable=SC2086
            step "decode-$cfg-attn-$attn" $PY bench/decode_latency.py --config "$cfg" --attention "$attn" \
                $DECODE_DEFAULTS --out-dir "$OUT" ${GPU_CHECK_DECODE_ARGS:-}
        done
    done
fi
# One rank of EP8 on this one device (E/8 experts, one rank's batch, peers emulated), world 1: the step
# one rank of an 8-GPU deployment does, minus the link (every backend, the same batches).
if [[ $STEPS == *" emulate "* ]]; then
    EMULATE_DEFAULTS="--world 1 --batches 1,2,4,8,16,32,64,128,256"
    [ -n "$KERNEL_DRY" ] && EMULATE_DEFAULTS="--world 1 --batches 1,2 --steps 3 --warmup 1 --check-steps 2"
    for cfg in ${GPU_CHECK_EMULATE_CONFIGS:-llama4-scout llama4-maverick deepseek-v3}; do
        # shellcheck disable=SC2086
        step "emulate-ep8-$cfg" $PY bench/decode_latency.py --config "$cfg" --emulate-ep 8 $EMULATE_DEFAULTS \
            --out-dir "$OUT" ${GPU_CHECK_DECODE_ARGS:-}
    done
fi
$PY scripts/gpu_summary.py "$OUT" --markdown "$OUT/summary.md" | tee "$OUT/summary.txt"
exit $status
