"""scripts/dev/tabulate_triton_trtllm_images.py on short inputs written here in the syntax of the files it reads (the
compatibility matrix's markdown table, a multi-stage Dockerfile in each of the two Python layouts)."""

import pytest

from tests.conftest import dev_script

tab = dev_script("tabulate_triton_trtllm_images")

MATRIX = """
# Release Compatibility Matrix

## Container Name: trtllm-python-py3

| Triton release version | NGC Tag | Python version | Torch version | TensorRT version | TensorRT-LLM version |
| --- | --- | --- | --- | --- | --- |
| 26.02 | nvcr.io/nvidia/tritonserver:26.02-trtllm-python-py3 | Python 3.12.3  | 2.9.0a0+abc.nv25.10 | 10.13 | 1.1.0 |
| 25.11 | nvcr.io/nvidia/tritonserver:25.11-trtllm-python-py3 | Python 3.12.3 | 2.9.0a0+abc | 10.13 | 1.0.3.2510 |

## Container Name: vllm-python-py3

| Triton release version | NGC Tag | Python version | vLLM version |
| --- | --- | --- | --- |
| 26.02 | nvcr.io/nvidia/tritonserver:26.02-vllm-python-py3 | Python 3.12.3 | 0.15.1 |
"""

# The system layout: packages copied and pip-installed into /usr/local; python3-dev and -pip only.
SYSTEM = """
ARG BASE_IMAGE=example/base:1
FROM example/torch:1 AS torch_source
FROM ${BASE_IMAGE} AS builder
RUN apt-get install -y python3.12-venv
FROM ${BASE_IMAGE} AS final
COPY --from=torch_source /usr/local/lib/python3.12/dist-packages/torch /usr/local/lib/python3.12/dist-packages/torch
RUN apt-get update && \\
    apt-get install -y --no-install-recommends \\
        python3-dev \\
        # a comment inside the continued command
        python3-pip && \\
    rm -rf /var/lib/apt/lists/*
"""

# The virtualenv layout: a venv first on PATH, made in the stage the final one is built on.
VENV = """
ARG BASE_IMAGE=example/base:2
ARG TENSORRTLLM_VER=1.2.1
FROM example/torch:2 AS torch_source
FROM ${BASE_IMAGE} AS wrapper
COPY --from=torch_source /usr/local/lib/python3.12/dist-packages/torch /opt/env/lib/python3.12/site-packages/torch
ENV PATH="/opt/env/bin:${PATH}"
RUN apt-get update && apt-get install -y --no-install-recommends python3.12-venv git-lfs \\
    && python3.12 -m venv /opt/env
FROM wrapper AS final
ARG TENSORRTLLM_VER
RUN pip3 install tensorrt_llm==${TENSORRTLLM_VER}
"""


def test_matrix_rows_are_read_from_the_trtllm_table_only():
    assert tab.matrix_rows(MATRIX) == [
        {"tag": "26.02", "python": "3.12", "torch": "2.9.0a0+abc.nv25.10", "tensorrt_llm": "1.1.0"},
        {"tag": "25.11", "python": "3.12", "torch": "2.9.0a0+abc", "tensorrt_llm": "1.0.3.2510"},
    ]


def test_a_matrix_of_another_shape_is_refused():
    with pytest.raises(tab.UnrecognizedSource, match="no table"):
        tab.matrix_rows(MATRIX.replace("trtllm-python-py3\n", "other\n", 1))


def test_the_system_layout_of_the_final_stage_only():
    """The builder stage's python3.12-venv is not in the final image: the final stage is based on BASE_IMAGE."""
    assert tab.dockerfile_layout(SYSTEM) == {
        "python": "3.12",
        "interpreter": "/usr/bin/python3.12",
        "environment": "/usr",
        "site_packages": "/usr/local/lib/python3.12/dist-packages",
        "venv_module": False,
        "tensorrt_llm": None,
    }


def test_the_virtualenv_layout_through_the_stage_the_final_one_is_built_on():
    assert tab.dockerfile_layout(VENV) == {
        "python": "3.12",
        "interpreter": "/usr/bin/python3.12",
        "environment": "/opt/env",
        "site_packages": "/opt/env/lib/python3.12/site-packages",
        "venv_module": True,
        "tensorrt_llm": "1.2.1",
    }


def test_torch_outside_the_environment_is_refused():
    moved = VENV.replace("/opt/env/lib/python3.12/site-packages/torch", "/usr/local/lib/python3.12/dist-packages/torch")
    with pytest.raises(tab.UnrecognizedSource, match="outside the environment /opt/env"):
        tab.dockerfile_layout(moved)
