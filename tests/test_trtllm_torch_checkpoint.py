"""The unified HF checkpoint against TensorRT-LLM's PyTorch backend: the tabulator on the committed upstream
excerpts, the committed table, and real exports of the tiny Llama (fp8 + fp8 KV, int4 AWQ) by the real CLI. Whether the
unified checkpoint's values are good is tests/test_trtllm_unified_reference.py's question."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.trtllm_torch_checkpoint import (
    RELEASES,
    torch_loader_problems,
    unsupported_quantization,
)
from tests.conftest import dev_script, run_cli
from tests.targets.test_trtllm import gpu_config

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = Path(__file__).parent / "fixtures" / "upstream"
TABLE = ROOT / "pipeline" / "upstream" / "trtllm_torch_loader.json"

tab = dev_script("tabulate_trtllm_torch_loader")

CASES = {
    "fp8-fp8kv": "{weights: fp8, kv_cache: fp8}",
    "int4-awq": "{weights: int4, method: awq, group_size: 32, calibration: {num_samples: 8, seq_len: 64}}",
    "int4-rtn": "{weights: int4, group_size: 32}",  # ModelOpt writes no pre_quant_scale: export_unified adds ones
}


def test_the_committed_excerpts_tabulate_to_the_committed_table():
    assert tab.tabulate(UPSTREAM) == json.loads(TABLE.read_text())


def test_the_table_says_what_each_release_loads():
    table = json.loads(TABLE.read_text())
    assert list(table) == ["1.0", "1.1", "1.2"] == list(RELEASES)
    for release, facts in table.items():
        assert facts["quant_config_source"][0] == {
            "when": "hf_quant_config.json exists",
            "reader": "cls.load_modelopt_quant_config",
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
        assert "unsupported quant mode" in algos["W8A8_SQ_PER_CHANNEL"]["raises"]
        assert algos["W8A16"]["method"] == "WeightOnlyQuantLinearMethod"
        assert set(algos["W8A16"]["tensors"]["required"]) == {"weight_scale"}
        assert algos["W8A16"]["tensors"]["dtypes"]["parameter weight"] == "torch.int8"
        assert algos["FP8"]["method"] == "FP8QDQLinearMethod"
        assert set(algos["FP8"]["tensors"]["required"]) == {"weight_scale"}
        assert set(algos["FP8"]["tensors"]["optional"]) == {"input_scale", "k_scale", "v_scale"}
        assert set(algos["W4A16_AWQ"]["tensors"]["required"]) == {"pre_quant_scale", "weight_scale"}
        assert algos["W4A16_AWQ"]["tensors"]["required"]["pre_quant_scale"].startswith("load_weights_vanilla")
        assert set(algos["W4A8_AWQ"]["tensors"]["required"]) == {
            "input_scale",
            "pre_quant_scale",
            "weight_scale",
            "weight_scale_2",
        }
        assert set(facts["kv_cache_scales"]) == {"k_scale", "v_scale"}
        assert all(f["index_id"] for f in facts["source"]["files"])


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


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    """`export/` of each case built by the real CLI, which stops at the engine stage for want of a GPU."""
    out = {}
    for name, quantization in CASES.items():
        root = tmp_path_factory.mktemp(name)
        result = run_cli("build", str(gpu_config(root, tiny_llama, quantization)), "--output", str(root / "out"))
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
