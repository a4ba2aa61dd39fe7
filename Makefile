# The two commands of the README: `make demo` (the main job on embedded defaults) and `make test`.
# Each sets itself up: Debian packages, a virtualenv in .venv, the project installed editable.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SYSTEM_PACKAGES := bwrap:bubblewrap

.PHONY: demo test lint system-packages bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

system-packages:
	scripts/system-packages.sh $(SYSTEM_PACKAGES)

demo: system-packages $(VENV)/.installed
	$(PY) examples/runtime_standalone/demo.py

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: system-packages lint
	$(PY) -m pytest

bench: system-packages $(VENV)/.installed
	$(PY) bench/bench_runtime.py --out docs/benchmarks.md
