# Quick start: `make run` (sets up the core and the mock backend, then a throughput run on the
# mock), `make test` (sets up the rest, torch's CPU build included, then the full suite).
#
# TORCH_INDEX_URL: where `make test` takes torch from. The default is PyTorch's CPU index, so a
# machine without a GPU does not download a multi-GB CUDA build; on a GPU machine pick a CUDA one
# (make test TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126), or PyPI's default build
# (TORCH_INDEX_URL=https://pypi.org/simple).
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
CORE_STAMP := $(VENV)/.core-installed
STAMP := $(VENV)/.installed

.PHONY: setup setup-core run test lint typecheck bench mutation clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

# The core, the mock and the progress bar: all that `make run` needs (no torch, no Triton).
$(CORE_STAMP): pyproject.toml backends/mock/pyproject.toml | $(PY)
	$(PIP) -e '.[progress]' -e backends/mock
	touch $(CORE_STAMP)

# torch first, from TORCH_INDEX_URL (alone: its dependencies come from the usual index with the
# rest): anything that pulled torch in before it would fetch PyPI's CUDA build. An index that
# cannot be reached is given up quickly (pip's find-links, when configured, still serve). Then the extras
# (Ray among them, for the tests marked `ray`), the test tools and the CUDA backend (whose tests
# run on the CPU).
$(STAMP): $(CORE_STAMP) backends/cuda/pyproject.toml
	$(PIP) --no-deps --retries 1 --timeout 20 torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX_URL)
	$(PIP) -e '.[all,dev]' -e backends/mock -e 'backends/cuda[test]'
	touch $(STAMP)

setup-core: $(CORE_STAMP)

setup: $(STAMP)

run: $(CORE_STAMP)
	$(PY) -m engine_core bench throughput --backend mock --num-prompts 1000 --input-len 128 --output-len 128

# Two worker processes, each test file whole on one of them (its module fixtures built once):
# the suite waits on engine processes and subprocesses as much as it computes.
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check engine_core backends tests bench
	$(VENV)/bin/ruff format --check engine_core backends tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy engine_core backends/mock/engine_core_mock backends/cuda/engine_core_cuda

bench: $(CORE_STAMP)
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
