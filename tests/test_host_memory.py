"""The host-memory plan (`pipeline.host_memory`): each stage's predicted peak and disk from the checkpoint's headers,
printed by `plan` and `build`, and the preflight that stops a stage this machine cannot hold with exit 4."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import NotEnoughMemory, PipelineError
from pipeline.host_memory import (
    AVAILABLE_MEMORY_ENV,
    Prediction,
    available_memory,
    check_fits,
    checkpoint_shape,
    parse_size,
    predict,
)
from pipeline.memory import GiB, MiB, parameter_counts
from pipeline.models import BUILTIN_MODELS
from pipeline.validation import load_config
from tests.conftest import llama_shape, run_cli, write_config

SMOLLM2 = BUILTIN_MODELS["smollm2-135m-instruct"].facts
SMOLLM2_PARAMETERS = sum(parameter_counts(SMOLLM2))  # tied embeddings: the table counts once


def test_the_default_build_is_predicted_without_a_download():
    predictions = predict(load_config("build_configs/smollm2-135m-cpu.yaml"))
    assert {"import", "export", "engine", "triton_repo"} <= predictions.keys()
    assert "quantize" not in predictions  # the onnxruntime target quantizes in the engine stage
    # what the default build wrote on 2026-11-28: import/model.safetensors 538,090,408 bytes (float32),
    # export/model.onnx.data 653,403,392 (the table and the lm_head apart), engine/model.onnx.data 265,285,376
    assert predictions["import"].disk_bytes == 4 * SMOLLM2_PARAMETERS == pytest.approx(538_090_408, rel=0.01)
    export_table_and_head = 4 * (SMOLLM2_PARAMETERS + SMOLLM2.vocab_size * SMOLLM2.hidden_size)
    assert predictions["export"].disk_bytes == export_table_and_head == pytest.approx(653_403_392, rel=0.01)
    assert predictions["engine"].disk_bytes == pytest.approx(265_285_376, rel=0.05)
    # the targets once the stages stream: what only converts and writes weights within 0.5 B/param + 1.5 GiB,
    # what runs a model (the export's check, the engine's calibration and gate) within one float32 copy + 1.5 GiB
    assert predictions["import"].host_bytes <= 0.5 * SMOLLM2_PARAMETERS + 1.5 * GiB
    for stage in ("export", "engine"):
        assert 4 * SMOLLM2_PARAMETERS < predictions[stage].host_bytes <= 4 * SMOLLM2_PARAMETERS + 1.5 * GiB


def write_float16_llama(path: Path, layers: int = 2, hidden: int = 64, intermediate: int = 128, vocab: int = 256):
    """A float16 Llama checkpoint's config.json and safetensors (zeros: only the headers are read)."""
    from safetensors.numpy import save_file

    path.mkdir()
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="float16",
    )
    (path / "config.json").write_text(json.dumps(config))
    kv = 2 * hidden // 4
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        shapes |= {
            f"{prefix}self_attn.q_proj.weight": (hidden, hidden),
            f"{prefix}self_attn.k_proj.weight": (kv, hidden),
            f"{prefix}self_attn.v_proj.weight": (kv, hidden),
            f"{prefix}self_attn.o_proj.weight": (hidden, hidden),
            f"{prefix}mlp.gate_proj.weight": (intermediate, hidden),
            f"{prefix}mlp.up_proj.weight": (intermediate, hidden),
            f"{prefix}mlp.down_proj.weight": (hidden, intermediate),
        }
    save_file({name: np.zeros(shape, np.float16) for name, shape in shapes.items()}, path / "model.safetensors")
    return sum(int(np.prod(shape)) for shape in shapes.values())


def test_a_float16_checkpoint_is_read_from_its_headers(tmp_path):
    elements = write_float16_llama(tmp_path / "ckpt")
    config = write_config(tmp_path / "c.yaml", f"model: {{source: hf, path: {tmp_path / 'ckpt'}}}\n")
    shape = checkpoint_shape(load_config(config))
    assert (shape.parameters, shape.checkpoint_bytes, shape.compute_bytes) == (elements, 2 * elements, 2)
    assert shape.largest_tensor == 256 * 64 and not shape.tied  # the embedding table (and the untied lm_head)
    # import keeps the checkpoint's own dtype on disk; model.dtype names the dtype computed in
    as_float32 = load_config(config, ["model.dtype=float32"])
    assert predict(as_float32)["import"].disk_bytes == 2 * elements
    assert checkpoint_shape(as_float32).compute_bytes == 4


def test_an_8b_trtllm_export_peaks_at_the_gates_float32_forwards(tmp_path):
    """The gate's two models, one at a time: the transformers reference (verify.reference_dtype) and the checkpoint's
    reference forward, which dequantizes to float32 whatever that says."""
    cfg = load_config("build_configs/llama-3.1-8b-fp8-h100.yaml", [f"model.path={llama_shape(tmp_path, '8b')}"])
    parameters = checkpoint_shape(cfg).parameters
    assert parameters == pytest.approx(8.03e9, rel=0.01)  # Llama 3.1 8B: untied lm_head
    predictions = predict(cfg)
    export = predictions["export"]
    assert "checkpoint, dequantized to float32" in export.peak
    # one float32 model, a window's activations and logits over 128K tokens, and what bench scale measured beyond them
    assert 4 * parameters < export.host_bytes < 5.5 * parameters
    # calibration holds one model in its dtype (config.json alone: float32 assumed) and writes quantizer state only
    assert predictions["quantize"].host_bytes < export.host_bytes and predictions["quantize"].disk_bytes < 64 * MiB
    assert predictions["export"].disk_bytes == pytest.approx(8.5 * GiB, rel=0.1)  # fp8 layers, 16-bit tables

    export = Prediction(export.host_bytes, export.disk_bytes, "verify.reference_dtype=bfloat16", "the reference")
    with pytest.raises(NotEnoughMemory) as refused:
        check_fits("export", export, 16 * GiB)
    message = str(refused.value)
    assert f"stage 'export' would need about {export.host_bytes / GiB:.2f} GiB" in message
    assert "16.00 GiB available" in message and "verify.reference_dtype=bfloat16 lowers it" in message
    assert "--ignore-memory-check" in message
    check_fits("export", export, export.host_bytes)  # fits exactly: no error


def test_modelopt_calibration_memory_follows_the_calibration_sequence_length():
    long, short = (
        predict(load_config("build_configs/smollm2-135m-fp8.yaml", [f"quantization.calibration.seq_len={n}"]))
        for n in (2048, 128)
    )
    assert long["quantize"].lowered_by == "a smaller quantization.calibration.seq_len"
    assert long["quantize"].host_bytes > short["quantize"].host_bytes
    assert "a smaller quantization.calibration.seq_len lowers it" in message_of(long["quantize"])


def message_of(prediction) -> str:
    with pytest.raises(NotEnoughMemory) as refused:
        check_fits("quantize", prediction, 1)
    return str(refused.value)


@pytest.mark.parametrize(
    ("text", "size"),
    [("1MiB", MiB), ("16 GiB", 16 * GiB), ("512MB", 512 * 10**6), ("4096", 4096), ("1.5GiB", 1.5 * GiB)],
)
def test_sizes_are_read_as_written(text, size):
    assert parse_size(text) == size


def test_the_available_memory_override_is_read_and_a_bad_one_refused(monkeypatch):
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "3GiB")
    assert available_memory() == 3 * GiB
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "lots")
    with pytest.raises(PipelineError, match="is not a size such as 512MiB"):
        available_memory()
    monkeypatch.delenv(AVAILABLE_MEMORY_ENV)
    assert 0 < available_memory()


def test_plan_prints_each_running_stage_and_flags_what_would_not_fit(tmp_path):
    result = run_cli(
        "plan",
        "build_configs/smollm2-135m-cpu.yaml",
        "--output",
        str(tmp_path / "out"),
        env={AVAILABLE_MEMORY_ENV: "0.8GiB"},
    )
    assert result.returncode == 0, result.stderr
    lines = {line.split(":")[0].strip(): line for line in result.stdout.splitlines() if "peak host memory" in line}
    assert set(lines) == {"import", "export", "engine", "triton_repo"}
    assert "819 MiB of host memory available here" in result.stdout
    assert "would stop here (exit 4)" in lines["export"] and "would stop here" not in lines["triton_repo"]


def test_the_gpu_memory_plan_no_longer_prints_the_old_conversion_estimate(tmp_path):
    result = run_cli("plan", "build_configs/smollm2-135m-fp8.yaml", "--output", str(tmp_path / "out"))
    out = " ".join(result.stdout.split())
    assert result.returncode == 0 and "full-length sequences" in out  # the GPU plan stays
    assert "ModelOpt conversion" not in out and "quantize: peak host memory" in out


def tiny_build(tmp_path: Path, tiny_llama: Path) -> tuple[Path, Path]:
    return write_config(tmp_path / "tiny.yaml", f"model: {{source: hf, path: {tiny_llama}}}\n"), tmp_path / "out"


def test_build_stops_before_a_stage_this_machine_cannot_hold(tmp_path, tiny_llama):
    config, output = tiny_build(tmp_path, tiny_llama)
    result = run_cli("build", str(config), "--output", str(output), env={AVAILABLE_MEMORY_ENV: "1MiB"})
    message = " ".join(result.stderr.split())
    assert result.returncode == 4, result.stdout + result.stderr
    assert "stage 'import' would need about" in message and "but this machine has 1 MiB available" in message
    assert "--ignore-memory-check" in message
    assert not (output / "import").exists() and not list(output.glob(".tmp-import-*"))  # it never started


def test_ignore_memory_check_runs_the_stage_anyway(tmp_path, tiny_llama, cli_build):
    config, output = tiny_build(tmp_path, tiny_llama)
    args = (str(config), "--output", str(output), "--until", "import", "--ignore-memory-check")
    result = cli_build(*args, env={AVAILABLE_MEMORY_ENV: "1MiB"})
    assert result.returncode == 0, result.stderr
    assert (output / "import" / "config.json").is_file()
    assert "import: predicted peak host memory" in " ".join(result.stdout.split())


def test_optimum_onnx_export_is_refused_above_its_size_naming_the_fused_graph(tmp_path):
    """optimum-onnx's export cannot stream: an 8B asking for it is refused by validate (and by the export stage for
    sources validate cannot size), pointing at the fused graph; the same config on a small model is accepted."""
    from pipeline.models import ModelFacts
    from pipeline.targets.onnxruntime.config_rules import optimum_too_large

    body = "model: {{source: hf, path: {path}}}\ntarget: {{onnx_graph: optimum}}\nquantization: {{weights: int8}}\n"
    config = write_config(tmp_path / "c.yaml", body.format(path=llama_shape(tmp_path, "8b")))
    with pytest.raises(PipelineError) as refused:
        load_config(config)
    message = str(refused.value)
    assert "target.onnx_graph" in message and "refused above 1B parameters; this checkpoint has 8.03B" in message
    assert "set target.onnx_graph: auto (the fused graph streams)" in message
    facts = ModelFacts.from_hf_config(json.loads((tmp_path / "8b" / "config.json").read_text()))
    assert "use target trtllm" in optimum_too_large(tmp_path / "8b", facts, "its family has no fused graph")
    small = write_float16_llama(tmp_path / "small")
    assert small and load_config(write_config(tmp_path / "s.yaml", body.format(path=tmp_path / "small")))


def test_an_already_quantized_checkpoint_is_planned_as_dequantized_one_tensor_at_a_time(tmp_path):
    """The import writes the float32 weights a GPTQ checkpoint stands for, one tensor at a time: its disk is four
    bytes a parameter, its peak the largest tensor read in its own dtype and made float32 beside it."""
    from safetensors.numpy import load_file

    from tests.prequantized_checkpoints import rtn_linears, write_checkpoint

    elements = write_float16_llama(tmp_path / "float")
    state = {
        name: value.astype(np.float32) for name, value in load_file(tmp_path / "float" / "model.safetensors").items()
    }
    write_checkpoint(
        tmp_path / "float", tmp_path / "gptq", rtn_linears(state, 4, 32, True), "gptq_v2", 4, 32, False, True
    )
    overrides = [f"model.path={tmp_path / 'gptq'}", "quantization.checkpoint_quantization=dequantize"]
    config = write_config(tmp_path / "c.yaml", "model: {source: hf, path: x}\n")
    prediction = predict(load_config(config, overrides))["import"]
    assert prediction.peak == "one tensor at a time, dequantized"
    assert prediction.disk_bytes == 4 * elements
    assert prediction.host_bytes == int(0.25 * GiB) + (2 + 4) * 256 * 64  # light libraries, the float16 table
