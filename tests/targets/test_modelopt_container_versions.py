"""The quantize stage under the ModelOpt a container's TensorRT-LLM pins, not only under ours.

NVIDIA's containers keep the ModelOpt their TensorRT-LLM was built with (1.1 and 1.2: nvidia-modelopt~=0.37.0,
tabulated in pipeline/upstream/triton_trtllm_images.json), whose presets hold `quant_cfg` as a dict; ours (0.47)
holds a list. `modelopt_config` writes the installed one's form: checked here on small presets of our own in both
forms, then for real: the real nvidia-modelopt 0.37.0 wheel (fetched from PyPI into the pipeline's cache, sha256
pinned, and put first on sys.path of a subprocess, never installed) calibrates, saves, restores and exports every
preset on a tiny Llama, and the image's quantize check passes under it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.errors import PipelineError
from pipeline.targets.trtllm import modelopt as ours
from pipeline.upstream import facts
from tests.conftest import REPO

# The wheels the 1.1/1.2 containers' ModelOpt line is (and torchprofile, which 0.37 imports and 0.47 no longer needs).
OLD_MODELOPT = {
    "nvidia-modelopt==0.37.0": "3490b6d6aea3541aa5d475d81230fee627e2c16ff47bbab1cba4b80a1eb119a2",
    "torchprofile==0.0.4": "7151fe88dc770f0eeec241244a4c7feaec2c5e8c7852386bc2d6a8d7dde7384d",
}
WORDS = " ".join(f"w{(i * 37) % 250}" for i in range(4000))  # the tiny tokenizer's words, in a fixed order


def section(weights="fp8", method="rtn", kv_cache="none", exclude=(), group_size=64):
    return SimpleNamespace(
        weights=weights,
        method=method,
        kv_cache=kv_cache,
        group_size=group_size,
        exclude_modules=list(exclude),
        modelopt_recipe=None,
        calibration=SimpleNamespace(num_samples=4, seq_len=32),
    )


# ---------------------------------------------------------------- the two forms, on presets of our own


def fake_modelopt(monkeypatch, version: str, presets: dict) -> None:
    """`modelopt` and `modelopt.torch.quantization` as this process imports them: `version` and `presets` only."""
    names = ("modelopt", "modelopt.torch", "modelopt.torch.quantization")
    top, torch_pkg, quantization = (types.ModuleType(name) for name in names)
    top.__version__, top.torch, torch_pkg.quantization = version, torch_pkg, quantization
    for name, preset in presets.items():
        setattr(quantization, name, preset)
    for name, module in zip(names, (top, torch_pkg, quantization)):
        monkeypatch.setitem(sys.modules, name, module)


DICT_PRESET = {  # a 0.43-style preset: pattern -> attributes, "default" first in effect
    "quant_cfg": {
        "*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}, "enable": True},
        "*input_quantizer": {"enable": False},
        "*lm_head*": {"enable": False},
        "default": {"enable": False},
    },
    "algorithm": "awq_lite",
}
LIST_PRESET = {  # a 0.44-style preset: entries applied in order
    "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}}},
        {"quantizer_name": "*lm_head*", "enable": False},
    ],
    "algorithm": "awq_lite",
}


def test_a_dict_preset_gets_the_block_size_kv_quantizer_and_exclusions_as_dict_entries(monkeypatch):
    fake_modelopt(monkeypatch, "0.37.0", {"INT4_AWQ_CFG": DICT_PRESET})
    config = ours.modelopt_config(section("int4", "awq", "fp8", exclude=["lm_head", "*.down_proj"]))
    assert config == {
        "quant_cfg": {
            "*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 64, "type": "static"}, "enable": True},
            "*input_quantizer": {"enable": False},
            "default": {"enable": False},
            ours.KV_QUANTIZER: {"num_bits": (4, 3), "axis": None, "enable": True},
            "*lm_head*": {"enable": False},  # moved after the preset's entries, as a list appends it
            "**.down_proj*": {"enable": False},
        },
        "algorithm": "awq_lite",
    }
    assert list(config["quant_cfg"])[-3:] == [ours.KV_QUANTIZER, "*lm_head*", "**.down_proj*"]  # applied last
    assert DICT_PRESET["quant_cfg"]["*weight_quantizer"]["block_sizes"][-1] == 128  # the preset itself is untouched


def test_a_list_preset_gets_them_as_entries(monkeypatch):
    fake_modelopt(monkeypatch, "0.47.0", {"INT4_AWQ_CFG": LIST_PRESET})
    config = ours.modelopt_config(section("int4", "awq", "int8", exclude=["lm_head"]))
    assert config["quant_cfg"] == [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 4, "block_sizes": {-1: 64, "type": "static"}}},
        {"quantizer_name": "*lm_head*", "enable": False},
        {"quantizer_name": ours.KV_QUANTIZER, "cfg": {"num_bits": 8, "axis": None}},
        {"quantizer_name": "*lm_head*", "enable": False},
    ]


@pytest.mark.parametrize(("version", "preset", "form"), [("0.37.0", DICT_PRESET, dict), ("0.47.0", LIST_PRESET, list)])
def test_without_a_preset_everything_is_disabled_in_the_installed_form(monkeypatch, version, preset, form):
    """Unquantized weights with an FP8 KV cache: the form is read from a preset all versions have."""
    fake_modelopt(monkeypatch, version, {"FP8_DEFAULT_CFG": preset})
    config = ours.modelopt_config(section("none", "rtn", "fp8"))
    assert isinstance(config["quant_cfg"], form) and config["algorithm"] == "max"
    if form is dict:
        assert config["quant_cfg"] == {
            "default": {"enable": False},
            ours.KV_QUANTIZER: {"num_bits": (4, 3), "axis": None, "enable": True},
        }
    else:
        assert config["quant_cfg"][0] == {"quantizer_name": "*", "enable": False}


def test_a_form_the_table_says_that_version_has_not_is_refused_naming_both(monkeypatch):
    assert facts("triton_trtllm_images")["modelopt"]["quant_cfg_list_from"] == "0.44.0"
    fake_modelopt(monkeypatch, "0.45.0", {"FP8_DEFAULT_CFG": DICT_PRESET})
    with pytest.raises(ours.UnsupportedModelOpt, match=r"0\.45\.0's presets hold quant_cfg as a dict.* holds a list"):
        ours.modelopt_config(section())
    fake_modelopt(monkeypatch, "0.37.0", {"FP8_DEFAULT_CFG": {"quant_cfg": (("*", {}),)}})
    with pytest.raises(ours.UnsupportedModelOpt, match="as tuple .*neither a dict .* nor a list"):
        ours.modelopt_config(section())


# ---------------------------------------------------------------- the real nvidia-modelopt 0.37.0


@pytest.fixture(scope="module")
def modelopt_037(tmp_path_factory) -> Path:
    """A directory holding nvidia-modelopt 0.37.0 and torchprofile as their wheels unpack (pure Python), to be put
    first on a subprocess's sys.path. Skipped only where PyPI cannot be reached."""
    from pipeline.build import cache_dir
    from pipeline.fetch import fetch_wheel

    root = tmp_path_factory.mktemp("modelopt-0.37")
    for spec, sha256 in OLD_MODELOPT.items():
        try:
            wheel = fetch_wheel(spec, sha256, cache_dir(), log=lambda *_: None)
        except PipelineError as error:
            if "could not download" in str(error):
                pytest.skip(f"PyPI is unreachable: {error}")
            raise
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(root)
    return root


def under(path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python ARGS` with `path` first on sys.path (before our virtualenv's ModelOpt)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(REPO)]), "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


# Runs under 0.37: every preset through calibrate, save, restore and export, then what the parent compares.
STAGES = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
import modelopt, modelopt.torch.quantization as mtq, torch
from pipeline.targets.trtllm.modelopt import (MODELOPT_PRESETS, calibrate, export_checkpoints, load_calibrated,
    quiet_modelopt, save_calibrated)
hf, out = Path(sys.argv[1]), Path(sys.argv[2])
report = {"version": modelopt.__version__, "file": modelopt.__file__}
report["quant_cfg"] = type(mtq.FP8_DEFAULT_CFG["quant_cfg"]).__name__
def quantizer_buffers(model):
    return {name: buffer.clone() for name, buffer in model.named_buffers() if "_quantizer." in name}
for (weights, method) in MODELOPT_PRESETS:
    q = SimpleNamespace(weights=weights, method=method, kv_cache="fp8" if weights == "fp8" else "none",
        group_size=32, exclude_modules=["lm_head"], modelopt_recipe=None,
        calibration=SimpleNamespace(num_samples=4, seq_len=32))
    case = out / f"{weights}-{method}"
    case.mkdir(parents=True)
    model = calibrate(hf, q, sys.argv[3], lambda items, *_, **__: items)
    kept, calibrated = save_calibrated(model, hf, case), quantizer_buffers(model)
    restored = load_calibrated(hf, case)
    after = quantizer_buffers(restored)  # before the export, which fuses q/k/v's amax in place
    same = after.keys() == calibrated.keys() and all(torch.equal(after[n], calibrated[n]) for n in calibrated)
    with quiet_modelopt():
        export_checkpoints(restored, case / "export", "float16", 1, 1, None, "1.1")
    report[case.name] = {"kept": kept, "restored": same, "quantizers": len(calibrated)}
print(json.dumps(report))
"""


def test_every_preset_calibrates_restores_and_exports_under_the_containers_modelopt(modelopt_037, tiny_llama, tmp_path):
    """Under 0.37 the quantize stage's state restores bit for bit, and its TensorRT-LLM checkpoint is the very one
    0.47 exports from the same model (same tensors, same values); the unified checkpoint passes what TensorRT-LLM
    1.1's PyTorch loader reads wherever 1.1 loads that algorithm at all."""
    from safetensors.torch import load_file

    from pipeline.targets.trtllm.torch_checkpoint import torch_loader_problems, unsupported_quantization

    result = under(modelopt_037, "-c", STAGES, str(tiny_llama), str(tmp_path / "0.37"), WORDS)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (report["version"], report["quant_cfg"]) == ("0.37.0", "dict")
    assert report["file"].startswith(str(modelopt_037))
    for weights, method in ours.MODELOPT_PRESETS:
        case = f"{weights}-{method}"
        assert report[case]["quantizers"] and report[case] | {"quantizers": 0} == {
            "kept": 0,
            "restored": True,
            "quantizers": 0,
        }, case
        q = section(weights, method, "fp8" if weights == "fp8" else "none", exclude=["lm_head"], group_size=32)
        model = ours.calibrate(tiny_llama, q, WORDS, lambda items, *_, **__: items)  # the same under our 0.47
        with ours.quiet_modelopt():
            ours.export_checkpoints(model, tmp_path / "0.47" / case, "float16", 1, 1, None, "1.1")
        old = load_file(tmp_path / "0.37" / case / "export" / "trtllm_checkpoint" / "rank0.safetensors")
        new = load_file(tmp_path / "0.47" / case / "trtllm_checkpoint" / "rank0.safetensors")
        assert old.keys() == new.keys() and all(old[n].equal(new[n]) for n in old), case
        unified = tmp_path / "0.37" / case / "export" / "hf_unified"
        if unsupported_quantization(weights, method, "none", "1.1") is None:  # all but int8 SmoothQuant
            assert torch_loader_problems(unified, "1.1") == [], case


def test_the_image_quantize_check_passes_under_the_containers_modelopt(modelopt_037):
    """What `docker build` runs in 1.2's stage for the default config (FP8 weights and KV cache), under 0.37."""
    config = "build_configs/smollm2-135m-fp8.yaml"
    result = under(modelopt_037, "-m", "pipeline.targets.trtllm.image_check", "quantize", "--release", "1.2", config)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "quantized: ModelOpt 0.37.0, the preset FP8_DEFAULT_CFG: " in result.stdout
