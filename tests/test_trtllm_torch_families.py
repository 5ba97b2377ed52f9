"""Every registered family through ModelOpt's unified export, checked against what TensorRT-LLM's PyTorch model for
it reads (trtllm_torch_models.json): tiny random checkpoints calibrated and exported in-process (no fp8 / int4 AWQ
preset differs from the CLI's: pipeline.targets.trtllm.modelopt.calibrate with the quantization section's values), the
conformance check per release, the CPU reference's perplexity / top-1 against fp32 through quality.measure, and
each family-specific tensor or config key dropped or changed is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline import quality, torch_models
from pipeline.build import cache_dir
from pipeline.targets.trtllm.reference import checkpoint_model
from pipeline.targets.trtllm.torch_checkpoint import RELEASES, family, linear_shapes, torch_loader_problems
from pipeline.validation import load_config
from tests.conftest import TINY_FAMILIES, make_tiny, slow_fixture, write_config

FAMILIES = list(TINY_FAMILIES)
# The tiny checkpoints as a release deploys them: a sliding window TensorRT-LLM's Mistral model never reads, and a
# soft-capping its Gemma 3 never applies, are each a problem of their own (tested below).
CLEAN = {"MistralForCausalLM": {"sliding_window": None}, "Gemma3ForCausalLM": {"final_logit_softcapping": None}}
QUANT = {
    "none": {"weights": "none", "method": "rtn", "kv_cache": "none"},
    "fp8-fp8kv": {"weights": "fp8", "method": "rtn", "kv_cache": "fp8"},
    "int4-awq": {"weights": "int4", "method": "awq", "kv_cache": "none"},
}
PHI3_FUSED = ["qkv_proj", "gate_up_proj"]
MAX_SEQ_LEN = 64
WORDS = " ".join(f"w{(i * 37) % 250}" for i in range(4000))  # the tiny tokenizer's words, in a fixed order


def export(hf: Path, name: str, out: Path, exclude: list[str] = ()) -> tuple[list[str], float]:
    """(what export_unified repaired, top-1 agreement of ModelOpt's own fake-quantized model with fp32 on the
    first verify window of WORDS: the bar the reference of the exported checkpoint is held to)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.targets.trtllm.modelopt import calibrate, quiet_modelopt
    from pipeline.targets.trtllm.unified_export import export_unified

    q = SimpleNamespace(
        **QUANT[name],
        group_size=32,
        exclude_modules=list(exclude),
        modelopt_recipe=None,
        calibration=SimpleNamespace(num_samples=4, seq_len=32),
    )
    fp32 = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    model = fp32 if name == "none" else calibrate(hf, q, WORDS, lambda items, *_, **__: items)
    window = AutoTokenizer.from_pretrained(hf)(WORDS, return_tensors="pt")["input_ids"][:, : quality.WINDOW]
    with torch.no_grad():
        fake_top1 = (fp32(window).logits.argmax(-1) == model(window).logits.argmax(-1)).float().mean().item()
    with quiet_modelopt():
        return export_unified(model, torch.float16, out), fake_top1


@slow_fixture(scope="module")
def exports(tmp_path_factory) -> dict:
    """(family, case) -> (hf_dir, hf_unified dir, what export_unified repaired, fake-quantized top-1)."""
    out = {}
    for arch in FAMILIES:
        root = tmp_path_factory.mktemp(arch)
        hf = make_tiny(arch, root / "hf", **CLEAN.get(arch, {}))
        for name in QUANT:
            out[arch, name] = (hf, root / name, *export(hf, name, root / name))
    phi3 = out["Phi3ForCausalLM", "none"][0]
    unified = phi3.parent / "int4-awq-excluded"
    out["Phi3ForCausalLM", "int4-awq-excluded"] = (phi3, unified, *export(phi3, "int4-awq", unified, PHI3_FUSED))
    return out


def refused(arch: str, case: str, release: str) -> bool:
    """Phi-3's checkpoint-fused linears quantized: int4 packing always, FP8 before 1.1 (its load_weights)."""
    return arch == "Phi3ForCausalLM" and (case == "int4-awq" or (case == "fp8-fp8kv" and release == "1.0"))


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_exports_what_the_release_loads(exports, arch, release):
    for case in ("none", "fp8-fp8kv", "int4-awq"):
        problems = torch_loader_problems(exports[arch, case][1], release, MAX_SEQ_LEN)
        if refused(arch, case, release):
            assert problems and all("qkv_proj" in p or "gate_up_proj" in p for p in problems), problems
        else:
            assert problems == [], (case, problems)


def test_export_unified_writes_the_config_keys_releases_read(exports):
    """transformers 4.57 writes neither Phi-3's attention_bias nor Gemma 3's sliding_window_pattern; 1.0's Phi-3
    attention and Gemma 3 decoder layer read them without a fallback. It writes `dtype` where the containers' older
    transformers read `torch_dtype` (else the PyTorch backend assumes bfloat16): both are written, the same."""
    assert exports["Phi3ForCausalLM", "none"][2] == ["config.json:attention_bias", "config.json:torch_dtype"]
    assert exports["Gemma3ForCausalLM", "none"][2] == ["config.json:sliding_window_pattern", "config.json:torch_dtype"]
    gemma = json.loads((exports["Gemma3ForCausalLM", "none"][1] / "config.json").read_text())
    assert gemma["sliding_window_pattern"] == 2 and gemma["layer_types"] == ["sliding_attention", "full_attention"]
    assert exports["Qwen3ForCausalLM", "int4-awq"][2] == ["config.json:torch_dtype"]
    for key in exports:
        config = json.loads((exports[key][1] / "config.json").read_text())
        assert config["torch_dtype"] == config["dtype"] in ("float16", "bfloat16"), key


def test_phi3_int4_with_its_fused_linears_excluded_loads(exports):
    for release in RELEASES:
        assert torch_loader_problems(exports["Phi3ForCausalLM", "int4-awq-excluded"][1], release, MAX_SEQ_LEN) == []


def report(exports, arch: str, case: str, tmp_path: Path) -> dict:
    hf, unified, *_ = exports[arch, case]
    (tmp_path / "eval.txt").write_text(WORDS)
    config = write_config(
        tmp_path / "gpu.yaml",
        f"""
        model: {{source: hf, path: {hf}}}
        target: {{name: trtllm, trtllm_backend: pytorch, trtllm_version: "1.2"}}
        build: {{max_input_len: 32, max_seq_len: {MAX_SEQ_LEN}, max_num_tokens: 64}}
        verify: {{eval_text: eval.txt, eval_tokens: 256}}
        """,
    )
    cfg, quiet = load_config(config), lambda *_: None
    model = checkpoint_model(cfg, hf, unified, "unified", quiet)
    return quality.measure(cfg, model, torch_models.transformers_reference(hf), hf, cache_dir(), quiet)


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_unified_reference_of_every_family_is_close_to_fp32(exports, arch, tmp_path):
    quantized = ["fp8-fp8kv", "int4-awq"] + (["int4-awq-excluded"] if arch == "Phi3ForCausalLM" else [])
    reports = {case: report(exports, arch, case, tmp_path) for case in ["none", *quantized]}
    for case, r in reports.items():
        keys = ("reference_perplexity", "engine_perplexity", "top1_agreement")
        print(arch, case, {k: r[k] for k in keys}, "modelopt fake-quant top1", exports[arch, case][3])
    exact = reports["none"]
    assert exact["top1_agreement"] >= 0.99  # fp16 weights, nothing else
    assert exact["engine_perplexity"] == pytest.approx(exact["reference_perplexity"], rel=0.002)
    for case in quantized:
        r = reports[case]
        assert r["engine_perplexity"] != exact["engine_perplexity"]  # quantization is modelled at all
        assert r["engine_perplexity"] == pytest.approx(r["reference_perplexity"], rel=0.03), case
        # random tiny models have near-flat logits that flip easily: the bar is ModelOpt's own fake quantization
        assert r["top1_agreement"] >= exports[arch, case][3] - 0.08, case


def _rewrite(file: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _copy(exports, arch: str, case: str, tmp_path: Path) -> Path:
    copy = tmp_path / "hf_unified"
    shutil.copytree(exports[arch, case][1], copy)
    return copy


@pytest.mark.parametrize(
    "arch, case, name",
    [
        ("Qwen2ForCausalLM", "fp8-fp8kv", "model.layers.1.self_attn.k_proj.bias"),
        ("Qwen3ForCausalLM", "int4-awq", "model.layers.0.self_attn.q_norm.weight"),
        ("Gemma3ForCausalLM", "fp8-fp8kv", "model.layers.1.pre_feedforward_layernorm.weight"),
        ("Gemma3ForCausalLM", "none", "model.layers.0.self_attn.k_norm.weight"),
    ],
)
def test_a_dropped_family_tensor_is_named(exports, tmp_path, arch, case, name):
    copy = _copy(exports, arch, case, tmp_path)
    _rewrite(copy / "model.safetensors", lambda t: t.pop(name))
    for release in RELEASES:
        problems = torch_loader_problems(copy, release, MAX_SEQ_LEN)
        assert problems and all(name in p for p in problems), problems


def test_a_bias_the_model_does_not_hold_is_named(exports, tmp_path):
    """Qwen2's o_proj has no bias (dense_bias=False): a checkpoint carrying one would be computed without it."""
    copy = _copy(exports, "Qwen2ForCausalLM", "none", tmp_path)
    name = "model.layers.0.self_attn.o_proj.bias"
    _rewrite(copy / "model.safetensors", lambda t: t.update({name: torch.zeros(64, dtype=torch.float16)}))
    assert any(name in p and "no such bias" in p for p in torch_loader_problems(copy, "1.2", MAX_SEQ_LEN))


def test_phi3_mis_split_fused_weights_are_named(exports):
    fp8 = torch_loader_problems(exports["Phi3ForCausalLM", "fp8-fp8kv"][1], "1.0", MAX_SEQ_LEN)
    assert any("model.layers.0.self_attn.qkv_proj" in p and "finds no ['weight_scale']" in p for p in fp8), fp8
    unified = exports["Phi3ForCausalLM", "int4-awq"][1]
    config = json.loads((unified / "config.json").read_text())
    shapes = linear_shapes(config, family(config, "1.2")["fused_checkpoint_linears"])
    qkv_rows = shapes["model.layers.0.self_attn.qkv_proj"][0]  # (heads + 2 kv heads) x head_dim, from config.json
    gate_up_rows = shapes["model.layers.1.mlp.gate_up_proj"][0]  # 2 x intermediate_size
    awq = torch_loader_problems(unified, "1.2", MAX_SEQ_LEN)
    packed = f"model.layers.1.mlp.gate_up_proj.weight has {gate_up_rows // 2} rows (packed int4"
    assert any(packed in p for p in awq), awq
    assert any(f"qkv_proj.weight_scale has {qkv_rows} rows, not the weight's {qkv_rows // 2}" in p for p in awq), awq


def _edit_config(copy: Path, change: dict) -> None:
    file = copy / "config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | change))


def test_config_keys_a_release_reads_or_ignores_are_named(exports, tmp_path):
    mistral = _copy(exports, "MistralForCausalLM", "none", tmp_path / "m")
    _edit_config(mistral, {"sliding_window": 16})
    problems = torch_loader_problems(mistral, "1.2", MAX_SEQ_LEN)
    assert len(problems) == 1 and "sliding_window 16" in problems[0] and "never names sliding_window" in problems[0]
    assert "modeling_mistral.py, a copy of unknown commit" in problems[0], problems
    assert torch_loader_problems(mistral, "1.2", 16) == []  # a window no sequence reaches changes nothing
    gemma = _copy(exports, "Gemma3ForCausalLM", "none", tmp_path / "g")
    _edit_config(gemma, {"final_logit_softcapping": 30.0, "sliding_window_pattern": 6})
    assert any("final_logit_softcapping" in p for p in torch_loader_problems(gemma, "1.2", MAX_SEQ_LEN))
    old = torch_loader_problems(gemma, "1.0", MAX_SEQ_LEN)
    assert any("sliding_window_pattern" in p and "layer_types" in p for p in old), old
    phi3 = _copy(exports, "Phi3ForCausalLM", "none", tmp_path / "p")
    config = json.loads((phi3 / "config.json").read_text())
    del config["attention_bias"]
    (phi3 / "config.json").write_text(json.dumps(config))
    assert any("no attention_bias" in p for p in torch_loader_problems(phi3, "1.0", MAX_SEQ_LEN))


def test_the_reference_computes_what_the_release_reads_not_what_transformers_does(exports, tmp_path):
    """Mistral's sliding window is never read (full attention past it); Qwen3's own q/k norms use eps 1e-6."""
    from transformers import AutoModelForCausalLM

    from pipeline.targets.trtllm.reference import load_unified_reference

    hf = tmp_path / "hf"
    shutil.copytree(exports["MistralForCausalLM", "none"][0], hf)
    _edit_config(hf, {"sliding_window": 8})  # the HF model as trained: windowed
    copy = _copy(exports, "MistralForCausalLM", "none", tmp_path)
    _edit_config(copy, {"sliding_window": 8})
    windowed = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.arange(3, 35)[None]
    with torch.no_grad():
        hf_logits, ref_logits = windowed(ids).logits, load_unified_reference(copy, hf, "1.2")(ids).logits
    assert torch.allclose(hf_logits[:, :8], ref_logits[:, :8], atol=1e-2)  # inside the window: the same
    assert (hf_logits[:, 8:] - ref_logits[:, 8:]).abs().max() > 0.05  # past it: the window is not applied
    qwen3 = load_unified_reference(exports["Qwen3ForCausalLM", "none"][1], exports["Qwen3ForCausalLM", "none"][0])
    assert qwen3.model.layers[0].self_attn.q_norm.variance_epsilon == 1e-6
    assert qwen3.model.layers[0].input_layernorm.variance_epsilon == 1e-5  # config.json's rms_norm_eps
