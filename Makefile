# `make test` on a fresh machine sets everything up and runs the suite on
# every supported stack; `make demo` sets up the primary stack and runs the demo.
#
# Stacks (requirements/stacks/*.txt): the primary one runs the whole suite;
# the compatibility stacks (the vLLM versions vLLM-Ascend releases run on)
# run the unit suite and the engine tests marked `compat` (the kernel suite
# once per torch, see COMPAT_TESTS). A `compat("fact", ...)` test runs on a
# compatibility stack only where one of those facts has a value no stack
# before it in COMPAT_STACKS (primary first) had: tests/support/stack_facts.py
# holds the table, checked against each stack by tests/unit/test_stack_facts.py.
# Each stack is installed once per machine outside the clone (scripts/stacks.py);
# the clone gets light overlay venvs: .venv for the primary stack,
# build/stacks/<stack>/venv (with a copy of the tree in build/stacks/<stack>/src,
# so each stack has its own build of the native ops) for the others.
SHELL := /bin/bash
PYTHON ?= python3
PRIMARY_STACK := vllm-0.32
COMPAT_STACKS := vllm-0.26 vllm-0.30 vllm-0.29 vllm-0.27 vllm-0.23
# Compatibility stacks running at once (each runs real engines; more than
# this on a 2-core machine only adds memory pressure, not throughput).
COMPAT_JOBS ?= 3
VENV := .venv
PY := $(VENV)/bin/python
STACKS := $(PYTHON) scripts/stacks.py
BUILD_STAMP := $(VENV)/.lmcache-ascend-built
NATIVE_SRC := $(shell find csrc -type f 2>/dev/null) CMakeLists.txt setup.py pyproject.toml
# The tests also need the AscendC simulation module (not part of a wheel).
BUILD_ENV := LMCA_BUILD_ASCEND_SIM=1
PIP_BUILD := -m pip install -q --no-build-isolation --no-deps -e .
# What the compatibility stacks run. The kernel suite does not import vLLM,
# so it runs once per torch: vllm-0.23 and vllm-0.26 both pin torch 2.11
# (and share it: the torch-2.11 base stack).
# It runs on vllm-0.26. Measured once each on a shared 2-core machine: with
# the kernels on vllm-0.26, the compat stacks took 14.0 min and CI 39.2 min;
# with them on vllm-0.23, 16.7 min and 43.6 min.
COMPAT_TESTS := -m "not engine or compat" tests
# A stack whose torch an earlier stack already ran: tests that load neither
# vLLM nor LMCache (marker `pure`, checked by tests/unit/test_pure_marker.py)
# would repeat that run. vllm-0.27/0.29/0.30 share the primary stack's torch
# (torch-2.13 base), vllm-0.23 shares vllm-0.26's (torch-2.11 base).
SAME_TORCH_TESTS := -m "(not engine and not pure) or compat" tests --ignore=tests/kernels
COMPAT_TESTS_vllm-0.23 := $(SAME_TORCH_TESTS)
COMPAT_TESTS_vllm-0.27 := $(SAME_TORCH_TESTS)
COMPAT_TESTS_vllm-0.29 := $(SAME_TORCH_TESTS)
COMPAT_TESTS_vllm-0.30 := $(SAME_TORCH_TESTS)
# `make test` prints its wall time (setup included) against this goal, in
# minutes; over it is a warning, never a failure.
TEST_GOAL_MIN ?= 45
# When this make started (make reads this before it runs any prerequisite),
# and a shell command printing the minutes since a `date +%s` time.
MAKE_START := $(shell date +%s)
MINUTES_SINCE = awk -v t0="$(1)" -v t1="$$(date +%s)" 'BEGIN { printf "%.1f min", (t1 - t0) / 60 }'

.PHONY: all venv build test test-primary test-compat test-stack prepare-stack test-unit \
        test-integration demo bench clean system-deps stacks typecheck

all: build

# Debian packages and the Mooncake wheel the tests need: redis-server, and
# Mooncake's TCP build (mooncake_master, mooncake_client and its Python store)
# in the primary venv with the libraries it links even for TCP. The wheel is
# pip-installed into the overlay venv, not the stack file, so adding it does
# not reinstall the primary stack (3 s against minutes).
MOONCAKE_WHEEL := mooncake-transfer-engine-non-cuda==0.3.13.post1
MOONCAKE_DEBS := libibverbs1 libnl-3-200 libnl-route-3-200
# scripts/apt_install.sh waits for apt's locks (another process often holds
# them on a fresh machine); a failed install stops the setup, naming the
# packages.
system-deps: venv
	@missing=""; command -v redis-server >/dev/null 2>&1 || missing="redis-server"; \
	for d in $(MOONCAKE_DEBS); do dpkg -s $$d >/dev/null 2>&1 || missing="$$missing $$d"; done; \
	if [ -n "$$missing" ]; then echo "[setup] installing Debian packages:$$missing (redis-server for the Redis tests; the rest Mooncake links)"; \
	  scripts/apt_install.sh $$missing || { \
	    echo "[setup] apt-get could not install$$missing: install them, then run this again"; exit 1; }; fi
	@$(PY) -c "import mooncake.store" 2>/dev/null || { \
	  echo "[setup] installing $(MOONCAKE_WHEEL) into $(VENV)"; \
	  $(PY) -m pip install -q --disable-pip-version-check $(MOONCAKE_WHEEL); }

venv:
	@$(STACKS) overlay $(PRIMARY_STACK) $(VENV) >/dev/null

$(BUILD_STAMP): $(NATIVE_SRC) | venv
	@echo "[build] building lmcache_ascend (native ops) in place for stack $(PRIMARY_STACK)"
	@rm -f build/native-build.txt
	$(BUILD_ENV) $(PY) $(PIP_BUILD) 2>&1 | tail -n 20; test $${PIPESTATUS[0]} -eq 0
	@cat build/native-build.txt 2>/dev/null || true
	touch $@

build: venv $(BUILD_STAMP)

# mypy over lmcache_ascend/ (pyproject.toml's [tool.mypy]: strict on planning/
# and transfer/, default checks elsewhere), pinned in requirements/typecheck.txt
# and installed into $(VENV) itself (the Mooncake wheel's way, above), so
# pinning it reinstalls no stack. Needs no build (_build_info.pyi stands in
# for the generated module). Its cache is build/mypy_cache: 12-22 s cold on
# a shared 2-core machine, 1 s warm.
TYPECHECK_REQS := requirements/typecheck.txt
TYPECHECK_STAMP := $(VENV)/.lmcache-ascend-typecheck-tools
$(TYPECHECK_STAMP): $(TYPECHECK_REQS) | venv
	@echo "[setup] installing $$(grep -v '^#' $(TYPECHECK_REQS) | xargs) into $(VENV)"
	@$(PY) -m pip install -q --disable-pip-version-check -r $(TYPECHECK_REQS)
	@touch $@

typecheck: venv $(TYPECHECK_STAMP)
	@echo "[typecheck] mypy: strict on planning/ and transfer/, default checks elsewhere"
	$(PY) -m mypy

# Every stack, even when one fails; the exit status says whether all passed.
# scripts/test_all.py schedules them: the compatibility stacks are installed
# and built in the background while the primary suite runs, and tested beside
# it (COMPAT_BESIDE at a time; an engine test keeps 2 cores about half busy),
# then COMPAT_JOBS at a time once it has ended, each into its own log,
# printed when all are done. Two stacks beside the primary overloaded a
# 2-core machine (load average 4.5; vllm-0.26 took 28.6 min instead of 19,
# the primary suite had run 5% of its tests after 43 min): one it is.
COMPAT_BESIDE ?= 1
# A second stack joins it only when every stack is prepared and the cores
# were under COMPAT_IDLE_BELOW busy over the last 2 minutes (the primary
# suite and one stack left 12-22% of two cores idle for 15 minutes).
COMPAT_BESIDE_MAX ?= 2
COMPAT_IDLE_BELOW ?= 0.85
# The order stacks are prepared and tested in: longest first (their wall
# times in the fresh-cache run of 7fbafa0: 16.6, 8.8, 8.4, 6.5 and 6.2 min),
# so the stacks left after the primary suite, where the cores idle most, are
# the shortest. COMPAT_STACKS' order is the facts order (stack_facts.ORDER:
# which stack covers which compat test) and is not changed by this one.
COMPAT_RUN_ORDER ?= vllm-0.26 vllm-0.30 vllm-0.23 vllm-0.29 vllm-0.27
# The time budget of `make test`, in minutes from its start (0: none), for
# machines too slow to run everything before CI's 90-minute limit cuts the
# log off mid-test (seen: a CI machine whose setup alone took 75 minutes).
# No engine test and no stack starts in its last TEST_BUDGET_MARGIN_MIN
# (pytest's own timeout of 900 s, plus teardown: a test started before that
# ends before the budget does); whatever still runs at its end is stopped.
# The tests that start no engine run first and always run; the run passes
# only if every test that ran passed and the primary suite ended by itself,
# and it names what the budget cut (scripts/test_all.py). A setup longer than
# TEST_SLOW_SETUP_MIN (2.5-3 min on a fresh, normal machine) marks a slow
# machine: the compatibility stacks then wait for the primary suite.
TEST_BUDGET_MIN ?= 85
TEST_BUDGET_MARGIN_MIN ?= 16
TEST_SLOW_SETUP_MIN ?= 10
# The type check runs beside the primary suite (--check), not before it: a
# cold mypy took 15 minutes of a slow machine's setup; its tools are
# installed in the setup.
test: system-deps build $(TYPECHECK_STAMP)
	@$(PYTHON) scripts/test_all.py --primary $(PRIMARY_STACK) --check typecheck --compat $(COMPAT_STACKS) \
	  --order $(COMPAT_RUN_ORDER) --beside $(COMPAT_BESIDE) --beside-max $(COMPAT_BESIDE_MAX) \
	  --idle-below $(COMPAT_IDLE_BELOW) --jobs $(COMPAT_JOBS) --goal-min $(TEST_GOAL_MIN) --start $(MAKE_START) \
	  --budget-min $(TEST_BUDGET_MIN) --budget-margin-min $(TEST_BUDGET_MARGIN_MIN) \
	  --slow-setup-min $(TEST_SLOW_SETUP_MIN)

test-primary: system-deps build
	@echo "[test] stack $(PRIMARY_STACK): the whole suite"
	$(PY) -m pytest -q --durations=25 tests

test-compat: system-deps
	@failed=""; for s in $(COMPAT_STACKS); do \
	  $(MAKE) --no-print-directory test-stack STACK=$$s || failed="$$failed $$s"; \
	done; if [ -n "$$failed" ]; then echo "[test] FAILED on:$$failed"; exit 1; fi

# One compatibility stack, STACK=vllm-0.23: install it (once per machine),
# copy the tree to build/stacks/<stack>/src and build it there (incremental,
# or the modules another tree of the same torch built: setup.py, _BuildCache).
prepare-stack:
	@test -n "$(STACK)" || { echo "usage: make prepare-stack STACK=<name>"; exit 2; }
	$(STACKS) sync build/stacks/$(STACK)/src
	@$(STACKS) overlay $(STACK) build/stacks/$(STACK)/venv >/dev/null
	@rm -f build/stacks/$(STACK)/src/build/native-build.txt
	cd build/stacks/$(STACK)/src && $(BUILD_ENV) ../venv/bin/python $(PIP_BUILD) 2>&1 | tail -n 20; test $${PIPESTATUS[0]} -eq 0
	@cat build/stacks/$(STACK)/src/build/native-build.txt 2>/dev/null || true

# Its last line gives the stack's wall time (preparing included), so each
# stack's log under `make test` records its own.
STACK_PYTEST = ../venv/bin/python -m pytest -q --durations=15 $(or $(COMPAT_TESTS_$(STACK)),$(COMPAT_TESTS))
test-stack: system-deps
	@test -n "$(STACK)" || { echo "usage: make test-stack STACK=<name>"; exit 2; }
	@echo "[test] stack $(STACK): unit, kernel and compat engine tests"
	@t=$$(date +%s); \
	$(MAKE) --no-print-directory prepare-stack STACK=$(STACK) && \
	{ echo 'cd build/stacks/$(STACK)/src && $(STACK_PYTEST)'; \
	  cd build/stacks/$(STACK)/src && $(STACK_PYTEST); }; rc=$$?; \
	if [ $$rc = 0 ]; then r=passed; else r="FAILED (exit $$rc)"; fi; \
	echo "[test] stack $(STACK): $$r, wall time $$($(call MINUTES_SINCE,$$t))"; exit $$rc

stacks:
	@$(STACKS) list

test-unit: build
	$(PY) -m pytest -q tests/unit tests/kernels

test-integration: system-deps build
	$(PY) -m pytest -q tests/integration

demo: build
	$(VENV)/bin/lmcache-ascend demo

bench: build
	$(PY) bench/bench_kernels.py

clean:
	rm -rf build *.egg-info lmcache_ascend/*.so lmcache_ascend/_build_info.py $(BUILD_STAMP)
