"""SmoothQuant on the fused graph (pipeline/targets/onnxruntime/smoothquant.py): which activations it smooths, that
folding its scales leaves the float graph's logits as they were, and that it lowers the int8-activation engine's
divergence where channels carry outliers; blocks per module (quantize_graph's module_group_sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from pipeline.quality import kl_divergence
from pipeline.targets.onnxruntime import ONNX_NAME, quantize, scoring, smoothquant
from pipeline.targets.onnxruntime import adapter as target
from pipeline.targets.onnxruntime.external_data import Initializers
from tests.conftest import TINY_FAMILIES, make_tiny


@pytest.fixture(scope="module")
def fused(tiny_llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fused")
    target.export_decoder(tiny_llama, out, "fused")
    return out


def token_windows(model_dir: Path, count: int = 4, length: int = 40) -> list[np.ndarray]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, size=(1, length)) for _ in range(count)]


def save(model, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(directory / ONNX_NAME), save_as_external_data=True, location=ONNX_NAME + ".data")
    return directory


def smoothing(export: Path, windows, scratch: Path, alpha: float = 0.5) -> smoothquant.Smoothing:
    tensors = [g.tensor for g in smoothquant.groups(onnx.load(str(export / ONNX_NAME)))]
    return smoothquant.Smoothing(smoothquant.activation_maxima(export / ONNX_NAME, tensors, windows, scratch), alpha)


def test_every_norm_read_by_matmuls_and_every_gated_mlp_product_is_smoothed(fused):
    model = onnx.load(str(fused / ONNX_NAME))
    found = {g.weights: g for g in smoothquant.groups(model)}
    layers = sum(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    assert len(found) == 3 * layers + 1  # qkv, gate_up and down per layer, and the head; o_proj is left alone
    head = found[("lm_head.weight_t",)]
    assert head.divisor == "model.norm.weight"
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        assert found[(f"{prefix}.self_attn.qkv_proj.weight_t",)].divisor == f"{prefix}.input_layernorm.weight"
        assert found[(f"{prefix}.mlp.gate_up_proj.weight_t",)].divisor == f"{prefix}.post_attention_layernorm.weight"
        down = found[(f"{prefix}.mlp.down_proj.weight_t",)]
        width = next(i for i in model.graph.initializer if i.name == down.divisor).dims[-1]
        assert down.divisor == f"{prefix}.mlp.gate_up_proj.weight_t" and down.columns == (width // 2, width)


def folded(export: Path, smoothing: smoothquant.Smoothing, directory: Path) -> tuple[dict, Path]:
    """The report of folding `smoothing` into the float graph in `export` as the engine stage does (one weight in
    memory at a time), and the folded graph's directory."""
    model = onnx.load(str(export / ONNX_NAME), load_external_data=False)
    directory.mkdir(parents=True, exist_ok=True)
    store = Initializers(model, export, directory / "unsaved.data")
    report = smoothing.apply(model, store)
    store.save(directory / ONNX_NAME)
    return report, directory


def test_folding_the_scales_leaves_the_float_graphs_logits_as_they_were(fused, tiny_llama, tmp_path):
    windows = token_windows(tiny_llama)
    before = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(fused / ONNX_NAME)).graph.initializer}
    report, smoothed_dir = folded(fused, smoothing(fused, windows, tmp_path), tmp_path / "smoothed")
    model = onnx.load(str(smoothed_dir / ONNX_NAME))
    assert report["smoothed_activations"] == report["smoothed_matmuls"] == len(smoothquant.groups(model))
    assert report["largest_scale_spread"] > 1
    changed = [i.name for i in model.graph.initializer if not np.array_equal(numpy_helper.to_array(i), before[i.name])]
    assert "lm_head.weight_t" in changed and "model.norm.weight" in changed
    assert sorted(before) == sorted(i.name for i in model.graph.initializer)
    smoothed = scoring.ort_logits_fn(smoothed_dir / ONNX_NAME)
    reference = scoring.ort_logits_fn(fused / ONNX_NAME)
    for ids in windows:
        np.testing.assert_allclose(smoothed(ids), reference(ids), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("arch", sorted(TINY_FAMILIES))
def test_every_familys_fused_graph_keeps_its_logits_when_smoothed(arch, tmp_path):
    """Qwen2's q/k/v biases, Qwen3's per-head q/k norms, Gemma 3's norms around attention and gelu MLP, Phi-3's fused
    projections: whatever is smoothed, the float graph computes what it did."""
    hf_dir = make_tiny(arch, tmp_path / "hf", initializer_range=0.1)
    export = tmp_path / "fused"
    target.export_decoder(hf_dir, export, "fused")
    model = onnx.load(str(export / ONNX_NAME))
    found = smoothquant.groups(model)
    layers = sum(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    assert len(found) == 3 * layers + 1, [g.weights for g in found]  # qkv, gate_up and down per layer, the head
    windows = token_windows(hf_dir, count=3)
    smoothed = scoring.ort_logits_fn(
        folded(export, smoothing(export, windows, tmp_path), tmp_path / "smoothed")[1] / ONNX_NAME
    )
    reference = scoring.ort_logits_fn(export / ONNX_NAME)
    for ids in windows:
        np.testing.assert_allclose(smoothed(ids), reference(ids), rtol=1e-3, atol=1e-4)


def test_smoothing_lowers_the_int8_engines_divergence_where_channels_carry_outliers(fused, tiny_llama, tmp_path):
    """Every norm amplifies two channels 30x, as trained models' massive activations do: int8 activations in blocks
    of 32 lose the other channels of those blocks, unless the outliers are first moved into the weights."""
    model = onnx.load(str(fused / ONNX_NAME))
    for initializer in model.graph.initializer:
        if initializer.name.endswith("layernorm.weight") or initializer.name == "model.norm.weight":
            gamma = numpy_helper.to_array(initializer).copy()
            gamma[[3, 17]] *= 30
            initializer.CopyFrom(numpy_helper.from_array(gamma, initializer.name))
    export = save(model, tmp_path / "outliers")
    windows = token_windows(tiny_llama, count=6)
    engines = {
        "rtn": quantize.quantize_graph(export, tmp_path / "rtn", weights="int8", group_size=32),
        "smoothquant": quantize.quantize_graph(
            export,
            tmp_path / "smoothquant",
            weights="int8",
            method="smoothquant",
            group_size=32,
            smoothing=smoothing(export, windows[:3], tmp_path),
        ),
    }
    assert engines["smoothquant"]["smoothquant"]["smoothed_matmuls"] > 0
    reference = scoring.ort_logits_fn(export / ONNX_NAME)
    divergence = {}
    for name in engines:
        engine = scoring.ort_logits_fn(tmp_path / name / ONNX_NAME)
        held_out = windows[3:]  # not the windows the scales were measured on
        divergence[name] = np.mean([kl_divergence(reference(ids)[0], engine(ids)[0]).mean() for ids in held_out])
    assert divergence["smoothquant"] < 0.5 * divergence["rtn"], divergence


def test_modules_get_their_own_blocks_and_excluded_ones_stay_float(fused, tmp_path):
    metrics = quantize.quantize_graph(
        fused,
        tmp_path,
        weights="int4",
        group_size=32,
        exclude_modules=["*.o_proj"],
        int8_modules=["lm_head"],
        module_group_sizes={"*.down_proj": 64, "*.mlp.*": 128, "lm_head": 128},  # the first match wins
    )
    nodes = onnx.load(str(tmp_path / ONNX_NAME), load_external_data=False).graph.node
    blocks = {}
    for node in nodes:
        if node.op_type == "MatMulNBits":
            attributes = {a.name: a.i for a in node.attribute}
            blocks[quantize.module_name(node.name).rsplit(".", 1)[-1]] = (attributes["bits"], attributes["block_size"])
    assert blocks == {"qkv_proj": (4, 32), "gate_up_proj": (4, 128), "down_proj": (4, 64), "lm_head": (8, 32)}
    assert all(n.op_type == "MatMul" for n in nodes if "o_proj" in n.name)  # not rounded by the int8 pass either
    assert sorted(set(metrics["resized_blocks"].values())) == [64, 128]
