"""The PyTorch-backend model tabulator (scripts/dev/tabulate_trtllm_torch_models.py), re-run on the committed
upstream excerpts, agrees with the committed trtllm_torch_models.json; the table says, per release, which families
tensorrt_llm/_torch/models registers and what each family's model reads beyond Llama's; the PyTorch backend's
architecture_support answers from it (a validate error naming release, file and fix)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.architectures import ARCHITECTURES
from pipeline.config import load_config
from pipeline.errors import ConfigError
from tests.conftest import dev_script, make_tiny, write_config

ROOT = Path(__file__).parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "upstream"
TABLE = json.loads((ROOT / "pipeline" / "trtllm_torch_models.json").read_text())
tab = dev_script("tabulate_trtllm_torch_models")


def test_the_committed_excerpts_tabulate_to_the_committed_table():
    assert tab.tabulate(FIXTURES) == TABLE


def test_every_registered_family_is_registered_by_every_tabulated_release():
    assert list(TABLE) == ["1.0", "1.1", "1.2"]
    for release, facts in TABLE.items():
        assert set(ARCHITECTURES) <= set(facts["architectures"]), release
        for arch in ARCHITECTURES:
            source = facts["architectures"][arch]["source"]
            assert source["repo"] == "NVIDIA/TensorRT-LLM" and source["index_id"], (release, arch)
            assert source["path"].startswith("tensorrt_llm/_torch/models/modeling_"), (release, arch)
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
        assert qwen3["bias"] == qwen3["dense_bias"] == "config.attention_bias" and set(qwen3["qk_norm"]) == {
            "q_norm",
            "k_norm",
        }
        gemma = families["Gemma3ForCausalLM"]
        assert set(gemma["layer_norms"]) >= {"pre_feedforward_layernorm", "post_feedforward_layernorm"}
        assert gemma["norm_weight_offset"]["add"] == 1 and set(gemma["attention"]["qk_norm"]) == {"q_norm", "k_norm"}
        assert {"final_logit_softcapping", "attn_logit_softcapping"} <= set(gemma["never_names"])
        assert gemma["attention"]["attention_window"] == "config.sliding_window"
        phi3 = families["Phi3ForCausalLM"]
        assert set(phi3["fused_checkpoint_linears"]) == {"self_attn.qkv_proj", "mlp.gate_up_proj"}
        assert (
            phi3["fused_checkpoint_linears"]["self_attn.qkv_proj"]["bindings"]["head_dim"] == "hidden_size // num_heads"
        )
        assert "attention_bias" in phi3["config_required"]
        assert families["MistralForCausalLM"]["attention"]["attention_window"] is None
        assert "sliding_window" in families["MistralForCausalLM"]["never_names"]
    passes = {r: TABLE[r]["architectures"]["Phi3ForCausalLM"]["fused_checkpoint_linears"] for r in TABLE}
    assert passes["1.0"]["self_attn.qkv_proj"]["passes"] == ["weight"]
    assert "weight_scale" in passes["1.2"]["self_attn.qkv_proj"]["passes"]
    schedules = {r: TABLE[r]["architectures"]["Gemma3ForCausalLM"]["sliding_schedule"] for r in TABLE}
    assert "sliding_window_pattern" in schedules["1.0"] and "layer_types" in schedules["1.2"]


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
    assert "modeling_phi3.py@9325938422" in says[0] and "set target.trtllm_version: 1.1" in says[0]
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
    from pipeline.trtllm_torch_checkpoint import evaluate

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
