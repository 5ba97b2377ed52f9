"""The tabulators of TensorRT-LLM facts (scripts/dev/tabulate_trtllm_build.py, tabulate_trtllm_checkpoint.py),
run on verbatim excerpts of the upstream files they read (tests/fixtures/upstream), agree with the committed
tables for every fact the pipeline relies on; and the pipeline's checks take those facts from the tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config
from tests.conftest import dev_script, write_config

ROOT = Path(__file__).parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "upstream"
FLAGS = json.loads((ROOT / "pipeline" / "targets" / "trtllm_build_flags.json").read_text())
RULES = json.loads((ROOT / "pipeline" / "trtllm_checkpoint_rules.json").read_text())
POSITION = {"line", "line_in_slice", "slice_offset"}  # excerpts keep the text, not the line numbers


build_tab, checkpoint_tab = dev_script("tabulate_trtllm_build"), dev_script("tabulate_trtllm_checkpoint")
upstream = sys.modules["upstream_source"]


def fixture(*names: str) -> str:
    return "".join((FIXTURES / name).read_text() for name in names)


def statements(*names: str) -> list:
    return upstream.complete_statements(fixture(*names))


def positionless(value):
    if isinstance(value, dict):
        return {k: positionless(v) for k, v in value.items() if k not in POSITION}
    if isinstance(value, list):
        return [positionless(v) for v in value]
    return value


@pytest.fixture(scope="module")
def emitted(tmp_path_factory, tiny_llama) -> dict[str, str]:
    """flag -> value of the trtllm-build command the pipeline prints for an FP8 build with FP8 context FMHA."""
    from pipeline.targets.trtllm_engine import trtllm_build_command

    path = write_config(
        tmp_path_factory.mktemp("cfg") / "gpu.yaml",
        f"""
        model: {{source: hf, path: {tiny_llama}}}
        target: {{name: trtllm, trtllm_backend: tensorrt, trtllm_version: "0.19"}}
        quantization: {{weights: fp8, kv_cache: fp8}}
        build: {{max_input_len: 256, max_seq_len: 512, max_num_tokens: 1024, use_fp8_context_fmha: true}}
    """,
    )
    command = trtllm_build_command(load_config(path), Path("/ckpt"), Path("/engine"))
    return dict(arg.split("=", 1) for arg in command[1:])


# ---------------------------------------------------------------- trtllm-build flags

BUILD_EXCERPTS = {
    "008b2b8d23af95e4e19fa6f354f9c5f6349b2bfc": "build_py_008b2b8d.py.txt",
    "65f1d1536e18aea3380e6e270e00895a709333eb": "build_py_65f1d153.py.txt",
}
PLUGIN_EXCERPTS = {
    "index-id-4216063708": ("plugin_py_4216063708_fields.py.txt", "plugin_py_4216063708_cli.py.txt"),
    "c20322ffd3dc0740ca530c9fad989b22e64f6e06": ("plugin_py_c20322ff_fields.py.txt", "plugin_py_c20322ff_cli.py.txt"),
}


def test_the_excerpts_are_of_every_version_tabulated():
    assert sorted(BUILD_EXCERPTS) == FLAGS["versions_read"][build_tab.BUILD]
    assert sorted(PLUGIN_EXCERPTS) == FLAGS["versions_read"][build_tab.PLUGIN]


@pytest.mark.parametrize("version", sorted(BUILD_EXCERPTS))
def test_build_py_parse_arguments_defines_the_flags_we_emit_as_tabulated(version, emitted):
    parsed = build_tab.build_arguments(fixture(BUILD_EXCERPTS[version]))
    ours = {f for f in emitted if FLAGS["flags"][f]["defined_in"] == build_tab.BUILD}
    assert ours <= set(parsed["flags"])  # the real text defines each build.py flag the pipeline passes
    for flag, spec in parsed["flags"].items():
        assert positionless(spec) == positionless(FLAGS["flags"][flag]["by_version"][version])
    assert parsed["adds_plugin_arguments"] and FLAGS["plugin_flags_added_by_build_py"][version]
    assert parsed["enum_lookup"] == FLAGS["enums"]["KVCacheType"]["lookup_in_build_py"][version]


@pytest.mark.parametrize("version", sorted(PLUGIN_EXCERPTS))
def test_plugin_py_adds_the_plugin_flags_we_emit_with_the_tabulated_choices(version, emitted):
    parsed = build_tab.plugin_arguments(fixture(*PLUGIN_EXCERPTS[version]), excerpt=True)
    ours = {f for f in emitted if FLAGS["flags"][f]["defined_in"] == build_tab.PLUGIN}
    assert ours <= set(parsed)
    for flag, spec in parsed.items():
        assert positionless(spec) == positionless(FLAGS["flags"][flag]["by_version"][version])
    for flag in ours:  # the values we pass are among the choices the real text derives
        assert parsed[flag]["choices"] is None or emitted[flag] in parsed[flag]["choices"]


def test_kv_cache_type_spellings_come_from_the_cpp_enum(emitted):
    binding = build_tab.kv_cache_type_spellings(fixture("bindings_2466487981_kv_cache_type.cpp.txt"))
    parser = build_tab.kv_cache_type_spellings(fixture("model_config_706570987_kv_cache_type.h.txt"))
    spellings = FLAGS["enums"]["KVCacheType"]["spellings"]
    assert binding == spellings["index-id-2466487981/cpp/tensorrt_llm/pybind/bindings.cpp"]
    assert parser == spellings["index-id-706570987/cpp/include/tensorrt_llm/runtime/modelConfig.h"]
    accepted = {v.lower() for v in binding["names"]} & {v.lower() for v in parser["from_string"]}
    assert sorted(accepted) == FLAGS["flags"]["--kv_cache_type"]["choices"]
    assert emitted["--kv_cache_type"] in accepted


def test_every_flag_we_emit_is_in_every_version_read_and_none_is_hidden(emitted):
    for flag, value in emitted.items():
        entry = FLAGS["flags"][flag]
        assert entry["in_versions"] == FLAGS["versions_read"][entry["defined_in"]], flag
        assert entry["choices"] is None or value in entry["choices"], (flag, value)


# ---------------------------------------------------------------- checkpoint rules

QUANT_CONFIG_EXCERPTS = {
    "01ea6d79d454bb3ab10c7510a6f706ba039090c2": "modeling_utils_01ea6d79_quant_config.py.txt",
    "index-id-1189552800": "modeling_utils_1189552800_quant_config.py.txt",
}
MAPPING_EXCERPTS = {
    "05ebebb2c1d34320db9019f2b7ace6009a67e997": "mapping_05ebebb2.py.txt",
    "b35ac1b64368513d215c57d2ed01d62d910df8da": "mapping_b35ac1b6.py.txt",
}


@pytest.mark.parametrize("version", sorted(QUANT_CONFIG_EXCERPTS))
def test_quant_config_fields_are_the_tabulated_ones_and_from_dict_takes_no_other_key(version):
    parsed = checkpoint_tab.quant_config(statements(QUANT_CONFIG_EXCERPTS[version]), 0)
    tabulated = RULES["quant_config"]["by_version"][version]
    assert parsed["fields"] == tabulated["fields"]
    assert parsed["from_dict_calls"] == tabulated["from_dict_calls"] == ["cls(**config)"]
    assert set(RULES["quant_config"]["accepted_in_every_version"]) <= {f["name"] for f in parsed["fields"]}


def test_the_checker_accepts_exactly_the_quant_config_keys_of_every_version():
    from pipeline.trtllm_checkpoint import QUANT_CONFIG_KEYS

    per_version = [{f["name"] for f in q["fields"]} for q in RULES["quant_config"]["by_version"].values()]
    assert QUANT_CONFIG_KEYS == set.intersection(*per_version)


def test_pretrained_config_builds_mapping_and_quant_config_with_from_dict():
    parsed = checkpoint_tab.pretrained_config(statements("modeling_utils_01ea6d79_pretrained_config.py.txt"), 0)
    tabulated = RULES["pretrained_config"]["by_version"]["01ea6d79d454bb3ab10c7510a6f706ba039090c2"]
    assert positionless(parsed) == positionless(tabulated)
    assert parsed["mapping"]["built_by"] == ["Mapping.from_dict"]
    assert parsed["quantization"]["built_by"] == ["QuantConfig.from_dict"]


@pytest.mark.parametrize("version", sorted(MAPPING_EXCERPTS))
def test_mapping_init_parameters_are_the_tabulated_ones_and_from_dict_passes_every_key(version):
    parsed = checkpoint_tab.mapping_rules(statements(MAPPING_EXCERPTS[version]), 0)
    tabulated = RULES["mapping"]["by_version"][version]
    assert parsed["init_params"] == tabulated["init_params"]
    assert parsed["from_dict_calls"] == tabulated["from_dict_calls"] == ["cls(**mapping)"]
    assert "tp_size * pp_size * cp_size != world_size" in parsed["init_raises_if"]
    assert set(RULES["mapping"]["accepted_in_every_version"]) <= set(parsed["init_params"])


def test_the_checker_takes_the_mapping_keys_of_every_version_and_names_the_others():
    from pipeline.trtllm_checkpoint import MAPPING_KEYS, mapping_problems

    versions = RULES["mapping"]["by_version"]
    assert MAPPING_KEYS == set.intersection(*(set(v["init_params"]) for v in versions.values()))
    assert mapping_problems({"world_size": 2, "tp_size": 2, "pp_size": 1}, 2, 1) == []
    for version in versions.values():  # what each version's Mapping.to_dict writes (PretrainedConfig drops rank)
        written = {key: 1 for key in version["to_dict_keys"] if key != "rank"} | {"world_size": 2, "tp_size": 2}
        problems = mapping_problems(written, 2, 1)
        others = sorted(set(written) - MAPPING_KEYS)
        assert others and set(others) <= set(RULES["mapping"]["accepted_in_some_version_only"])
        assert len(problems) == 1 and str(others) in problems[0]
    assert any("mapping is" in p for p in mapping_problems({"world_size": 4, "tp_size": 4, "pp_size": 1}, 2, 2))


def test_load_raises_on_a_missing_tensor_and_warns_on_an_extra_one():
    parsed = checkpoint_tab.load_rules(statements("modeling_utils_01ea6d79_load.py.txt"), 0)
    tabulated = RULES["load"]["by_version"]["01ea6d79d454bb3ab10c7510a6f706ba039090c2"]
    assert parsed["on"] == tabulated["on"]
    assert parsed["on"]["not required_names.issubset(provided_names)"] == "raise RuntimeError"


def test_w8a16_linears_register_an_int8_weight_and_a_per_channel_scale():
    parsed = checkpoint_tab.weight_only_layers(statements("layers_790827869_weight_only.py.txt"), 0)
    tabulated = RULES["weight_only_layers"]["by_version"]["index-id-790827869"]["WeightOnlyQuantLinear"]
    assert positionless(parsed["WeightOnlyQuantLinear"]) == positionless(tabulated)
    params = parsed["WeightOnlyQuantLinear"]["parameters"]
    assert sorted(params) == ["per_channel_scale", "weight"] and params["weight"]["dtype"] == "'int8'"
    assert parsed["WeightOnlyQuantLinear"]["aliases"] == ["WeightOnlyQuantColumnLinear"]


def test_the_loader_quantizes_float_w8a16_weights_itself_and_skips_int8_ones():
    preprocess = checkpoint_tab.w8a16_preprocessing(statements("modeling_utils_01ea6d79_preprocess.py.txt"), 70000)
    tabulated = RULES["w8a16_loader"]["preprocess_perlayer_weights"]["by_version"]
    assert positionless(preprocess) == positionless(tabulated["01ea6d79d454bb3ab10c7510a6f706ba039090c2"])
    assert all(positionless(v) == positionless(preprocess) for v in tabulated.values())
    quantizer = checkpoint_tab.weight_only_quantize_dict(statements("convert_utils_03961722.py.txt"), 0)
    tabulated = RULES["w8a16_loader"]["weight_only_quantize_dict"]["by_version"]
    assert positionless(quantizer) == positionless(tabulated["03961722f65265573cad179baca3bc5fe8c03f76"])
    assert any("weights[name].dtype != torch.int8" in c for c in quantizer["quantizes_when"])


def test_awq_linears_pad_to_the_tabulated_multiple():
    parsed = checkpoint_tab.weight_only_layers(statements("layers_790827869_groupwise.py.txt"), 0)
    tabulated = RULES["weight_only_layers"]["by_version"]["index-id-790827869"]["WeightOnlyGroupwiseQuantLinear"]
    assert positionless(parsed["WeightOnlyGroupwiseQuantLinear"]) == positionless(tabulated)
    padding = parsed["WeightOnlyGroupwiseQuantLinear"]["padding"]
    multiple = eval(padding["multiple"], {"max": max}, {"use_w4a8_awq": True, "group_size": 64, "tp_size": 2})
    assert multiple == 256 and padding["padded"] == ["in_features", "out_features"]


# ---------------------------------------------------------------- reading slices


def test_a_statement_cut_by_the_end_of_a_slice_is_left_out_even_when_it_parses():
    text = (
        "def whole():\n    return 1\n\n\ndef cut():\n    logger.se"  # 'logger.se' parses: a cut 'logger.set_level(...)'
    )
    assert [s.name for s in upstream.complete_statements(text, cut_end=True)] == ["whole"]
    cls = "class A:\n\n    def one(self):\n        pass\n\n    def two(self):\n        pass\n\n    def three(self, x,\n"
    (salvaged,) = upstream.complete_statements(cls, cut_end=True)
    assert [m.name for m in salvaged.body] == ["one", "two"]  # 'three' is cut by the end of the text
    assert [s.name for s in upstream.complete_statements("ntization = 1\n        x = 2\ndef f():\n    pass\n")] == ["f"]
