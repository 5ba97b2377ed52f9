"""SmoothQuant (Xiao et al. 2022, arXiv:2211.10438) for the fused graph's int8-activation matmuls.

MatMulNBits at accuracy level 4 quantizes its input to int8 in blocks along K, so one outlier channel coarsens its
whole block. SmoothQuant divides each input channel j by s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) and multiplies
the weight's row j by it: the product is unchanged in exact arithmetic, while the activations' range moves into the
weights, which have a scale per block of their own. The division is folded into what produces the input, so the
graph gains no node:
- a norm's gamma (RMSNormalization, SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization), for the
  matmuls that read the norm (qkv_proj, gate_up_proj, lm_head);
- the up half of a gated MLP (act(gate) * up), for down_proj: up's output columns are divided instead.
o_proj's input (the attention output) is left as it is: its channels could only be divided out of v_proj, one factor
per value channel shared by every query head of the group.

Written here because the library behind ONNX Runtime's own SmoothQuant option, neural-compressor's ORTSmoothQuant
(intel/neural-compressor, neural_compressor/adaptor/ox_utils/smooth_quant.py
@ 0b36bc5ca452de81c6715705696cf4e3ce54b757), absorbs scales only into an op whose weight is its second input: the
fused graph's skip norms (gamma third) and the gated MLP's product would each keep an extra Mul before the matmul,
on every decode step.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NORMS = {"RMSNormalization": 1, "SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2}  # -> gamma
PASS_THROUGH = {"Reshape", "Gather"}  # the head reads the final norm through a reshape and a row gather


@dataclass(frozen=True)
class Group:
    """One activation smoothed for every matmul that reads it."""

    tensor: str  # the activation (a norm's output, or the gated MLP's product)
    weights: tuple[str, ...]  # the reading matmuls' weight initializers, [K, N] with K the activation's channels
    divisor: str  # the initializer the scales are divided out of: a gamma [K] or the up projection's weight [*, N]
    columns: tuple[int, int]  # the divisor's slice that makes the activation's channels ([0, K) for a gamma)


def _maps(model):
    producers = {out: node for node in model.graph.node for out in node.output}
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return producers, readers


def _matmuls_reading(tensor: str, readers: dict) -> list | None:
    """The MatMuls that read `tensor` (as their first input, through reshapes and row gathers), or None when
    anything else reads it: scaling it would change that reader too."""
    found = []
    for node in readers.get(tensor, []):
        if node.op_type == "MatMul" and node.input[0] == tensor:
            found.append(node)
        elif node.op_type in PASS_THROUGH and node.input[0] == tensor:
            below = _matmuls_reading(node.output[0], readers)
            if below is None:
                return None
            found += below
        else:
            return None
    return found


def _up_half(product, producers: dict, readers: dict, initializers: dict) -> tuple[str, tuple[int, int]] | None:
    """The initializer and columns that make the `up` factor of a gated MLP's act(gate) * up: the second half of a
    fused gate_up projection split in two, or a projection of its own, read by nothing but this product. Dividing
    up's output channels divides the product's, whatever the other factor is."""

    def only_reader(tensor: str, node) -> bool:
        return [n.name for n in readers.get(tensor, [])] == [node.name]

    for side in product.input:
        source = producers.get(side)
        if source is None or not only_reader(side, product):
            continue
        if source.op_type == "Split" and len(source.output) == 2 and source.output[1] == side:
            fused = producers.get(source.input[0])
            if fused is None or fused.op_type != "MatMul" or fused.input[1] not in initializers:
                continue
            if not only_reader(fused.output[0], source):
                continue
            sizes = source.input[1] if len(source.input) > 1 else ""
            if sizes and (sizes not in initializers or len(set(_array(initializers[sizes]).tolist())) != 1):
                continue  # uneven parts: not a gate/up pair
            width = initializers[fused.input[1]].dims[-1]
            return fused.input[1], (width // 2, width)
        if source.op_type == "MatMul" and source.input[1] in initializers:
            return source.input[1], (0, initializers[source.input[1]].dims[-1])
    return None


def _array(initializer) -> np.ndarray:
    from onnx import numpy_helper

    return numpy_helper.to_array(initializer)


def groups(model) -> list[Group]:
    """Every activation of the graph that can be smoothed, and how (see the module docstring)."""
    producers, readers = _maps(model)
    initializers = {i.name: i for i in model.graph.initializer}

    def used_once(name: str) -> bool:
        return len(readers.get(name, [])) == 1

    found = []
    for node in model.graph.node:
        tensor = node.output[0] if node.output else ""
        if node.op_type in NORMS and len(node.input) > NORMS[node.op_type]:
            gamma = node.input[NORMS[node.op_type]]
            if gamma not in initializers:
                continue
            divisor, columns = gamma, (0, initializers[gamma].dims[0])
        elif node.op_type == "Mul":
            up = _up_half(node, producers, readers, initializers)
            if up is None:
                continue
            divisor, columns = up
        else:
            continue
        matmuls = _matmuls_reading(tensor, readers)
        if not matmuls or not used_once(divisor):
            continue
        weights = tuple(m.input[1] for m in matmuls)
        if all(w in initializers and used_once(w) for w in weights):
            found.append(Group(tensor, weights, divisor, columns))
    return found


@dataclass(frozen=True)
class Smoothing:
    """What the engine stage measured on the float graph, and the migration strength to fold it with."""

    maxima: dict[str, np.ndarray]  # activation -> per-channel max |x| over the calibration windows
    alpha: float

    def apply(self, model, store) -> dict:
        return fold(store, [g for g in groups(model) if g.tensor in self.maxima], self.maxima, self.alpha)


def measured(onnx_path: Path, hf_dir: Path, text: str, calibration, alpha: float, progress, scratch: Path) -> Smoothing:
    """The smoothing of the float graph at `onnx_path`, from its activations over `calibration`'s windows of `text`
    (tokenized by the checkpoint in `hf_dir`); `progress(items, description)` reports the passes, `scratch` (a
    directory on the graph's file system) holds the measuring graph meanwhile."""
    import onnx
    from transformers import AutoTokenizer

    from pipeline.fetch import calibration_windows

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    windows = calibration_windows(tokenizer, text, calibration.num_samples, calibration.seq_len)
    tensors = [g.tensor for g in groups(onnx.load(str(onnx_path), load_external_data=False))]
    passes = progress([w.numpy().astype(np.int64) for w in windows], "SmoothQuant: each activation's range")
    return Smoothing(activation_maxima(onnx_path, tensors, passes, scratch), alpha)


def activation_maxima(onnx_path: Path, tensors: list[str], windows, scratch: Path) -> dict:
    """Per-channel max |x| of each of `tensors` over a forward pass of the float graph on each token window; the
    graph with those tensors as outputs is written to a temporary directory in `scratch` beside a hard link to (or
    else a copy of) its weights, as ONNX Runtime reads external data only from the graph's own directory and not
    through a symbolic link."""
    import onnx

    from pipeline.targets.onnxruntime.scoring import empty_past, ort_session

    model = onnx.load(str(onnx_path), load_external_data=False)
    for name in tensors:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        for data in onnx_path.parent.glob(onnx_path.name + ".data"):
            try:
                os.link(data, Path(tmp) / data.name)
            except OSError:  # another file system
                shutil.copy2(data, Path(tmp) / data.name)
        onnx.save(model, str(Path(tmp) / onnx_path.name))
        session = ort_session(Path(tmp) / onnx_path.name)
        maxima = {name: None for name in tensors}
        for ids in windows:
            length = ids.shape[1]
            feeds = {
                "input_ids": ids,
                "seqlens_k": np.array([length - 1], dtype=np.int32),
                "total_sequence_length": np.array(length, dtype=np.int32),
                "logits_index": np.arange(length),
                **empty_past(session, 1),
            }
            for name, value in zip(tensors, session.run(tensors, feeds)):
                peak = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0)
                maxima[name] = peak if maxima[name] is None else np.maximum(maxima[name], peak)
    return maxima


def fold(store, found: list[Group], maxima: dict, alpha: float) -> dict:
    """Scale the graph's weights by each group's smoothing factors, one group's at a time through `store`
    (`external_data.Initializers`); what was done, for the build report."""
    factors = []
    for group in found:
        weights = [store.array(name) for name in group.weights]
        weight_peak = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
        scale = np.clip(maxima[group.tensor], 1e-5, None) ** alpha / np.clip(weight_peak, 1e-5, None) ** (1 - alpha)
        scale = np.clip(scale, 1e-5, None).astype(np.float32)
        for name, weight in zip(group.weights, weights):
            store.put(name, weight * scale[:, None])
        del weights
        divisor = store.array(group.divisor)
        start, stop = group.columns
        divisor[..., start:stop] /= scale
        store.put(group.divisor, divisor)
        factors.append(scale)
    spread = [float(s.max() / s.min()) for s in factors]
    return {
        "alpha": alpha,
        "smoothed_activations": len(found),
        "smoothed_matmuls": sum(len(g.weights) for g in found),
        "largest_scale_spread": round(max(spread), 1) if spread else None,
    }
