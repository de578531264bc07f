# The two commands of the README: `make test` and `make demo`. Both set up from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The examples' datasets (UMLS, Kinships, Nations) are plain text files inside PyKEEN's wheel.
# --no-deps: only those files are read (pykeen is never imported), nothing else is pulled in.
PYKEEN := pykeen==1.11.1

.PHONY: setup test test-all demo bench clean

setup: $(STAMP)

# torch first, pinned to the version the tests were run with, so that the next install finds
# it satisfied and does not resolve a torch of its own (the package itself asks only for
# torch>=2.1). Which build pip takes depends on the indexes it uses: on Linux, PyPI's torch is
# the CUDA build (several GB); for the CPU build, add PyTorch's CPU index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make test
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[torch,jax,test,bench]"
	$(PY) -m pip install -q --no-deps $(PYKEEN)
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow"

# the guard installs the data into a .venv set up before the examples existed
demo: $(STAMP)
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('pykeen') is None)" \
		|| $(PY) -m pip install -q --no-deps $(PYKEEN)
	$(PY) -m examples.demo

bench: $(STAMP)
	$(PY) -m benchmarks.warm

clean:
	rm -rf $(VENV) .pytest_cache runs
	find . -name __pycache__ -prune -exec rm -rf {} +
