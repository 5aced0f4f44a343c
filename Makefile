# Two commands on a fresh machine: `make demo` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test unit lint model clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(VENV)/bin/kvroute build-model

demo: model
	$(VENV)/bin/kvroute demo

lint: setup
	$(VENV)/bin/ruff check router scorers fleet kvroute tests scripts
	$(VENV)/bin/mypy

test: model lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
