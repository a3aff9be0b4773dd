# Sourced by test_serving.sh: serving_venv DIST VERSION "SKIP..." "RELAX..." builds $VENV
# once per DIST version (marker file), then installs moe-comm into it (editable, --no-deps) on every run,
# which picks up entry-point changes in pyproject.toml. Sets PY.
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TRITON_VERSION=${TRITON_VERSION:-3.6.0}  # the Triton moe-comm is tested with (the frameworks pull newer)
PY="$VENV/bin/python"

serving_venv() {
    local dist=$1 version=$2 skip=$3 relax=$4
    if [ ! -f "$VENV/.ready-$dist-$version" ]; then
        rm -f "$VENV"/.ready-*
        "$PYTHON" -m venv "$VENV"
        "$PY" -m pip install -q --upgrade pip
        "$PY" -m pip install -q "torch==$TORCH_VERSION" packaging
        "$PY" -m pip install -q --no-deps "$dist==$version"
        local pin
        pin=$(mktemp)
        echo "torch==$TORCH_VERSION" > "$pin"
        # shellcheck disable=SC2086
        "$PY" scripts/install_deps.py "$dist" -c "$pin" --skip $skip ${relax:+--relax $relax}
        rm -f "$pin"
        "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
        "$PY" -m pip install -q "triton==$TRITON_VERSION" pytest pytest-timeout
        touch "$VENV/.ready-$dist-$version"
    fi
    "$PY" -m pip install -q --no-deps -e .
}
