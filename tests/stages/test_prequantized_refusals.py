"""What an already-quantized checkpoint may not hold, each refused naming the file, the field or tensor and the fix
(issue #45): a NaN in a tensor (the build stops at import, before the quality gate would score NaN), a
quantization_config field of the wrong type or value (validate names it instead of a traceback, build instead of a
ZeroDivisionError), a g_idx of the wrong length (named as g_idx, not as qweight)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pipeline.errors import CheckpointError
from pipeline.prequantized import CheckpointQuantization, QuantizedLinear, detect
from pipeline.prequantized_packing import unpack
from tests.conftest import run_cli, write_config
from tests.prequantized_checkpoints import pack, rtn_linears, write_checkpoint

Q_PROJ_SCALES = "model.layers.0.self_attn.q_proj.scales"


@pytest.fixture(scope="module")
def gptq(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama as an int4 GPTQ (v1, group 32) checkpoint."""
    linears = rtn_linears(load_file(tiny_llama / "model.safetensors"), 4, 32, symmetric=False)
    out = tmp_path_factory.mktemp("gptq") / "model"
    return write_checkpoint(tiny_llama, out, linears, "gptq_v1", 4, 32, desc_act=False, symmetric=False)


def copy_of(checkpoint: Path, out: Path, config_changes: dict | None = None, tensors=None) -> Path:
    """`checkpoint` in `out`, its quantization_config updated by `config_changes` (a non-dict replaces it) and each
    tensor passed through `tensors(name, value)`."""
    out.mkdir()
    for file in checkpoint.iterdir():
        if file.suffix == ".safetensors":
            state = load_file(file)
            save_file(
                {name: tensors(name, value) if tensors else value for name, value in state.items()}, out / file.name
            )
        else:
            (out / file.name).write_bytes(file.read_bytes())
    if config_changes is not None:
        config = json.loads((out / "config.json").read_text())
        block = config["quantization_config"]
        config["quantization_config"] = (
            {**block, **config_changes} if isinstance(config_changes, dict) else config_changes
        )
        (out / "config.json").write_text(json.dumps(config))
    return out


def config(path: Path, model: Path) -> Path:
    return write_config(
        path,
        f"""
        model: {{source: hf, path: {model}}}
        quantization: {{weights: int4, method: gptq, group_size: 32}}
        build: {{max_input_len: 64, max_seq_len: 128}}
        verify: {{eval_tokens: 128, max_perplexity_increase: 0.5}}
        """,
    )


def one_nan(name: str, value: np.ndarray) -> np.ndarray:
    if name == Q_PROJ_SCALES:
        value = value.copy()
        value[0, 3] = np.nan
    return value


def test_a_nan_scale_stops_the_build_at_import_naming_file_and_tensor(gptq, tmp_path):
    """Issue #45 item 3: one NaN in q_proj.scales used to build with exit 0 and pass verify with every score NaN."""
    model = copy_of(gptq, tmp_path / "nan", tensors=one_nan)
    result = run_cli("build", str(config(tmp_path / "nan.yaml", model)), "--output", str(tmp_path / "out"))
    output = result.stdout + result.stderr
    assert result.returncode == 3, output  # StageError: the import stage
    assert "stage 'import' failed" in output
    assert f"{model / 'model.safetensors'}: {Q_PROJ_SCALES} holds NaN (first at [0, 3]; 1 of" in " ".join(
        output.split()
    )
    assert "Download the checkpoint again" in " ".join(output.split())
    assert not (tmp_path / "out" / "engine").exists()


def test_past_the_import_check_the_export_check_names_the_nan_logits(gptq, tmp_path, monkeypatch):
    """Defence in depth: with the import's check gone, the export's logits check (which NaN passed: max(0.0, nan) is
    0.0) stops the build, naming the first NaN logit."""
    from pipeline import prequantized_packing

    monkeypatch.setattr(prequantized_packing, "_refuse_nonfinite", lambda *args: None)
    model = copy_of(gptq, tmp_path / "nan", tensors=one_nan)
    result = run_cli("build", str(config(tmp_path / "nan.yaml", model)), "--output", str(tmp_path / "out"))
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 3, output
    # transformers' SDPA attention hides the NaN weight; ONNX Runtime's logits show it, and the weight is named
    assert "stage 'export' failed: ONNX Runtime's logits are NaN at check prompt 0" in output
    imported = tmp_path / "out" / "import" / "model.safetensors"
    assert (
        f"the imported checkpoint is the cause: {imported}: model.layers.0.self_attn.q_proj.weight holds NaN" in output
    )


@pytest.mark.parametrize(
    "changes,named",
    [
        ({"group_size": 0}, "quantization_config.group_size is 0, expected the input rows per group of scales"),
        ({"group_size": "abc"}, "quantization_config.group_size is 'abc', expected the input rows per group"),
        ({"desc_act": "false"}, "quantization_config.desc_act is 'false', expected true or false (a JSON boolean"),
        ({"sym": 1, "bits": "4"}, "quantization_config.bits is '4', expected 4 or 8"),
        ("gptq", "quantization_config is 'gptq': expected an object (quant_method, bits, group_size, ...)"),
        ([4, 128], "quantization_config is [4, 128]: expected an object"),
    ],
    ids=["group_size-0", "group_size-abc", "desc_act-string", "bits-string", "string", "list"],
)
def test_validate_names_each_unreadable_quantization_config_field(gptq, tmp_path, changes, named):
    """Issue #45 items 9 and 12: these ended validate with a traceback (ValueError, AttributeError), or passed it
    (group_size 0: a ZeroDivisionError in build; desc_act "false": read as true)."""
    model = copy_of(gptq, tmp_path / "model", config_changes=changes)
    result = run_cli("validate", str(config(tmp_path / "c.yaml", model)))
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output  # ConfigError, no traceback
    assert "Traceback" not in output
    assert f"{model / 'config.json'}: {named}" in output
    assert "Correct the quantization_config" in output or "remove the key" in output


def test_every_packing_field_is_checked_by_type_and_value(tmp_path):
    """AWQ's and compressed-tensors' blocks too; names are compared case-insensitively, as their libraries do."""
    cases = [
        ({"quant_method": "awq", "bits": 4, "group_size": 0, "version": "GEMM"}, "group_size is 0"),
        ({"quant_method": "awq", "zero_point": "true"}, "zero_point is 'true', expected true or false"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": ["g"]},
            "config_groups is ['g'], expected an object holding one scheme",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "GROUP", "symmetric": "false"}}},
            },
            "config_groups.g.weights.symmetric is 'false', expected true or false",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "group"}}},
            },
            "config_groups.g.weights.group_size is None with strategy group; expected a positive group size",
        ),
    ]
    for block, named in cases:
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": block}))
        with pytest.raises(CheckpointError, match="quantization_config") as error:
            detect(tmp_path)
        assert named in str(error.value), block
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "awq", "version": "GEMM"}})
    )
    assert detect(tmp_path) == CheckpointQuantization("awq", "awq_gemm", 4, 128, False, False)


def test_a_g_idx_of_the_wrong_length_is_named_as_g_idx():
    """Issue #45 item 12: a g_idx one word short was reported as "qweight: expected int32 [7, 16], found [8, 16]"."""
    rng = np.random.default_rng(0)
    linear = QuantizedLinear(
        rng.integers(0, 16, (16, 64), dtype=np.uint8),
        rng.random((16, 2)).astype(np.float16),
        rng.integers(0, 16, (16, 2), dtype=np.uint8),
        None,
        4,
        32,
    )
    tensors = pack(linear, "gptq_v2")
    tensors["g_idx"] = tensors["g_idx"][:-8]
    q = CheckpointQuantization("gptq", "gptq_v2", 4, 32, False, False)
    with pytest.raises(CheckpointError) as error:
        unpack(tensors, q, "model.layers.0.self_attn.q_proj")
    assert str(error.value) == (
        "model.layers.0.self_attn.q_proj.g_idx: expected 64 entries (one per input row: qweight int32 [8, 16]), "
        "found 56"
    )
