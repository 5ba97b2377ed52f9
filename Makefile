# Two commands on a fresh machine: `make build-engine` and `make test` (both set themselves up).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
CONFIG ?= build_configs/smollm2-135m-cpu.yaml
# The CPU wheel of torch goes in first; installed later, a dependency would pull the CUDA build (GBs).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
export OMP_WAIT_POLICY ?= PASSIVE

# The onnxruntime-genai peer of `make bench`: its model builder needs transformers 5, which the pipeline's
# environment cannot take (optimum-onnx, ModelOpt and the GGUF import pin 4.57), so it gets its own, build-only one.
GENAI_VENV ?= .venv-genai
GENAI_SPEC ?= onnxruntime-genai==0.18.0
OUTPUT ?= artifacts/$(basename $(notdir $(CONFIG)))
GENAI_MODEL ?= $(OUTPUT)/genai-int4

.PHONY: setup build-engine run-batch bench bench-family-decode genai-peer serve plan validate deploy test test-fast format clean tables

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

$(GENAI_VENV)/.installed:
	test -x $(GENAI_VENV)/bin/python || $(PYTHON) -m venv $(GENAI_VENV)
	$(GENAI_VENV)/bin/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(GENAI_VENV)/bin/pip install -q --disable-pip-version-check "$(GENAI_SPEC)" "transformers>=5,<6" onnx onnx-ir
	touch $@

# onnxruntime-genai's INT4 CPU model of the same imported checkpoint (its builder's defaults), for `bench offline --genai-model`.
genai-peer: build-engine $(GENAI_MODEL)/genai_config.json
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[bench]'

$(GENAI_MODEL)/genai_config.json: $(OUTPUT)/import/model.safetensors $(GENAI_VENV)/.installed
	rm -rf $(GENAI_MODEL).tmp
	$(GENAI_VENV)/bin/python -m onnxruntime_genai.models.builder -i $(OUTPUT)/import -o $(GENAI_MODEL).tmp -p int4 -e cpu -c $(GENAI_MODEL).cache > $(OUTPUT)/genai-builder.log 2>&1
	rm -rf $(GENAI_MODEL) $(GENAI_MODEL).cache && mv $(GENAI_MODEL).tmp $(GENAI_MODEL)

# ~6 minutes on 2 cores: the engine vs transformers and onnxruntime-genai offline, then the in-flight batching gain on
# Triton; then ~3 more (4m42 on busy cores): the shared-prefix and grounded workloads, whose long prefills dominate.
bench: build-engine genai-peer
	$(VENV)/bin/trtllm-pipeline bench offline $(CONFIG) --batch 1 --batch 8 --shape 128x64 --repeats 3 --genai-model $(GENAI_MODEL) --both-spinning
	$(VENV)/bin/trtllm-pipeline bench serve $(CONFIG) --concurrency 1 --concurrency 8 --concurrency 16 --requests 16 --output-len 64
	$(VENV)/bin/trtllm-pipeline bench serve $(CONFIG) --workload shared-prefix --workload grounded --concurrency 1 --concurrency 8 --requests 8 --output-len 64

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
