"""The weight-writing stages stream (issue #46): the fused-graph export writes each initializer to its data file as
it is made, the engine stage's quantization reads one weight at a time, and the import of an already-quantized
checkpoint dequantizes one linear at a time, so none holds a copy of the model. Measured as the growth of the
process's anonymous memory (RssAnon, sampled every 2 ms in a process of its own) over a checkpoint whose weights are
large beside everything else the process holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from pipeline.targets.onnxruntime import ONNX_NAME, graph
from tests.conftest import REPO, make_tiny

# Runs `stage` (export | quantize | dequantize) from argv[2] into argv[3]; prints the growth of RssAnon over the
# imports'.
MEASURED = """
import json, sys, threading, time
from pathlib import Path

import numpy, onnx, onnxruntime, torch, transformers

from pipeline.prequantized import detect
from pipeline.prequantized_packing import write_dequantized
from pipeline.stages.import_model import expected_shapes
from pipeline.targets.onnxruntime import graph, quantize


def anonymous() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


peak, running = [0], [True]


def sample():
    while running[0]:
        peak[0] = max(peak[0], anonymous())
        time.sleep(0.002)


base = anonymous()
sampler = threading.Thread(target=sample)
sampler.start()
stage, source, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
try:
    if stage == "export":
        graph.build(source, out / "model.onnx")
    elif stage == "dequantize":  # as the import stage does: a tied lm_head is not written
        out.mkdir()
        tied = json.loads((source / "config.json").read_text()).get("tie_word_embeddings", False)
        shapes = {k: v for k, v in expected_shapes(source).items() if not (tied and k == "lm_head.weight")}
        write_dequantized(source, detect(source), out / "model.safetensors", shapes)
    else:
        quantize.quantize_graph(source, out, weights="int8", group_size=32, quantize_embedding=True)
finally:
    running[0] = False
    sampler.join()
print(json.dumps({"growth": peak[0] - base}))
"""


def growth(stage: str, source: Path, out: Path) -> int:
    result = subprocess.run(
        [sys.executable, "-c", MEASURED, stage, str(source), str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])["growth"]


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """A 6-layer Llama 1024 wide with a 4096-wide MLP (91M parameters, 366 MB in float32)."""
    return make_tiny(
        "LlamaForCausalLM",
        tmp_path_factory.mktemp("wide"),
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=4,
    )


@pytest.mark.slow
def test_the_export_and_the_quantization_hold_less_than_half_a_copy_of_the_weights(wide, tmp_path):
    weights = (wide / "model.safetensors").stat().st_size  # float32: the graph's copy of the weights
    export, engine = tmp_path / "export", tmp_path / "engine"
    grown = {"export": growth("export", wide, export), "quantize": growth("quantize", export, engine)}
    print(f"\nanonymous memory grown, of one float32 copy of the weights ({weights / 2**20:.0f} MiB): {grown}")
    assert all(value < 0.5 * weights for value in grown.values()), (grown, weights)
    assert onnx.load(str(engine / ONNX_NAME), load_external_data=False).graph.node  # written whole
    onnx.checker.check_model(str(engine / ONNX_NAME))


@pytest.mark.slow
def test_an_already_quantized_checkpoint_is_dequantized_one_linear_at_a_time(wide, tmp_path):
    """The import of a GPTQ checkpoint of the wide model: its float32 weights written, never held (it held the whole
    float32 model and a float32 state dict beside it: 10.4 B/param at 0.23B parameters, measured 2026-11-29)."""
    from safetensors.numpy import load_file

    from tests.prequantized_checkpoints import rtn_linears, write_checkpoint

    float_state = load_file(wide / "model.safetensors")
    gptq = write_checkpoint(
        wide, tmp_path / "gptq", rtn_linears(float_state, 4, 128, True), "gptq_v2", 4, 128, False, True
    )
    del float_state
    weights = (wide / "model.safetensors").stat().st_size
    grown = growth("dequantize", gptq, tmp_path / "import")
    print(f"\nanonymous memory grown, of one float32 copy of the weights ({weights / 2**20:.0f} MiB): {grown}")
    assert grown < 0.5 * weights, (grown, weights)
    assert (tmp_path / "import" / "model.safetensors").stat().st_size == pytest.approx(weights, rel=0.01)


def test_a_graph_written_as_it_is_made_is_the_bytes_onnx_save_writes(tiny_llama, tmp_path):
    """The streamed export against the same graph loaded whole and saved by onnx with the stages' arguments: the
    data file and the graph's external-data fields are byte for byte the same."""
    graph.build(tiny_llama, tmp_path / "streamed" / ONNX_NAME)
    model = onnx.load(str(tmp_path / "streamed" / ONNX_NAME))
    (tmp_path / "saved").mkdir()
    onnx.save(
        model,
        str(tmp_path / "saved" / ONNX_NAME),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=ONNX_NAME + ".data",
        size_threshold=1024,
    )
    for name in (ONNX_NAME, ONNX_NAME + ".data"):
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "saved" / name).read_bytes(), name
