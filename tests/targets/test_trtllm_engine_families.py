"""The trtllm target's tensorrt backend (engines) beyond Llama: Qwen2 (q/k/v biases) and Mistral (sliding window)
exported by ModelOpt with the decoder type ModelOpt's own table gives them, checked for conformance against the
tabulated class facts and scored by the reference forward against the fp32 model; the families the engine workflow
cannot take from this pipeline refused at validate with the reason."""

from __future__ import annotations

import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pipeline.targets.trtllm.checkpoint import check_checkpoint
from pipeline.validation import load_config
from tests.conftest import TINY_SLIDING_WINDOW, make_tiny, run_cli, slow_fixture, spawn_cli, trtllm_config

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
CLI_CASE = ("MistralForCausalLM", "fp8")  # the end-to-end path: calibration, FP8 KV cache, the sliding window


def engine_config(root: Path, model: Path, quantization: str, parallel: str = "{}") -> Path:
    return trtllm_config(root / "gpu.yaml", model, quantization, parallel)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return {arch: make_tiny(arch, tmp_path_factory.mktemp(arch)) for arch in FAMILIES}


@slow_fixture(scope="module")
def built(tmp_path_factory, models):
    """Every (family, quantization) built through export: CLI_CASE by the real CLI (in a subprocess, meanwhile),
    the rest in-process by the same pipeline.build.build the CLI calls (stages, lock and metrics alike)."""
    from rich.console import Console

    from pipeline.build import build

    roots = {}
    for arch, case in CASES:
        quantization, parallel, _ = QUANTIZATIONS[case]
        roots[arch, case] = tmp_path_factory.mktemp(f"{arch}-{case}")
        engine_config(roots[arch, case], models[arch], quantization, parallel)
    cli_root = roots[CLI_CASE]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core each: two processes of two torch threads on two cores thrash
    try:
        with ThreadPoolExecutor(1) as pool:
            cli = pool.submit(
                spawn_cli,
                *("build", str(cli_root / "gpu.yaml"), "--output", str(cli_root / "out"), "--until", "export"),
                env={"OMP_NUM_THREADS": "1"},
            )
            for key, root in roots.items():
                if key != CLI_CASE:
                    build(load_config(root / "gpu.yaml"), root / "out", Console(file=io.StringIO()), until="export")
            result = cli.result()
    finally:
        torch.set_num_threads(threads)
    assert result.returncode == 0, result.stdout + result.stderr
    return roots


def test_the_cli_builds_through_export(built):
    lock = json.loads((built[CLI_CASE] / "out" / "build.lock.json").read_text())
    assert set(lock["stages"]) == {"import", "quantize", "export"}


@pytest.mark.parametrize(("arch", "case"), CASES)
def test_family_checkpoint_conforms_and_matches_fp32(built, arch, case):
    root = built[(arch, case)]
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

    root = built[("Qwen2ForCausalLM", "none-tp2")]
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
    root = built[("Qwen2ForCausalLM", "none-tp2")]
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
    from pipeline.targets.trtllm.reference import load_reference
    from pipeline.targets.trtllm.tensorrt_backend import template_parameters
    from pipeline.targets.trtllm.triton_cpp_backend import SUPPORTED_VERSIONS, template

    root = built[("MistralForCausalLM", "none-tp2")]
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
    qwen_root = built[("Qwen2ForCausalLM", "none-tp2")]
    assert "max_attention_window_size" not in template_parameters(load_config(qwen_root / "gpu.yaml"), root, engine)
    assert all("max_attention_window_size" in template(v)["parameters"] for v in SUPPORTED_VERSIONS)


def test_the_engine_runner_gets_the_window_the_triton_model_gets(built, tmp_path):
    """The engine stage records the window beside trtllm-build's config.json (whose LLaMAConfig has none), and
    load_runner passes it to ModelRunnerCpp.from_dir as max_attention_window_size (a per-layer list)."""
    from pipeline.targets.trtllm.tensorrt_backend import RUNTIME_FILE, record_runtime, runner_options

    mistral, qwen = (load_config(built[arch, "none-tp2"] / "gpu.yaml") for arch in FAMILIES[::-1])
    engine = {
        "pretrained_config": json.loads(
            (built[FAMILIES[1], "none-tp2"] / "out" / "export" / "trtllm_checkpoint" / "config.json").read_text()
        )
    }
    assert "sliding_window" not in engine["pretrained_config"]  # what trtllm-build copies into the engine config
    (tmp_path / "mistral").mkdir()
    assert record_runtime(mistral, tmp_path / "mistral") == {"max_attention_window_size": [TINY_SLIDING_WINDOW]}
    assert json.loads((tmp_path / "mistral" / RUNTIME_FILE).read_text())["max_attention_window_size"] == [
        TINY_SLIDING_WINDOW
    ]
    r = mistral.runtime
    assert runner_options(tmp_path / "mistral", r) == {
        "kv_cache_free_gpu_memory_fraction": r.kv_cache_free_gpu_mem_fraction,
        "enable_chunked_context": r.enable_chunked_context,
        "kv_cache_enable_block_reuse": r.enable_kv_cache_reuse,
        "cuda_graph_mode": r.cuda_graph_mode,
        "max_attention_window_size": [TINY_SLIDING_WINDOW],
    }
    assert runner_options(tmp_path / "mistral", None) == {"max_attention_window_size": [TINY_SLIDING_WINDOW]}
    (tmp_path / "qwen").mkdir()
    assert record_runtime(qwen, tmp_path / "qwen") == {"max_attention_window_size": None}
    assert "max_attention_window_size" not in runner_options(tmp_path / "qwen", qwen.runtime)
    assert runner_options(tmp_path, None) == {}  # an engine directory built before the window was recorded


def test_config_keys_transformers_defaults_are_checked_against_the_defaults(built, tmp_path):
    """A config.json without rms_norm_eps / max_position_embeddings is checked against the values the loaded
    model has (transformers' defaults), not a KeyError."""
    from transformers import Qwen2Config

    root = built[("Qwen2ForCausalLM", "none-tp2")]
    hf_dir = tmp_path / "hf"
    shutil.copytree(root / "out" / "import", hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    keys = {"max_position_embeddings": "max_position_embeddings", "norm_epsilon": "rms_norm_eps"}
    saved = {key: config.pop(key) for key in keys.values()}
    (hf_dir / "config.json").write_text(json.dumps(config))
    checkpoint = root / "out" / "export" / "trtllm_checkpoint"
    defaults = Qwen2Config()
    assert check_checkpoint(checkpoint, hf_dir, load_config(root / "gpu.yaml")) == [
        f"config.json: {ckpt_key} is {saved[key]!r}, the model's value is {getattr(defaults, key)!r}"
        for ckpt_key, key in keys.items()
        if saved[key] != getattr(defaults, key)
    ]


@pytest.mark.parametrize(
    ("arch", "release", "why"),
    [
        (
            "Qwen3ForCausalLM",
            "0.19",
            "has no class for it (MODEL_MAP in tensorrt_llm/models/__init__.py @ a copy of unknown commit",
        ),
        ("Qwen3ForCausalLM", "0.19", "0.20 added one (QWenForCausalLM; docs/source/release-notes.md"),
        (
            "Qwen3ForCausalLM",
            "1.2",
            "MODEL_MAP maps it to QWenForCausalLM, but this pipeline checks and references only the LlamaForCausalLM, "
            "MistralForCausalLM, Qwen2ForCausalLM checkpoint layouts of the engine workflow: it does not check or "
            "reference Qwen3's per-head q/k RMSNorm tensors",
        ),
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
