"""scripts/dev/tabulate_trtllm_backend.py on stored snapshots of its upstream inputs (tests/fixtures/upstream:
verbatim tensorrtllm_backend v0.19.0 files and excerpts), and the committed table it wrote."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("tree_sitter")
pytest.importorskip("tree_sitter_cpp")

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = Path(__file__).parent / "fixtures" / "upstream"
TABLE = ROOT / "pipeline" / "triton" / "tensorrt_llm_templates.json"

spec = importlib.util.spec_from_file_location(
    "tabulate_trtllm_backend", ROOT / "scripts/dev/tabulate_trtllm_backend.py"
)
tab = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = tab  # dataclasses look their module up
spec.loader.exec_module(tab)


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
        }
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
    from pipeline.targets import trtllm

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
