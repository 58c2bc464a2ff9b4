# Quick start: `make run` (set up + throughput run on the mock backend), `make test` (set up + full suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test lint typecheck bench mutation clean

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

# Mutation testing of the core modules (minutes per module; configured in pyproject.toml under
# [tool.mutmut]), then the kill rate per module. `mutmut results` lists the survivors and
# `mutmut show NAME` shows one; equivalent mutants are marked in the code.
MUTATION_MODULES := engine_core._core.block_pool engine_core._core.kv_cache_manager \
	engine_core._core.scheduler engine_core._frontend.detokenizer engine_core._frontend.stop_strings

mutation: $(STAMP)
	for m in $(MUTATION_MODULES); do env -u PYTHONPATH nice -n 15 $(VENV)/bin/mutmut run "$$m.*" || exit 1; done
	$(VENV)/bin/mutmut results --all true | awk -F': ' '{ m = $$1; gsub(/^ +/, "", m); \
		sub(/\.x[^.]*__mutmut_[0-9]+$$/, "", m); \
		if ($$2 == "not checked" || $$2 == "skipped") next; n[m]++; if ($$2 == "killed" || $$2 == "timeout") k[m]++ } \
		END { for (m in n) printf "%-40s %4d/%-4d killed (%.1f%%)\n", m, k[m], n[m], 100 * k[m] / n[m] }'

clean:
	rm -rf $(VENV) build mutants *.egg-info backends/mock/*.egg-info backends/cuda/*.egg-info
