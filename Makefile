# ngra: environments, training, tests.
#
#   make train          create .venv if needed, then train a GCN on a generated SBM graph
#   make test           create .venv and .venv-dgl if needed, then run the test suite in both
#   make env / dgl-env  only create (or update) one environment
#   make scatter        also build torch-scatter into .venv (optional; about 10 minutes)
#
# Environments are stamped (.venv/.ngra-env, .venv-dgl/.ngra-env): a second run reinstalls
# nothing unless pyproject.toml or this Makefile changed since the stamp was written.

PYTHON ?= python3
VENV := .venv
DGL_VENV := .venv-dgl

# Main environment: the newest supported torch. On this machine image pip finds a CPU wheel of
# torch 2.13.0 through the find-links of its pip configuration; elsewhere, point pip at a CPU
# build with TORCH_PIP_ARGS (for instance an --index-url) or pip may pick a CUDA one.
TORCH := 2.13.0
TORCH_PIP_ARGS ?=
# DGL environment: DGL 2.1.0 needs torch 2.2; this is also the floor of the supported torch range.
DGL_TORCH := 2.2.1

# Main run: everything except the DGL parity tests (dgl is not installable next to torch 2.13).
PYTEST_MARK ?= not dgl
# DGL run: the DGL parity tests, plus every other non-slow test again at the torch 2.2 floor.
DGL_PYTEST_MARK ?= dgl or not slow
PYTEST_ARGS ?=

PIP := pip install --quiet --disable-pip-version-check

# $(call check_python,ENV,LOW,HIGH): stop with the reason unless LOW <= Python version < HIGH.
define check_python
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; lo, hi = [tuple(map(int, x.split("."))) \
	    for x in ("$(2)", "$(3)")]; sys.exit(0 if lo <= v < hi else f"error: $(PYTHON) is Python \
	    {v[0]}.{v[1]}; $(1) needs Python >= $(2) and < $(3); run make with PYTHON=<another python>")'
endef

.PHONY: help env dgl-env scatter train test test-main test-dgl bench-kernels clean clean-env

help:
	@sed -n '3,6p' Makefile | sed 's/^#   //'

env: $(VENV)/.ngra-env
dgl-env: $(DGL_VENV)/.ngra-env

# torch goes in first, alone and pinned, and stays pinned in the second command, so no other
# requirement can make pip resolve a different (CUDA) torch build.
$(VENV)/.ngra-env: pyproject.toml Makefile
	@echo "==> creating $(VENV) (torch $(TORCH))"
	$(call check_python,$(VENV),3.10,4.0)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/$(PIP) $(TORCH_PIP_ARGS) "torch==$(TORCH)"
	$(VENV)/bin/$(PIP) $(TORCH_PIP_ARGS) "torch==$(TORCH)" -e ".[test,partition,plot,schedule,pyg]"
	@touch $@

# The PyPI torch 2.2.1 wheel is a CUDA build that pulls about 2.5 GB of nvidia-* libraries; on a
# machine without a GPU it runs on the CPU. Creating this environment takes about 3 minutes.
$(DGL_VENV)/.ngra-env: pyproject.toml Makefile
	@echo "==> creating $(DGL_VENV) (torch $(DGL_TORCH), dgl 2.1.0; downloads about 2.5 GB)"
	$(call check_python,$(DGL_VENV),3.10,3.13)
	$(PYTHON) -m venv $(DGL_VENV)
	$(DGL_VENV)/bin/$(PIP) "torch==$(DGL_TORCH)"
	$(DGL_VENV)/bin/$(PIP) "torch==$(DGL_TORCH)" -e ".[test,partition,plot,schedule,pyg,dgl]"
	@touch $@

# torch-scatter is on PyPI only as source: it compiles against the torch already in .venv (no
# build isolation, which would fetch another torch). benchmarks/kernels.py times it when present.
# Not stamped: a .venv created afresh (after make clean-env) does not have it.
scatter: env
	$(VENV)/bin/$(PIP) --no-build-isolation "torch-scatter==2.1.2"

train: env
	$(VENV)/bin/python -m ngra train --model gcn --dataset sbm --epochs 100 --seed 0

# Both environments are created first (side by side; tests of the first session call
# .venv-dgl's python when it is there, so it must not be half-built under them), then the two
# sessions run side by side: on a 2-core machine neither keeps both cores busy all the time
# (numba compiles on one thread). -O shows each session's output whole when it ends, not
# interleaved. -k: a failure in one environment still lets the other one run and report (an
# environment that failed to build is tried again, and fails, in the second step).
# TEST_JOBS=1 does everything one step after the other.
TEST_JOBS ?= 2
test:
	-@$(MAKE) --no-print-directory -k -j$(TEST_JOBS) env dgl-env
	@$(MAKE) --no-print-directory -k -j$(TEST_JOBS) -O test-main test-dgl

# pytest exits 5 when the selection is empty: that is a broken selection, so it stays an error,
# with a message saying so.
define run_pytest
	@echo "==> $(1): pytest -m \"$(2)\""
	@$(1)/bin/python -c "import sys, torch; print(sys.executable, 'torch', torch.__version__)"
	@DGLBACKEND=pytorch $(1)/bin/python -m pytest -m "$(2)" --durations=15 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest selected no tests with -m \"$(2)\" in $(1)" >&2; fi; \
	exit $$rc
endef

test-main: env
	$(call run_pytest,$(VENV),$(PYTEST_MARK))

test-dgl: dgl-env
	$(call run_pytest,$(DGL_VENV),$(DGL_PYTEST_MARK))

bench-kernels: env
	$(VENV)/bin/python benchmarks/kernels.py --quick

clean:
	rm -rf .pytest_cache .hypothesis build dist *.egg-info
	find . -path ./$(VENV) -prune -o -path ./$(DGL_VENV) -prune -o \
	    \( -name __pycache__ -o -name '*.nbi' -o -name '*.nbc' \) -print0 | xargs -0 -r rm -rf

clean-env:
	rm -rf $(VENV) $(DGL_VENV)
