# The two commands of the README: `make test` and `make demo`. Both set up from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test test-all demo bench clean

setup: $(STAMP)

# torch first, pinned: its CPU wheel lies on this machine's disk; an unpinned `torch` would
# pull a multi-GB CUDA build. The package itself only asks for torch>=2.1.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[torch,jax,test,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow"

demo: $(STAMP)
	$(PY) -m examples.demo

bench: $(STAMP)
	$(PY) -m benchmarks.warm

clean:
	rm -rf $(VENV) .pytest_cache runs
	find . -name __pycache__ -prune -exec rm -rf {} +
