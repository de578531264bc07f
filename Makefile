# The two commands of the README: `make test` and `make demo`. Both set up from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# PyKEEN: the pykeen extra (adapters.pykeen and its tests), pinned to the version the tests
# were run with; the examples' datasets (UMLS, Kinships, Nations) are text files in its wheel.
# It brings pandas, scikit-learn, optuna, class-resolver, ... (about 45 s and 300 MB more).
PYKEEN := pykeen==1.11.1

# pytest-xdist workers: the suite waits on subprocesses and the disk part of the time, so two
# workers on two cores finish it well before one does (docs/notebook.md, suite time)
WORKERS ?= 2

.PHONY: setup test test-all demo bench clean

setup: $(STAMP)

# torch first, pinned to the version the tests were run with, so that the next install finds
# it satisfied and does not resolve a torch of its own (the package itself asks only for
# torch>=2.1). Which build pip takes depends on the indexes it uses: on Linux, PyPI's torch is
# the CUDA build (several GB); for the CPU build, add PyTorch's CPU index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make test
#
# pip byte-compiles what it installs on one core; COMPILE_ALL compiles it on every core
# instead (13-34 s less on 2 cores, docs/notebook.md). The .pyc files matter: where
# PYTHONDONTWRITEBYTECODE is set (as on this project's machines) nothing writes them later,
# and every interpreter the tests start would compile torch's sources again. A file that
# does not compile (torch ships one for Python 3.12 only) is left to import time, as pip
# leaves it.
COMPILE_ALL := import compileall, sysconfig; \
	compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --upgrade pip
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e ".[torch,jax,test,bench,pykeen]" "$(PYKEEN)" torch==2.13.0
	$(PY) -c "$(COMPILE_ALL)"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS)

test-all: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) -m "slow or not slow"

# the guard installs PyKEEN into a .venv set up before the pykeen extra existed
demo: $(STAMP)
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('class_resolver') is None)" \
		|| $(PY) -m pip install -q "$(PYKEEN)" torch==2.13.0
	$(PY) -m examples.demo

bench: $(STAMP)
	$(PY) -m benchmarks.warm

clean:
	rm -rf $(VENV) .pytest_cache runs
	find . -name __pycache__ -prune -exec rm -rf {} +
