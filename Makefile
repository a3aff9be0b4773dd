# `make test` and `make demo` each build .venv from nothing, with the exact versions of
# requirements/constraints.txt (torch 2.13.0: on a CPU machine pip takes the CPU build from the local wheel
# directory), then this project in editable mode.
PYTHON ?= python3
VENV   ?= .venv
CONSTRAINTS := requirements/constraints.txt
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c $(CONSTRAINTS)

# test-long: the same suite with the soak, exclusion, round-trip and order tests at full size (tests/budget.py).
.PHONY: test test-long demo test-vllm test-sglang gpu-check gpu-quick clean
OUT ?= bench/results/gpu-check

$(VENV)/.ready: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip setuptools
	$(PIP) torch
	$(PIP) --no-build-isolation -e '.[test,bench]'
	$(PIP) --no-deps nvidia-nvshmem-cu13  # NVSHMEM device bitcode only: the put transport's sm_90 compile check
	touch $@

test: $(VENV)/.ready
	$(PY) -m pytest -q -ra --durations=30 tests

test-long: $(VENV)/.ready
	MOE_COMM_LONG_TESTS=1 $(PY) -m pytest -q -ra --durations=30 tests

demo: $(VENV)/.ready
	$(PY) -m moe_comm.serving.latency_bench

# vLLM / SGLang integration against their real classes on CPU ranks: each in its own venv (.venv-vllm,
# .venv-sglang: 3-4 GB each), not part of `make test`.
test-vllm:
	bash scripts/test_serving.sh vllm

test-sglang:
	bash scripts/test_serving.sh sglang

# On a GPU machine, offline, with that machine's own Python (no .venv: installing would fetch packages):
# GPU tests, kernel benchmark, decode benchmark, summary table; everything under OUT.
gpu-check:
	PYTHON=$(PYTHON) scripts/gpu_check.sh $(OUT)

# A GPU loan of minutes: every claim in priority order, each step within its own budget, results written
# under OUT as each step ends (GPU_QUICK_BUDGET_S=seconds scales the whole run, GPU_QUICK_STEPS=a,b picks
# steps; BASELINE=other checkout).
# Without a GPU: the dry run (tiny shapes, interpreter, labelled).
gpu-quick:
	$(PYTHON) scripts/gpu_quick.py $(OUT)

clean:
	rm -rf $(VENV) .pytest_cache
