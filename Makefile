# Two commands do all the set-up: `make demo` and `make test` (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.m2flow-installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

# torch is pinned to the CPU build on disk and installed first, so nothing pulls a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/m2flow demo

test: setup
	$(PY) -m pytest -q -x --durations=15 tests

bench: setup
	$(PY) -m pip install -q -e ".[test,bench]"

clean:
	rm -rf runs/ .pytest_cache
