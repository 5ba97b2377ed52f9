"""The default build on the real SmolLM2: quality gate numbers, and chat turns ending where the template says."""

from __future__ import annotations

import json

from tests.conftest import run_cli


def test_default_engine_passes_its_quality_gate_and_records_it(smollm2_build):
    lock = json.loads((smollm2_build / "build.lock.json").read_text())
    engine = lock["stages"]["engine"]["metrics"]
    assert lock["stages"]["export"]["metrics"]["graph"] == "fused"
    assert (
        engine["weights"] == "int8" and engine["quantized_matmuls"] == 30 * 4 + 1
    )  # qkv, o, gate_up, down per layer + lm_head
    assert abs(engine["perplexity_increase"]) <= 0.05  # SmoothQuant's int8 may land a hair below fp32
    # the KL divergence / top-1 / chat gates ran on the 30 built-in questions (their thresholds are in the config)
    assert engine["chat_prompts"] == 30 and 0 < engine["kl_divergence"] and 0 < engine["chat_answer_match"] <= 1
    assert lock["stages"]["export"]["metrics"]["max_abs_logits_diff"] < 1e-3
    config = json.loads((smollm2_build / "engine" / "config.json").read_text())
    assert config["build_config"]["end_id"] == 2  # <|im_end|>, from the GGUF header


def test_chat_answer_is_english_and_stops_at_end_of_turn(smollm2_build, tmp_path):
    out = tmp_path / "r.jsonl"
    result = run_cli(
        "run",
        str(smollm2_build / "engine"),
        "--chat",
        "-p",
        "What is the capital of France? Answer in one sentence.",
        "--max-tokens",
        "40",
        "--output-file",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert "Paris" in row["text"]
    assert row["finish_reason"] == "stop" and row["completion_tokens"] < 40
    assert "<|im" not in row["text"]


def test_rebuild_of_default_config_does_nothing(smollm2_build, cli_build):
    result = cli_build("build_configs/smollm2-135m-cpu.yaml", "--output", str(smollm2_build))
    assert result.returncode == 0
    assert "nothing to do" in result.stdout and "running" not in result.stdout
