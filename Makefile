# Quick start: `make run` (set up + throughput run on the mock backend), `make test` (set up + full suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test lint typecheck bench clean

# torch first, and its CPU build: anything that pulls torch in before it would fetch a CUDA build.
$(STAMP): pyproject.toml backends/mock/pyproject.toml backends/cuda/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q numpy
	$(PY) -m pip install -q -e '.[all,dev]' -e backends/mock -e 'backends/cuda[test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) -m engine_core bench throughput --backend mock --num-prompts 1000 --input-len 128 --output-len 128

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check engine_core backends tests bench
	$(VENV)/bin/ruff format --check engine_core backends tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy engine_core backends/mock/engine_core_mock backends/cuda/engine_core_cuda

bench: $(STAMP)
	$(PY) bench/bench_scheduler.py --workload all

clean:
	rm -rf $(VENV) build *.egg-info backends/mock/*.egg-info backends/cuda/*.egg-info
