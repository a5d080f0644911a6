# Everyday commands; `make help` lists them. Run from the project root.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
# In the template repository the library's source is here: installed and tested from it.
LIBRARY := $(if $(wildcard lib/pyproject.toml),-e ./lib,)

.PHONY: help install train test test-full test-slow gpu-check lint format ui clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install:  ## create .venv and install the project with the pinned versions (as the README)
	python3 -m venv $(VENV)
	$(BIN)/pip install $(LIBRARY) -e ".[dev]" -c constraints.txt
	$(BIN)/pip install --no-deps -c constraints.txt litdata

train:  ## train with the defaults; pass overrides as ARGS="data=fashion_mnist devices=2"
	$(PY) -m src.train $(ARGS)

test:  ## the daily set: every module, slow end-to-end jobs left out (a few minutes)
	$(PY) -m pytest
	$(if $(LIBRARY),cd lib && ../$(PY) -m pytest)

test-full:  ## everything, 3 tests at a time (what CI runs after the daily set)
	$(PY) -m pytest --full -n 3
	$(if $(LIBRARY),cd lib && ../$(PY) -m pytest --full -n 3)

test-slow:  ## only the end-to-end tests: real jobs, DDP, sweeps, clusters, servers, notebooks
	$(PY) -m pytest -m slow -n 3
	$(if $(LIBRARY),cd lib && ../$(PY) -m pytest -m slow -n 3)

gpu-check:  ## every GPU test and GPU benchmark row, one table (~10 min; without a GPU: says so)
	$(PY) -m benchmarks.gpu_check

lint:  ## ruff, formatting, notebooks stripped, YAML/TOML, Dockerfile (pre-commit)
	$(BIN)/pre-commit run --all-files

format:  ## fix what ruff can fix and format the code
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

ui:  ## MLflow UI on the project's store (./mlflow.db) at http://127.0.0.1:5000
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow ui --workers 1 \
		--backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

clean:  ## remove run outputs and caches (keeps data/, mlflow.db and mlartifacts/)
	rm -rf outputs .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -not -path "./$(VENV)/*" -exec rm -rf {} +
