"""scripts/dev/tabulate_trtllm_llmapi_model.py on short inputs written here in the syntax of the llmapi model's
files (config.pbtxt, model.yaml, model.py, helpers.py, the backend's Dockerfile and docs), the committed table, and
its reader."""

import json

import pytest

from pipeline.targets.trtllm import triton_llmapi_model as lm
from pipeline.upstream import NotTabulated, facts
from tests.conftest import dev_script

TABLE = facts("llmapi_model")["releases"]

tab = dev_script("tabulate_trtllm_llmapi_model")

CONFIG = """
name: "chat_model"
backend: "python"
instance_group [ { count: 2, kind: KIND_CPU } ]
input [
  { name: "prompt", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "knob_temperature", data_type: TYPE_FP32, dims: [ 1 ], optional: true }
]
output [ { name: "answer", data_type: TYPE_STRING, dims: [ -1 ] } ]
"""

MODEL_PY = """
import os

from tensorrt_llm import LLM
from tensorrt_llm._utils import global_mpi_size
from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict


def get_model_config(path, exclude_keys=None):
    return {}


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        path = os.environ.get("CHAT_CONFIG", "chat.yaml")
        triton_config = get_model_config(path)["triton_config"]
        auto_complete_model_config.set_max_batch_size(int(triton_config["max_batch_size"]))
        return auto_complete_model_config

    def initialize(self, args):
        triton_config = get_model_config("chat.yaml")["triton_config"]
        self.decoupled = bool(triton_config["decoupled"])
        self.poll_ms = int(triton_config["poll_ms"]) if "poll_ms" in triton_config else 250
        self.llm_engine_args = update_llm_args_with_extra_dict(
            {}, get_model_config("chat.yaml", exclude_keys=["triton_config"])
        )
        if self._many and is_leader:
            ids = self.params.get("device_ids", {}).get("string_value", "")
            if not ids:
                raise ValueError("device_ids parameter required")
            self.llm_engine_args["gpus_per_node"] = len(self._ids)
        if is_leader and global_mpi_size() > 1:
            self.llm_engine_args["_mpi_session"] = mpi_session
"""

HELPERS = """
def get_sampling_params_from_request(request, batch_size=1, batch_index=0):
    kwargs = {}
    default_values = {"knob_best_of": 1}
    params = ["temperature", "best_of"]
    for arg in params:
        param_mappings[f"knob_{arg}"] = arg
    kwargs["stop"] = get_input_tensor_by_name(request, "knob_stop", batch_size, batch_index)
    return kwargs


def get_streaming_from_request(request, batch_size=1, batch_index=0):
    return get_input_scalar_by_name(request, "streaming", batch_size, batch_index) or False
"""

DOCKERFILE = """
ARG BASE_IMAGE=registry.example/serving:1.0
ARG TENSORRTLLM_REPO_TAG=release/9.9
FROM ${BASE_IMAGE} AS final
WORKDIR /srv
COPY --from=build /src/triton_backend/all_models all_models
COPY --from=build /src/triton_backend/scripts /srv/scripts
"""

DOC = """
Copy it: `cp` the model, then run

    python3 tensorrt_llm/triton_backend/scripts/launch_triton_server.py --model_repo=repo/ --no-mpi
    srun -N 2 --mpi=pmix \\
        trtllm-llmapi-launch /opt/tritonserver/bin/tritonserver --model-repository repo
    python3 tensorrt_llm/triton_backend/scripts/launch_triton_server.py --model_repo=elsewhere/ --no-mpi
"""


def test_config_pbtxt_tensors_and_instances():
    assert tab.config_facts(CONFIG) == {
        "name": "chat_model",
        "backend": "python",
        "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
        "inputs": [
            {"name": "prompt", "data_type": "TYPE_STRING", "dims": [-1], "optional": False},
            {"name": "knob_temperature", "data_type": "TYPE_FP32", "dims": [1], "optional": True},
        ],
        "outputs": [{"name": "answer", "data_type": "TYPE_STRING", "dims": [-1]}],
    }


def test_model_yaml_is_read_as_yaml():
    assert tab.model_yaml_facts("model: org/name\ntriton_config:\n  decoupled: false\n") == {
        "model": "org/name",
        "triton_config": {"decoupled": False},
    }


def test_model_py_reads_of_triton_config_with_and_without_a_fallback():
    facts = tab.model_py_facts(MODEL_PY)
    assert facts["model_yaml_path"] == {
        "env": "CHAT_CONFIG",
        "default": "chat.yaml",
        "relative_to": "the model's directory",
    }
    assert facts["model_yaml_top_level_reads"] == {
        "triton_config": {"required": True, "methods": ["auto_complete_config", "initialize"]}
    }
    assert facts["triton_config"] == {
        "max_batch_size": {
            "required": True,
            "default": None,
            "conversion": "int",
            "read_in": ["auto_complete_config"],
            "used_for": ["set_max_batch_size"],
        },
        "decoupled": {
            "required": True,
            "default": None,
            "conversion": "bool",
            "read_in": ["initialize"],
            "used_for": ["attribute decoupled"],
        },
        "poll_ms": {
            "required": False,
            "default": 250,
            "conversion": "int",
            "read_in": ["initialize"],
            "used_for": ["attribute poll_ms"],
        },
    }


def test_model_py_llm_kwargs_state_values_and_conditions_without_code():
    facts = tab.model_py_facts(MODEL_PY)
    llm = facts["llm_kwargs"]
    assert llm["excluded_model_yaml_keys"] == ["triton_config"]
    assert llm["built_with"] == "update_llm_args_with_extra_dict"
    assert llm["set_by_model"] == {
        "gpus_per_node": {"value": {"length_of": "_ids"}, "when": [{"flag": "_many"}, {"flag": "is_leader"}]},
        "_mpi_session": {
            "value": {"variable": "mpi_session"},
            "when": [{"flag": "is_leader"}, {"call": "global_mpi_size", "op": ">", "value": 1}],
        },
    }
    assert "tensorrt_llm.llmapi.llm_utils.update_llm_args_with_extra_dict" in llm["tensorrt_llm_imports"]
    assert facts["config_parameters"] == {
        "device_ids": {
            "read_in": "initialize",
            "when": [{"flag": "_many"}, {"flag": "is_leader"}],
            "missing": "raises ValueError",
        }
    }


def test_helpers_map_request_tensors_to_sampling_fields():
    facts = tab.helpers_facts(HELPERS)
    assert facts["sampling_inputs"] == {
        "knob_stop": {"field": "stop", "default_when_absent": None, "read_as": "tensor"},
        "knob_temperature": {"field": "temperature", "default_when_absent": None, "read_as": "scalar"},
        "knob_best_of": {"field": "best_of", "default_when_absent": 1, "read_as": "scalar"},
    }
    assert (
        facts["streaming_input"]["tensor"] == "streaming" and facts["streaming_input"]["default_when_absent"] is False
    )


def test_dockerfile_paths_and_doc_launches():
    assert tab.dockerfile_facts(DOCKERFILE) == {
        "BASE_IMAGE": "registry.example/serving:1.0",
        "TENSORRTLLM_REPO_TAG": "release/9.9",
        "all_models_dir": "/srv/all_models",
        "scripts_dir": "/srv/scripts",
        "llmapi_model_dir": "/srv/all_models/llmapi/tensorrt_llm",
        "launch_script": "/srv/scripts/launch_triton_server.py",
    }
    assert tab.launch_line_facts(DOC) == [  # one entry per distinct launcher and flags
        {"launcher": "launch_triton_server.py", "flags": ["--model_repo", "--no-mpi"]},
        {"launcher": "trtllm-llmapi-launch", "flags": ["--mpi", "--model-repository"]},
    ]


# ---------------------------------------------------------------- the committed table


@pytest.mark.parametrize("release", lm.LLMAPI_RELEASES)
def test_every_release_has_every_section_and_cites_commits(release):
    block = TABLE[release]
    assert set(block) == {
        "source", "config", "model_yaml", "model_yaml_path", "triton_config", "llm_kwargs", "config_parameters",
        "model_py_input_reads", "sampling_inputs", "output_config_inputs", "streaming_input",
        "required_model_yaml_keys", "container",
    }  # fmt: skip
    for record in [*block["source"]["files"].values(), *block["container"]["source"]["files"]]:
        assert len(record["commit"]) == 40 and record["pinned"] is False
    assert all(len(r["release_commit"]) == 40 for r in block["source"]["files"].values())
    text = json.dumps(block)
    assert "self." not in text and "(" not in json.dumps(block["llm_kwargs"]["set_by_model"])


@pytest.mark.parametrize("release", lm.LLMAPI_RELEASES)
def test_table_has_what_the_pipeline_reads(release):
    config = TABLE[release]["config"]
    inputs = {t["name"]: t for t in config["inputs"]}
    outputs = {t["name"]: t for t in config["outputs"]}
    assert inputs["text_input"]["data_type"] == "TYPE_STRING" and not inputs["text_input"]["optional"]
    assert outputs["text_output"]["data_type"] == "TYPE_STRING"
    for field in ("temperature", "top_k", "top_p", "max_tokens", "seed", "frequency_penalty", "presence_penalty"):
        name = f"sampling_param_{field}"
        assert inputs[name]["optional"], name
        assert TABLE[release]["sampling_inputs"][name]["field"] == field
    assert set(TABLE[release]["sampling_inputs"]) <= set(inputs)  # every tensor helpers.py reads is declared
    assert TABLE[release]["required_model_yaml_keys"] == [
        "triton_config",
        "triton_config.max_batch_size",
        "triton_config.decoupled",
    ]
    assert set(TABLE[release]["triton_config"]) >= {"max_batch_size", "decoupled"}
    assert TABLE[release]["llm_kwargs"]["excluded_model_yaml_keys"] == ["triton_config"]
    assert TABLE[release]["container"]["llmapi_model_dir"] == "/app/all_models/llmapi/tensorrt_llm"


def test_model_yaml_problems():
    good = {"model": "/models/x", "backend": "pytorch", "triton_config": {"max_batch_size": 0, "decoupled": True}}
    assert lm.model_yaml_problems(good, "1.2") == []
    missing = {"model": "/models/x", "triton_config": {"decoupled": False}}
    assert any("triton_config.max_batch_size" in p for p in lm.model_yaml_problems(missing, "1.0"))
    assert any("'triton_config'" in p for p in lm.model_yaml_problems({"model": "x"}, "1.1"))
    unknown = {"model": "x", "triton_config": {"max_batch_size": 0, "decoupled": False, "max_queue_delay": 5}}
    assert any("max_queue_delay" in p for p in lm.model_yaml_problems(unknown, "1.2"))
    typed = {"model": "x", "triton_config": {"max_batch_size": "8", "decoupled": "false"}}
    problems = lm.model_yaml_problems(typed, "1.2")
    assert any("max_batch_size" in p and "int()" in p for p in problems)
    assert any("decoupled" in p and "bool()" in p for p in problems)


def test_reader():
    assert lm.LLMAPI_RELEASES == ("1.0", "1.1", "1.2")
    assert lm.llmapi_model("1.1")["config"]["backend"] == "python"
    with pytest.raises(NotTabulated):
        lm.llmapi_model("0.19")
