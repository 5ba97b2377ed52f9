"""scripts/dev/tabulate_trtllm_backend.py on stored snapshots of its upstream inputs (tests/fixtures/upstream:
verbatim tensorrtllm_backend v0.19.0 files and excerpts, docs/model_config.md excerpts, an excerpt of the stored
NVIDIA/TensorRT-LLM tensorrt_llm template), and the committed table it wrote."""

import json
import re
from pathlib import Path

from tests.conftest import dev_script

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = Path(__file__).parent / "fixtures" / "upstream"
TABLE = ROOT / "pipeline" / "triton" / "tensorrt_llm_templates.json"

tab = dev_script("tabulate_trtllm_backend")


def reads(name: str):
    return tab.parameter_reads((UPSTREAM / name).read_text(), name)


def test_v019_guided_decoding_parameters_are_required():
    # getGuidedDecodingConfigFromParams reads them outside any try: a config without them does not load
    required, optional = tab.classify(reads("tensorrtllm_backend-v0.19.0-model_instance_state-guided.cc"))
    assert required == {
        "guided_decoding_backend": "std::string",
        "tokenizer_dir": "std::string",
        "xgrammar_tokenizer_info_path": "std::string",
    }
    assert optional == ["batch_scheduler_policy"]  # read inside try { ... } catch


def test_v019_names_passed_through_a_variable_are_resolved_and_guarded():
    found = reads("tensorrtllm_backend-v0.19.0-model_instance_state-peft.cc")
    assert [(r.variable, r.name, r.cpp_type, r.guarded) for r in found] == [
        ("fieldName", "lora_cache_max_adapter_size", "SizeType32", True),
        ("fieldName", "lora_cache_optimal_adapter_size", "SizeType32", True),
    ]


def test_a_read_in_a_catch_handler_is_unguarded_and_an_outer_try_guards():
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


def test_the_stored_v019_template_tabulates_to_the_committed_entry():
    committed = json.loads(TABLE.read_text())["0.19"]["models"]["tensorrt_llm"]
    tabulated = tab.tabulate((UPSTREAM / "tensorrtllm_backend-v0.19.0-tensorrt_llm-config.pbtxt").read_text())
    assert tabulated["inputs"] == committed["inputs"]
    assert tabulated["outputs"] == committed["outputs"]
    assert tabulated["parameters"] == committed["parameters"]
    assert {"guided_decoding_backend", "xgrammar_tokenizer_info_path"} <= set(tabulated["parameters"])
    row = next(t for t in tabulated["outputs"] if t["name"] == "context_logits")
    assert row["data_type"] == "${logits_datatype}"


def test_committed_table_layout_and_v019_required_parameters():
    table = json.loads(TABLE.read_text())
    assert list(table) == ["0.18", "0.19", "0.20", "0.21", "1.0", "1.1", "1.2"]
    for release, facts in table.items():
        assert set(facts) == {
            "source",
            "models",
            "required_parameters",
            "optional_parameters",
            "variable_parameter_reads",
            "renamed_from_docs",
            "docs_disagreements",
        }
        assert facts["source"]["docs"]["path"] == "docs/model_config.md", release
        assert re.fullmatch(r"[0-9a-f]{40}", facts["source"]["docs"]["commit"]), release
        assert set(facts["models"]) == set(tab.MODELS)
        assert all(re.fullmatch(r"[0-9a-f]{40}", f["commit"]) for f in facts["source"]["files"]), release
        assert not tab.consistency_problems(facts["models"]), release
        assert set(facts["required_parameters"]) <= set(facts["models"]["tensorrt_llm"]["parameters"]), release
    assert table["0.19"]["source"]["commit"] == "c1e19638304d287f554f738c1411746555ed348c"
    assert table["0.19"]["required_parameters"] == {
        "gpt_model_type": "std::string",
        "guided_decoding_backend": "std::string",
        "tokenizer_dir": "std::string",
        "xgrammar_tokenizer_info_path": "std::string",
    }
    assert table["0.18"]["required_parameters"] == {"gpt_model_type": "std::string"}


def test_trtllm_target_reads_the_table():
    from pipeline.targets import trtllm_engine as trtllm

    for version in trtllm.SUPPORTED_VERSIONS:
        spec = trtllm.template(version)
        assert {"inputs", "outputs", "parameters"} <= set(spec)
        variables = {t["data_type"] for t in spec["inputs"] + spec["outputs"] if t["data_type"].startswith("${")}
        # every ${var} data type is one triton_llm_model fills
        assert variables <= {
            "${logits_datatype}",
            "${encoder_input_features_data_type}",
            "${prompt_embedding_table_data_type}",
        }
    assert trtllm.required_parameters("0.19")["guided_decoding_backend"] == "std::string"


def test_docs_tables_are_read_by_heading():
    docs = tab.documented_inputs((UPSTREAM / "tensorrtllm_backend-v0.20.0-model_config.md").read_text())
    common = ["end_id", "pad_id", "temperature", "repetition_penalty", "min_length"]
    common += ["presence_penalty", "frequency_penalty", "random_seed"]
    assert list(docs["tensorrt_llm_bls"]) == common
    assert list(docs["tensorrt_llm"]) == [*common, "early_stopping", "beam_search_diversity_rate"]
    row = docs["tensorrt_llm"]["random_seed"]
    assert (row.dims, row.data_type, row.description) == ([1], "TYPE_UINT64", "Sampling Config param: `randomSeed`")
    assert docs["tensorrt_llm"]["min_length"].data_type == "TYPE_INT32"  # spelled `int32_t`


def test_stored_template_is_reconciled_with_the_v020_docs():
    # the stored template says min_tokens/seed; v0.20.0's docs list min_length/random_seed instead. The stored
    # names are described by the release/1.2 docs ("Sampling Config param: `minTokens`" / "`seed`"): not the same
    # text, but the same dims and type and a related Sampling Config param -- and only one candidate each
    template = tab.tabulate((UPSTREAM / "TensorRT-LLM-2a9abd95-tensorrt_llm-config-excerpt.pbtxt").read_text())
    docs = tab.documented_inputs((UPSTREAM / "tensorrtllm_backend-v0.20.0-model_config.md").read_text())
    later = tab.documented_inputs((UPSTREAM / "tensorrtllm_backend-release1.2-model_config.md").read_text())
    described = {name: row.description for name, row in later["tensorrt_llm"].items()}
    models = {"tensorrt_llm": template}
    renamed, disagreements = tab.reconcile(models, docs, described)
    assert renamed == {"tensorrt_llm": {"min_tokens": "min_length", "seed": "random_seed"}}
    assert disagreements == {
        "tensorrt_llm": {
            "documented_not_in_template": ["end_id", "pad_id", "temperature"],
            "template_not_documented": [],
        }
    }
    tab.apply_renames(models, renamed)
    assert [t["name"] for t in template["inputs"]][1:3] == ["repetition_penalty", "min_length"]
    # without a description of the stored name there is no evidence: nothing is renamed
    assert (
        tab.reconcile(
            {
                "tensorrt_llm": tab.tabulate(
                    (UPSTREAM / "TensorRT-LLM-2a9abd95-tensorrt_llm-config-excerpt.pbtxt").read_text()
                )
            },
            docs,
            {},
        )[0]
        == {}
    )


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


def test_committed_tensor_names_follow_the_release_docs():
    table = json.loads(TABLE.read_text())
    for release, (min_tokens, seed) in {
        "0.19": ("min_length", "random_seed"),
        "0.20": ("min_length", "random_seed"),
        "1.0": ("min_length", "random_seed"),
        "1.1": ("min_length", "random_seed"),
        "1.2": ("min_tokens", "seed"),
    }.items():
        for model in tab.RECONCILED:
            names = {t["name"] for t in table[release]["models"][model]["inputs"]}
            assert {min_tokens, seed} <= names, (release, model)
            assert not {"min_tokens", "seed", "min_length", "random_seed"} - {min_tokens, seed} & names
    assert table["1.0"]["source"]["docs"]["commit"] == "efb8a497eac3e16acf6f3ad250565465c80e6f0a"  # tag v1.0.0
    assert table["1.0"]["renamed_from_docs"]["tensorrt_llm"] == {"min_tokens": "min_length", "seed": "random_seed"}
    assert table["1.2"]["renamed_from_docs"] == {} == table["0.19"]["renamed_from_docs"]
    steps = {s["model_name"]: s for s in table["1.0"]["models"]["ensemble"]["steps"]}
    assert steps["tensorrt_llm"]["input_map"]["min_length"] == "min_length"
