"""The trtllm target's engine backend beyond Llama: Qwen2 (q/k/v biases) and Mistral (sliding window) exported by
ModelOpt with the decoder type ModelOpt's own table gives them, checked for conformance against the tabulated
class facts and scored by the reference forward against the fp32 model; the families the engine workflow cannot take
from this pipeline refused at validate with the reason."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.trtllm_checkpoint import check_checkpoint
from tests.conftest import TINY_SLIDING_WINDOW, make_tiny, run_cli, write_config

CALIBRATION = "calibration: {num_samples: 8, seq_len: 64}"
# case -> (quantization YAML, parallel YAML, quant_algo)
QUANTIZATIONS = {
    "none-tp2": ("{weights: none}", "{tp_size: 2}", None),
    "int8-weight-only": ("{weights: int8}", "{}", "W8A16"),
    "int4-awq": (f"{{weights: int4, method: awq, group_size: 32, {CALIBRATION}}}", "{}", "W4A16_AWQ"),
    "fp8": (f"{{weights: fp8, kv_cache: fp8, {CALIBRATION}}}", "{}", "FP8"),
}
FAMILIES = ("Qwen2ForCausalLM", "MistralForCausalLM")
CASES = [(arch, case) for arch in FAMILIES for case in QUANTIZATIONS]


def engine_config(root: Path, model: Path, quantization: str, parallel: str = "{}") -> Path:
    return write_config(
        root / "gpu.yaml",
        f"""
        model: {{source: hf, path: {model}}}
        target: {{name: trtllm, trtllm_backend: tensorrt, trtllm_version: "1.2"}}
        quantization: {quantization}
        parallel: {parallel}
        build: {{max_input_len: 256, max_seq_len: 512, max_num_tokens: 1024}}
        verify: {{eval_tokens: 256, max_perplexity_increase: 0.5}}
    """,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return {arch: make_tiny(arch, tmp_path_factory.mktemp(arch)) for arch in FAMILIES}


@pytest.fixture(scope="module")
def built(tmp_path_factory, models):
    """Every (family, quantization) exported by the real CLI (two builds at a time, one per core)."""

    def build(arch_case):
        arch, case = arch_case
        quantization, parallel, _ = QUANTIZATIONS[case]
        root = tmp_path_factory.mktemp(f"{arch}-{case}")
        config = engine_config(root, models[arch], quantization, parallel)
        result = run_cli("build", str(config), "--output", str(root / "out"), "--until", "export")
        return arch_case, (root, result)

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(build, CASES))


@pytest.mark.parametrize(("arch", "case"), CASES)
def test_family_checkpoint_conforms_and_matches_fp32(built, arch, case):
    root, result = built[(arch, case)]
    assert result.returncode == 0, result.stdout + result.stderr
    checkpoint, hf_dir = root / "out" / "export" / "trtllm_checkpoint", root / "out" / "import"
    assert check_checkpoint(checkpoint, hf_dir, load_config(root / "gpu.yaml")) == []
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architecture"] == arch and config["quantization"]["quant_algo"] == QUANTIZATIONS[case][2]
    if arch == "Qwen2ForCausalLM":  # QWenDecoderLayer branches on qwen_type, which ModelOpt does not write
        assert config["qwen_type"] == "qwen2" and config.get("attn_bias", True)
    metrics = json.loads((root / "out" / "build.lock.json").read_text())["stages"]["export"]["metrics"]
    assert metrics["perplexity_increase"] < 0.1 and metrics["top1_agreement"] >= 0.9, metrics
    if case == "none-tp2":  # unquantized, over two ranks: fp16 rounding only
        assert metrics["top1_agreement"] == 1.0 and metrics["max_abs_logits_diff"] < 5e-3, metrics


def test_qwen2_biases_are_split_per_rank(built):
    from safetensors import safe_open

    root, _ = built[("Qwen2ForCausalLM", "none-tp2")]
    for rank in (0, 1):
        path = root / "out" / "export" / "trtllm_checkpoint" / f"rank{rank}.safetensors"
        with safe_open(path, "pt") as f:
            # 4 heads x 16 over 2 ranks, plus one of the 2 KV heads each for k and v
            assert f.get_slice("transformer.layers.0.attention.qkv.bias").get_shape() == [(2 + 1 + 1) * 16]
            assert "transformer.layers.0.attention.dense.bias" not in f.keys()  # QWen's Attention(dense_bias=False)


def without(checkpoint: Path, out: Path, *, tensors: str = "", keys: tuple[str, ...] = (), set_keys=None) -> Path:
    """A copy of `checkpoint` missing the tensors whose names end with `tensors` and the config keys `keys`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    config = json.loads((out / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in keys} | (set_keys or {})
    (out / "config.json").write_text(json.dumps(config))
    if tensors:
        for file in out.glob("rank*.safetensors"):
            save_file({k: v for k, v in load_file(file).items() if not k.endswith(tensors)}, file)
    return out


def test_a_qwen2_checkpoint_without_what_qwen_reads_is_reported(built, tmp_path):
    root, _ = built[("Qwen2ForCausalLM", "none-tp2")]
    checkpoint, hf_dir = root / "out" / "export" / "trtllm_checkpoint", root / "out" / "import"
    cfg = load_config(root / "gpu.yaml")
    no_bias = check_checkpoint(without(checkpoint, tmp_path / "a", tensors="qkv.bias"), hf_dir, cfg)
    assert "rank0.safetensors: missing transformer.layers.0.attention.qkv.bias (F16 [64])" in no_bias
    assert "rank1.safetensors: missing transformer.layers.1.attention.qkv.bias (F16 [64])" in no_bias
    dropped = check_checkpoint(without(checkpoint, tmp_path / "b", set_keys={"attn_bias": False}), hf_dir, cfg)
    assert any("attn_bias is False" in p and "drops those biases" in p for p in dropped), dropped
    assert any("stray tensor transformer.layers.0.attention.qkv.bias" in p for p in dropped), dropped
    untyped = check_checkpoint(without(checkpoint, tmp_path / "c", keys=("qwen_type",)), hf_dir, cfg)
    assert untyped == [
        "config.json: qwen_type is None; TensorRT-LLM's QWenForCausalLM reads it without a default and "
        "from_hugging_face takes it from the HF config's model_type: 'qwen2'"
    ]


def test_mistral_window_reaches_the_reference_and_the_triton_model(built):
    from pipeline.targets.trtllm_engine import template_parameters
    from pipeline.triton.tensorrtllm_backend import SUPPORTED_VERSIONS, template
    from pipeline.trtllm_reference import load_reference

    root, _ = built[("MistralForCausalLM", "none-tp2")]
    reference = load_reference(root / "out" / "export" / "trtllm_checkpoint", root / "out" / "import")
    assert reference.config.sliding_window == TINY_SLIDING_WINDOW
    ids = torch.randint(3, 250, (1, 4 * TINY_SLIDING_WINDOW))
    with torch.no_grad():
        windowed = reference(ids).logits
        reference.config.sliding_window = None
        full = reference(ids).logits
    assert torch.equal(windowed[0, :TINY_SLIDING_WINDOW], full[0, :TINY_SLIDING_WINDOW])  # the window is applied,
    assert not torch.allclose(windowed[0, TINY_SLIDING_WINDOW + 1 :], full[0, TINY_SLIDING_WINDOW + 1 :])  # past it
    engine = {"build_config": {"max_beam_width": 1, "max_batch_size": 8}}
    mistral = template_parameters(load_config(root / "gpu.yaml"), root / "engine", engine)
    assert mistral["max_attention_window_size"] == TINY_SLIDING_WINDOW
    qwen_root, _ = built[("Qwen2ForCausalLM", "none-tp2")]
    assert "max_attention_window_size" not in template_parameters(load_config(qwen_root / "gpu.yaml"), root, engine)
    assert all("max_attention_window_size" in template(v)["parameters"] for v in SUPPORTED_VERSIONS)


@pytest.mark.parametrize(
    ("arch", "release", "why"),
    [
        ("Qwen3ForCausalLM", "0.19", "has no class for it (MODEL_MAP in tensorrt_llm/models/__init__.py @ index id"),
        ("Qwen3ForCausalLM", "0.19", "0.20 added one (QWenForCausalLM; docs/source/release-notes.md"),
        ("Qwen3ForCausalLM", "1.2", "MODEL_MAP maps it to QWenForCausalLM, but this pipeline checks and references"),
        ("Gemma3ForCausalLM", "0.18", "0.19 added one (GemmaForCausalLM"),
        ("Gemma3ForCausalLM", "1.2", "maps it to GemmaForCausalLM, but ModelOpt 0.47.0 cannot export it"),
        ("Phi3ForCausalLM", "1.0", "maps it to Phi3ForCausalLM, but ModelOpt 0.47.0 cannot export it"),
    ],
)
def test_validate_refuses_what_the_engine_backend_cannot_take(tmp_path, arch, release, why):
    model = make_tiny(arch, tmp_path / "model")
    config = engine_config(tmp_path, model, "{weights: none}")
    config.write_text(config.read_text().replace('"1.2"', f'"{release}"'))
    result = run_cli("validate", str(config))
    message = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"architecture {arch} is not supported on target trtllm" in message and why in message, message
    assert f"TensorRT-LLM {release}'s engine workflow" in message and "use target.trtllm_backend: pytorch" in message
    assert "(supported there: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)" in message
