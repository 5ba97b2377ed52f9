# Two commands on a fresh machine: `make build-engine` and `make test` (both set themselves up).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
CONFIG ?= build_configs/smollm2-135m-cpu.yaml
# The CPU wheel of torch goes in first; installed later, a dependency would pull the CUDA build (GBs).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup build-engine run-batch bench serve plan validate test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check --upgrade pip
	$(VENV)/bin/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev,quant]'
	touch $(STAMP)

build-engine: $(STAMP)
	$(VENV)/bin/trtllm-pipeline build $(CONFIG)

run-batch: build-engine
	$(VENV)/bin/python scripts/run_batch.py $(CONFIG) --chat --input-file scripts/prompts.txt --output-file artifacts/run_batch.jsonl

serve: build-engine
	$(VENV)/bin/trtllm-pipeline serve $(CONFIG)

# ~5 minutes on 2 cores: the engine vs transformers offline, then the in-flight batching gain on Triton.
bench: build-engine
	$(VENV)/bin/trtllm-pipeline bench offline $(CONFIG) --batch 1 --batch 8 --shape 128x64
	$(VENV)/bin/trtllm-pipeline bench serve $(CONFIG) --concurrency 1 --concurrency 8 --concurrency 16 --requests 16 --output-len 64

plan: $(STAMP)
	$(VENV)/bin/trtllm-pipeline plan $(CONFIG)

validate: $(STAMP)
	$(VENV)/bin/trtllm-pipeline validate $(CONFIG)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf artifacts .pytest_cache
