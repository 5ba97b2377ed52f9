"""The unified HF checkpoint against TensorRT-LLM's PyTorch backend: the loader tabulator's parsing on inputs written
here, the committed table (upstream/trtllm_torch_loader.json), and real exports of the tiny Llama (fp8 + fp8 KV, int4
AWQ) by the real CLI. Whether the unified checkpoint's values are good is tests/test_trtllm_unified_reference.py's
question."""

from __future__ import annotations

import ast
import json
import shutil
import textwrap
from pathlib import Path

import pytest

from pipeline.targets.trtllm.checkpoint import EXPECTED_ALGO
from pipeline.targets.trtllm.torch_checkpoint import (
    RELEASES,
    TABLE,
    torch_loader_problems,
    unsupported_quantization,
)
from pipeline.upstream import releases
from tests.conftest import dev_script, run_cli, slow_fixture
from tests.targets.test_trtllm import gpu_config

tab = dev_script("tabulate_trtllm_torch_loader")

CASES = {
    "fp8-fp8kv": "{weights: fp8, kv_cache: fp8}",
    "int4-awq": "{weights: int4, method: awq, group_size: 32, calibration: {num_samples: 8, seq_len: 64}}",
    "int4-rtn": "{weights: int4, group_size: 32}",  # ModelOpt writes no pre_quant_scale: export_unified adds ones
}

# ---------------------------------------------------------------- the tabulator's parsing, on inputs of our own

CONFIG_PY = textwrap.dedent(
    """
    class Settings:
        @staticmethod
        def load_modelopt_quant_config(path, folder):
            with open(path) as f:
                document = json.load(f)
            part = document['body']
            algo = part.get('algo', None)
            size = part.get('size', 64)
            name = part['name']
            if algo == 'MIXED':
                with open(folder / 'other.json') as g:
                    other = json.load(g)['layers']  # another file's section: not hf_quant_config.json's
            return algo

        @classmethod
        def from_pretrained(cls, folder, **kwargs):
            settings = None
            if (found := folder / 'hf_quant_config.json').exists():
                settings = cls.read_ours(found)
            elif hasattr(config, "their_config"):
                settings = cls.read_theirs(config.their_config)
            elif (found := folder / 'kinds.json').exists():
                settings = cls.read_kinds(found)
            return settings
    """
)


def test_the_quant_config_keys_are_the_section_subscripted_out_then_its_subscripts_and_gets():
    assert tab.quant_config_keys(CONFIG_PY) == {
        "function": "load_modelopt_quant_config",
        "optional_in_section": [{"default": None, "key": "algo"}, {"default": 64, "key": "size"}],
        "required_in_section": ["name"],
        "required_top_level": ["body"],
    }


def test_the_quant_config_source_is_the_if_elif_chain_as_files_and_config_attributes():
    assert tab.config_sources(CONFIG_PY) == [
        {"reader": "read_ours", "when": {"file_exists": "hf_quant_config.json"}},
        {"reader": "read_theirs", "when": {"config_has": "their_config"}},
        {"reader": "read_kinds", "when": {"file_exists": "kinds.json"}},
    ]


MODE_PY = textwrap.dedent(
    """
    class QuantMode(IntFlag):
        WEIGHTS_AND_ACTIVATIONS = 7

        @staticmethod
        def from_description(quantize_weights=False, quantize_activations=False, per_token=False,
                             per_channel=False, per_group=False, use_int4_weights=False, use_fp8_qdq=False):
            return QuantMode(0)

        @staticmethod
        def use_weight_only(use_int4_weights=False, per_group=False):
            return QuantMode.from_description(True, False, False, False, per_group, use_int4_weights)

        def is_weight_only(self):
            return self._all(self.INT4_WEIGHTS, self.WEIGHTS_AND_ACTIVATIONS) or self._all(
                self.INT8_WEIGHTS, self.WEIGHTS_AND_ACTIVATIONS)

        def has_per_group_scaling(self):
            return self._any(self.PER_GROUP)

        def has_fp8_qdq(self):
            return self._any(self.FP8_QDQ)

        @staticmethod
        def from_quant_algo(quant_algo=None):
            if quant_algo == QuantAlgo.W8A16:
                mode = QuantMode.use_weight_only(use_int4_weights=False)
            elif quant_algo == QuantAlgo.W4A16_AWQ:
                mode = QuantMode.use_weight_only(use_int4_weights=True, per_group=True)
            elif quant_algo == QuantAlgo.FP8:
                mode = QuantMode.from_description(use_fp8_qdq=True)
            elif quant_algo == QuantAlgo.SOMETHING_ELSE:
                mode = QuantMode.use_unknown_constructor()
            else:
                mode = QuantMode(0)
            return mode
    """
)
LINEAR_PY = textwrap.dedent(
    """
    def get_quant_method(quant_config=None):
        if quant_config is None or not quant_config.layer_quant_mode.has_any_quant():
            return Plain()
        if quant_config.layer_quant_mode.has_fp8_qdq():
            return Eights()
        if quant_config.layer_quant_mode.is_weight_only() and not quant_config.layer_quant_mode.has_per_group_scaling():
            return WeightOnly()
        if quant_config.layer_quant_mode.is_weight_only() and quant_config.quant_algo == QuantAlgo.W4A16_AWQ:
            return Grouped()
        raise ValueError(f'no method for {quant_config.quant_mode}')


    class WeightOnly(Base):
        def create_weights(self, module, in_features, out_features, bias, dtype):
            module.weight = Parameter(torch.empty((out_features, in_features), dtype=torch.int8))
            module.weight_scale = Parameter(torch.empty(out_features, dtype=dtype))

        def load_weights_vanilla(self, module, weights):
            scale = shard(weights[0]['weight_scale'])
            copy(module.weight_scale, scale)


    class Grouped(Base):
        def load_weights_vanilla(self, module, weights):
            factor = shard(weights[0]['pre_quant_scale'])
            assert factor.dtype == module.dtype
            found = []
            for w in weights:
                if 'weight_scale' in w:
                    found.append(w['weight_scale'])
            assert len(found) == 1

        def load_extra(self, module, weights):
            extras = []
            for w in weights:
                if 'k_scale' in w:
                    extras.append(w['k_scale'])
            if extras:
                copy(module.k_scale, max(extras))


    class Eights(Base):
        def load_weights_vanilla(self, module, weights):
            if 'input_scale' in weights[0]:
                copy(module.input_scale, weights[0]['input_scale'])
            copy(module.weight_scale, weights[0]['weight_scale'])


    class Unused(Base):
        def load_weights_vanilla(self, module, weights):
            odd = weights[0]['never_chosen']
    """
)


def test_from_quant_algo_gives_each_of_our_algos_the_flags_of_its_constructor():
    assert tab.algo_modes(MODE_PY) == {
        "W8A16": {"INT8_WEIGHTS"},
        "W4A16_AWQ": {"INT4_WEIGHTS", "PER_GROUP"},
        "FP8": {"FP8_QDQ"},
    }  # SOMETHING_ELSE is not ours: its unknown constructor is never read


def test_get_quant_method_picks_the_first_branch_whose_condition_holds_and_stores_it_as_data():
    methods = tab.quant_methods(LINEAR_PY, tab.algo_modes(MODE_PY), tab.predicates(MODE_PY))
    assert methods["FP8"] == {
        "condition": {"predicate": "has_fp8_qdq"},
        "method": "Eights",
        "quant_mode_flags": ["FP8_QDQ"],
    }
    assert methods["W8A16"]["condition"] == {
        "all": [{"predicate": "is_weight_only"}, {"not": {"predicate": "has_per_group_scaling"}}]
    }
    assert methods["W4A16_AWQ"]["condition"] == {"all": [{"predicate": "is_weight_only"}, {"quant_algo": "W4A16_AWQ"}]}
    assert methods["W4A8_AWQ"] == {"method": None, "why": "QuantMode.from_quant_algo has no branch for W4A8_AWQ"}


def test_no_matching_branch_raises_and_only_the_error_class_is_kept():
    modes = {"W8A8_SQ_PER_CHANNEL": {"INT8_WEIGHTS", "ACTIVATIONS", "PER_CHANNEL"}}
    row = tab.quant_methods(LINEAR_PY, modes, tab.predicates(MODE_PY))["W8A8_SQ_PER_CHANNEL"]
    assert row == {
        "method": None,
        "quant_mode_flags": ["ACTIVATIONS", "INT8_WEIGHTS", "PER_CHANNEL"],
        "raises": "ValueError",
        "when": "no_branch_matches",
    }


def test_a_method_reads_required_optional_and_guarded_then_used_tensors_with_their_dtypes():
    methods = tab.linear_methods(LINEAR_PY, {"WeightOnly", "Grouped", "Eights"})
    assert methods["WeightOnly"] == {
        "asserted_dtypes": {},
        "optional": {},
        "parameter_dtypes": {"weight": "int8", "weight_scale": "module_dtype"},
        "required": {"weight_scale": {"function": "load_weights_vanilla", "read": "unguarded"}},
    }
    assert methods["Grouped"] == {
        "asserted_dtypes": {"factor": "module_dtype"},
        "optional": {"k_scale": {"function": "load_extra", "read": "guarded"}},  # used only under `if extras`
        "parameter_dtypes": {},
        "required": {
            "pre_quant_scale": {"function": "load_weights_vanilla", "read": "unguarded"},
            "weight_scale": {"function": "load_weights_vanilla", "read": "guarded_then_used"},  # assert len(...)
        },
    }
    assert methods["Eights"]["optional"] == {"input_scale": {"function": "load_weights_vanilla", "read": "guarded"}}
    with pytest.raises(tab.UnrecognizedSource):
        tab.linear_methods(LINEAR_PY, {"Missing"})


def test_a_dtype_given_as_an_expression_is_refused_not_stored():
    tree = ast.parse("class M:\n    def load(self, weights):\n        assert w.dtype == pick(module)\n")
    with pytest.raises(tab.UnrecognizedSource):
        tab.method_tensors(tree.body[0])


def test_a_release_block_puts_the_kv_cache_scales_of_the_chosen_methods_together():
    block = tab.release_facts(CONFIG_PY, MODE_PY, LINEAR_PY)
    assert block["kv_cache_scales"] == {"k_scale": {"function": "load_extra", "method": "Grouped", "read": "guarded"}}
    assert block["exclude_modules"]["read"] is False  # this load_modelopt_quant_config never gets exclude_modules
    assert "tensors" not in block["quant_algos"]["W4A8_AWQ"]


# ---------------------------------------------------------------- the committed table


def test_every_release_has_every_section_cited_by_commit():
    assert releases("trtllm_torch_loader") == RELEASES == ("1.0", "1.1", "1.2")
    for release, facts in TABLE.items():
        assert set(facts) == {
            "exclude_modules",
            "hf_quant_config",
            "kv_cache_scales",
            "quant_algos",
            "quant_config_source",
            "release_commit",
            "source",
        }, release
        assert len(facts["release_commit"]) == 40
        for file in facts["source"]["files"]:
            assert set(file) == {"repo", "path", "commit", "pinned", "read_for"} and file["pinned"] is False
        assert {f["path"] for f in facts["source"]["files"]} == {tab.MODEL_CONFIG, tab.MODE, tab.LINEAR}
        assert set(facts["quant_algos"]) == set(tab.OUR_ALGOS) >= {a for a in EXPECTED_ALGO.values() if a}


def test_the_table_says_what_each_release_loads():
    for release, facts in TABLE.items():
        assert facts["quant_config_source"][0] == {
            "reader": "load_modelopt_quant_config",
            "when": {"file_exists": "hf_quant_config.json"},
        }
        keys = facts["hf_quant_config"]
        assert keys["required_top_level"] == ["quantization"] and keys["required_in_section"] == []
        assert [k["key"] for k in keys["optional_in_section"]] == [
            "quant_algo",
            "kv_cache_quant_algo",
            "group_size",
            "exclude_modules",
        ]
        algos = facts["quant_algos"]
        assert algos["W8A8_SQ_PER_CHANNEL"]["method"] is None, release  # no SmoothQuant linear method
        assert algos["W8A8_SQ_PER_CHANNEL"]["raises"] == "ValueError"
        assert algos["W8A16"]["method"] == "WeightOnlyQuantLinearMethod"
        assert set(algos["W8A16"]["tensors"]["required"]) == {"weight_scale"}
        assert algos["W8A16"]["tensors"]["parameter_dtypes"]["weight"] == "int8"
        assert algos["FP8"]["method"] == "FP8QDQLinearMethod"
        assert set(algos["FP8"]["tensors"]["required"]) == {"weight_scale"}
        assert set(algos["FP8"]["tensors"]["optional"]) == {"input_scale", "k_scale", "v_scale"}
        assert set(algos["W4A16_AWQ"]["tensors"]["required"]) == {"pre_quant_scale", "weight_scale"}
        assert algos["W4A16_AWQ"]["tensors"]["required"]["pre_quant_scale"]["function"] == "load_weights_vanilla"
        assert set(algos["W4A8_AWQ"]["tensors"]["required"]) == {
            "input_scale",
            "pre_quant_scale",
            "weight_scale",
            "weight_scale_2",
        }
        assert algos["W4A8_AWQ"]["tensors"]["asserted_dtypes"] == {"pre_quant_scale": "module_dtype"}
        assert set(facts["kv_cache_scales"]) == {"k_scale", "v_scale"}


def test_unsupported_quantization_names_the_release():
    for release in ("1.0", "1.2"):
        assert unsupported_quantization("fp8", "rtn", "fp8", release) is None
        assert unsupported_quantization("int4", "awq", "none", release) is None
        assert unsupported_quantization("int4", "w4a8_awq", "none", release) is None
        assert unsupported_quantization("none", "rtn", "fp8", release) is None
        sq = unsupported_quantization("int8", "smoothquant", "fp8", release)
        assert f"TensorRT-LLM {release}" in sq and "W8A8_SQ_PER_CHANNEL" in sq
        assert "float weights" in unsupported_quantization("int8", "rtn", "none", release)
        assert unsupported_quantization("int4", "rtn", "none", release) is None  # export_unified repairs it
    assert "no PyTorch-backend facts" in unsupported_quantization("fp8", "rtn", "none", "0.19")


@slow_fixture(scope="module")
def exports(tmp_path_factory, tiny_llama, calibrated) -> dict[str, Path]:
    """`export/` of each case built by the real CLI, which stops at the engine stage for want of a GPU."""
    out = {}
    for name, quantization in CASES.items():
        root = tmp_path_factory.mktemp(name)
        config = gpu_config(root, tiny_llama, quantization)
        calibrated(config, root / "out")
        result = run_cli("build", str(config), "--output", str(root / "out"))
        assert (root / "out" / "export" / "hf_unified" / "config.json").is_file(), result.stdout + result.stderr
        out[name] = root / "out" / "export"
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("release", ["1.0", "1.2"])
def test_the_unified_export_is_what_the_pytorch_backend_loads(exports, case, release):
    assert torch_loader_problems(exports[case] / "hf_unified", release) == []


def _rewrite(file: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture
def awq_copy(exports, tmp_path) -> Path:
    copy = tmp_path / "hf_unified"
    shutil.copytree(exports["int4-awq"] / "hf_unified", copy)
    return copy


def test_a_dropped_weight_scale_is_named(awq_copy):
    name = "model.layers.1.mlp.down_proj.weight_scale"
    _rewrite(awq_copy / "model.safetensors", lambda t: t.pop(name))
    problems = torch_loader_problems(awq_copy, "1.2")
    assert problems and all(name in p for p in problems), problems
    assert "W4A16_AWQ_LinearMethod" in problems[0]


def test_a_wrong_quant_algo_is_caught(awq_copy):
    file = awq_copy / "hf_quant_config.json"
    document = json.loads(file.read_text())
    document["quantization"]["quant_algo"] = "W8A8_SQ_PER_CHANNEL"
    file.write_text(json.dumps(document))
    assert "TensorRT-LLM 1.0's PyTorch backend has no linear method" in torch_loader_problems(awq_copy, "1.0")[0]
    document["quantization"]["quant_algo"] = "FP8"
    file.write_text(json.dumps(document))
    problems = torch_loader_problems(awq_copy, "1.0")
    assert "model.layers.0.self_attn.q_proj.weight is U8, FP8QDQLinearMethod expects F8_E4M3" in problems
