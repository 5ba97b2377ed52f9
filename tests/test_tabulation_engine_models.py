"""scripts/dev/tabulate_trtllm_engine_models.py re-run on the committed verbatim excerpts of NVIDIA/TensorRT-LLM
(tests/fixtures/upstream/models_init_*, qwen_*, llama_*, ...) and the installed ModelOpt: it reproduces the
committed pipeline/trtllm_engine_models.json, and the facts the engine backend relies on are in it."""

import json
from pathlib import Path

import modelopt

from tests.conftest import dev_script

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = Path(__file__).parent / "fixtures" / "upstream"
TABLE = json.loads((ROOT / "pipeline" / "trtllm_engine_models.json").read_text())

tab = dev_script("tabulate_trtllm_engine_models")


def test_the_tabulator_reproduces_the_committed_table(tmp_path):
    out = tmp_path / "engine_models.json"
    tab.main(str(UPSTREAM), str(Path(modelopt.__file__).parent), str(out))
    assert json.loads(out.read_text()) == TABLE


def test_every_stored_model_map_names_its_source_and_the_families_split_as_read():
    for version in TABLE["model_map"]:
        assert version["source"]["path"] == "tensorrt_llm/models/__init__.py"
        assert version["source"]["commit"] or version["source"]["index_id"]
        classes = version["classes"]
        assert classes["MistralForCausalLM"] == classes["LlamaForCausalLM"] == "LLaMAForCausalLM"
        assert classes["Qwen2ForCausalLM"] == "QWenForCausalLM"
    oldest, *newer = TABLE["model_map"]
    assert "Gemma3ForCausalLM" not in oldest["classes"] and "Qwen3ForCausalLM" not in oldest["classes"]
    assert all(v["classes"]["Gemma3ForCausalLM"] == "GemmaForCausalLM" for v in newer)


def test_qwen_facts_the_checkpoint_check_uses():
    qwen = TABLE["config_classes"]["QWenConfig"]
    assert qwen["init_defaults"]["attn_bias"] is True and qwen["init_defaults"]["mlp_bias"] is False
    assert qwen["from_hugging_face"] == {"qwen_type": "hf_config.model_type"}
    layer = TABLE["decoder_layers"]["QWenDecoderLayer"]
    assert layer["attention"] == {"bias": "config.attn_bias", "dense_bias": "False"}
    assert "qwen_type" in layer["compares"]
    assert TABLE["pretrained_config"]["unnamed_keys_become_attributes"]
    assert "sliding_window" not in TABLE["config_classes"]["LLaMAConfig"]["init_defaults"]


def test_modelopt_facts():
    mo = TABLE["modelopt"]
    assert {"llama", "qwen"} <= set(mo["config_writer_decoder_types"])
    assert "phi3" not in mo["config_writer_decoder_types"] and "gemma3" not in mo["config_writer_decoder_types"]
    assert mo["config_writer_otherwise_raises"] == "NotImplementedError"


def test_release_notes_date_the_entries_older_stored_versions_lack():
    added = TABLE["added_in_release"]
    assert {arch: entry["release"] for arch, entry in added.items()} == {
        "Gemma3ForCausalLM": "0.19",  # not 0.21's "Added Gemma3 VLM support": the earliest wins
        "Qwen3ForCausalLM": "0.20",
    }
