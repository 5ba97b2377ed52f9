"""scripts/gpu_check.py: its exit without a CUDA device (checked here), and its checks on a machine with one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"
CUDA = torch.cuda.is_available()


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
