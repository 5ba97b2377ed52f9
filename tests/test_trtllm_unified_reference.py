"""The CPU reference forward of ModelOpt's unified HF checkpoint (TensorRT-LLM PyTorch-backend semantics) on real
exports of the tiny Llama by the real CLI (fp8 + fp8 KV, int4 AWQ): it scores like the TensorRT-LLM checkpoint's
reference of the same calibration, a tampered weight_scale shows in its report, and export_unified writes the model
dtype the PyTorch backend loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline import quality, torch_models
from pipeline.build import cache_dir
from pipeline.targets.trtllm.reference import checkpoint_model, load_unified_reference
from pipeline.targets.trtllm.torch_checkpoint import RELEASES as TORCH_RELEASES
from pipeline.targets.trtllm.torch_checkpoint import torch_loader_problems
from pipeline.targets.trtllm.unified_export import export_unified
from pipeline.validation import load_config
from tests.conftest import run_cli, slow_fixture
from tests.targets.test_trtllm import gpu_config

CASES = {
    "fp8-fp8kv": "{weights: fp8, kv_cache: fp8}",
    "int4-awq": "{weights: int4, method: awq, group_size: 32, calibration: {num_samples: 8, seq_len: 64}}",
}
KEYS = ("engine_perplexity", "reference_perplexity", "top1_agreement", "max_abs_logits_diff")


@slow_fixture(scope="module")
def builds(tmp_path_factory, tiny_llama, calibrated) -> dict[str, Path]:
    """Each case built by the real CLI up to the engine stage, which stops for want of a GPU."""
    out = {}
    for name, quantization in CASES.items():
        root = tmp_path_factory.mktemp(name)
        config = gpu_config(root, tiny_llama, quantization)
        calibrated(config, root / "out")
        result = run_cli("build", str(config), "--output", str(root / "out"))
        assert (root / "out" / "export" / "hf_unified" / "config.json").is_file(), result.stdout + result.stderr
        out[name] = root
    return out


def report(root: Path, checkpoint: Path, kind: str) -> dict:
    cfg = load_config(root / "gpu.yaml")
    if kind == "unified":  # the engine build's unified checkpoint, as the newest tabulated PyTorch backend loads it
        cfg.target = cfg.target.model_copy(update={"trtllm_version": TORCH_RELEASES[-1]})
    hf_dir, quiet = root / "out" / "import", lambda *_: None
    model = checkpoint_model(cfg, hf_dir, checkpoint, kind, quiet)
    full = quality.measure(cfg, model, torch_models.transformers_reference(hf_dir), hf_dir, cache_dir(), quiet)
    return {k: full[k] for k in KEYS}


@pytest.fixture(scope="module")
def reports(builds) -> dict[str, dict[str, dict]]:
    return {
        case: {
            kind: report(root, root / "out" / "export" / folder, kind)
            for kind, folder in (("trtllm", "trtllm_checkpoint"), ("unified", "hf_unified"))
        }
        for case, root in builds.items()
    }


@pytest.mark.parametrize("case", list(CASES))
def test_the_unified_reference_scores_like_the_trtllm_checkpoint_reference(reports, case):
    trtllm, unified = reports[case]["trtllm"], reports[case]["unified"]
    print(case, "trtllm", trtllm, "unified", unified)
    assert unified["reference_perplexity"] == trtllm["reference_perplexity"]
    # the two exports round a few codes differently; measured on this model: within 0.5 % of each other
    assert unified["engine_perplexity"] == pytest.approx(trtllm["engine_perplexity"], rel=0.03)
    assert unified["engine_perplexity"] != unified["reference_perplexity"]  # quantization is modelled at all
    assert unified["top1_agreement"] >= 0.95 and trtllm["top1_agreement"] >= 0.95
    assert unified["max_abs_logits_diff"] < 3 * trtllm["max_abs_logits_diff"]


def _rewrite(file: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("case", list(CASES))
def test_a_tampered_weight_scale_changes_the_report(builds, reports, case, tmp_path):
    copy = tmp_path / "hf_unified"
    shutil.copytree(builds[case] / "out" / "export" / "hf_unified", copy)
    name = "model.layers.0.mlp.down_proj.weight_scale"

    def scale(t):
        t[name] = t[name] * 3

    _rewrite(copy / "model.safetensors", scale)
    tampered, honest = report(builds[case], copy, "unified"), reports[case]["unified"]
    print(case, "tampered", tampered)
    assert tampered["engine_perplexity"] != honest["engine_perplexity"]
    assert tampered["max_abs_logits_diff"] > 1.5 * honest["max_abs_logits_diff"]


def test_the_fp8_kv_cache_is_at_scale_one_whatever_k_scale_says(builds, tmp_path):
    """TensorRT-LLM's PyTorch backend passes k_scale / v_scale to its attention kernel only for an FP4 KV cache."""
    copy = tmp_path / "hf_unified"
    shutil.copytree(builds["fp8-fp8kv"] / "out" / "export" / "hf_unified", copy)
    hf_dir = builds["fp8-fp8kv"] / "out" / "import"
    ids = torch.arange(3, 67)[None]
    with torch.no_grad():
        before = load_unified_reference(copy, hf_dir)(ids).logits

        def scale(t):
            t["model.layers.0.self_attn.k_proj.k_scale"] = t["model.layers.0.self_attn.k_proj.k_scale"] * 100

        _rewrite(copy / "model.safetensors", scale)
        assert torch.equal(load_unified_reference(copy, hf_dir)(ids).logits, before)


def test_export_unified_writes_the_model_dtype(builds, reports, tmp_path):
    from safetensors import safe_open

    from pipeline.targets.trtllm.modelopt import load_calibrated, quiet_modelopt

    root = builds["int4-awq"]
    model = load_calibrated(root / "out" / "import", root / "out" / "quantize")
    with quiet_modelopt():
        # AWQ has its pre_quant_scale; torch_dtype is written beside dtype for the containers' transformers
        assert export_unified(model, torch.float16, tmp_path / "hf_unified") == ["config.json:torch_dtype"]
    unified = tmp_path / "hf_unified"
    config = json.loads((unified / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float16"
    with safe_open(unified / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.input_layernorm.weight").dtype == torch.float16
        assert f.get_tensor("model.layers.0.mlp.down_proj.pre_quant_scale").dtype == torch.float16
    assert torch_loader_problems(unified, "1.0") == torch_loader_problems(unified, "1.2") == []
    fp16 = report(root, unified, "unified")
    print("int4-awq unified fp16", fp16)
    assert fp16["engine_perplexity"] == pytest.approx(reports["int4-awq"]["unified"]["engine_perplexity"], rel=0.03)
