# make up    — run the system locally on the embedded default (tiny synthetic checkpoint)
# make test  — create .venv if missing, install, check formatting and lint (ruff), run the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch first, pinned to the CPU wheel these machines carry; the project's range admits a GPU user's build.
TORCH_PIN ?= torch==2.13.0
# Never put the repo root first on sys.path (Python >= 3.11): operator/__init__.py steps aside for the standard
# library's `operator` module when imported under that name, but nothing else from the root should shadow either.
export PYTHONSAFEPATH := 1

.PHONY: install up lint test bench clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

up: install
	$(VENV)/bin/expertmesh up --expert-workers 2

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test: install lint
	scripts/install-tools.sh
	scripts/install-libibverbs.sh
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(PY) -m pytest -q

bench: install
	$(PY) bench/mxfp4.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
