"""The tabulators of trtllm-build's flags and of the checkpoint loader's rules (scripts/dev/tabulate_trtllm_build.py,
tabulate_trtllm_checkpoint.py) on short inputs of our own in the upstream syntax, and the committed tables
(pipeline/upstream/trtllm_build_flags.json, trtllm_checkpoint.json) against what the pipeline looks up in them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipeline.upstream import facts
from pipeline.validation import load_config
from tests.conftest import dev_script, write_config

FLAGS = facts("trtllm_build_flags")
RULES = facts("trtllm_checkpoint")

build_tab, checkpoint_tab = dev_script("tabulate_trtllm_build"), dev_script("tabulate_trtllm_checkpoint")

BUILD_PY = """
import argparse


def enum_type(enum_class):
    def parse(value):
        return enum_class[value.upper()]
    return parse


def parse_arguments():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_width", "--max_size", type=int, default=Settings.max_width)
    parser.add_argument("--mode", type=str, choices=["fast", "slow"], default="fast")
    parser.add_argument("--cache_kind", type=enum_type(CacheKind), default=argparse.SUPPRESS)
    parser.add_argument("--region", type=str, choices=regions.keys(), dest="area")
    parser.add_argument("--verbose", action="store_true")
    add_plugin_argument(parser)
    return parser
"""

PLUGIN_PY = """
DEFAULT_PLUGIN_DTYPE_OPTIONS = ["auto", "float16", None]
PLUGIN_DTYPE_OPTIONS_MAP = {"mixer_plugin": ["auto", "bfloat16", None]}


@dataclass
class PluginConfig:
    _mixer_plugin: Optional[str] = field(default="auto", init=False)
    _blend_plugin: Optional[str] = field(default=None, init=False)
    _fused_mode: bool = field(default=True, init=False)
    _block_count: int = field(default=4, init=False)
    _not_on_the_cli: bool = field(default=False, init=False)


cli_plugin_args = ["mixer_plugin", "blend_plugin", "fused_mode", "block_count"]


def add_plugin_argument(parser):
    for name in cli_plugin_args:
        if name == "gemm_plugin":
            pass
        parser.add_argument(f"--{name}", choices=[x if x else "disable" for x in plugin_dtype_options])
        parser.add_argument(f"--{name}", choices=['enable', 'disable'])
"""

KV_CACHE_TYPE_BINDING = """
    py::enum_<tr::CacheKindEnum>(m, "Other")
        .value("NOT_THIS", tr::CacheKindEnum::kNOT);
    py::enum_<tr::KVCacheType>(m, "KVCacheType")
        .value("ROLLING", tr::KVCacheType::kROLLING)
        .value("BLOCKED", tr::KVCacheType::kBLOCKED);
"""

KV_CACHE_TYPE_PARSER = """
    static KVCacheType KVCacheTypeFromString(std::string value)
    {
        std::transform(value.begin(), value.end(), value.begin(), ::toupper);
        if (value == "ROLLING") { return KVCacheType::kROLLING; }
        if (value == "OFF") { return KVCacheType::kOFF; }
        throw std::invalid_argument("no such kind");
    }
"""


@pytest.fixture(scope="module")
def emitted(tmp_path_factory, tiny_llama) -> dict[str, str]:
    """flag -> value of the trtllm-build command the pipeline prints for an FP8 build with FP8 context FMHA."""
    from pipeline.targets.trtllm.tensorrt_backend import trtllm_build_command

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


# ---------------------------------------------------------------- trtllm-build flags: parsing


def test_build_arguments_reads_each_flag_its_alias_and_non_literal_defaults_and_choices():
    parsed = build_tab.build_arguments(BUILD_PY)
    assert parsed["flags"] == {
        "--max_width": {"type": "int", "choices": None, "default_from": "Settings.max_width", "action": None},
        "--max_size": {
            "type": "int",
            "choices": None,
            "default_from": "Settings.max_width",
            "action": None,
            "alias_of": "--max_width",  # the renamed flag's old spelling
        },
        "--mode": {"type": "str", "choices": ["fast", "slow"], "default": "fast", "action": None},
        "--cache_kind": {"type": {"enum": "CacheKind"}, "choices": None, "default_suppressed": True, "action": None},
        "--region": {
            "type": "str",
            "choices": None,
            "choices_are_keys_of": "regions",
            "default": None,
            "action": None,
            "dest": "area",
        },
        "--verbose": {"type": None, "choices": None, "default": None, "action": "store_true"},
    }
    assert parsed["adds_plugin_arguments"] and parsed["enum_lookup"] == build_tab.UPPER_CASED_NAME


def test_enum_lookup_by_from_string_and_a_build_py_without_parse_arguments():
    lookup = "def enum_type(enum_class):\n    return lambda value: enum_class.from_string(value)\n"
    assert build_tab.enum_lookup(ast.parse(lookup).body) == build_tab.FROM_STRING_LOOKUP
    with pytest.raises(build_tab.UnrecognizedSource):
        build_tab.build_arguments("def other():\n    pass\n")


def test_plugin_arguments_from_dataclass_fields():
    assert build_tab.plugin_arguments(PLUGIN_PY) == {
        "--mixer_plugin": {
            "type": "str",
            "choices": ["auto", "bfloat16", "disable"],
            "default": "auto",
            "action": None,
        },
        "--blend_plugin": {
            "type": "str",
            "choices": ["auto", "float16", "disable"],
            "default": "disable",
            "action": None,
        },
        "--fused_mode": {"type": "str", "choices": ["enable", "disable"], "default": "enable", "action": None},
        "--block_count": {"type": "int", "choices": None, "default": 4, "action": None},
    }


def test_plugin_arguments_refuse_a_cli_name_without_a_field_and_an_unknown_dtype_rule():
    with pytest.raises(build_tab.UnrecognizedSource, match="without a PluginConfig field"):
        build_tab.plugin_arguments(PLUGIN_PY.replace('"block_count"]', '"block_count", "ghost"]'))
    with pytest.raises(build_tab.UnrecognizedSource, match="no longer maps"):
        build_tab.plugin_arguments(PLUGIN_PY.replace('else "disable"', 'else "off"'))


def test_kv_cache_type_spellings_from_the_binding_and_from_string():
    assert build_tab.kv_cache_type_spellings(KV_CACHE_TYPE_BINDING) == {"names": ["ROLLING", "BLOCKED"]}
    assert build_tab.kv_cache_type_spellings(KV_CACHE_TYPE_PARSER) == {"from_string": ["ROLLING", "OFF"]}
    with pytest.raises(build_tab.UnrecognizedSource):
        build_tab.kv_cache_type_spellings(KV_CACHE_TYPE_PARSER.replace("::toupper", "::tolower"))


def test_merged_flags_store_a_shared_spec_once_and_name_the_versions_that_differ():
    spec = {"type": "int", "choices": None, "default": 1, "action": None}
    merged = build_tab.merged_flags(
        "b.py",
        {
            "a" * 40: {"--same": spec, "--old": spec, "--picky": spec | {"choices": [1, 2, 3]}},
            "b" * 40: {"--same": spec, "--picky": spec | {"choices": [2, 3, 4]}},
        },
    )
    assert merged["--same"] == {"defined_in": "b.py"} | spec
    assert merged["--old"] == {"defined_in": "b.py"} | spec | {"absent_from": ["b" * 40]}
    assert merged["--picky"] == {
        "defined_in": "b.py",
        "type": "int",
        "default": 1,
        "action": None,
        "choices": [2, 3],  # those every version offers
        "by_version": {"a" * 40: {"choices": [1, 2, 3]}, "b" * 40: {"choices": [2, 3, 4]}},
    }


# ---------------------------------------------------------------- trtllm-build flags: the committed table


def test_every_flag_we_emit_is_in_every_version_read_with_a_value_among_its_choices(emitted):
    for flag, value in emitted.items():
        entry = FLAGS["flags"][flag]
        assert "absent_from" not in entry and "by_version" not in entry, flag
        assert entry["choices"] is None or value in entry["choices"], (flag, value)


def test_the_flag_table_cites_every_file_it_read_and_types_kv_cache_type_by_the_cpp_enum():
    assert set(FLAGS["sources"]) == {build_tab.BUILD, build_tab.PLUGIN}
    read = {path: [s["commit"] for s in sources] for path, sources in FLAGS["sources"].items()}
    assert read == {build_tab.BUILD: list(build_tab.BUILD_COMMITS), build_tab.PLUGIN: list(build_tab.PLUGIN_COMMITS)}
    enum = FLAGS["enums"]["KVCacheType"]
    assert set(enum["lookup_in_build_py"]) == set(build_tab.BUILD_COMMITS)
    assert [(s["source"]["path"], s["source"]["commit"]) for s in enum["spellings"]] == list(
        build_tab.KV_CACHE_TYPE_READS
    )
    kv = FLAGS["flags"]["--kv_cache_type"]
    assert kv["type"] == {"enum": "KVCacheType"} and kv["choices"] == enum["accepted_in_every_version"]
    assert {"paged", "continuous"} <= set(kv["choices"])
    for flag in FLAGS["flags"].values():
        assert set(flag.get("absent_from", [])) <= set(read[flag["defined_in"]])


# ---------------------------------------------------------------- checkpoint rules: parsing


def statements(source: str) -> list:
    return ast.parse(source).body


QUANT_CONFIG = """
@dataclasses.dataclass
class QuantConfig:
    algo: Optional[str] = None
    size: int = 64
    scale: float = 0.25

    @classmethod
    def from_dict(cls, config):
        return cls(**config)
"""

PRETRAINED_CONFIG = """
class PretrainedConfig:
    def __init__(self, arch, dtype, mapping=None, quantization=None, **kwargs):
        self.mapping = Mapping.from_dict(mapping)
        self.legacy_tp = quantization.get("tp") if quantization else 1
        self.legacy_group = quantization.get("group")

    @classmethod
    def from_dict(cls, config):
        arch = config.pop("arch")
        return cls(arch, **config)
"""

MAPPING = """
class MappingBase:
    def __init__(self, world_size=1, tp_size=1, pp_size=1, lanes=1):
        if tp_size * pp_size * lanes != world_size:
            raise ValueError("sizes")
        if lanes != 1 and not tp_size > 1:
            raise ValueError("lanes")


class Mapping(MappingBase):
    def __init__(self, world_size=1, tp_size=1, pp_size=1, lanes=1):
        super().__init__(world_size, tp_size, pp_size, lanes)

    @classmethod
    def from_dict(cls, mapping):
        return cls(**mapping)

    def to_dict(self):
        return {"world_size": self.world_size, "tp_size": self.tp_size}
"""

LOAD = """
class PretrainedModel:
    def load(self, weights):
        provided_names = set(weights)
        if not needed.issubset(provided_names):
            raise RuntimeError("missing")
        if not provided_names.issubset(needed):
            logger.warning("extra")
"""

WEIGHT_ONLY = """
class WeightOnlyQuantLinear(Linear):
    def __init__(self, in_features, out_features, tp_size=1, bits_mode=None, with_scale=False):
        multiple = 32 * tp_size
        in_features = math.ceil(in_features / multiple) * multiple
        if bits_mode.is_eight():
            width = 8
        else:
            width = 4
        self.weight = Parameter(shape=(self.in_features, self.out_features * width // 8), dtype="int8")
        if with_scale:
            self.scale = Parameter(shape=(self.out_features,), dtype=dtype)


WeightOnlyQuantColumnLinear = WeightOnlyQuantLinear
"""

QUANTIZE_DICT = """
def weight_only_quantize(weight):
    return torch.ops.demo.pack_rows(weight)


def weight_only_quantize_dict(weights, quant_weights=["a.weight", "b.weight"]):
    for name in list(weights):
        if name.endswith(".weight") and weights[name].dtype != torch.int8:
            weights[name], scale = weight_only_quantize(weights[name])
            weights[name.replace(".weight", ".scale")] = scale
"""

PREPROCESS = """
def preprocess_perlayer_weights(weights, quant_algo):
    if quant_algo in [QuantAlgo.W8A16]:
        weights = weight_only_quantize_dict(weights=weights, plugin=True)
"""


def name(n: str) -> dict:
    return {"name": n}


def test_quant_config_fields_and_from_dict_passing_every_key():
    assert checkpoint_tab.quant_config(statements(QUANT_CONFIG)) == {
        "dataclass": True,
        "fields": [
            {"name": "algo", "type": "Optional[str]", "default": None},
            {"name": "size", "type": "int", "default": 64},
            {"name": "scale", "type": "float", "default": 0.25},
        ],
        "from_dict_passes_every_key": True,
    }
    assert checkpoint_tab.quant_config(statements("class Other:\n    pass\n")) is None


def test_pretrained_config_builds_mapping_with_from_dict_and_picks_legacy_keys_with_get():
    assert checkpoint_tab.pretrained_config(statements(PRETRAINED_CONFIG)) == {
        "from_dict_passes_every_key": True,
        "mapping": {"built_by": ["Mapping.from_dict"], "keys_picked_with_get": []},
        "quantization": {"built_by": [], "keys_picked_with_get": ["group", "tp"]},
    }


def test_mapping_parameters_the_base_class_raising_conditions_and_to_dict():
    assert checkpoint_tab.mapping_rules(statements(MAPPING)) == {
        "class_lineage": ["Mapping", "MappingBase"],
        "init_params": ["world_size", "tp_size", "pp_size", "lanes"],
        "from_dict_passes_every_key": True,
        "to_dict_keys": ["world_size", "tp_size"],
        "init_raises_if": [
            {
                "not_equal": [
                    {"multiply": [{"multiply": [name("tp_size"), name("pp_size")]}, name("lanes")]},
                    name("world_size"),
                ]
            },
            {"all": [{"not_equal": [name("lanes"), 1]}, {"not": {"greater": [name("tp_size"), 1]}}]},
        ],
    }


def test_load_raises_on_a_missing_tensor_and_warns_on_an_extra_one():
    assert checkpoint_tab.load_rules(statements(LOAD)) == [
        {"when": {"not": {"call": "needed.issubset", "args": [name("provided_names")]}}, "raises": "RuntimeError"},
        {"when": {"not": {"call": "provided_names.issubset", "args": [name("needed")]}}, "calls": "logger.warning"},
    ]


def test_weight_only_layers_parameters_their_conditions_and_padding():
    layers = checkpoint_tab.weight_only_layers(statements(WEIGHT_ONLY))
    assert layers == {
        "WeightOnlyQuantLinear": {
            "parameters": {
                "weight": {
                    "shape": [
                        name("self.in_features"),
                        {"floor_divide": [{"multiply": [name("self.out_features"), name("width")]}, 8]},
                    ],
                    "dtype": "int8",
                    "only_if": None,
                    "where": {
                        "width": [
                            {"value": 8, "if": {"call": "bits_mode.is_eight"}},
                            {"value": 4, "if": {"not": {"call": "bits_mode.is_eight"}}},
                        ]
                    },
                },
                "scale": {
                    "shape": [name("self.out_features")],
                    "dtype": name("dtype"),
                    "only_if": name("with_scale"),
                    "where": {},
                },
            },
            "padding": {"multiple": {"multiply": [32, name("tp_size")]}, "padded": ["in_features"]},
            "aliases": ["WeightOnlyQuantColumnLinear"],
            "base": ["Linear"],
        }
    }


def test_the_loader_quantizes_float_weights_itself_and_skips_int8_ones():
    assert checkpoint_tab.weight_only_quantize_dict(statements(QUANTIZE_DICT)) == {
        "quant_weights_default": ["a.weight", "b.weight"],
        "quantizes_when": [
            {
                "all": [
                    {"call": "name.endswith", "args": [".weight"]},
                    {
                        "not_equal": [
                            {"attribute": "dtype", "of": {"item": name("name"), "of": name("weights")}},
                            name("torch.int8"),
                        ]
                    },
                ]
            }
        ],
        "writes": [
            {"item": {"call": "name.replace", "args": [".weight", ".scale"]}, "of": name("weights")},
        ],
        "quantizer_ops": ["torch.ops.demo.pack_rows"],
    }
    assert checkpoint_tab.w8a16_preprocessing(statements(PREPROCESS)) == {
        "condition": {"in": [name("quant_algo"), [name("QuantAlgo.W8A16")]]},
        "calls": [{"call": "weight_only_quantize_dict", "keywords": {"weights": name("weights"), "plugin": True}}],
    }


def test_a_formula_refuses_what_it_cannot_represent():
    with pytest.raises(checkpoint_tab.UnrecognizedSource):
        checkpoint_tab.formula(ast.parse("lambda x: x", mode="eval").body)


# ---------------------------------------------------------------- checkpoint rules: the committed table


def test_the_checker_accepts_exactly_the_quant_config_keys_of_every_version():
    from pipeline.targets.trtllm.checkpoint import QUANT_CONFIG_KEYS

    versions = RULES["quant_config"]["versions"]
    assert all(v["from_dict_passes_every_key"] for v in versions)
    assert QUANT_CONFIG_KEYS == set.intersection(*({f["name"] for f in v["fields"]} for v in versions))
    assert {
        "quant_algo",
        "kv_cache_quant_algo",
        "group_size",
        "pre_quant_scale",
        "exclude_modules",
    } <= QUANT_CONFIG_KEYS


def test_the_checker_takes_the_mapping_keys_of_every_version_and_names_the_others():
    from pipeline.targets.trtllm.checkpoint import MAPPING_KEYS, mapping_problems

    versions = RULES["mapping"]["versions"]
    assert MAPPING_KEYS == set.intersection(*(set(v["init_params"]) for v in versions))
    world_rule = {
        "not_equal": [
            {"multiply": [{"multiply": [name("tp_size"), name("pp_size")]}, name("cp_size")]},
            name("world_size"),
        ]
    }
    assert all(world_rule in v["init_raises_if"] and v["from_dict_passes_every_key"] for v in versions)
    assert mapping_problems({"world_size": 2, "tp_size": 2, "pp_size": 1}, 2, 1) == []
    for version in versions:  # what each version's Mapping.to_dict writes (PretrainedConfig drops rank)
        written = {key: 1 for key in version["to_dict_keys"] if key != "rank"} | {"world_size": 2, "tp_size": 2}
        problems = mapping_problems(written, 2, 1)
        others = sorted(set(written) - MAPPING_KEYS)
        assert others and set(others) <= set(RULES["mapping"]["accepted_in_some_version_only"])
        assert len(problems) == 1 and str(others) in problems[0]


def test_the_tabulated_padding_and_w8a16_rules_are_the_checkers():
    from pipeline.targets.trtllm.checkpoint import padding_multiple

    classes = RULES["weight_only_layers"]["classes"]
    assert classes["WeightOnlyQuantLinear"]["padding"]["multiple"] == {"multiply": [64, name("tp_size")]}
    assert padding_multiple("W8A16", 0, 2) == 128
    groupwise = classes["WeightOnlyGroupwiseQuantLinear"]["padding"]["multiple"]
    assert groupwise == {
        "multiply": [
            {"call": "max", "args": [{"if": name("use_w4a8_awq"), "then": 128, "else": 64}, name("group_size")]},
            name("tp_size"),
        ]
    }
    assert padding_multiple("W4A8_AWQ", 64, 2) == 256 and padding_multiple("W4A16_AWQ", 128, 1) == 128
    weight = classes["WeightOnlyQuantLinear"]["parameters"]["weight"]
    assert weight["dtype"] == "int8" and set(classes["WeightOnlyQuantLinear"]["parameters"]) == {
        "weight",
        "per_channel_scale",
    }
    (load,) = [v for v in RULES["load"]["versions"] if len(v["on"]) > 1]
    assert {"raises": "RuntimeError"}.items() <= load["on"][0].items()  # a missing tensor fails the load
    quantizer = RULES["w8a16_loader"]["weight_only_quantize_dict"]["versions"][0]
    assert quantizer["writes"][1]["item"]["args"] == [".weight", ".per_channel_scale"]


def test_every_source_of_the_checkpoint_table_is_cited():
    sections = [RULES[k]["versions"] for k in ("quant_config", "pretrained_config", "load", "mapping")]
    sections += [
        RULES["w8a16_loader"][k]["versions"] for k in ("preprocess_perlayer_weights", "weight_only_quantize_dict")
    ]
    cited = [v["source"] for versions in sections for v in versions] + [RULES["weight_only_layers"]["source"]]
    for source in cited:
        assert set(source) == {"repo", "path", "commit", "pinned"} and source["commit"] in (
            *checkpoint_tab.COMMITS[source["path"]],
        )
