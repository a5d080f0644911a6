# Everyday commands; `make help` lists them. Run from the project root.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin

.PHONY: help install train test test-slow test-fast lint format ui clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install:  ## create .venv and install the project with the pinned versions (as the README)
	python3 -m venv $(VENV)
	$(BIN)/pip install -e ".[dev]" -c constraints.txt
	$(BIN)/pip install --no-deps -c constraints.txt litdata

train:  ## train with the defaults; pass overrides as ARGS="data=fashion_mnist devices=2"
	$(PY) -m src.train $(ARGS)

test:  ## the whole test suite (what CI runs)
	$(PY) -m pytest

test-fast:  ## the tests that start no training process
	$(PY) -m pytest -m "not slow"

test-slow:  ## only the end-to-end tests: real jobs, DDP, sweeps, MLflow server, notebooks
	$(PY) -m pytest -m slow

lint:  ## ruff, formatting, notebooks stripped, YAML/TOML, Dockerfile (pre-commit)
	$(BIN)/pre-commit run --all-files

format:  ## fix what ruff can fix and format the code
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

ui:  ## MLflow UI on the project's store (./mlflow.db) at http://127.0.0.1:5000
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

clean:  ## remove run outputs and caches (keeps data/, mlflow.db and mlartifacts/)
	rm -rf outputs .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -not -path "./$(VENV)/*" -exec rm -rf {} +
