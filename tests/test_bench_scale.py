"""`bench scale`: the harness end to end on a tiny shape (every stage measured in its own process, a second run
resumes), and its parts: the memory sampling, the relaxed gate, the table."""

from __future__ import annotations

import json
import sys

import pytest

from pipeline.bench import scale, scale_report
from tests.conftest import make_tiny_llama, run_cli, slow_fixture
from tests.test_quality import TINY_CHAT_TEMPLATE

TINY = scale.Shape(64, 128, 2, 4, 2, True, "a test's shape: every stage in seconds")


@slow_fixture(scope="module")
def tiny_scale(tmp_path_factory):
    """`bench scale --sizes tiny --targets onnxruntime` run twice through the CLI, the tiny shape registered for the
    run, with a word-level tokenizer that has a chat template: (results folder, first run, second run)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("scale")
    tokenizer = make_tiny_llama(root / "tokenizer")
    chat = AutoTokenizer.from_pretrained(tokenizer)
    chat.chat_template = TINY_CHAT_TEMPLATE  # the default config scores its chat set, as a user's build does
    chat.save_pretrained(tokenizer)
    args = ["bench", "scale", "--sizes", "tiny", "--targets", "onnxruntime", "--tokenizer", str(tokenizer)]
    args += ["--out", str(root / "out"), "--work", str(root / "work")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(scale.SIZES, "tiny", TINY)
        first = run_cli(*args)
        second = run_cli(*args)
    return root, first, second


def test_every_stage_of_a_tiny_build_is_measured(tiny_scale):
    root, first, _ = tiny_scale
    assert first.returncode == 0, first.stdout + first.stderr
    result = json.loads((root / "out" / "tiny" / "onnxruntime.json").read_text())
    assert result["status"] == "ok" and result["parameters"] > 0
    stages = {s["stage"]: s for s in result["stages"]}
    ran = ["import", "export", "engine", "triton_repo"]
    assert [name for name, s in stages.items() if s["status"] == "ok"] == [*ran, "serve"]
    assert stages["quantize"]["status"] == stages["lora"]["status"] == "skipped"
    for name in ran:
        s = stages[name]
        assert s["peak_anon_bytes"] > 0 and s["ru_maxrss_bytes"] > 0 and s["cpu_s"] > 0 and s["wall_s"] > 0, name
        assert s["disk_bytes"] > 0, name
    # each part of a stage measured apart, named by what it does, within its stage's peak
    phases = {name: [p["phase"] for p in stages[name]["phases"]] for name in ran}
    assert phases["import"] == ["starting", "copying the tensors"]
    assert phases["export"] == ["starting", "writing the ONNX graph", "the export's logits check"]
    assert phases["engine"] == ["starting", "calibration", "quantization", "the quality gate"]
    for name in ran:
        assert max(p["peak_anon_bytes"] for p in stages[name]["phases"]) <= stages[name]["peak_anon_bytes"]
    # the built repository served: tritonserver and our gateway answered every streamed completion
    served = stages["serve"]
    assert served["serving"]["requests"] == 4 and served["serving"]["errors"] == 0
    assert served["peak_anon_bytes"] > 0 and "none failed" in served["answered"]
    assert stages["import"]["metrics"]["parameters"] == result["parameters"]
    assert stages["engine"]["gate_s"] is not None and 0 < stages["engine"]["gate_s"] < stages["engine"]["wall_s"]
    assert stages["engine"]["metrics"]["chat_prompts"] > 0  # the chat set scored, its threshold relaxed
    assert any(o.startswith("verify.min_chat_answer_match=") for o in result["overrides"])
    summary = (root / "out" / "summary.md").read_text()
    for name in ran:
        assert f"| tiny | {result['parameters'] / 1e9:.3g} | onnxruntime | {name} |" in summary
    assert "| tiny | onnxruntime | engine | the quality gate | runs a model |" in summary
    assert "| tiny | onnxruntime | import | copying the tensors | converts |" in summary
    assert "## Served" in summary and "none failed" in summary
    assert f"Measured at commit {result['commit']}." in summary
    assert "| Llama 3.1 8B (8.03B) | onnxruntime |" in summary  # the plan's 8B and 70B beside the measured line
    assert (root / "out" / "bytes_per_parameter.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (root / "work" / "tiny-onnxruntime").exists() and not (root / "work" / "checkpoints" / "tiny").exists()


def test_a_second_run_resumes_without_measuring_again(tiny_scale):
    root, first, second = tiny_scale
    assert second.returncode == 0, second.stdout + second.stderr
    assert "tiny onnxruntime: measured already" in second.stdout
    assert "tiny onnxruntime: import" not in second.stdout  # no stage ran
    assert "| tiny |" in second.stdout


def test_the_peak_is_the_process_trees_anonymous_memory_and_cpu_its_own(tmp_path):
    """A child that holds 300 MB of its own memory, then burns CPU: the sampled peak sees the memory, wait4 the CPU."""
    code = (
        "import time; held = bytearray(300 * 2**20); time.sleep(0.5); start = time.process_time()\n"
        "while time.process_time() - start < 0.3: pass"
    )
    measured = scale.measure_process([sys.executable, "-c", code], tmp_path / "child.log")
    assert measured["returncode"] == 0
    assert 300 * 2**20 <= measured["peak_anon_bytes"] < 600 * 2**20
    assert measured["ru_maxrss_bytes"] >= 300 * 2**20
    assert measured["cpu_s"] >= 0.3 and measured["wall_s"] >= 0.8


def test_only_the_gates_a_config_sets_are_relaxed(tiny_llama):
    cpu = scale.build_overrides(scale.TARGETS["onnxruntime"].config, tiny_llama, None, [])
    assert {"verify.min_chat_answer_match=0.0", "verify.max_kl_divergence=10.0"} <= set(cpu)
    gpu = scale.build_overrides(scale.TARGETS["trtllm"].config, tiny_llama, 16, ["verify.eval_tokens=256"])
    assert "verify.max_perplexity_increase=10.0" in gpu and "quantization.calibration.num_samples=16" in gpu
    assert not any("chat" in o for o in gpu)  # the trtllm config scores no chat set, and still does not
    assert gpu[-1] == "verify.eval_tokens=256"


def test_the_table_puts_the_prediction_beside_the_measurement():
    stage = {"status": "ok", "wall_s": 10.0, "cpu_s": 18.0, "peak_anon_bytes": 4 * 2**30, "ru_maxrss_bytes": 2**31}
    stage |= {"disk_bytes": 2**30, "gate_s": 4.0}
    result = {"size": "1.1b", "parameters": 2 * 10**9, "target": "onnxruntime"}
    predicted = {**stage, "stage": "engine", "predicted": {"host_bytes": 5 * 2**30, "disk_bytes": 2**30}}
    text = scale_report.table(
        [{**result, "stages": [{**stage, "stage": "export"}, predicted, {"stage": "lora", "status": "skipped"}]}]
    )
    assert "| 1.1b | 2 | onnxruntime | export | 10.0 | 18.0 | 4.00 | 2.00 | 2.15 | 1.00 | - | - | - |" in text
    assert "| engine | 10.0 | 18.0 | 4.00 | 2.00 | 2.15 | 1.00 | 5.00 | 1.25 | 1.00 |" in text
    assert "lora" not in text and "took 4 s of the engine stage's 10 s (40%)" in text


@pytest.mark.parametrize(
    "size, dim, ffn_dim_multiplier, multiple_of",
    # meta-llama/llama-models models/sku_list.py @ 5309637ceedec731719b742d9a44176a8e96b494, Llama 3.1 8b and 70b
    [("8b", 4096, 1.3, 1024), ("70b", 8192, 1.3, 4096)],
)
def test_the_planned_llama_shapes_follow_metas_feed_forward_rounding(size, dim, ffn_dim_multiplier, multiple_of):
    hidden = int(ffn_dim_multiplier * int(2 * 4 * dim / 3))
    intermediate = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
    shape = scale_report.LLAMA_31_SHAPES[size]
    assert (shape["hidden_size"], shape["intermediate_size"]) == (dim, intermediate)
