"""The trtllm quantize stage's output is ModelOpt's quantizer state, not a copy of the weights: restored onto the
imported checkpoint in its own dtype, it gives back the calibrated quantizers and exports the same checkpoints, byte
for byte, as the calibrated model itself (what `mto.save` / `mto.restore` of the whole model exported before)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.targets.trtllm.modelopt import (
    QUANTIZER_BUFFERS,
    REWRITTEN_WEIGHTS,
    STATE_FILE,
    calibrate,
    export_checkpoints,
    load_calibrated,
    quiet_modelopt,
    save_calibrated,
)

CASES = {  # the presets that fold a pre_quant_scale into the weights (SmoothQuant, AWQ) and one that does not
    "fp8-fp8kv": {"weights": "fp8", "method": "rtn", "kv_cache": "fp8"},
    "int8-smoothquant": {"weights": "int8", "method": "smoothquant", "kv_cache": "none"},
    "int4-awq": {"weights": "int4", "method": "awq", "kv_cache": "none"},
}
WORDS = " ".join(f"w{(i * 37) % 250}" for i in range(4000))  # the tiny tokenizer's words, in a fixed order


def calibrated(hf_dir: Path, case: str):
    q = SimpleNamespace(
        **CASES[case],
        group_size=32,
        exclude_modules=[],
        modelopt_recipe=None,
        calibration=SimpleNamespace(num_samples=4, seq_len=32),
    )
    return calibrate(hf_dir, q, WORDS, lambda items, *_, **__: items)


def quantizer_buffers(model) -> dict[str, torch.Tensor]:
    return {name: buffer.clone() for name, buffer in model.named_buffers() if "_quantizer." in name}


def tensors_in(value, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested dict / list, by its path of keys."""
    if isinstance(value, torch.Tensor):
        return {path: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    return {name: t for key, item in items for name, t in tensors_in(item, f"{path}/{key}").items()}


def exported(model, out: Path) -> dict[str, bytes]:
    with quiet_modelopt():
        export_checkpoints(model, out, "float16", 1, 1, None, "0.19")
    return {str(file.relative_to(out)): file.read_bytes() for file in sorted(out.rglob("*")) if file.is_file()}


@pytest.fixture(scope="module")
def bf16_llama(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama stored in bfloat16, as the import stage keeps a bfloat16 checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-llama-bf16")
    AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(out)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_quantize_holds_the_quantizer_state_only_and_restores_what_calibration_made(tiny_llama, tmp_path, case):
    model = calibrated(tiny_llama, case)
    buffers = quantizer_buffers(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert save_calibrated(model, tiny_llama, tmp_path) == 0  # every weight comes back from the import
    (saved,) = tmp_path.iterdir()
    assert saved.name == STATE_FILE and saved.stat().st_size < weight_bytes / 4
    state = torch.load(saved, weights_only=False)
    assert state[REWRITTEN_WEIGHTS] == {}
    tensors = tensors_in(state)  # amax, pre_quant_scale, SmoothQuant's activation maxima: a quantizer's, each
    assert any(path.startswith(f"/{QUANTIZER_BUFFERS}/") for path in tensors)
    assert all(re.search(r"_quantizer(\.\d+)?/_\w+$", path) for path in tensors), list(tensors)

    before = exported(model, tmp_path / "calibrated")  # what the whole calibrated model exports
    restored = load_calibrated(tiny_llama, tmp_path)
    assert {p.dtype for p in restored.parameters()} == {torch.float32}  # the import's dtype
    after_buffers = quantizer_buffers(restored)
    assert after_buffers.keys() == buffers.keys() and any(name.endswith("_amax") for name in buffers)
    assert all(torch.equal(after_buffers[name], buffers[name]) for name in buffers)
    assert exported(restored, tmp_path / "restored") == before


@pytest.mark.parametrize("case", ["int8-smoothquant"])
def test_a_bfloat16_import_is_restored_in_bfloat16(bf16_llama, tmp_path, case):
    """Calibration runs in float32; the export restores onto the bfloat16 weights as stored, the smoothed ones as
    the calibrated float32 weights rounded to bfloat16."""
    model = calibrated(bf16_llama, case)
    assert save_calibrated(model, bf16_llama, tmp_path) == 0
    restored = load_calibrated(bf16_llama, tmp_path)
    assert {p.dtype for p in restored.parameters()} == {torch.bfloat16}
    calibrated_weights = dict(model.named_parameters())
    for name, parameter in restored.named_parameters():
        assert torch.equal(parameter, calibrated_weights[name].to(torch.bfloat16)), name
    buffers, after = quantizer_buffers(model), quantizer_buffers(restored)
    assert after.keys() == buffers.keys() and all(torch.equal(after[n], buffers[n]) for n in buffers)


def test_a_weight_calibration_rewrote_is_kept(tiny_llama, tmp_path):
    """An algorithm that changes weights otherwise than by a pre_quant_scale (a recipe's) still exports what it
    calibrated: that weight, and only it, is kept beside the quantizer state."""
    model = calibrated(tiny_llama, "fp8-fp8kv")
    name = "model.layers.0.mlp.down_proj.weight"
    with torch.no_grad():
        model.get_parameter(name).mul_(0.5)
    assert save_calibrated(model, tiny_llama, tmp_path) == 1
    restored = load_calibrated(tiny_llama, tmp_path)
    assert torch.equal(restored.get_parameter(name), model.get_parameter(name))


def test_the_exported_model_is_freed(tiny_llama, tmp_path):
    """In a fresh process (where ModelOpt is first imported by the export, as in a build), the model is gone once the
    export drops it: pulp, which ModelOpt imports, keeps the frames that imported it (`import_modelopt`)."""
    import subprocess
    import sys

    script = f"""
import gc, weakref
from pathlib import Path
from pipeline.targets.trtllm.modelopt import export_checkpoints, load_calibrated, quiet_modelopt
model = load_calibrated(Path({str(tiny_llama)!r}), None)
with quiet_modelopt():
    export_checkpoints(model, Path({str(tmp_path)!r}), "float16", 1, 1, None, "0.19")
alive = weakref.ref(model)
del model
gc.collect()
print("alive" if alive() else "freed")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.stdout.strip().splitlines()[-1:] == ["freed"], result.stdout + result.stderr
