"""The LLM-API options tabulator (scripts/dev/tabulate_trtllm_llm_args.py), run on verbatim excerpts of the
upstream files it reads (tests/fixtures/upstream), agrees with the committed trtllm_llm_args.json; the table has
every key the trtllm target's PyTorch path writes, for 1.0 and 1.2; and llm_api_args refuses what a release's
TorchLlmArgs would refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.targets.llm_api_args import LLM_API_RELEASES, options_problems, serve_options_flag
from tests.conftest import dev_script

ROOT = Path(__file__).parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "upstream"
TABLE = json.loads((ROOT / "pipeline" / "targets" / "trtllm_llm_args.json").read_text())


tab = dev_script("tabulate_trtllm_llm_args")
LLM_ARGS_EXCERPTS = {
    "1.0": "llm_args_1520735490_excerpt.py.txt",
    "1.1": "llm_args_1090804222_excerpt.py.txt",
    "1.2": "llm_args_7019226376_excerpt.py.txt",
}
SERVE_EXCERPTS = {"1.0": "serve_py_901178132_excerpt.py.txt", "1.2": "serve_py_00209af1_excerpt.py.txt"}

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


# ---------------------------------------------------------------- the tabulator on excerpts


@pytest.mark.parametrize("release", sorted(LLM_ARGS_EXCERPTS))
def test_llm_args_excerpt_reproduces_the_table(release):
    facts = tab.llm_args_facts((FIXTURES / LLM_ARGS_EXCERPTS[release]).read_text(), excerpt=True)
    committed = TABLE["releases"][release]
    assert facts["models"], "no model found in the excerpt"
    for model, spec in facts["models"].items():
        assert spec["extra"] == committed["models"][model]["extra"] == "forbid"
        for name, facts_field in spec["fields"].items():
            assert facts_field == committed["models"][model]["fields"][name], (model, name)
    for enum, values in facts["enums"].items():
        assert values == committed["enums"][enum]
    for decoding_type, model in facts["decoding_types"].items():
        assert committed["speculative_decoding_types"][decoding_type] == model


def test_excerpts_show_the_moves_between_1_0_and_1_2():
    old = tab.llm_args_facts((FIXTURES / LLM_ARGS_EXCERPTS["1.0"]).read_text(), excerpt=True)
    new = tab.llm_args_facts((FIXTURES / LLM_ARGS_EXCERPTS["1.2"]).read_text(), excerpt=True)
    assert "DraftTarget" in old["decoding_types"] and "Draft_Target" in new["decoding_types"]
    assert old["models"]["StrictBaseModel"]["extra"] == "forbid"  # defined in llm_args.py in 1.0
    assert new["models"]["KvCacheConfig"]["extra_from"].startswith("StrictBaseModel (imported")
    assert new["models"]["KvCacheConfig"]["fields"]["free_gpu_memory_fraction"]["default"] == 0.9
    assert new["models"]["TorchLlmArgs"]["fields"]["backend"]["choices"] == ["pytorch"]  # overrides BaseLlmArgs'
    assert new["models"]["DecodingBaseConfig"]["fields"]["speculative_model"]["aliases"] == [
        "speculative_model",
        "speculative_model_dir",
    ]
    assert "fail_fast_on_attention_window_too_large" in old["models"]["BaseLlmArgs"]["fields"]


@pytest.mark.parametrize("release", sorted(SERVE_EXCERPTS))
def test_serve_excerpt_reproduces_the_table(release):
    facts = tab.serve_facts((FIXTURES / SERVE_EXCERPTS[release]).read_text())
    committed = TABLE["releases"][release]["serve"]
    assert facts["options_flags"] == committed["options_flags"]
    assert facts["backend_choices"] == committed["backend_choices"] == ["pytorch", "tensorrt", "_autodeploy"]


def test_tabulator_refuses_an_unrecognized_llm_args():
    with pytest.raises(tab.UnrecognizedSource):
        tab.llm_args_facts("class Unrelated(BaseModel):\n    x: int = 1\n")


# ---------------------------------------------------------------- the committed table


def test_table_records_its_sources():
    assert LLM_API_RELEASES == ("1.0", "1.1", "1.2") and not TABLE["not_tabulated"]
    for release in LLM_API_RELEASES:
        source = TABLE["releases"][release]["source"]
        for file in ("llm_args", "serve"):
            assert source[file]["repo"] == "NVIDIA/TensorRT-LLM"
            assert source[file]["commit"] or source[file]["index_id"]
            assert source[file]["ranges"]
        assert "confidence" in source["note"]


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
    with pytest.raises(ValueError, match="0.21"):
        options_problems({}, "0.21")


def test_keys_of_a_partly_read_model_are_not_refused():
    """1.2's EagleDecodingConfig was cached with its fields left out: its keys cannot be judged."""
    assert not TABLE["releases"]["1.2"]["models"]["EagleDecodingConfig"]["fields_complete"]
    eagle = {"decoding_type": "Eagle3", "max_draft_len": 3, "eagle_choices": [[0]], "speculative_model": "/d"}
    assert options_problems({"speculative_config": eagle}, "1.2") == []
    assert options_problems({"speculative_config": eagle | {"max_draft_len": "3"}}, "1.2")


def test_serve_options_flag_is_the_newest_name_each_release_accepts():
    assert serve_options_flag("1.0") == serve_options_flag("1.1") == "--extra_llm_api_options"
    assert serve_options_flag("1.2") == "--config"
