"""The GPU image's check of its own Python environment (pipeline/targets/trtllm/image_check.py), as `docker build` runs
it: on this machine's torch, transformers and ModelOpt (0.47), and on stand-ins of our own for what a container may
hold (a `tensorrt_llm` and a `modelopt` written to tmp_path and put first on sys.path) where ours cannot play the
part. Under the real ModelOpt 0.37 it runs in test_modelopt_container_versions.py."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.targets.trtllm import image_check
from pipeline.targets.trtllm.image import CHECK
from tests.conftest import REPO

FP8_CONFIG = REPO / "build_configs/smollm2-135m-fp8.yaml"
INT4 = ["quantization.weights=int4", "quantization.method=awq", "quantization.group_size=64"]


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", str(REPO / CHECK), *args], capture_output=True, text=True)


def test_the_image_check_refuses_a_python_without_tensorrt_llm(tmp_path):
    result = run_check("record", "--tensorrt-llm", "1.2.1", str(tmp_path / "record"))
    assert result.returncode == 1
    assert f"the container's python3 ({sys.executable}) has no tensorrt_llm" in result.stderr
    assert not (tmp_path / "record").exists()


def write_record(directory: Path, modules: dict, requires: dict | None = None) -> None:
    (directory / image_check.RECORD).write_text(
        json.dumps({"modules": modules, "tensorrt_llm_requires": requires or {}})
    )


def test_the_image_check_passes_the_same_modules_and_names_a_replaced_one(tmp_path, capsys):
    """compare (here in this process, which has the modules imported already) against a record of this very
    interpreter: same files, transformers among them, and ModelOpt's quantization and export import; against a record
    whose torch lies elsewhere: refused, naming torch."""
    record = image_check.resolved()
    write_record(tmp_path, record)
    assert image_check.compare(tmp_path) is None
    printed = capsys.readouterr().out
    assert f"same: torch {record['torch']['version']} at {record['torch']['file']}" in printed
    assert f"same: transformers {record['transformers']['version']} at {record['transformers']['file']}" in printed
    assert "imported: modelopt.torch.export" in printed
    assert "absent: tensorrt_llm (the record has none)" in printed  # a container's record always has it

    record["torch"]["file"] = "/opt/venv-tritonserver/lib/python3.12/site-packages/torch/__init__.py"
    write_record(tmp_path, record)
    assert "does not use the container's torch" in image_check.compare(tmp_path)


def test_a_modelopt_other_than_the_release_pins_is_named_with_the_fix(tmp_path):
    """This interpreter's ModelOpt 0.47 as a container's for 1.2, which pins ~=0.37.0: refused with the fix."""
    write_record(tmp_path, image_check.resolved())
    problem = image_check.compare(tmp_path, "1.2")
    assert problem.startswith("container ModelOpt 0.47.0, TensorRT-LLM 1.2 pins nvidia-modelopt~=0.37.0")
    assert (
        "fix: build this stage FROM nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3 as NVIDIA ships it" in problem
    )


def test_the_quantize_check_quantizes_a_tiny_model_with_the_configs_preset_under_our_modelopt(capsys):
    """The real thing on CPU: the default config's FP8 with FP8 KV cache, and int4 AWQ with lm_head excluded."""
    assert image_check.quantize(FP8_CONFIG, [], "1.2") is None
    assert "quantized: ModelOpt 0.47.0, the preset FP8_DEFAULT_CFG: " in capsys.readouterr().out
    assert image_check.quantize(FP8_CONFIG, [*INT4, "quantization.exclude_modules=[lm_head]"], "1.2") is None
    assert "quantized: ModelOpt 0.47.0, the preset INT4_AWQ_CFG: " in capsys.readouterr().out


def test_quantizers_missing_from_what_the_section_asks_are_named():
    class Section:
        kv_cache, exclude_modules = "fp8", ["lm_head"]

    enabled = ["lm_head.input_quantizer", "model.layers.0.mlp.up_proj.input_quantizer"]
    assert image_check.quantizer_problems(enabled, Section, weights_quantized=True) == [
        "no weight quantizer is enabled",
        "no KV-cache quantizer is enabled for kv_cache fp8",
        "exclude_modules 'lm_head' still has enabled quantizers (lm_head.input_quantizer)",
    ]
    enabled = ["model.layers.0.mlp.up_proj.weight_quantizer.1", "model.layers.0.self_attn.k_bmm_quantizer"]
    assert image_check.quantizer_problems(enabled, Section, weights_quantized=True) == []


# ---------------------------------------------------------------- stand-ins for a container's packages


def stand_ins(root: Path, modelopt: str, quant_cfg: str, quantize: str = "return model", trtllm=None) -> Path:
    """Packages of our own on `root`: `modelopt` of version `modelopt` whose FP8 preset holds `quant_cfg` (Python
    source) and whose quantize runs `quantize`; with `trtllm` = (version, [requirements]), a `tensorrt_llm` of that
    version requiring them. Each with its dist-info, as importlib.metadata reads installed versions."""

    def dist_info(name: str, version: str, requires=()) -> None:
        info = root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        lines = [
            "Metadata-Version: 2.1",
            f"Name: {name}",
            f"Version: {version}",
            *(f"Requires-Dist: {r}" for r in requires),
        ]
        (info / "METADATA").write_text("\n".join(lines) + "\n")

    for package in ("modelopt", "modelopt/torch", "modelopt/torch/quantization", "modelopt/torch/export"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "modelopt" / "__init__.py").write_text(f"__version__ = {modelopt!r}\n")
    (root / "modelopt" / "torch" / "quantization" / "__init__.py").write_text(
        f"FP8_DEFAULT_CFG = {{'quant_cfg': {quant_cfg}, 'algorithm': 'max'}}\n\n\n"
        f"def quantize(model, config, forward_loop=None):\n    {quantize}\n"
    )
    dist_info("nvidia-modelopt", modelopt)
    if trtllm:
        (root / "tensorrt_llm").mkdir()
        (root / "tensorrt_llm" / "__init__.py").write_text("")
        dist_info("tensorrt_llm", *trtllm)
    return root


def check_with(root: Path, *args: str) -> subprocess.CompletedProcess:
    """image_check with `root` first on sys.path (as a module: -I would drop PYTHONPATH), then what this process
    was given on PYTHONPATH (a transformers under test, say)."""
    paths = [str(root), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "pipeline.targets.trtllm.image_check", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


DICT = "{'*weight_quantizer': {'num_bits': (4, 3)}, 'default': {'enable': False}}"


@pytest.mark.parametrize("transformers_required", [True, False])
def test_a_container_whose_modelopt_is_not_the_one_its_tensorrt_llm_pins_is_refused_at_compare(
    tmp_path, transformers_required
):
    """A container of 1.1 holding ModelOpt 0.35: recorded, constrained (transformers only where its tensorrt_llm
    requires it), then refused by compare against the release's pin and against its own tensorrt_llm's requirement,
    each with the fix, not a traceback."""
    transformers = importlib.metadata.version("transformers")
    requires = ["nvidia-modelopt[torch]~=0.37.0", *([f"transformers=={transformers}"] if transformers_required else [])]
    root = stand_ins(tmp_path / "site", "0.35.0", DICT, trtllm=("1.1.0", requires))
    recorded = check_with(root, "record", "--tensorrt-llm", "1.1.0", str(tmp_path / "record"))
    assert recorded.returncode == 0, recorded.stderr
    constraints = (tmp_path / "record" / image_check.CONSTRAINTS).read_text().splitlines()
    torch = importlib.metadata.version("torch")
    assert constraints == [
        "tensorrt_llm==1.1.0",
        f"torch=={torch}",
        "nvidia-modelopt==0.35.0",
        *([f"transformers=={transformers}"] if transformers_required else []),
    ]

    compared = check_with(root, "compare", "--release", "1.1", str(tmp_path / "record"))
    assert compared.returncode == 1 and "Traceback" not in compared.stderr, compared.stderr
    assert "container ModelOpt 0.35.0, TensorRT-LLM 1.1 pins nvidia-modelopt~=0.37.0" in compared.stderr
    assert "fix: build this stage FROM nvcr.io/nvidia/tritonserver:26.02-trtllm-python-py3" in compared.stderr
    assert "container nvidia-modelopt 0.35.0, but its own tensorrt_llm 1.1.0 requires " in compared.stderr


@pytest.mark.parametrize(
    ("version", "quant_cfg", "quantize", "found"),
    [
        # a dict where the table says this version holds a list
        ("0.45.0", DICT, "return model", "0.45.0's presets hold quant_cfg as a dict, but the table"),
        # neither form
        ("0.37.0", "(('*weight_quantizer', 8),)", "return model", "as tuple (('*weight_quantizer', 8),)"),
        # a form ours writes, refused by that ModelOpt's quantize
        (
            "0.37.0",
            DICT,
            "raise TypeError('this quant_cfg takes entries only')",
            "mtq.quantize refused the config for the preset FP8_DEFAULT_CFG: TypeError: this quant_cfg takes entries",
        ),
        # accepted, but nothing quantized
        ("0.37.0", DICT, "return model", "but no weight quantizer is enabled; no KV-cache quantizer"),
    ],
)
def test_a_modelopt_api_ours_does_not_write_for_is_reported_with_the_release_and_the_fix(
    tmp_path, version, quant_cfg, quantize, found
):
    root = stand_ins(tmp_path / "site", version, quant_cfg, quantize)
    result = check_with(root, "quantize", "--release", "1.2", str(FP8_CONFIG))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    message = result.stderr.removeprefix("image check failed: ")
    assert message.startswith(f"container ModelOpt {version}") and found in message, message
    assert "TensorRT-LLM 1.2 pins nvidia-modelopt~=0.37.0, whose quant_cfg is a dict" in message
    assert "fix: make modelopt_config (pipeline/targets/trtllm/modelopt.py) write ModelOpt " in message
