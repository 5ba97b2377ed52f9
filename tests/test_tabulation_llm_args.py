"""The LLM-API options tabulator (scripts/dev/tabulate_trtllm_llm_args.py) on short inputs written here in the
upstream syntax; the committed llm_args table has every key the trtllm target's PyTorch path writes; and
llm_api_options refuses what a release's TorchLlmArgs would refuse."""

from __future__ import annotations

import json

import pytest

from pipeline.targets.trtllm.llm_api_options import LLM_API_RELEASES, options_problems, serve_options_flag
from pipeline.upstream import NotTabulated, facts
from tests.conftest import dev_script

tab = dev_script("tabulate_trtllm_llm_args")
TABLE = facts("llm_args")

# What the trtllm target's PyTorch path writes into the options YAML: (key path, kind).
EMITTED = [
    (("max_batch_size",), "int"),
    (("max_num_tokens",), "int"),
    (("max_seq_len",), "int"),
    (("max_input_len",), "int"),
    (("tensor_parallel_size",), "int"),
    (("pipeline_parallel_size",), "int"),
    (("enable_chunked_prefill",), "bool"),
    (("backend",), None),
    (("kv_cache_config", "free_gpu_memory_fraction"), "float"),
    (("kv_cache_config", "enable_block_reuse"), "bool"),
    (("kv_cache_config", "dtype"), "str"),
    (("cuda_graph_config", "batch_sizes"), "list"),
    (("cuda_graph_config", "max_batch_size"), "int"),
    (("cuda_graph_config", "enable_padding"), "bool"),
    (("scheduler_config", "capacity_scheduler_policy"), "enum"),
]


def field(release: str, path: tuple[str, ...]) -> dict | None:
    table = TABLE["releases"][release]
    model, spec = table["root"], None
    for key in path:
        spec = table["models"][model]["fields"].get(key)
        if spec is None:
            return None
        model = spec.get("model")
    return spec


# ---------------------------------------------------------------- the tabulator on inputs written here

ARGS = """
from enum import Enum
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class Colour(str, Enum):
    RED = "red"
    BLUE = "blue"


class StrictBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WheelConfig(StrictBaseModel):
    spokes: int = Field(default=12, ge=0, description="how many")
    tint: Colour = Colour.BLUE
    rim: Optional[float] = None


class Loose(BaseModel):
    anything: dict = Field(default_factory=dict)


class BikeArgs(StrictBaseModel):
    wheel_config: WheelConfig = Field(default_factory=WheelConfig, status="beta")
    saddle_height: float = Field(default=0.9, alias="seat_height")
    bell_model: Optional[str] = Field(default=None, validation_alias=AliasChoices("bell_model", "bell_dir"))
    old_bell: Optional[bool] = Field(default=None, deprecated="a sentence of upstream's")
    gears: List[int] = Field(default_factory=lambda: [1, 2, 3])
    frame: Union[str, int]
    style: Literal["road", "gravel"] = "road"
    pedals: int = Field(default=WheelConfig.model_fields['spokes'].default)
    _private: int = 0


class TorchLlmArgs(BikeArgs):
    style: Literal["road"] = "road"
    loose: Optional[Loose] = None
"""
LITERALS = """
class DecodingBaseConfig(StrictBaseModel):
    max_draft_len: Optional[int] = None


class DraftConfig(DecodingBaseConfig):
    decoding_type: Literal["Draft_Target"] = "Draft_Target"
"""
MAPPING = """
class DecodingBaseConfig(StrictBaseModel):
    @classmethod
    def from_dict(cls, data: dict):
        config_classes = {"DraftTarget": DraftConfig, "NGram": NGramConfig}
        return config_classes[data["decoding_type"]](**data)
"""


def test_a_pydantic_args_class_is_tabulated_field_by_field():
    facts = tab.llm_args_facts(ARGS + LITERALS)
    bike = facts["models"]["BikeArgs"]
    assert (
        bike["extra"] == "forbid" and bike["extra_from"] == "StrictBaseModel" and bike["bases"] == ["StrictBaseModel"]
    )
    fields = bike["fields"]
    assert "_private" not in fields
    assert fields["wheel_config"] == {
        "type": "WheelConfig",
        "required": False,
        "default": {"default_factory": "WheelConfig"},
        "status": "beta",
        "kind": "model",
        "nullable": False,
        "model": "WheelConfig",
    }
    assert fields["saddle_height"]["aliases"] == ["seat_height"] and fields["saddle_height"]["default"] == 0.9
    assert fields["bell_model"]["aliases"] == ["bell_model", "bell_dir"]  # renamed: the old name still accepted
    assert fields["old_bell"]["deprecated"] is True  # the message itself is not kept
    assert fields["gears"]["default"] == [1, 2, 3] and fields["gears"]["kind"] == "list"
    assert fields["frame"]["required"] is True
    assert fields["frame"]["members"] == [{"kind": "str", "nullable": False}, {"kind": "int", "nullable": False}]
    assert fields["style"] == {
        "type": 'Literal["road", "gravel"]'.replace('"', "'"),
        "required": False,
        "default": "road",
        "kind": "enum",
        "nullable": False,
        "choices": ["road", "gravel"],
    }
    assert fields["pedals"]["default"] == {"default_of": {"model": "WheelConfig", "field": "spokes"}}


def test_nested_configs_inherit_forbid_and_subclasses_override_fields():
    facts = tab.llm_args_facts(ARGS + LITERALS)
    wheel = facts["models"]["WheelConfig"]
    assert wheel["extra"] == "forbid" and wheel["fields_complete"] is True
    assert wheel["fields"]["spokes"]["ge"] == 0
    assert wheel["fields"]["tint"]["default"] == {"enum": "Colour", "member": "BLUE"}
    assert wheel["fields"]["tint"]["choices"] == ["red", "blue"]
    assert wheel["fields"]["rim"]["nullable"] is True
    assert facts["models"]["Loose"]["extra"] == "ignore"  # pydantic's default where nothing says otherwise
    root = facts["models"]["TorchLlmArgs"]["fields"]
    assert root["style"]["choices"] == ["road"] and "saddle_height" in root  # own over inherited, inherited kept
    assert facts["enums"] == {"Colour": ["red", "blue"]}


def test_the_speculative_discriminator_before_and_after_the_literals():
    assert tab.llm_args_facts(ARGS + LITERALS)["decoding_types"] == {"Draft_Target": "DraftConfig"}
    assert tab.llm_args_facts(ARGS + MAPPING)["decoding_types"] == {
        "DraftTarget": "DraftConfig",
        "NGram": "NGramConfig",
    }
    with pytest.raises(tab.UnrecognizedSource, match="decoding_type"):
        tab.llm_args_facts(ARGS)


def test_an_imported_strict_base_is_named_as_not_read():
    facts = tab.llm_args_facts(
        LITERALS
        + ARGS.replace('class StrictBaseModel(BaseModel):\n    model_config = ConfigDict(extra="forbid")\n', "")
    )
    assert facts["models"]["WheelConfig"]["extra"] == "forbid"
    assert facts["models"]["WheelConfig"]["extra_from"].startswith("StrictBaseModel (imported")


def test_defaults_it_cannot_state_and_unrelated_files_are_refused():
    with pytest.raises(tab.UnrecognizedSource):
        tab.llm_args_facts("class Unrelated(BaseModel):\n    x: int = 1\n")
    with pytest.raises(tab.UnrecognizedSource, match="cannot state"):
        tab.llm_args_facts(ARGS.replace("= Colour.BLUE", "= pick(Colour)") + LITERALS)


SERVE = """
@click.command("serve")
@click.argument("model", type=str)
@click.option("--host", type=str, default="localhost")
@click.option("--backend", type=ChoiceWithAlias(["pytorch", "tensorrt"], {"trt": "tensorrt"}), default="pytorch")
@click.option("--tensor_parallel_size", "--tp_size", type=int, default=1)
@click.option("--log_level", type=click.Choice(severity_map.keys()), default="info")
@click.option("--config", "--extra_llm_api_options", "extra_llm_api_options", type=str, default=None)
@click.option("--max_batch_size", type=int, default=BuildConfig.model_fields["max_batch_size"].default)
@click.option("--trust_remote_code", is_flag=True, default=False)
def serve(model, **options):
    pass
"""


def test_serve_options_keep_a_renamed_flag_and_its_old_name():
    facts = tab.serve_facts(SERVE)
    assert facts["options_flags"] == ["--config", "--extra_llm_api_options"]
    assert facts["backend_choices"] == ["pytorch", "tensorrt"] and facts["backend_aliases"] == {"trt": "tensorrt"}
    options = facts["options"]
    assert options["extra_llm_api_options"] == {
        "options": ["--config", "--extra_llm_api_options"],
        "type": "str",
        "default": None,
    }
    assert options["tensor_parallel_size"] == {
        "options": ["--tensor_parallel_size", "--tp_size"],
        "type": "int",
        "default": 1,
    }
    assert options["log_level"] == {
        "options": ["--log_level"],
        "type": "choice",
        "choices_from": "severity_map",
        "default": "info",
    }
    assert options["max_batch_size"]["default"] == {"default_of": {"model": "BuildConfig", "field": "max_batch_size"}}
    assert options["trust_remote_code"] == {"options": ["--trust_remote_code"], "is_flag": True, "default": False}
    assert "model" not in options  # an argument, not an option


def test_a_serve_without_the_options_flag_is_refused():
    with pytest.raises(tab.UnrecognizedSource, match="extra_llm_api_options"):
        tab.serve_facts(SERVE.replace('"--config", "--extra_llm_api_options", "extra_llm_api_options"', '"--config"'))


# ---------------------------------------------------------------- the committed table


def test_table_cites_its_sources_by_commit():
    assert LLM_API_RELEASES == ("1.0", "1.1", "1.2") and not TABLE["not_tabulated"]
    for release in LLM_API_RELEASES:
        source = TABLE["releases"][release]["source"]
        assert source["llm_args"]["commit"] is None and source["llm_args"]["pinned"] is False
        assert source["serve"]["commit"] and not source["serve"]["pinned"]
        for file in ("llm_args", "serve"):
            assert source[file]["repo"] == "NVIDIA/TensorRT-LLM" and len(source[file]["release_commit"]) == 40
        assert "confidence" in source["note"] and len(source["note"]) < 200


def test_table_holds_no_source_expressions():
    text = json.dumps(TABLE)
    assert '"expr"' not in text and '"factory"' not in text and "index" not in text.lower()


def test_every_release_has_every_section():
    for release in LLM_API_RELEASES:
        block = TABLE["releases"][release]
        assert set(block) == {"source", "root", "models", "enums", "speculative_decoding_types", "serve"}
        assert block["root"] in block["models"]
        for model in block["models"].values():
            assert {"bases", "extra", "extra_from", "fields", "fields_complete"} <= set(model)
            for field in model["fields"].values():
                assert field.get("model") in (None, *block["models"])


@pytest.mark.parametrize("release", LLM_API_RELEASES)
@pytest.mark.parametrize(("path", "kind"), EMITTED)
def test_table_has_every_key_the_target_emits(release, path, kind):
    spec = field(release, path)
    assert spec is not None, f"{'.'.join(path)} missing in {release}"
    if kind:
        assert spec["kind"] == kind


@pytest.mark.parametrize("release", LLM_API_RELEASES)
def test_capacity_scheduler_policies(release):
    choices = ["MAX_UTILIZATION", "GUARANTEED_NO_EVICT", "STATIC_BATCH"]
    assert field(release, ("scheduler_config", "capacity_scheduler_policy"))["choices"] == choices
    assert TABLE["releases"][release]["enums"]["CapacitySchedulerPolicy"] == choices


def test_kv_cache_defaults_and_tokens_per_block_by_release():
    assert field("1.0", ("kv_cache_config", "tokens_per_block")) is None
    for release, fraction in (("1.0", None), ("1.1", 0.9), ("1.2", 0.9)):
        assert field(release, ("kv_cache_config", "free_gpu_memory_fraction"))["default"] == fraction
        if release != "1.0":
            assert field(release, ("kv_cache_config", "tokens_per_block"))["default"] == 32


# ---------------------------------------------------------------- the validator


GOOD = {
    "max_batch_size": 8,
    "max_num_tokens": 2048,
    "max_seq_len": 1024,
    "max_input_len": 512,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "enable_chunked_prefill": True,
    "backend": "pytorch",
    "kv_cache_config": {"free_gpu_memory_fraction": 0.8, "enable_block_reuse": True, "dtype": "auto"},
    "cuda_graph_config": {"batch_sizes": [1, 2, 4, 8], "enable_padding": True},
    "scheduler_config": {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"},
}


@pytest.mark.parametrize("release", LLM_API_RELEASES)
def test_options_the_target_writes_are_accepted(release):
    assert options_problems(GOOD, release) == []
    assert options_problems({"cuda_graph_config": None}, release) == []  # null turns CUDA graphs off


@pytest.mark.parametrize(
    ("key", "accepted_in", "refused_in"),
    [
        ({"fail_fast_on_attention_window_too_large": True}, "1.0", "1.2"),
        ({"kv_cache_config": {"tokens_per_block": 32}}, "1.1", "1.0"),
        ({"kv_connector_config": None}, "1.1", "1.0"),
        ({"connector_config": None}, "1.0", "1.1"),
        ({"speculative_config": {"decoding_type": "DraftTarget", "max_draft_len": 3}}, "1.1", "1.2"),
        ({"speculative_config": {"decoding_type": "DraftTarget", "max_draft_len": 3}}, "1.0", "1.2"),
        ({"speculative_config": {"decoding_type": "Draft_Target", "max_draft_len": 3}}, "1.2", "1.0"),
    ],
)
def test_a_key_that_moved_is_accepted_by_one_release_and_refused_by_the_other(key, accepted_in, refused_in):
    assert options_problems(key, accepted_in) == []
    problems = options_problems(key, refused_in)
    assert len(problems) == 1 and f"in {refused_in}" in problems[0][1]


def test_refusal_says_where_the_key_is():
    (path, message), *_ = options_problems({"fail_fast_on_attention_window_too_large": True}, "1.2")
    assert message.endswith("(1.0, 1.1 have it)")
    for release in LLM_API_RELEASES:
        problems = dict(options_problems({"kv_cache_dtype": "fp8", "cuda_graph_batch_sizes": [1]}, release))
        assert problems[("kv_cache_dtype",)] == (
            f"kv_cache_dtype is not an LLM-API option in {release} (it is kv_cache_config.dtype)"
        )
        assert problems[("cuda_graph_batch_sizes",)].endswith("(it is cuda_graph_config.batch_sizes)")
        assert options_problems({"use_cuda_graph": True}, release)  # gone since 1.0


@pytest.mark.parametrize("release", LLM_API_RELEASES)
def test_validator_refuses_unknown_nested_keys_bad_enums_and_types(release):
    problems = dict(
        options_problems(
            {
                "kv_cache_config": {"free_gpu_memory_fraction": 0.9, "free_gpu_mem_fraction": 0.9},
                "scheduler_config": {"capacity_scheduler_policy": "MAX_UTILISATION"},
                "cuda_graph_config": {"enable_padding": "yes", "max_batch_size": True},
                "enable_chunked_prefill": 1,
                "max_num_tokens": "2048",
                "tensor_parallel_size": None,
                "moe_config": "CUTLASS",
            },
            release,
        )
    )
    assert set(problems) == {
        ("kv_cache_config", "free_gpu_mem_fraction"),
        ("scheduler_config", "capacity_scheduler_policy"),
        ("cuda_graph_config", "enable_padding"),
        ("cuda_graph_config", "max_batch_size"),
        ("enable_chunked_prefill",),
        ("max_num_tokens",),
        ("tensor_parallel_size",),
        ("moe_config",),
    }
    assert "'MAX_UTILISATION' is not one of" in problems[("scheduler_config", "capacity_scheduler_policy")]
    assert problems[("tensor_parallel_size",)] == f"tensor_parallel_size may not be null in {release}"
    assert all(f"in {release}" in message for message in problems.values())


def test_unknown_release_is_refused():
    with pytest.raises(NotTabulated, match="0.21"):
        options_problems({}, "0.21")


def test_keys_of_a_partly_read_model_are_not_refused():
    """1.2's EagleDecodingConfig was read from a copy with some of its fields left out: its keys cannot be judged."""
    assert not TABLE["releases"]["1.2"]["models"]["EagleDecodingConfig"]["fields_complete"]
    eagle = {"decoding_type": "Eagle3", "max_draft_len": 3, "eagle_choices": [[0]], "speculative_model": "/d"}
    assert options_problems({"speculative_config": eagle}, "1.2") == []
    assert options_problems({"speculative_config": eagle | {"max_draft_len": "3"}}, "1.2")


def test_serve_options_flag_is_the_spelling_every_release_accepts():
    """1.2 added --config and kept --extra_llm_api_options as its alias: the older name serves every release."""
    assert (
        serve_options_flag("1.0") == serve_options_flag("1.1") == serve_options_flag("1.2") == "--extra_llm_api_options"
    )
