# eyrie — the commands a user types. Every target installs what it needs first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
EYRIE := $(VENV)/bin/eyrie
PY := $(VENV)/bin/python
EXTRAS ?= dev,ml,generate,docker,provision
RUN_DIR ?= runs/demo

.PHONY: help venv demo test test-slow lint clean

help:
	@echo "make demo       run the embedded demo pipeline on this machine, then show its status"
	@echo "make test       run the test suite (default markers: not slow, not host)"
	@echo "make test-slow  run the slow suites too"

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	@touch $@

venv: $(VENV)/.installed-$(EXTRAS)

demo: venv
	$(EYRIE) run pipeline/embedded/demo.yaml --run-dir $(RUN_DIR)
	$(EYRIE) status --run-dir $(RUN_DIR)

test: venv
	$(VENV)/bin/pytest

test-slow: venv
	$(VENV)/bin/pytest -m "slow"

lint: venv
	$(VENV)/bin/ruff check pipeline tests benchmarks

clean:
	rm -rf runs .eyrie .pytest_cache
