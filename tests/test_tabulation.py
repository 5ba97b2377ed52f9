"""scripts/dev/tabulate_trtllm_backend.py and tabulate_sampling_checks.py on short inputs written here in the
upstream syntax (config.pbtxt, C++, markdown), and the committed tables they write."""

import json
import re

import pytest

from pipeline.upstream import TABLES, facts, resolved_releases
from tests.conftest import dev_script

tab = dev_script("tabulate_trtllm_backend")
sampling = dev_script("tabulate_sampling_checks")

SECTIONS = [
    "source",
    "models",
    "required_parameters",
    "optional_parameters",
    "variable_parameter_reads",
    "renamed_from_docs",
    "docs_disagreements",
    "guide_types",
    "guided_decoding_backends",
    "tokenizer_info",
]

# ---------------------------------------------------------------- parsing, on inputs written here

CONFIG = """
name: "demo"
backend: "${backend_name}"
max_batch_size: ${max_batch}
input [
  {
    name: "token_ids"
    data_type: TYPE_INT32
    dims: [ -1 ]
    optional: true
    allow_ragged_batch: true
  },
  {
    name: "budget"
    data_type: TYPE_INT32
    dims: [ 1 ]
    reshape: { shape: [ ] }
  }
]
output [
  {
    name: "scores"
    data_type: ${scores_type}
    dims: [ -1, -1 ]
  }
]
parameters: {
  key: "zeta_path"
  value: { string_value: "${zeta_path}" }
}
parameters: {
  key: "alpha_mode"
  value: { string_value: "${alpha_mode}" }
}
"""


def test_a_template_config_gives_its_tensors_and_parameter_keys():
    assert tab.template_interface(CONFIG) == {
        "inputs": [
            {
                "name": "token_ids",
                "data_type": "TYPE_INT32",
                "dims": [-1],
                "optional": True,
                "allow_ragged_batch": True,
            },
            {
                "name": "budget",
                "data_type": "TYPE_INT32",
                "dims": [1],
                "optional": False,
                "allow_ragged_batch": False,
                "reshape": [],
            },
        ],
        "outputs": [{"name": "scores", "data_type": "${scores_type}", "dims": [-1, -1]}],  # the variable is kept
        "parameters": ["alpha_mode", "zeta_path"],
    }


def test_an_ensemble_config_gives_its_steps_with_sorted_maps():
    ensemble = """
name: "pipe"
platform: "ensemble"
input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "reply" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "tokenize"
      model_version: -1
      input_map { key: "RAW" value: "text" }
      input_map { key: "LIMIT" value: "text" }
      output_map { key: "IDS" value: "_ids" }
    }
  ]
}
"""
    spec = tab.template_interface(ensemble)
    assert spec["steps"] == [
        {"model_name": "tokenize", "input_map": {"LIMIT": "text", "RAW": "text"}, "output_map": {"IDS": "_ids"}}
    ]
    assert spec["parameters"] == []


def test_a_read_outside_a_try_is_required_and_one_inside_a_try_optional():
    source = """
    void Holder::setUp()
    {
        auto mode = model_state->GetParameter<std::string>("x");
        try
        {
            depth = model_state->GetParameter<int32_t>("y");
        }
        catch (std::exception const& e)
        {
            depth = 4;
        }
    }
    """
    reads = tab.parameter_reads(source, "holder.cc")
    assert [(r.function, r.name, r.cpp_type, r.guarded) for r in reads] == [
        ("Holder::setUp", "x", "std::string", False),
        ("Holder::setUp", "y", "int32_t", True),
    ]
    assert tab.classify(reads) == ({"x": "std::string"}, ["y"])


def test_a_read_in_a_catch_handler_or_a_lambda_is_unguarded_and_an_outer_try_guards():
    source = """
    void f() {
        try { a = GetParameter<int32_t>("in_try"); }
        catch (std::exception const& e) { b = model_state_->GetParameter<bool>("in_catch"); }
        try { try { x(); } catch (std::exception const& e) { GetParameter<float>("nested_catch"); } }
        catch (...) {}
        auto read = [&]() { return model_state_->GetParameter<std::string>("in_lambda"); };
    }
    """
    required, optional = tab.classify(tab.parameter_reads(source, "snippet.cc"))
    assert required == {"in_catch": "bool", "in_lambda": "std::string"}
    assert optional == ["in_try", "nested_catch"]


def test_a_name_passed_in_a_variable_is_resolved_and_a_delegating_specialisation_skipped():
    source = """
    template <>
    int32_t State::GetParameter<int32_t>(std::string const& name)
    {
        return std::stoi(GetParameter<std::string>(name));
    }

    void Cache::configure()
    {
        std::string key = "first_size";
        try { one = model_state->GetParameter<SizeType32>(key); } catch (...) {}
        key = "second_size";
        two = model_state->GetParameter<SizeType32>(key);
    }
    """
    reads = tab.parameter_reads(source, "cache.cc")
    assert [(r.function, r.variable, r.name, r.guarded) for r in reads] == [
        ("Cache::configure", "key", "first_size", True),
        ("Cache::configure", "key", "second_size", False),
    ]
    assert tab.variable_reads(reads) == [
        {"file": "cache.cc", "function": "Cache::configure", "variable": "key", "resolved": name, "guarded": guarded}
        for name, guarded in (("first_size", True), ("second_size", False))
    ]


def test_guide_types_are_the_string_keys_the_guide_parser_maps_to_a_guide_type():
    source = """
    std::optional<GuidedDecodingParams> getGuidedDecodingParamsFromTensors(InputTensors const& inputs)
    {
        std::unordered_map<std::string, GuidedDecodingParams::GuideType> byName
            = {{"schema", GuidedDecodingParams::GuideType::kJSON_SCHEMA},
                {"pattern", GuidedDecodingParams::GuideType::kREGEX}};
        std::vector<int> unrelated = {{1, 2}};
        return std::nullopt;
    }
    void other() { std::map<std::string, GuideType> m = {{"elsewhere", GuideType::kJSON}}; }
    """
    assert tab.guide_types(source) == ["pattern", "schema"]  # sorted, and only from the guide parser
    assert tab.guide_types("void other() {}") == []  # a release without guided decoding
    with pytest.raises(tab.UnrecognizedSource, match="getGuidedDecodingParamsFromTensors"):
        tab.guide_types("void getGuidedDecodingParamsFromTensors() { auto m = {{1, 2}}; }")


def test_the_guided_decoding_config_gives_the_accepted_backends_and_the_tokenizer_info_keys_with_types():
    source = """
    std::optional<GuidedDecodingConfig> State::getGuidedDecodingConfigFromParams()
    {
        std::string path = model_state_->GetParameter<std::string>("info_path");
        std::string chosen = model_state_->GetParameter<std::string>("guided_decoding_backend");
        if (chosen.empty() || chosen == "${guided_decoding_backend}" || path == "${info_path}")
        {
            return std::nullopt;
        }
        auto const info = nlohmann::json::parse(std::ifstream{path});
        auto const words = info["words"].template get<std::vector<std::string>>();
        auto const ends = info["ends"].template get<std::vector<int32_t>>();
        if (chosen == "grammarlib") { return GuidedDecodingConfig(words, ends); }
        TLLM_THROW("unknown backend");
    }
    """
    assert tab.guided_decoding_config(source) == {
        "guided_decoding_backends": ["grammarlib"],  # the placeholder comparison means "off", not a backend
        "tokenizer_info": {"ends": "std::vector<int32_t>", "words": "std::vector<std::string>"},
    }
    assert tab.guided_decoding_config("void other() {}") == {"guided_decoding_backends": [], "tokenizer_info": {}}
    newer = source.replace('"grammarlib"', '"otherlib"').replace("int32_t>>", "int64_t>>")
    with pytest.raises(tab.UnrecognizedSource, match="'ends' is read as"):
        tab.guided_decoding_configs([source, newer])
    assert tab.guided_decoding_configs([source, source.replace('"ends"', '"stops"')])["tokenizer_info"].keys() == {
        "ends",
        "stops",
        "words",
    }  # a file must hold the keys any version reads


DOCS = """
## Intro

| Name | Shape | Type | Description |
| :--- | :---: | :--- | :---------- |
| `count_floor` | [1] | `int32_t` | Sampling Config param: `countFloor` |
| `noise_seed` | [1] | `uint64_t` | Sampling Config param: `noiseSeed` |
| `weights` | [-1, 2] | The model data type | Per-row weights |
"""


def test_documented_inputs_are_read_from_the_input_tables_by_heading():
    common = tab.documented_inputs(DOCS.replace("Intro", "Common Inputs"))
    assert list(common) == ["tensorrt_llm", "tensorrt_llm_bls"]
    assert list(common["tensorrt_llm"]) == list(common["tensorrt_llm_bls"]) == ["count_floor", "noise_seed", "weights"]
    row = common["tensorrt_llm"]["noise_seed"]
    assert (row.dims, row.data_type, row.description) == ([1], "TYPE_UINT64", "Sampling Config param: `noiseSeed`")
    assert common["tensorrt_llm"]["count_floor"].data_type == "TYPE_INT32"
    weights = common["tensorrt_llm"]["weights"]
    assert (weights.dims, weights.data_type) == ([-1, 2], None)  # the model's own data type: none to compare
    unique = tab.documented_inputs(DOCS.replace("Intro", "Unique Inputs for tensorrt_llm_bls model"))
    assert unique["tensorrt_llm"] == {} and list(unique["tensorrt_llm_bls"]) == ["count_floor", "noise_seed", "weights"]
    assert tab.documented_inputs(DOCS) == {"tensorrt_llm": {}, "tensorrt_llm_bls": {}}  # no input table
    with pytest.raises(ValueError, match="unknown heading"):
        tab.documented_inputs(DOCS.replace("Intro", "Unique Inputs for other model"))


def _inputs(*names_dims_types):
    return {"inputs": [{"name": n, "dims": d, "data_type": t} for n, d, t in names_dims_types], "outputs": []}


def test_template_inputs_are_renamed_to_the_documented_name_of_the_same_or_a_related_sampling_param():
    docs = tab.documented_inputs(DOCS.replace("Intro", "Common Inputs"))
    models = {"tensorrt_llm": _inputs(("floor_count", [1], "TYPE_INT32"), ("seed", [1], "TYPE_UINT64"))}
    described = {"floor_count": "Sampling Config param: `countFloor`", "seed": "Sampling Config param: `seed`"}
    renamed, disagreements = tab.reconcile(models, docs, described)
    # floor_count: the same description; seed: same dims and type, and noiseSeed shares the word "seed"
    assert renamed == {"tensorrt_llm": {"floor_count": "count_floor", "seed": "noise_seed"}}
    assert disagreements == {"tensorrt_llm": {"documented_not_in_template": ["weights"], "template_not_documented": []}}
    assert [t["name"] for t in models["tensorrt_llm"]["inputs"]] == ["floor_count", "seed"]  # not applied
    # another type, or no description at all: no evidence, nothing renamed
    other_type = {"tensorrt_llm": _inputs(("seed", [1], "TYPE_INT32"))}
    assert tab.reconcile(other_type, docs, described)[0] == {}
    assert tab.reconcile(models, docs, {})[0] == {}


def test_renames_follow_into_the_ensemble_steps():
    models = {
        "tensorrt_llm": {"inputs": [{"name": "seed"}], "outputs": [], "parameters": []},
        "ensemble": {
            "inputs": [{"name": "seed"}],
            "outputs": [],
            "parameters": [],
            "steps": [{"model_name": "tensorrt_llm", "input_map": {"seed": "seed"}, "output_map": {}}],
        },
    }
    tab.apply_renames(models, {"tensorrt_llm": {"seed": "random_seed"}, "ensemble": {"seed": "random_seed"}})
    assert models["ensemble"]["steps"][0]["input_map"] == {"random_seed": "random_seed"}
    assert not tab.consistency_problems(models)
    models["ensemble"]["steps"][0]["input_map"]["missing"] = "random_seed"
    assert tab.consistency_problems(models) == ["ensemble -> tensorrt_llm: no input missing"]


class Files:
    """An Upstream serving texts written here by the end of the file's path, recording what was read."""

    def __init__(self, texts: dict[str, str]):
        self.texts, self.read_at = texts, []

    def read(self, repo: str, path: str, commit: str) -> str:
        self.read_at.append((repo, path, commit))
        return next((text for end, text in self.texts.items() if path.endswith(end)), "")


def test_tabulate_reads_every_file_through_upstream_and_stores_shared_releases_once():
    config = 'name: "m"\ninput [ { name: "count_floor" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
    step = '{ model_name: "tensorrt_llm" input_map { key: "count_floor" value: "count_floor" } }'
    steps = f"ensemble_scheduling {{ step [ {step} ] }}"
    cpp = 'void S::f() { auto x = model_state->GetParameter<bool>("switch"); }'
    texts = {"ensemble/config.pbtxt": config + steps, "config.pbtxt": config, "model_state.cc": cpp}
    upstream = Files(texts | {"model_config.md": DOCS.replace("Intro", "Common Inputs")})
    table = tab.tabulate(upstream)
    assert all(re.fullmatch(r"[0-9a-f]{40}", commit) for _, _, commit in upstream.read_at)
    stored = table["releases"]
    assert list(stored) == list(tab.RELEASES)
    assert stored["0.18"]["required_parameters"] == {"switch": "bool"}
    assert stored["0.18"]["models"]["ensemble"]["inputs"] == [
        {"name": "count_floor", "data_type": "TYPE_INT32", "dims": [1], "optional": False, "allow_ragged_batch": False}
    ]
    for release in ("0.19", "0.20", "0.21", "1.0", "1.1", "1.2"):  # every other release differs in its sources only
        assert {op["path"].split("/")[1] for op in stored[release]["patch"]} == {"source"}, release
    files = stored["0.18"]["source"]["files"]
    assert {(f["repo"], f["pinned"]) for f in files} == {(tab.BACKEND_REPO, True)}
    moved = resolved_releases(stored)["0.20"]["source"]
    assert moved["release_commit"] == tab.RELEASES["0.20"].release_commit
    assert {(f["repo"], f["pinned"]) for f in moved["files"]} == {(tab.TRTLLM_REPO, False)}


# ---------------------------------------------------------------- the committed tensorrtllm_backend table

TABLE = facts("tensorrtllm_backend")["releases"]


def _cited(record: dict) -> bool:
    return {"repo", "path", "commit", "pinned"} <= set(record) and re.fullmatch(r"[0-9a-f]{40}", record["commit"])


def test_every_release_has_every_section_model_and_a_cited_source():
    assert list(TABLE) == list(tab.RELEASES)
    for release, block in TABLE.items():
        assert list(block) == SECTIONS, release
        assert set(block["models"]) == set(tab.MODELS), release
        assert not tab.consistency_problems(block["models"]), release
        assert set(block["required_parameters"]) <= set(block["models"]["tensorrt_llm"]["parameters"]), release
        source = block["source"]
        assert all(set(f) == {"repo", "path", "commit", "pinned"} and _cited(f) for f in source["files"]), release
        assert _cited(source["docs"]) and source["docs"]["commit"] == tab.RELEASES[release].backend_commit, release
        tagged = tab.RELEASES[release].tag is not None
        assert all(f["pinned"] == tagged for f in source["files"]), release  # from 0.20 on, not the release commit
        if not tagged:
            assert source["release_commit"] == tab.RELEASES[release].release_commit, release
            assert _cited(source["release_commit_from"]), release


def test_the_names_the_pipeline_looks_up_are_in_every_release():
    from pipeline.targets.trtllm.guided import BACKEND_PARAMETER, INFO_PATH_PARAMETER, takes_guided_decoding
    from pipeline.triton.repo import LLM_INPUT_ALIASES

    for release, block in TABLE.items():
        llm = block["models"]["tensorrt_llm"]
        variables = {t["data_type"] for t in llm["inputs"] + llm["outputs"] if t["data_type"].startswith("${")}
        # every ${var} data type is one engine.triton_llm_model fills
        assert variables <= {
            "${logits_datatype}",
            "${encoder_input_features_data_type}",
            "${prompt_embedding_table_data_type}",
        }, release
        names = {t["name"] for t in llm["inputs"]}
        assert all({ours, theirs} & names for ours, theirs in LLM_INPUT_ALIASES.items()), release
        guided = {BACKEND_PARAMETER, INFO_PATH_PARAMETER}  # what guided.engine_parameters fills
        assert (guided <= set(llm["parameters"])) == takes_guided_decoding(release), release
        assert block["models"]["ensemble"]["inputs"], release


def test_committed_required_parameters_and_tensor_names_per_release():
    assert TABLE["0.18"]["required_parameters"] == {"gpt_model_type": "std::string"}
    assert TABLE["0.19"]["required_parameters"] == {
        "gpt_model_type": "std::string",
        "guided_decoding_backend": "std::string",
        "tokenizer_dir": "std::string",
        "xgrammar_tokenizer_info_path": "std::string",
    }
    for release, (min_tokens, seed) in {
        "0.19": ("min_length", "random_seed"),
        "0.20": ("min_length", "random_seed"),
        "1.0": ("min_length", "random_seed"),
        "1.1": ("min_length", "random_seed"),
        "1.2": ("min_tokens", "seed"),
    }.items():
        for model in tab.RECONCILED:
            names = {t["name"] for t in TABLE[release]["models"][model]["inputs"]}
            assert {min_tokens, seed} <= names, (release, model)
            assert not {"min_tokens", "seed", "min_length", "random_seed"} - {min_tokens, seed} & names
    assert TABLE["1.0"]["renamed_from_docs"]["tensorrt_llm"] == {"min_tokens": "min_length", "seed": "random_seed"}
    assert TABLE["1.2"]["renamed_from_docs"] == {} == TABLE["0.19"]["renamed_from_docs"]
    steps = {s["model_name"]: s for s in TABLE["1.0"]["models"]["ensemble"]["steps"]}
    assert steps["tensorrt_llm"]["input_map"]["min_length"] == "min_length"


def test_guide_types_per_release_are_the_cpp_backends():
    assert TABLE["0.18"]["guide_types"] == []  # 0.18 has no guided decoding
    for release in ("0.19", "0.20", "0.21", "1.0", "1.1", "1.2"):
        assert TABLE[release]["guide_types"] == ["ebnf_grammar", "json", "json_schema", "regex"], release
        utils = [
            f for f in TABLE[release]["source"]["files"] if f["path"].endswith("inflight_batcher_llm/src/utils.cc")
        ]
        assert len(utils) == 1, release  # the file the guide types are read from is cited
        names = {t["name"] for t in TABLE[release]["models"]["tensorrt_llm"]["inputs"]}
        assert {"guided_decoding_guide_type", "guided_decoding_guide"} <= names, release
        assert TABLE[release]["guided_decoding_backends"] == ["xgrammar"], release
        assert TABLE[release]["tokenizer_info"] == {
            "encoded_vocab": "std::vector<std::string>",
            "stop_token_ids": "std::vector<tensorrt_llm::runtime::TokenIdType>",
            "tokenizer_str": "std::string",
        }, release
    assert TABLE["0.18"]["guided_decoding_backends"] == [] and TABLE["0.18"]["tokenizer_info"] == {}


def test_the_cpu_models_guide_types_are_those_of_the_release_it_mirrors_read_from_the_same_file():
    interface = facts("cpu_llm_interface")
    mirrored = TABLE[interface["mirrors"]]
    assert interface["guide_types"] == mirrored["guide_types"]
    assert interface["source"] in mirrored["source"]["files"] and interface["source"]["pinned"]
    parser = """
    std::optional<GuidedDecodingParams> getGuidedDecodingParamsFromTensors(InputTensors const& inputs)
    {
        std::unordered_map<std::string, GuidedDecodingParams::GuideType> byName
            = {{"regex", GuidedDecodingParams::GuideType::kREGEX}, {"json", GuidedDecodingParams::GuideType::kJSON}};
    }
    """
    upstream = Files({"utils.cc": parser})
    made = dev_script("tabulate_cpu_llm_interface").tabulate(upstream)
    assert made["guide_types"] == ["json", "regex"] and made["source"] == interface["source"]
    assert upstream.read_at == [
        (interface["source"]["repo"], interface["source"]["path"], interface["source"]["commit"])
    ]


def test_releases_0_20_to_1_1_store_their_templates_once():
    stored = json.loads((TABLES / "tensorrtllm_backend.json").read_text())["releases"]
    assert "models" in stored["0.20"]
    for release in ("0.21", "1.0", "1.1"):
        assert {op["path"].split("/")[1] for op in stored[release]["patch"]} == {"source"}, release


# ---------------------------------------------------------------- sampling_checks

CHECKERS = """
Width SamplingConfig::checkWidth(Width width)
{
    TLLM_CHECK(width > 0 && width <= static_cast<Width const>(limits::kMaxWidth));
    return width;
}

OptFloat const& SamplingConfig::checkSharpness(OptFloat const& sharpness)
{
    if (sharpness.has_value())
    {
        TLLM_CHECK(sharpness.value() >= 0.5f);
        TLLM_CHECK(sharpness.value() <= 2.f);
    }
    return sharpness;
}

OptSize32 const& SamplingConfig::checkCopies(OptSize32 const& copies, Width width)
{
    if (copies.has_value())
    {
        TLLM_CHECK(copies.value().size() < width);
    }
    return copies;
}
"""


def test_sampling_checks_give_each_checker_its_bounds():
    # numbers lose their float suffix, a named bound keeps its bare name; a checker comparing no bound is left out
    assert sampling.checks(CHECKERS) == {
        "Width": [[">", 0], ["<=", "kMaxWidth"]],
        "Sharpness": [[">=", 0.5], ["<=", 2]],
    }


def test_sampling_checks_table_is_cited_and_holds_the_bounds_the_runner_checks():
    from pipeline.targets.onnxruntime.runtime.sampling import SAMPLING_SETTINGS

    table = facts("sampling_checks")
    assert table["source"] == {
        "repo": sampling.REPO,
        "path": sampling.PATH,
        "commit": sampling.COMMIT,
        "pinned": False,
    }
    assert {checker for checker in SAMPLING_SETTINGS.values() if checker} <= set(table["checks"])
    assert table["checks"]["TopP"] == [[">", 0], ["<=", 1]]
