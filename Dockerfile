# Two images from one file.
#   CPU (default):  docker build -t trtllm-pipeline .   (--build-arg=CONFIG=build_configs/X.yaml builds another config in)
#                   docker run --rm -p 8000-8002:8000-8002 trtllm-pipeline
#   GPU:            docker build --target=gpu --build-arg=TRITON_TAG=26.07 --build-arg=TRTLLM_VERSION=1.2 \
#                     --build-arg=CONFIG=build_configs/smollm2-135m-fp8.yaml --tag=trtllm-pipeline:gpu-1.2 .
#                   docker run --rm --gpus all -p 8000-8002:8000-8002 trtllm-pipeline:gpu-1.2
# `trtllm-pipeline plan CONFIG` prints the GPU command for a config: TRITON_TAG is the newest NVIDIA Triton
# container holding its target.trtllm_version (pipeline/targets/trtllm/adapter.py TRITON_CONTAINERS), and the build stops
# if the container's TensorRT-LLM is another release. The build runs when the container starts (an engine needs
# the GPU), then `serve`: trtllm-serve for the PyTorch backend (OpenAI API on port 8000), tritonserver for engines.
# On Kubernetes, `trtllm-pipeline deploy CONFIG` writes the manifests running either image (docs/kubernetes.md).
ARG TRITON_TAG=26.07

FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3 AS gpu
ARG CONFIG=build_configs/smollm2-135m-fp8.yaml
ARG TRTLLM_VERSION=1.2
ENV CONFIG=${CONFIG} TRTLLM_PIPELINE_CACHE=/opt/trtllm-pipeline/.cache
WORKDIR /opt/trtllm-pipeline
COPY pyproject.toml Makefile README.md ./
COPY pipeline pipeline
# The container's tensorrt_llm, torch, ModelOpt and transformers stay exactly as NVIDIA built them, which the last
# line checks: the pipeline gets a virtualenv that sees them (--system-site-packages, so the container's CUDA torch
# is reused) and installs only its own pins in front of them (ModelOpt, transformers, onnxruntime, ...), for its
# CPU-side steps. trtllm-build, tritonserver and the Triton python models run on the container's packages.
RUN python3 -c "import importlib.metadata as m, sys; v = m.version('tensorrt_llm'); \
sys.exit(None if v.startswith('${TRTLLM_VERSION}.') else \
f'this container holds TensorRT-LLM {v}, the config targets ${TRTLLM_VERSION}: use the TRITON_TAG trtllm-pipeline plan prints')" \
 && pip freeze > /tmp/container-packages.txt \
 && python3 -m venv --system-site-packages .venv \
 && .venv/bin/pip install --no-cache-dir -e '.[quant]' \
 && pip freeze | diff /tmp/container-packages.txt -
COPY build_configs build_configs
COPY scripts scripts
# kubectl: the leader of a multi-node group (LeaderWorkerSet) starts the MPI ranks in its workers through
# `kubectl exec` (scripts/kubessh, mpirun's remote shell), and waits for them with `kubectl wait`.
ARG KUBECTL_VERSION=v1.33.5
RUN python3 -c "import platform, urllib.request; arch = {'x86_64': 'amd64', 'aarch64': 'arm64'}[platform.machine()]; \
urllib.request.urlretrieve(f'https://dl.k8s.io/release/${KUBECTL_VERSION}/bin/linux/{arch}/kubectl', '/usr/local/bin/kubectl')" \
 && chmod +x /usr/local/bin/kubectl
EXPOSE 8000 8001 8002
CMD ["sh", "-c", ".venv/bin/trtllm-pipeline build $CONFIG && .venv/bin/trtllm-pipeline serve $CONFIG --host 0.0.0.0"]

FROM python:3.11-slim-bookworm AS cpu
RUN apt-get update && apt-get install -y --no-install-recommends make procps && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/trtllm-pipeline
ENV TRTLLM_PIPELINE_CACHE=/opt/trtllm-pipeline/.cache OMP_WAIT_POLICY=PASSIVE
COPY pyproject.toml Makefile README.md ./
COPY pipeline pipeline
RUN make setup
COPY build_configs build_configs
COPY scripts scripts
# The build is part of the image (the pods of `trtllm-pipeline deploy` run `serve --build`, which finds it up to date),
# and so is tritonserver (serve fetches it from PyPI on first use; a cluster may not reach PyPI).
ARG CONFIG=build_configs/smollm2-135m-cpu.yaml
ENV CONFIG=${CONFIG}
RUN make build-engine CONFIG=${CONFIG} \
 && .venv/bin/python -c "from pipeline.build import cache_dir; from pipeline.triton.server import install_tritonserver; install_tritonserver(cache_dir())"
EXPOSE 8000 8001 8002
CMD ["sh", "-c", ".venv/bin/trtllm-pipeline serve $CONFIG --host 0.0.0.0"]
