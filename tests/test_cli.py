"""The command line as users run it: verbs, help, exit codes, machine-readable output."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli, spawn_cli


@pytest.mark.parametrize(
    "verb", ["validate", "plan", "build", "verify", "run", "serve", "validate-repo", "targets", "bench"]
)
def test_every_verb_has_help_with_an_example(verb):
    result = run_cli(verb, "--help")
    assert result.returncode == 0, result.stderr
    assert "Example" in result.stdout or verb == "bench", result.stdout


def test_targets_lists_each_target_its_availability_and_the_fields_it_refuses():
    result = spawn_cli("targets")  # the console script itself, once
    assert result.returncode == 0, result.stderr
    onnxruntime, trtllm = result.stdout.split("\ntrtllm: ")
    assert "on this machine: available" in onnxruntime and "runtime.cuda_graph_mode" in onnxruntime
    assert (
        "/dev/nvidia0" in trtllm and "runtime.cpu_threads" in trtllm and "runtime.enable_kv_cache_reuse" not in trtllm
    )


def test_plan_json_gives_every_stage_with_status_and_reason(tmp_path):
    result = run_cli("plan", "build_configs/smollm2-135m-cpu.yaml", "--output", str(tmp_path / "out"), "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["stage"] for r in rows] == ["import", "quantize", "export", "engine", "lora", "triton_repo"]
    assert rows[1]["status"] == "skipped" and "engine stage" in rows[1]["reasons"][0]
    assert rows[4]["status"] == "skipped" and rows[4]["reasons"] == ["no LoRA adapters configured"]
    assert all(
        r["status"] == "will run" and r["reasons"] == ["never built"]
        for r in rows
        if r["stage"] not in ("quantize", "lora")
    )


def test_a_knob_the_target_ignores_fails_validate_with_exit_2():
    result = run_cli("validate", "build_configs/smollm2-135m-cpu.yaml", "runtime.cuda_graph_mode=false")
    assert result.returncode == 2
    assert "runtime.cuda_graph_mode: is not honoured by target onnxruntime" in " ".join(result.stderr.split())


@pytest.mark.parametrize(
    "override", ["triton.ensemble_name=../../evil", "triton.preprocessing_name={root}/abs"], ids=["dotdot", "absolute"]
)
def test_a_model_name_that_is_a_path_writes_nothing_anywhere(tmp_path, override):
    """The reproduction of issue #14 item 2: the build exited 0 and wrote OUT/../evil/config.pbtxt."""
    root = tmp_path / "parent"
    root.mkdir()
    before = sorted(tmp_path.rglob("*"))
    result = run_cli(
        "build", "build_configs/smollm2-135m-cpu.yaml", override.format(root=root), "--output", str(root / "OUT")
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is not a valid Triton model name" in result.stderr and "Traceback" not in result.stderr
    assert sorted(tmp_path.rglob("*")) == before
