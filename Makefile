# Two commands on a fresh machine: `make demo` and `make test`. Both install into .venv first when it is
# missing or older than setup.py.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch==2.13.0 is the CPU wheel on the project's machines; on a GPU machine pass e.g. TORCH_SPEC="torch>=2.6".
TORCH_SPEC ?= torch==2.13.0
# megatron-core 0.17+ needs Python >= 3.12; older Pythons get the pinned 0.16.1 (what CI runs).
MCORE_SPEC ?= $(shell $(PYTHON) -c 'import sys; print("megatron-core==0.16.1" if sys.version_info < (3, 12) else "megatron-core>=0.16.1")')
PYTEST_ARGS ?=
# two workers on CI's two cores, whole files per worker (module fixtures build once); TEST_WORKERS=0: one process.
# --no-loadscope-reorder keeps conftest's order (the files that take minutes first): xdist's default reorders whole
# files by their number of tests, which put the few-test multi-process files last and left one worker running them
# alone at the end.
# (pytest-xdist >= 3.8 has the flag; test-gpu asks the machine's xdist whether it does.)
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
XDIST_GPU = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile $(shell $(PYTHON) -c \
	'import xdist; print("--no-loadscope-reorder" * (tuple(map(int, xdist.__version__.split(".")[:2])) >= (3, 8)))'))
NPROC ?= 2

.PHONY: install test test-gpu demo demo-agent demo-vla benchmark learn-gpu lint clean

install: $(STAMP)

# The venv takes about 3 GiB (torch, triton, megatron-core, transformers, pyarrow): said before pip fails half-way.
INSTALL_GIB ?= 3
$(STAMP): setup.py
	@$(PYTHON) -c 'import shutil, sys; d, need = sys.argv[1], float(sys.argv[2]); free = shutil.disk_usage(d).free / 2**30; \
	sys.exit(f"make install: {free:.1f} GiB free under {d}, and .venv needs about {need:g} GiB: free some space, or set " \
	         "VENV= to a disk with room" if free < need else 0)' "$(dir $(abspath $(VENV)))" $(INSTALL_GIB)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q "$(MCORE_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

# pytest exits 5 when it collected no test: that is a failure here, never a silent green.
test: $(STAMP)
	@$(BIN)/python -m pytest tests $(XDIST) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The whole suite on a GPU machine whose $(PYTHON) already holds the packages (no venv built): the GPU-only tests run
# there; the tests calibrated on CPU fp32 (the multi-process workers, the rollout parity tests) pin the CPU themselves.
# Each result is printed with its name as it comes (-o addopts= drops pyproject's -q), so a run cut short by a
# time limit still says which tests failed.
test-gpu:
	@$(PYTHON) -m pytest tests -o addopts= -v -rfE --timeout=900 --durations=15 $(XDIST_GPU) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-gpu: pytest collected no tests" >&2; exit 1; fi; exit $$rc

demo: $(STAMP)
	$(BIN)/python launch/demo.py --nproc $(NPROC)

# multi-turn GRPO with the calculator on CPU, before/after table and summary.json (about a minute on one core;
# tests/test_agent_learning.py runs the same at seed 1; the demo's docstring has seeds 1-10)
demo-agent: $(STAMP)
	$(BIN)/python launch/demo_agent.py --seed 1

benchmark: $(STAMP)
	$(BIN)/python launch/benchmark.py

# the GPU learning run (one CUDA GPU; install with TORCH_SPEC for your CUDA): launch/learn_gpu.py
learn-gpu: $(STAMP)
	$(BIN)/python launch/learn_gpu.py

lint: $(STAMP)
	$(BIN)/python -m ruff check rlhf_mcore kernels launch tests

clean:
	rm -rf $(VENV) outputs .pytest_cache

demo-vla: $(STAMP)
	$(BIN)/python launch/demo_vla.py --seed 1
