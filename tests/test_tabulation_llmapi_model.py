"""scripts/dev/tabulate_trtllm_llmapi_model.py on committed verbatim excerpts of the stored NVIDIA/TensorRT-LLM
llmapi model files (tests/fixtures/upstream/llmapi_*), the committed table it wrote, and its reader."""

import json
from pathlib import Path

import pytest

from pipeline.errors import BuildStepError
from pipeline.triton import llmapi_model as lm
from tests.conftest import dev_script

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = Path(__file__).parent / "fixtures" / "upstream"
TABLE = json.loads((ROOT / "pipeline" / "triton" / "llmapi_model.json").read_text())

tab = dev_script("tabulate_trtllm_llmapi_model")


def excerpt(name: str) -> str:
    """The upstream text of a fixture, without its two-line provenance header."""
    return "".join((UPSTREAM / name).read_text().splitlines(keepends=True)[2:])


def test_config_excerpt_reproduces_the_tabulated_inputs():
    facts = tab.config_facts(
        excerpt("llmapi_config_c8c6df08_inputs.pbtxt").rstrip().rstrip(",") + "\n]\n"
    )  # cut in `input`
    assert facts["backend"] == "python" and "max_batch_size" not in facts  # left to model.yaml
    assert facts["instance_group"] == [{"count": 1, "kind": "KIND_CPU"}]
    for release in ("1.0", "1.2"):
        table = TABLE[release]["config"]
        assert table["backend"] == "python" and table["instance_group"] == facts["instance_group"]
        assert table["inputs"][: len(facts["inputs"])] == facts["inputs"]
    assert facts["inputs"][0] == {"name": "text_input", "data_type": "TYPE_STRING", "dims": [-1], "optional": False}


def test_model_py_auto_complete_reads_max_batch_size_and_decoupled_without_fallback():
    facts = tab.model_py_facts(excerpt("llmapi_model_py_b35ac1b6_auto_complete.py.txt"))
    assert facts["triton_config"] == {
        "decoupled": {
            "required": True,
            "default": None,
            "conversion": "bool",
            "read_in": ["auto_complete_config"],
            "used_for": ["auto_complete_model_config.set_model_transaction_policy(dict(decoupled=...))"],
        },
        "max_batch_size": {
            "required": True,
            "default": None,
            "conversion": "int",
            "read_in": ["auto_complete_config"],
            "used_for": ["auto_complete_model_config.set_max_batch_size(...)"],
        },
    }
    assert facts["model_yaml_path"]["env"] == "LLM_CONFIG_PATH" and facts["model_yaml_path"]["default"] == "model.yaml"
    assert facts["model_yaml_top_level_reads"]["triton_config"]["required"]


def test_model_py_initialize_llm_kwargs_and_cancellation_default():
    facts = tab.model_py_facts(excerpt("llmapi_model_py_b35ac1b6_initialize.py.txt"), cut_start=True, cut_end=True)
    assert facts["triton_config"]["cancellation_check_period_ms"]["required"] is False
    assert facts["triton_config"]["cancellation_check_period_ms"]["default"] == 100
    llm = facts["llm_kwargs"]
    assert llm["excluded_model_yaml_keys"] == ["triton_config"]
    assert llm["built_with"] == "update_llm_args_with_extra_dict"
    assert set(llm["set_by_model"]) == {"_mpi_session"}
    for release in ("1.0", "1.1"):
        assert TABLE[release]["llm_kwargs"]["set_by_model"] == llm["set_by_model"]
        assert (
            TABLE[release]["triton_config"]["cancellation_check_period_ms"]
            == (facts["triton_config"]["cancellation_check_period_ms"])
        )
    # the 1.2 model.py also sets gpus_per_node when several instances share the GPUs (gpu_device_ids)
    assert (
        TABLE["1.2"]["llm_kwargs"]["set_by_model"]["gpus_per_node"]["when"] == "is_leader and self._use_multi_instance"
    )
    assert TABLE["1.2"]["config_parameters"]["gpu_device_ids"]["missing"] == "raises ValueError"


def test_helpers_excerpt_reproduces_the_sampling_inputs():
    facts = tab.helpers_facts(excerpt("llmapi_helpers_fab2f90b_request.py.txt"))
    for release in ("1.0", "1.2"):
        assert TABLE[release]["sampling_inputs"] == facts["sampling_inputs"]
        assert TABLE[release]["streaming_input"] == facts["streaming_input"]
    sampling = facts["sampling_inputs"]
    assert sampling["sampling_param_max_tokens"] == {
        "field": "max_tokens",
        "default_when_absent": None,
        "read_as": "scalar",
    }
    assert sampling["sampling_param_seed"]["field"] == "seed"
    assert sampling["sampling_param_best_of"]["default_when_absent"] == 1
    assert sampling["sampling_param_stop"]["field"] == "stop"
    assert (
        facts["streaming_input"]["tensor"] == "streaming" and facts["streaming_input"]["default_when_absent"] is False
    )


def test_model_yaml_excerpt():
    facts = tab.model_yaml_facts(excerpt("llmapi_model_yaml_c8c6df08.yaml"))
    assert facts["triton_config"] == {"max_batch_size": 0, "decoupled": False}
    assert TABLE["1.2"]["model_yaml"] == facts


@pytest.mark.parametrize("release", ["1.0", "1.2"])
def test_table_has_text_io_and_sampling_inputs(release):
    config = TABLE[release]["config"]
    inputs = {t["name"]: t for t in config["inputs"]}
    outputs = {t["name"]: t for t in config["outputs"]}
    assert inputs["text_input"]["data_type"] == "TYPE_STRING" and not inputs["text_input"]["optional"]
    assert outputs["text_output"]["data_type"] == "TYPE_STRING"
    for field in ("temperature", "top_k", "top_p", "max_tokens", "seed", "frequency_penalty", "presence_penalty"):
        name = f"sampling_param_{field}"
        assert inputs[name]["optional"], name
        assert TABLE[release]["sampling_inputs"][name]["field"] == field
    # every tensor helpers.py reads is declared in config.pbtxt
    assert set(TABLE[release]["sampling_inputs"]) <= set(inputs)
    assert TABLE[release]["required_model_yaml_keys"] == [
        "triton_config",
        "triton_config.max_batch_size",
        "triton_config.decoupled",
    ]
    assert TABLE[release]["source"]["note"].startswith("APPROXIMATE")
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
    with pytest.raises(BuildStepError):
        lm.llmapi_model("0.19")
