"""The trtllm target's rules for checkpoints already quantized (GPTQ, AWQ, compressed-tensors): which release and
backend loads which as it is (upstream/trtllm_prequantized.json), and the safetensors checks, on tiny checkpoints
written here (a config.json and random packed tensors of a 2-layer Llama); and a kept GPTQ checkpoint built by the
real CLI on the engine workflow, which stops at export with the release's convert_checkpoint.py command."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.prequantized import CheckpointQuantization, detect
from pipeline.targets.trtllm import prequantized as pq
from pipeline.upstream import facts
from tests.conftest import run_cli, write_config
from tests.prequantized_checkpoints import rtn_linears
from tests.prequantized_checkpoints import write_checkpoint as write_packed

HIDDEN, INTER, LAYERS = 64, 128, 2
SHAPES = {  # module -> (in, out)
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN, HIDDEN),
    "self_attn.v_proj": (HIDDEN, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTER),
    "mlp.up_proj": (HIDDEN, INTER),
    "mlp.down_proj": (INTER, HIDDEN),
}
BLOCKS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
}


def write_checkpoint(path: Path, method: str, **block_changes) -> Path:
    """A 2-layer Llama with every linear packed as `method` packs it (values random: only names, dtypes and shapes
    matter here)."""
    path.mkdir(parents=True, exist_ok=True)
    block = BLOCKS[method] | block_changes
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "num_hidden_layers": LAYERS}
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": block}))
    rng, group, words = np.random.default_rng(0), block["group_size"], 32 // block["bits"]
    tensors = {
        "model.embed_tokens.weight": np.zeros((32, HIDDEN), np.float16),
        "model.norm.weight": np.ones(HIDDEN, np.float16),
        "lm_head.weight": np.zeros((32, HIDDEN), np.float16),
    }
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = np.ones(HIDDEN, np.float16)
        tensors[prefix + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float16)
        for module, (rows, cols) in SHAPES.items():
            packed = (rows // words, cols) if method == "gptq" else (rows, cols // words)
            name = prefix + module
            tensors[name + ".qweight"] = rng.integers(0, 2**31, packed, dtype=np.int32)
            tensors[name + ".qzeros"] = rng.integers(0, 2**31, (rows // group, cols // words), dtype=np.int32)
            tensors[name + ".scales"] = rng.random((rows // group, cols)).astype(np.float16)
            if method == "gptq":
                tensors[name + ".g_idx"] = (np.arange(rows) // group).astype(np.int32)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def config(backend: str, release: str, method: str = "awq", keep: str = "keep"):
    """The fields config_problems reads, as a BuildConfig holds them."""
    quantization = SimpleNamespace(method=method, checkpoint_quantization=keep, kv_cache="none", modelopt_recipe=None)
    target = SimpleNamespace(trtllm_backend=backend, trtllm_version=release)
    return SimpleNamespace(quantization=quantization, target=target)


GPTQ = CheckpointQuantization("gptq", "gptq_v1", 4, 128, False, True)


@pytest.mark.parametrize("release", ["1.0", "1.1", "1.2"])
@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_the_pytorch_backend_loads_none_of_them(release, method):
    detected = CheckpointQuantization(method, "pack_quantized" if method[0] == "c" else "gptq_v1", 4, 128, False, True)
    problems = pq.config_problems(config("pytorch", release, method="awq"), detected)
    [(loc, message)] = problems
    assert loc == ("quantization", "checkpoint_quantization")
    assert f"TensorRT-LLM {release}'s pytorch backend" in message
    assert "NVIDIA/TensorRT-LLM tensorrt_llm/" in message and "dequantize with method: awq" in message


@pytest.mark.parametrize("release", ["0.19", "1.2"])
def test_the_engine_workflow_loads_gptq_v1_and_autoawq(release):
    assert pq.config_problems(config("tensorrt", release, method="gptq"), GPTQ) == []
    awq = CheckpointQuantization("awq", "awq_gemm", 4, 128, False, False)
    assert pq.config_problems(config("tensorrt", release), awq) == []


@pytest.mark.parametrize(
    ("detected", "words"),
    [
        (CheckpointQuantization("gptq", "gptq_v1", 8, 128, False, True), "4-bit weights only"),
        (CheckpointQuantization("gptq", "gptq_v1", 4, 128, True, True), "act-order"),
        (CheckpointQuantization("gptq", "gptq_v2", 4, 128, False, True), "gptq_v1 packing"),
        (CheckpointQuantization("compressed-tensors", "pack_quantized", 4, 128, False, True), "compressed-tensors"),
    ],
)
def test_what_the_engine_workflow_refuses_is_named_with_its_source(detected, words):
    [(_, message)] = pq.config_problems(config("tensorrt", "1.2", method=detected.method), detected)
    assert words in message and "convert_checkpoint.py@368f8f2ade00" in message and "ModelOpt AWQ" in message


def test_method_gptq_is_refused_without_a_gptq_checkpoint_kept():
    for detected, keep in ((None, "keep"), (GPTQ, "dequantize")):
        [(loc, message)] = pq.config_problems(config("tensorrt", "1.2", method="gptq", keep=keep), detected)
        assert loc == ("quantization", "method") and "onnxruntime" in message
    assert pq.config_problems(config("tensorrt", "1.2", method="awq", keep="dequantize"), GPTQ) == []


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_conforming_checkpoint_has_no_tensor_problems(tmp_path, method):
    hf_dir = write_checkpoint(tmp_path / method, method)
    detected = detect(hf_dir)
    assert pq.tensor_problems(hf_dir, detected, "1.2", "tensorrt") == []


def test_tensor_problems_name_each_nonconformity(tmp_path):
    hf_dir = write_checkpoint(tmp_path / "gptq", "gptq")
    detected = detect(hf_dir)
    from safetensors.numpy import load_file

    tensors = load_file(str(hf_dir / "model.safetensors"))
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):  # a linear the checkpoint left in float
        del tensors[f"model.layers.1.mlp.down_proj.{suffix}"]
    tensors["model.layers.1.mlp.down_proj.weight"] = np.zeros((HIDDEN, INTER), np.float16)
    del tensors["model.layers.0.self_attn.k_proj.qzeros"]
    tensors["model.layers.0.mlp.up_proj.qweight"] = tensors["model.layers.0.mlp.up_proj.qweight"].view(np.float32)
    tensors["model.layers.1.self_attn.q_proj.scales"] = np.zeros((1, HIDDEN), np.float16)
    del tensors["model.norm.weight"]
    save_file(tensors, str(hf_dir / "model.safetensors"))
    problems = pq.tensor_problems(hf_dir, detected, "1.2", "tensorrt")
    assert any("k_proj.qzeros missing" in p for p in problems)
    assert any("up_proj.qweight is F32" in p for p in problems)
    assert any("q_proj.scales has shape [1, 64]" in p for p in problems)
    assert any("layers.1.mlp.down_proj is left unquantized" in p for p in problems)
    assert any("model.norm.weight missing" in p for p in problems)
    assert len(problems) == 5
    assert "does not load" in pq.tensor_problems(hf_dir, detected, "1.2", "pytorch")[0]


# ---------------------------------------------------------------- a kept checkpoint built by the CLI


@pytest.fixture(scope="module")
def gptq_llama(tmp_path_factory, tiny_llama) -> Path:
    """tiny_llama with every linear round-to-nearest quantized and packed as GPTQ v1 (4-bit, groups of 32)."""
    from safetensors.numpy import load_file

    linears = rtn_linears(load_file(tiny_llama / "model.safetensors"), bits=4, group_size=32, symmetric=True)
    out = tmp_path_factory.mktemp("gptq-llama") / "model"
    return write_packed(tiny_llama, out, linears, "gptq_v1", bits=4, group_size=32, desc_act=False, symmetric=True)


def kept_config(path: Path, model: Path, backend: str = "tensorrt", release: str = "1.2", extra: str = "") -> Path:
    return write_config(
        path,
        f"""
        model: {{source: hf, path: {model}}}
        target: {{name: trtllm, trtllm_backend: {backend}, trtllm_version: "{release}"}}
        quantization: {{weights: int4, method: gptq, group_size: 32, checkpoint_quantization: keep{extra}}}
        build: {{max_input_len: 256, max_seq_len: 512, max_num_tokens: 1024}}
    """,
    )


def test_the_converter_command_uses_only_tabulated_flags():
    converter = facts("trtllm_prequantized")["releases"]["1.2"]["tensorrt"]["gptq"]["converter"]
    assert converter["quantization_from_checkpoint_config"] and len(converter["source"]["commit"]) == 40
    cfg = SimpleNamespace(
        target=SimpleNamespace(trtllm_version="1.2"),
        parallel=SimpleNamespace(tp_size=2, pp_size=1),
        model=SimpleNamespace(dtype="float16"),  # auto reads the kept checkpoint (tests/targets/test_trtllm_dtypes.py)
    )
    command = pq.converter_command(cfg, GPTQ, Path("/in"), Path("/out"))
    assert command[:2] == ["python3", converter["script"]]
    flags = dict(arg[2:].split("=", 1) for arg in command[2:])
    assert set(flags) <= set(converter["arguments"])
    assert flags == {
        "model_dir": "/in",
        "output_dir": "/out",
        "dtype": "float16",
        "tp_size": "2",
        "pp_size": "1",
        "workers": "2",
    }
    assert flags["dtype"] in converter["arguments"]["dtype"]["choices"]


def test_a_kept_gptq_checkpoint_stops_at_export_with_the_converter_command(tmp_path, gptq_llama):
    config, out = kept_config(tmp_path / "kept.yaml", gptq_llama), tmp_path / "out"
    result = run_cli("build", str(config), "--output", str(out))
    assert result.returncode == 4, result.stdout + result.stderr  # TargetUnavailable
    message = " ".join(result.stderr.split())
    quantized = out.resolve() / "import" / "quantized"
    assert (quantized / "config.json").is_file() and (out / "import" / "config.json").is_file()  # import ran
    assert "the checkpoint is already quantized" in result.stdout  # quantize skipped
    script = facts("trtllm_prequantized")["releases"]["1.2"]["tensorrt"]["gptq"]["converter"]["script"]
    assert (
        f"python3 {script} --model_dir={quantized} --output_dir={out.resolve() / 'export' / 'trtllm_checkpoint'}"
        in (message)
    )
    assert f"trtllm-build --checkpoint_dir={out.resolve() / 'export' / 'trtllm_checkpoint'}" in message
    assert "conform" in message and "TensorRT-LLM 1.2" in message
    assert not (out / "export").exists() and not (out / "quantize").exists()  # nothing faked


def test_a_kept_checkpoint_whose_tensors_do_not_conform_stops_with_them_named(tmp_path, gptq_llama):
    import shutil

    from safetensors.numpy import load_file

    model = tmp_path / "spoilt"
    shutil.copytree(gptq_llama, model)
    tensors = load_file(model / "model.safetensors")
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):  # a linear left in float: the loader reads it packed
        del tensors[f"model.layers.1.mlp.down_proj.{suffix}"]
    tensors["model.layers.1.mlp.down_proj.weight"] = np.zeros((HIDDEN, INTER), np.float32)
    save_file(tensors, str(model / "model.safetensors"), {"format": "pt"})
    result = run_cli("build", str(kept_config(tmp_path / "kept.yaml", model)), "--output", str(tmp_path / "out"))
    assert result.returncode not in (0, 4), result.stdout + result.stderr
    message = " ".join((result.stdout + result.stderr).split())
    assert "stage 'export' failed" in message and "layers.1.mlp.down_proj is left unquantized" in message


def test_validate_refuses_a_kept_checkpoint_on_the_pytorch_backend(tmp_path, gptq_llama):
    result = run_cli("validate", str(kept_config(tmp_path / "kept.yaml", gptq_llama, backend="pytorch")))
    assert result.returncode != 0
    message = " ".join((result.stdout + result.stderr).split())
    assert "TensorRT-LLM 1.2's pytorch backend does not load" in message and "dequantize" in message


def test_a_kept_checkpoint_takes_no_calibration_but_refuses_modelopt_options(tmp_path, gptq_llama):
    assert run_cli("validate", str(kept_config(tmp_path / "a.yaml", gptq_llama))).returncode == 0
    result = run_cli("validate", str(kept_config(tmp_path / "b.yaml", gptq_llama, extra=", kv_cache: fp8")))
    assert result.returncode != 0 and "needs ModelOpt calibration" in " ".join(
        result.stdout.split() + result.stderr.split()
    )
