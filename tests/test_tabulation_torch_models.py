"""The PyTorch-backend model tabulator (scripts/dev/tabulate_trtllm_torch_models.py) on inputs written here, in the
upstream syntax; the committed table (upstream/trtllm_torch_models.json) says, per release, which families
tensorrt_llm/_torch/models registers and what each family's model reads beyond Llama's; the PyTorch backend's
architecture_support answers from it (a validate error naming release, file and fix)."""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest

from pipeline.architectures import ARCHITECTURES
from pipeline.errors import ConfigError
from pipeline.targets.trtllm.torch_checkpoint import MODELS as TABLE
from pipeline.targets.trtllm.torch_checkpoint import evaluate, shown
from pipeline.upstream import releases
from pipeline.validation import load_config
from tests.conftest import dev_script, make_tiny, write_config

tab = dev_script("tabulate_trtllm_torch_models")

# ---------------------------------------------------------------- the tabulator's parsing, on inputs of our own

INIT_PY = "from .modeling_base import BaseForCausalLM\nfrom .modeling_other import OtherForCausalLM\n"
UTILS_PY = textwrap.dedent(
    """
    def register_auto_model(name):
        def decorate(cls):
            REGISTRY[name] = cls
            return cls
        return decorate
    """
)
BASE_PY = textwrap.dedent(
    """
    class BaseAttention(Attention):
        def __init__(self, model_config, layer_idx=None):
            config = model_config.pretrained_config
            super().__init__(hidden_size=config.hidden_size, num_key_value_heads=config.num_key_value_heads,
                             bias=config.use_bias, dense_bias=False)
            self.q_norm = RMSNorm(hidden_size=self.head_dim, eps=1e-5)
            self.k_norm = RMSNorm(hidden_size=config.head_dim, eps=config.rms_norm_eps)
            self.attention_window_size = config.window
            rope_params.theta = 5000


    class BaseLayer(DecoderLayer):
        def __init__(self, model_config, layer_idx):
            config = model_config.pretrained_config
            self.self_attn = BaseAttention(model_config, layer_idx)
            self.input_layernorm = RMSNorm(hidden_size=config.hidden_size)
            self.extra_norm = RMSNorm(hidden_size=config.hidden_size)
            is_sliding = bool((layer_idx + 1) % config.every)
            self.scale = config.embed_scale
            self.cap = getattr(config, "cap", None)
            if not hasattr(config, "fallback"):
                config.fallback = 3
            self.fallback = config.fallback


    @register_auto_model("BaseForCausalLM")
    @register_auto_model("OtherForCausalLM")
    class BaseForCausalLM(DecoderModelForCausalLM[BaseModel, BaseConfig]):
        def load_weights(self, weights):
            hidden = self.config.hidden_size
            heads = self.config.num_attention_heads
            per_head = hidden // heads
            for name, module in self.named_modules():
                if 'norm' in name:
                    module.weight.data.copy_(weights[name][:] + 1)
                if "attn.fused" in name:
                    fused = weights[name]['weight']
                    split = hidden + 2 * per_head
                    scale = weights[name].get('weight_scale')
                    first = {'weight': fused[:hidden, :]}
                    second = {'weight': fused[hidden:split, :]}
                    if scale.shape and scale.shape[0] == fused.shape[0]:
                        first['weight_scale'] = scale[:hidden, :]
    """
)
OTHER_PY = textwrap.dedent(
    """
    class OtherAttention(QKNormRoPEAttention):
        def __init__(self, model_config):
            config = model_config.pretrained_config
            super().__init__(num_key_value_heads=config.num_key_value_heads, bias=True)
            self.attention_window_size = None


    class OtherLayer(DecoderLayer):
        def __init__(self, model_config, layer_idx):
            self.self_attn = OtherAttention(model_config)
            is_sliding = model_config.pretrained_config.kinds[layer_idx] == "local"


    @register_auto_model("OtherForCausalLM")
    class OtherForCausalLM(DecoderModelForCausalLM[OtherModel, OtherConfig]):
        pass
    """
)
QK_NORM_PY = textwrap.dedent(
    """
    class QKNormRoPEAttention(Attention):
        def __init__(self, *args, **kwargs):
            self.q_norm = RMSNorm(hidden_size=self.head_dim, eps=self.pretrained_config.rms_norm_eps)
            self.k_norm = RMSNorm(hidden_size=self.head_dim, eps=self.pretrained_config.rms_norm_eps)
    """
)


def _files(**texts: str) -> dict:
    paths = {"init": tab.INIT, "utils": tab.UTILS, "qk": tab.QK_NORM}
    paths |= {"base": f"{tab.MODELS}/modeling_base.py", "other": f"{tab.MODELS}/modeling_other.py"}
    return {
        paths[k]: ({"repo": tab.REPO, "path": paths[k], "commit": None, "pinned": False}, t) for k, t in texts.items()
    }


def test_a_family_is_read_as_names_config_keys_and_formulas():
    families = tab.family_facts(_files(init=INIT_PY, utils=UTILS_PY, base=BASE_PY))
    base = families["BaseForCausalLM"]
    assert base["attention"] == {
        "attention_window": {"config": "window"},
        "base": "Attention",
        "bias": {"config": "use_bias"},
        "class": "BaseAttention",
        "dense_bias": False,
        "qk_norm": {
            "k_norm": {"eps": {"config": "rms_norm_eps"}, "hidden_size": {"config": "head_dim"}},
            "q_norm": {"eps": 1e-5, "hidden_size": {"attribute": "head_dim"}},
        },
        "sliding_rope_theta": 5000,
    }
    assert base["layer_norms"] == ["extra_norm", "input_layernorm"] and base["model"] == "BaseModel"
    assert base["sliding_schedule"] == {"full_every": {"config": "every"}}
    # getattr-guarded keys are not required, `if not hasattr(...)` ones are defaulted, common ones are left out
    assert base["config_required"] == ["embed_scale", "every", "head_dim", "use_bias", "window"]
    assert base["config_defaulted"] == ["fallback"]
    assert base["norm_weight_offset"] == {"add": 1, "to_names_containing": "norm"}
    assert base["fused_checkpoint_linears"] == {
        "attn.fused": {
            "bindings": {
                "heads": {"config": "num_attention_heads"},
                "hidden": {"config": "hidden_size"},
                "per_head": {"floor_divide": [{"name": "hidden"}, {"name": "heads"}]},
                "split": {"add": [{"name": "hidden"}, {"multiply": [2, {"name": "per_head"}]}]},
            },  # fused / scale / first / second are no integers
            "passes": ["weight", "weight_scale"],
            "split_rows_at": [  # `split` resolved to its formula, each bound once
                {"name": "hidden"},
                {"add": [{"name": "hidden"}, {"multiply": [2, {"name": "per_head"}]}]},
            ],
            "weight_scale_split_when": "rows_equal_weight_rows",
        }
    }
    assert base["never_names"] == [] and base["shadows"] == []


def test_the_module_imported_later_holds_a_name_two_modules_register():
    families = tab.family_facts(_files(init=INIT_PY, utils=UTILS_PY, base=BASE_PY, qk=QK_NORM_PY, other=OTHER_PY))
    other = families["OtherForCausalLM"]
    assert other["class"] == "OtherForCausalLM" and other["shadows"] == [f"{tab.MODELS}/modeling_base.py"]
    assert other["attention"]["base"] == "QKNormRoPEAttention" and other["attention"]["attention_window"] is None
    norm = {"eps": {"config": "rms_norm_eps"}, "hidden_size": {"attribute": "head_dim"}}
    assert other["attention"]["qk_norm"] == {"k_norm": norm, "q_norm": norm}  # the base class's own norms
    assert other["sliding_schedule"] == {"equals": "local", "sliding_where": {"config": "kinds"}}
    assert other["fused_checkpoint_linears"] == {} and other["layer_norms"] == []


def test_a_registration_that_does_not_overwrite_is_refused():
    keeps_first = UTILS_PY.replace("REGISTRY[name] = cls", "REGISTRY.setdefault(name, cls)")
    with pytest.raises(tab.UnrecognizedSource):
        tab.family_facts(_files(init=INIT_PY, utils=keeps_first, base=BASE_PY))


def test_never_named_keys_are_those_the_whole_file_lacks_as_words():
    text = "window = config.sliding_window_size\n"  # a longer name is not the key
    assert tab.never_named("modeling_mistral", text) == ["sliding_window"]
    assert tab.never_named("modeling_mistral", "w = config.sliding_window\n") == []
    assert tab.never_named("modeling_base", text) == []  # no key is checked for a module not listed


def test_values_that_are_neither_literals_nor_config_keys_are_refused_not_stored():
    with pytest.raises(tab.UnrecognizedSource):
        tab.refers_to(ast.parse("pick(config)", mode="eval").body)
    with pytest.raises(tab.UnrecognizedSource):
        tab.sliding_schedule(ast.parse("layer_idx in chosen", mode="eval").body)
    assert tab.arithmetic(ast.parse("weights['x'].shape[0]", mode="eval").body) is None


def test_a_formula_evaluates_on_config_json_and_shows_as_arithmetic():
    bindings = {"hidden": {"config": "hidden_size"}, "per": {"floor_divide": [{"name": "hidden"}, 4]}}
    formula = {"add": [{"name": "hidden"}, {"multiply": [2, {"name": "per"}]}]}
    assert evaluate(formula, {"hidden_size": 64}, bindings) == 96
    assert shown(bindings["per"]) == "hidden // 4"


# ---------------------------------------------------------------- the committed table


def test_every_release_registers_every_family_cited_by_commit():
    assert releases("trtllm_torch_models") == ("1.0", "1.1", "1.2")
    for release, facts in TABLE.items():
        assert set(facts) == {"architectures", "release_commit", "source"} and len(facts["release_commit"]) == 40
        assert set(ARCHITECTURES) <= set(facts["architectures"]), release
        cited = {f["path"]: f for f in facts["source"]["files"]}
        for arch, family in facts["architectures"].items():
            source = family["source"]
            assert set(source) == {"repo", "path", "commit", "pinned"} and source["pinned"] is False
            assert cited[source["path"]] == source, (release, arch)  # a file the release lists
            assert source["path"].startswith("tensorrt_llm/_torch/models/modeling_"), (release, arch)
            assert set(family) == {
                "attention",
                "class",
                "config_defaulted",
                "config_required",
                "fused_checkpoint_linears",
                "layer_norms",
                "model",
                "never_names",
                "norm_weight_offset",
                "shadows",
                "sliding_schedule",
                "source",
            }, (release, arch)
    mistral = TABLE["1.2"]["architectures"]["MistralForCausalLM"]  # modeling_mistral is imported after modeling_llama
    assert (
        mistral["source"]["path"].endswith("modeling_mistral.py")
        and mistral["attention"]["class"] == "MistralAttention"
    )
    assert mistral["shadows"] == ["tensorrt_llm/_torch/models/modeling_llama.py"]
    assert TABLE["1.0"]["architectures"]["Phi3ForCausalLM"]["source"]["commit"].startswith("000a01de")


def test_what_each_family_reads_beyond_llama():
    for release, facts in TABLE.items():
        families = facts["architectures"]
        qwen2 = families["Qwen2ForCausalLM"]["attention"]
        assert (qwen2["bias"], qwen2["dense_bias"], qwen2["qk_norm"]) == (True, False, None)
        qwen3 = families["Qwen3ForCausalLM"]["attention"]
        assert qwen3["bias"] == qwen3["dense_bias"] == {"config": "attention_bias"} and set(qwen3["qk_norm"]) == {
            "q_norm",
            "k_norm",
        }
        assert qwen3["qk_norm"]["q_norm"]["eps"] == 1e-06  # a literal, which the CPU reference uses
        gemma = families["Gemma3ForCausalLM"]
        assert set(gemma["layer_norms"]) >= {"pre_feedforward_layernorm", "post_feedforward_layernorm"}
        assert gemma["norm_weight_offset"]["add"] == 1 and set(gemma["attention"]["qk_norm"]) == {"q_norm", "k_norm"}
        assert {"final_logit_softcapping", "attn_logit_softcapping"} <= set(gemma["never_names"])
        assert gemma["attention"]["attention_window"] == {"config": "sliding_window"}
        phi3 = families["Phi3ForCausalLM"]
        assert set(phi3["fused_checkpoint_linears"]) == {"self_attn.qkv_proj", "mlp.gate_up_proj"}
        head_dim = phi3["fused_checkpoint_linears"]["self_attn.qkv_proj"]["bindings"]["head_dim"]
        assert shown(head_dim) == "hidden_size // num_heads"
        assert "attention_bias" in phi3["config_required"]
        assert families["MistralForCausalLM"]["attention"]["attention_window"] is None
        assert "sliding_window" in families["MistralForCausalLM"]["never_names"]
    passes = {r: TABLE[r]["architectures"]["Phi3ForCausalLM"]["fused_checkpoint_linears"] for r in TABLE}
    assert passes["1.0"]["self_attn.qkv_proj"]["passes"] == ["weight"]
    assert "weight_scale" in passes["1.2"]["self_attn.qkv_proj"]["passes"]
    schedules = {r: TABLE[r]["architectures"]["Gemma3ForCausalLM"]["sliding_schedule"] for r in TABLE}
    assert schedules["1.0"] == {"full_every": {"config": "sliding_window_pattern"}}
    assert schedules["1.2"] == {"equals": "sliding_attention", "sliding_where": {"config": "layer_types"}}


def test_every_formula_of_a_split_evaluates_on_a_config():
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    for facts in TABLE.values():
        for split in facts["architectures"]["Phi3ForCausalLM"]["fused_checkpoint_linears"].values():
            assert all(isinstance(evaluate(b, config, split["bindings"]), int) for b in split["split_rows_at"])


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory) -> Path:
    return make_tiny("Phi3ForCausalLM", tmp_path_factory.mktemp("tiny-phi3"))


def pytorch_config(tmp_path: Path, model: Path, release: str, quantization: str) -> Path:
    return write_config(
        tmp_path / f"pytorch-{release}.yaml",
        f"""
        model: {{source: hf, path: {model}}}
        target: {{name: trtllm, trtllm_backend: pytorch, trtllm_version: "{release}"}}
        quantization: {quantization}
        build: {{max_input_len: 32, max_seq_len: 64, max_num_tokens: 64}}
        """,
    )


@pytest.mark.parametrize("release", list(TABLE))
def test_architecture_support_answers_from_the_release_table(tmp_path, tiny_phi3, release):
    from pipeline.targets import TARGETS

    cfg = load_config(pytorch_config(tmp_path, tiny_phi3, release, "{weights: none}"))
    assert TARGETS["trtllm"].architecture_support(cfg) == dict.fromkeys(ARCHITECTURES)


def test_phi3_fp8_on_1_0_is_refused_naming_release_file_and_fix(tmp_path, tiny_phi3):
    path = pytorch_config(tmp_path, tiny_phi3, "1.0", "{weights: fp8, calibration: {num_samples: 4, seq_len: 32}}")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    says = [p for p in info.value.problems if "Phi3ForCausalLM is not supported" in p]
    assert says and "TensorRT-LLM 1.0's Phi3ForCausalLM.load_weights" in says[0], info.value.problems
    assert "modeling_phi3.py@000a01de" in says[0] and "set target.trtllm_version: 1.1" in says[0]
    load_config(path, ["target.trtllm_version=1.1"])


def test_phi3_int4_is_refused_unless_its_fused_linears_stay_float(tmp_path, tiny_phi3):
    awq = "{weights: int4, method: awq, group_size: 32, calibration: {num_samples: 4, seq_len: 32}"
    with pytest.raises(ConfigError) as info:
        load_config(pytorch_config(tmp_path, tiny_phi3, "1.2", awq + "}"))
    assert any("packed int4" in p and "exclude_modules" in p for p in info.value.problems), info.value.problems
    load_config(pytorch_config(tmp_path, tiny_phi3, "1.2", awq + ", exclude_modules: [qkv_proj, gate_up_proj]}"))


@pytest.mark.parametrize(
    "exclude",
    [["qkv_proj", "gate_up_proj"], ["*.qkv_proj", "*.gate_up_proj"], ["self_attn.qkv_proj", "mlp.gate_up_proj"]],
)
def test_phi3_exclude_patterns_match_full_module_names_as_modelopt_does(tmp_path, tiny_phi3, exclude):
    """ModelOpt disables `*{pattern}*` on full quantizer names (model.layers.0.self_attn.qkv_proj.weight_quantizer),
    so every one of these keeps the fused linears float."""
    awq = "{weights: int4, method: awq, group_size: 32, calibration: {num_samples: 4, seq_len: 32}"
    load_config(pytorch_config(tmp_path, tiny_phi3, "1.2", f"{awq}, exclude_modules: {json.dumps(exclude)}}}"))


@pytest.mark.parametrize("exclude", [["qkv_proj"], ["model.layers.0.*"]])
def test_phi3_int4_with_a_fused_linear_left_quantized_names_evaluated_rows(tmp_path, tiny_phi3, exclude):
    """gate_up_proj left quantized, or excluded in layer 0 only: refused, naming the rows its split is at."""
    from pipeline.targets.trtllm.torch_checkpoint import evaluate

    awq = "{weights: int4, method: awq, group_size: 32, calibration: {num_samples: 4, seq_len: 32}"
    with pytest.raises(ConfigError) as info:
        load_config(pytorch_config(tmp_path, tiny_phi3, "1.2", f"{awq}, exclude_modules: {json.dumps(exclude)}}}"))
    config = json.loads((tiny_phi3 / "config.json").read_text())
    split = TABLE["1.2"]["architectures"]["Phi3ForCausalLM"]["fused_checkpoint_linears"]
    module = "mlp.gate_up_proj"  # quantized in every layer, or in layer 1
    rows = [evaluate(b, config, split[module]["bindings"]) for b in split[module]["split_rows_at"]]
    says = [p for p in info.value.problems if "packed int4" in p]
    assert says and f"rows at {rows}, counted unpacked" in says[0] and f"({module}, W4A16_AWQ)" in says[0], says
    assert "self.config" not in says[0] and "hidden_size" not in says[0]


@pytest.mark.parametrize(
    ("arch", "change", "read"),
    [
        ("MistralForCausalLM", {"sliding_window": 16}, "never names sliding_window"),
        ("Phi3ForCausalLM", {"sliding_window": 16}, "takes no window from it"),
    ],
)
def test_a_window_the_model_never_applies_is_a_validate_error_on_max_seq_len(tmp_path, arch, change, read):
    """Refused before calibration, naming build.max_seq_len and the largest that keeps the window unreached."""
    model = make_tiny(arch, tmp_path / "hf", **change)
    window = change["sliding_window"]
    path = pytorch_config(tmp_path, model, "1.2", "{weights: none}")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    says = [p for p in info.value.problems if ": build.max_seq_len: " in p]
    assert len(says) == 1 and f"sliding_window {window}" in says[0] and read in says[0], info.value.problems
    assert f"set build.max_seq_len <= {window}, the window" in says[0]
    path.write_text(
        path.read_text().replace("max_input_len: 32, max_seq_len: 64", f"max_input_len: 8, max_seq_len: {window}")
    )
    load_config(path)
