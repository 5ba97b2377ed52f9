# Two commands on a fresh machine: `make build-engine` and `make test` (both set themselves up).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
CONFIG ?= build_configs/smollm2-135m-cpu.yaml
# The CPU wheel of torch goes in first; installed later, a dependency would pull the CUDA build (GBs).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
export OMP_WAIT_POLICY ?= PASSIVE

OUTPUT ?= artifacts/$(basename $(notdir $(CONFIG)))

.PHONY: setup build-engine run-batch bench bench-structured bench-scale bench-family-decode bench-lora bench-quantization lora-adapters peers serve plan validate deploy test test-fast format clean tables

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

# The example LoRA adapters (upper, ahoy) that build_configs/smollm2-135m-cpu-lora.yaml serves, trained on the default
# build's imported model (one thread, deterministic: 13 min on a clean clone here, 2026-11-28, with the import): then
# `make build-engine CONFIG=build_configs/smollm2-135m-cpu-lora.yaml`.
LORA_BASE := artifacts/smollm2-135m-cpu
lora-adapters: $(STAMP)
	test -f $(LORA_BASE)/import/config.json || $(VENV)/bin/trtllm-pipeline build build_configs/smollm2-135m-cpu.yaml --until import
	$(VENV)/bin/python scripts/train_lora_adapters.py $(LORA_BASE)/import artifacts/lora-adapters --check

# What multi-LoRA costs a decode step, against the default build (docs/benchmarks.md#lora-adapters).
bench-lora: lora-adapters
	$(VENV)/bin/trtllm-pipeline build build_configs/smollm2-135m-cpu.yaml
	$(VENV)/bin/trtllm-pipeline build build_configs/smollm2-135m-cpu-lora.yaml
	$(VENV)/bin/trtllm-pipeline bench lora build_configs/smollm2-135m-cpu-lora.yaml --batch 1 --batch 8 --rounds 5

# The engines `make bench` compares against, built from their own packages in their own environments under the
# cache: llama.cpp (compiled once, ~10 min on 2 cores), OpenVINO GenAI, onnxruntime-genai; see docs/benchmarks.md.
peers: build-engine
	$(VENV)/bin/trtllm-pipeline bench peers $(CONFIG)

# Our engine against every peer offline (speed and quality, interleaved rounds), where its decode step's time goes,
# then the serving benchmarks: ours through its OpenAI gateway and llama-server side by side, then the shared-prefix
# and grounded workloads.
bench: peers
	$(VENV)/bin/trtllm-pipeline bench offline $(CONFIG) --batch 1 --batch 8 --shape 128x64 --repeats 5 --both-spinning
	$(VENV)/bin/trtllm-pipeline bench profile $(CONFIG) --batch 1 --batch 8 --shape 128x64
	$(VENV)/bin/trtllm-pipeline bench serve $(CONFIG) --protocol openai --peer llama-server --concurrency 1 --concurrency 8 --concurrency 16 --requests 16 --output-len 64
	$(VENV)/bin/trtllm-pipeline bench serve $(CONFIG) --workload shared-prefix --workload grounded --concurrency 1 --concurrency 8 --requests 8 --output-len 64

# JSON-schema answers on JSONSchemaBench's schemas, ours and llama-server side by side (DATA: a local copy of it).
bench-structured: peers
	$(VENV)/bin/trtllm-pipeline bench structured $(CONFIG)$(if $(DATA), --data $(DATA))

# What every build stage costs at real model sizes (0.5B, 1.1B, 3B, 8B widths with 2 layers), on both targets: peak
# host memory, CPU and wall seconds, disk, bytes per parameter, beside the memory plan's prediction. Hours on 2 cores;
# run it again to resume (docs/benchmarks.md#build-cost-at-real-sizes).
bench-scale: $(STAMP)
	$(VENV)/bin/trtllm-pipeline bench scale

# The int4 methods side by side on the default model (round-to-nearest, HQQ, GPTQ) and the default int8 engine: decode
# speed and quality against the same fp32 reference, in one run (docs/targets.md#quantization-and-the-shipped-configs).
# The default config leads, so its chat gate scores every engine's greedy chat answers too.
QUANT_CONFIGS := build_configs/smollm2-135m-cpu-int4.yaml build_configs/smollm2-135m-cpu-int4-gptq.yaml build_configs/smollm2-135m-cpu-int4-hqq.yaml
bench-quantization: $(STAMP)
	for config in $(CONFIG) $(QUANT_CONFIGS); do $(VENV)/bin/trtllm-pipeline build $$config || exit 1; done
	$(VENV)/bin/trtllm-pipeline bench offline $(CONFIG) $(QUANT_CONFIGS:%=--with %) --peer none --batch 1 --batch 8 --shape 128x64 --repeats 3

# The fused graph's decode speed per registered family, as ratios to Llama of SmolLM2-135M's size (int8 engines).
bench-family-decode: $(STAMP)
	$(VENV)/bin/trtllm-pipeline bench family-decode --batch 1 --batch 4

plan: $(STAMP)
	$(VENV)/bin/trtllm-pipeline plan $(CONFIG)

validate: $(STAMP)
	$(VENV)/bin/trtllm-pipeline validate $(CONFIG)

# Kubernetes manifests for CONFIG in $(OUTPUT)/deploy/k8s/, validated offline (docs/kubernetes.md).
deploy: $(STAMP)
	$(VENV)/bin/trtllm-pipeline deploy $(CONFIG)

# The whole suite (CI's) in TEST_WORKERS processes (pytest-xdist; each test file runs in one, so its module fixtures
# are made once; see tests/conftest.py for the order); the 15 slowest tests are listed at the end.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# The edit loop: every test that needs neither the real SmolLM2 build nor a server on it (tests/conftest.py marks
# the others `slow` from the fixtures they use).
test-fast: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# ruff formats the tree and fixes what it can (imports); `make test` checks both.
format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf artifacts .pytest_cache

# Maintainers: regenerate-and-compare every table in pipeline/upstream/ from the upstream sources it cites (needs
# those files, downloaded from GitHub or put under --sources); `make test` never reads upstream sources.
tables: $(STAMP)
	$(VENV)/bin/python scripts/dev/tabulate_all.py --check
	$(VENV)/bin/python scripts/dev/render_dockerfile.py --check
