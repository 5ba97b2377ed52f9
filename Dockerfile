# Two images from one file.
#   CPU (default):  docker build -t trtllm-pipeline .
#                   docker run --rm -p 8000-8002:8000-8002 trtllm-pipeline
#   GPU:            docker build --target gpu --build-arg TRITON_TAG=25.05 --build-arg CONFIG=build_configs/smollm2-135m-fp8.yaml -t trtllm-pipeline:gpu .
#                   docker run --rm --gpus all -p 8000-8002:8000-8002 trtllm-pipeline:gpu
# The GPU image starts from NVIDIA's Triton TensorRT-LLM container; its tag must match target.trtllm_version
# (pipeline/targets/trtllm.py TRITON_CONTAINERS: 0.18 -> 25.03, 0.19 -> 25.05, 0.20 -> 25.06).
# The GPU engine is built when the container starts (a GPU is needed), then served.
ARG TRITON_TAG=25.05

FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3 AS gpu
ARG CONFIG=build_configs/smollm2-135m-fp8.yaml
ENV CONFIG=${CONFIG} TRTLLM_PIPELINE_CACHE=/opt/trtllm-pipeline/.cache
WORKDIR /opt/trtllm-pipeline
COPY pyproject.toml Makefile README.md ./
COPY pipeline pipeline
# torch and tensorrt_llm come with the container; install only what they lack
RUN pip install --no-cache-dir -e '.[quant]'
COPY build_configs build_configs
COPY scripts scripts
EXPOSE 8000 8001 8002
CMD ["sh", "-c", "trtllm-pipeline build $CONFIG && trtllm-pipeline serve $CONFIG --host 0.0.0.0"]

FROM python:3.11-slim-bookworm AS cpu
RUN apt-get update && apt-get install -y --no-install-recommends make procps && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/trtllm-pipeline
ENV TRTLLM_PIPELINE_CACHE=/opt/trtllm-pipeline/.cache OMP_WAIT_POLICY=PASSIVE
COPY pyproject.toml Makefile README.md ./
COPY pipeline pipeline
RUN make setup
COPY build_configs build_configs
COPY scripts scripts
RUN make build-engine
EXPOSE 8000 8001 8002
CMD [".venv/bin/trtllm-pipeline", "serve", "build_configs/smollm2-135m-cpu.yaml", "--host", "0.0.0.0"]
