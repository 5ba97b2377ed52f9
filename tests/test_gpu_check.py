"""scripts/gpu_check.py: its exit without a CUDA device, the parts of its checks that need none (fp8-forward's
divergence and verdict, modelopt-container on CPU, what scripts/dev/gpu_check_carry.py carries), and its checks on a
machine with a CUDA device."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"
CUDA = torch.cuda.is_available()
CARRIED_0_37 = REPO / ".gpu_check" / "modelopt-0.37"


def script(path: Path):
    """A script imported as a module (gpu_check imports its sibling modelopt_container_smoke)."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


gpu_check = script(SCRIPT)
smoke = script(REPO / "scripts" / "modelopt_container_smoke.py")


def run_script(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.no_gpu
@pytest.mark.skipif(CUDA, reason="this machine has a CUDA device, so the script runs its checks (the test below)")
def test_without_a_cuda_device_it_exits_4_at_once_saying_why(tmp_path):
    result = run_script("--output", str(tmp_path / "out"), timeout=120)
    assert result.returncode == 4, result.stdout + result.stderr  # the pipeline's "no GPU for a GPU step"
    assert "no CUDA device" in result.stderr and "torch.cuda.is_available() is False" in result.stderr
    assert result.stdout == ""  # no check ran
    assert not (tmp_path / "out").exists()  # nothing imported or calibrated: it stops before any work


def test_the_divergence_is_the_kl_of_the_next_token_distributions_and_top1_their_argmaxes():
    generator = torch.Generator().manual_seed(0)
    expected, got = torch.randn(7, 50, generator=generator), torch.randn(7, 50, generator=generator)
    got[:3] = expected[:3] + 0.01  # a shift: the same distributions (KL 0 up to rounding), the same top-1
    kl, agree = gpu_check.next_token_divergence(expected, got)
    log_p, log_q = torch.log_softmax(expected.double(), -1), torch.log_softmax(got.double(), -1)
    assert torch.allclose(kl, torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1))
    assert (kl > -1e-12).all() and torch.equal(agree, expected.argmax(-1) == got.argmax(-1)) and agree[:3].all()
    same, all_agree = gpu_check.next_token_divergence(expected, expected.clone())
    assert float(same.abs().max()) < 1e-12 and all_agree.all()


@pytest.mark.parametrize(
    ("kl", "spread", "status", "why"),
    [
        (0.088, 0.074, "PASS", "within 2x the spread (1.480e-01)"),  # measured on CPU (gpu_check's comment)
        (0.362, 0.074, "FAIL", "beyond 2x the spread"),  # one linear's weight scale doubled
        (0.01, 0.0, "FAIL", "beyond 2x the spread"),  # no spread bounds nothing
        (float("nan"), 0.074, "FAIL", "not finite"),
        (0.1, float("inf"), "FAIL", "not finite"),
        (0.2, 0.5, "FAIL", "the float16 spread is beyond 0.3"),  # a broken fake quant would raise the bound
    ],
)
def test_fp8_forward_fails_the_fp8_gemms_beyond_twice_the_measured_spread(kl, spread, status, why):
    got, text = gpu_check.fp8_verdict(kl, spread)
    assert (got, why in text) == (status, True), text


def test_a_modelopt_copy_keeps_the_quantizers_amax_in_float32_and_casts_the_parameters():
    model = torch.nn.Linear(4, 3)
    model.register_buffer("_amax", torch.tensor(3065.25))
    copied = gpu_check.with_dtype(model, torch.float16, "cpu")
    assert copied.weight.dtype == torch.float16 and copied._amax.dtype == torch.float32
    assert model.weight.dtype == torch.float32  # the calibrated model itself is left as it is


def modelopt_dir() -> Path:
    import modelopt

    return Path(modelopt.__file__).resolve().parents[1]


def test_modelopt_container_passes_on_cpu_with_this_environments_modelopt():
    status, text, _ = smoke.check(modelopt_dir(), "cpu")
    assert status == "PASS", text
    assert "28 linear weight/input quantizers and 4 k/v attention quantizers FP8 per-tensor and calibrated" in text


@pytest.mark.skipif(not (CARRIED_0_37 / "modelopt").is_dir(), reason="scripts/dev/gpu_check_carry.py not run here")
def test_modelopt_container_passes_on_cpu_with_the_containers_modelopt_0_37():
    status, text, _ = smoke.check(CARRIED_0_37, "cpu")
    assert status == "PASS", text
    assert text.startswith("ModelOpt 0.37.0") and "quant_cfg a dict" in text


def test_modelopt_container_names_a_quantizer_not_where_the_config_asks():
    import modelopt.torch.quantization as mtq

    from pipeline.targets.trtllm.modelopt import modelopt_config
    from pipeline.validation import load_config

    q = load_config(smoke.FP8_CONFIG).quantization
    model = smoke.tiny_llama("cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    model = mtq.quantize(model, modelopt_config(q), lambda m: m(ids))
    assert smoke.placement_problems(model, q)[0] == []
    model.model.layers[1].self_attn.v_bmm_quantizer.disable()
    model.lm_head.weight_quantizer.enable()
    problems, counts = smoke.placement_problems(model, q)
    assert "model.layers.1.self_attn.v_bmm_quantizer disabled, expected FP8" in problems
    assert any(p.startswith("lm_head.weight_quantizer enabled") for p in problems), problems


def test_modelopt_container_skips_without_a_modelopt_to_run(tmp_path):
    status, text, _ = smoke.check(tmp_path, "cpu")
    assert status == "SKIP" and "gpu_check_carry.py" in text


def test_the_carried_entry_points_are_the_pipelines_and_the_docstring_holds_the_carry_scripts_calls(tmp_path):
    from importlib.metadata import distribution, distributions

    carry = script(REPO / "scripts" / "dev" / "gpu_check_carry.py")
    carry.write_entry_points(tmp_path)
    (found,) = distributions(path=[str(tmp_path)])
    assert set(found.entry_points) == set(distribution("trtllm-pipeline").entry_points)
    assert {"trtllm_pipeline.targets", "trtllm_pipeline.trtllm_backends"} <= {e.group for e in found.entry_points}
    for carried in (carry.CALL_1, carry.CALL_2):
        assert f"carry={carried}".replace("'", '"') in gpu_check.__doc__
    assert f'command="{carry.DEVICE_COMMAND}"' in gpu_check.__doc__


# Not `gpu`-marked: conftest skips those where TensorRT-LLM is missing, which this script does not need.
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False here)")
@pytest.mark.timeout(1800)  # 7 min on an H200 machine with 16 cores, most of it the two CPU calibrations
def test_on_a_cuda_device_every_check_passes_or_is_skipped(tmp_path, smollm2_gguf):
    # smollm2_gguf: the model the script imports, fetched into the pipeline's cache (and the test marked slow)
    result = run_script("--output", str(tmp_path / "out"), timeout=1700)
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert [line for line in lines if line.startswith(("PASS ", "SKIP "))] == lines, result.stdout
    names = {line.split(":")[0].split(" ", 1)[1] for line in lines}
    assert {"export/smollm2-135m-fp8", "export/smollm2-135m-int4-awq", "fp8-forward", "memory-weights"} <= names
    assert "modelopt-container" in names
