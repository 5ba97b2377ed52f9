"""NaN compares false with every threshold, so a model computing NaN scored NaN everywhere and passed the quality gate
(issue #45 item 3). Each gate now fails on a score that is not finite and names the first non-finite logit or weight
it meets: the verify thresholds, the export's logits check, the trtllm reference's checkpoint, a float checkpoint's
import."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pipeline import quality, torch_models
from pipeline.errors import BuildStepError, CheckpointError
from pipeline.validation import load_config
from tests.conftest import run_cli, write_config

VOCAB = 253  # the tiny Llama's: three specials and 250 words


@pytest.fixture()
def cfg(tiny_llama, tmp_path):
    (tmp_path / "eval.txt").write_text(" ".join(f"w{i % 250}" for i in range(200)))
    body = f"""
        model: {{source: hf, path: {tiny_llama}}}
        quantization: {{weights: none}}
        verify: {{eval_text: eval.txt, eval_tokens: 64, max_perplexity_increase: 0.1, max_kl_divergence: 0.01,
                  min_top1_agreement: 0.9}}
        """
    return load_config(write_config(tmp_path / "tiny.yaml", body))


def logits_model(name: str, nan_at: int | None = None, in_sequence: int | None = None) -> quality.Model:
    """Fixed random logits per position; NaN in every logit of position `nan_at` of each sequence (of the
    `in_sequence`-th only, when given)."""
    calls = itertools.count()

    def logits(ids: np.ndarray) -> np.ndarray:
        out = np.random.default_rng(0).normal(size=(1, ids.shape[1], VOCAB)).astype(np.float32)
        sequence = next(calls)
        if nan_at is not None and in_sequence in (None, sequence):
            out[0, nan_at] = np.nan
        return out

    return quality.Model(name, Path(name), logits, lambda prompt, n, end: [end])


def test_nan_scores_fail_every_threshold_and_the_first_nan_logit_is_named(cfg, tiny_llama, tmp_path):
    report = quality.measure(cfg, logits_model("engine", nan_at=3), logits_model("fp32 model"), tiny_llama, tmp_path)
    assert np.isnan(report["kl_divergence"]) and np.isnan(report["perplexity_increase"])
    assert report["nonfinite_logits"] == "the engine's logits are NaN at eval-text window 0, position 3"
    problem = quality.gate_problem(cfg, report)
    assert problem is not None
    assert problem.startswith("perplexity_increase is nan; kl_divergence is nan; the engine's logits are NaN")
    assert "fails every verify threshold" in problem and "quantization.weights: none" in problem

    # without the logits' note (a report from elsewhere), the NaN scores alone fail; this returned None before
    scores = {k: v for k, v in report.items() if k != "nonfinite_logits"}
    assert "kl_divergence is nan" in quality.gate_problem(cfg, scores)
    finite = quality.measure(cfg, logits_model("engine"), logits_model("fp32 model"), tiny_llama, tmp_path)
    assert "nonfinite_logits" not in finite and quality.gate_problem(cfg, finite) is None


def test_the_reference_is_named_when_both_compute_nan(cfg, tiny_llama, tmp_path):
    report = quality.measure(cfg, logits_model("engine", 5), logits_model("fp32 model", 7), tiny_llama, tmp_path)
    assert report["nonfinite_logits"] == "the fp32 model's logits are NaN at eval-text window 0, position 7"


def test_the_nonfinite_logits_named_are_those_a_pass_in_turn_meets_first(tiny_llama, tmp_path):
    """The reference now scores every window before the engine runs: the note still names the first non-finite
    logits of a pass alternating the two per window, as before (here the engine's in window 0, not the reference's
    in window 1), and the reference's in a window where both compute them."""
    (tmp_path / "eval.txt").write_text(" ".join(f"w{i % 250}" for i in range(1100)))
    body = f"""
        model: {{source: hf, path: {tiny_llama}}}
        verify: {{eval_text: eval.txt, eval_tokens: 1024}}
        """
    cfg = load_config(write_config(tmp_path / "two-windows.yaml", body))

    def first_named(engine_window: int, reference_window: int) -> str:
        engine = logits_model("engine", nan_at=3, in_sequence=engine_window)
        reference = logits_model("fp32 model", nan_at=4, in_sequence=reference_window)
        return quality.measure(cfg, engine, reference, tiny_llama, tmp_path)["nonfinite_logits"]

    assert (
        first_named(engine_window=0, reference_window=1)
        == "the engine's logits are NaN at eval-text window 0, position 3"
    )
    assert (
        first_named(engine_window=1, reference_window=0)
        == "the fp32 model's logits are NaN at eval-text window 0, position 4"
    )
    assert (
        first_named(engine_window=1, reference_window=1)
        == "the fp32 model's logits are NaN at eval-text window 1, position 4"
    )


def test_the_export_check_names_nan_logits(monkeypatch, tiny_llama):
    """verify.max_export_logits_diff: max(0.0, nan) is 0.0, so NaN logits passed it."""
    from pipeline.targets.onnxruntime import adapter, scoring

    fine = logits_model("x").logits
    monkeypatch.setattr(torch_models, "hf_logits_fn", lambda hf_dir: fine)
    monkeypatch.setattr(scoring, "ort_logits_fn", lambda path: logits_model("x", nan_at=2).logits)
    with pytest.raises(BuildStepError, match=r"^ONNX Runtime's logits are NaN at check prompt 0 \('w1 w2 w3'\), "):
        adapter.compare_logits(tiny_llama, Path("model.onnx"), ["w1 w2 w3"])
    monkeypatch.setattr(scoring, "ort_logits_fn", lambda path: fine)
    assert adapter.compare_logits(tiny_llama, Path("model.onnx"), ["w1 w2 w3"]) == 0.0


def test_a_trtllm_checkpoint_tensor_holding_inf_is_named(tmp_path):
    import torch
    from safetensors.torch import save_file as save_torch

    from pipeline.targets.trtllm.reference import load_ranks

    (tmp_path / "config.json").write_text(json.dumps({"mapping": {"world_size": 1}}))
    scale = torch.ones(4, 2, dtype=torch.float16)
    scale[1, 1] = float("inf")
    save_torch(
        {"transformer.layers.0.mlp.fc.weight": torch.ones(4, 4, dtype=torch.int8), "s": scale},
        tmp_path / "rank0.safetensors",
    )
    with pytest.raises(CheckpointError, match=r"rank0\.safetensors: s holds inf \(first at \[1, 1\]; 1 of 8 values"):
        load_ranks(tmp_path)


def test_a_float_checkpoint_holding_nan_stops_the_build_at_import(tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    state = load_file(model / "model.safetensors")
    state["model.layers.1.mlp.down_proj.weight"][2, 5] = np.nan
    save_file(state, model / "model.safetensors", {"format": "pt"})
    body = f"""
        model: {{source: hf, path: {model}}}
        quantization: {{weights: none}}
        """
    result = run_cli("build", str(write_config(tmp_path / "c.yaml", body)), "--output", str(tmp_path / "out"))
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 3, output
    assert f"{model / 'model.safetensors'}: model.layers.1.mlp.down_proj.weight holds NaN" in output
    assert "(first at [2, 5]; 1 of 8192 values not finite)" in output
