"""Checkpoints that arrive already quantized: GPTQ, AWQ and compressed-tensors W4A16/W8A16 as the Hub ships them.

A Hugging Face checkpoint says so in config.json's `quantization_config` (transformers' quantizers dispatch on its
`quant_method`). `detect` reads that block into a `CheckpointQuantization` without loading a tensor; the packings
themselves are unpacked by `pipeline.prequantized_packing` (each layout cited there); what each target does with
them: docs/targets.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import CheckpointError

METHODS = ("gptq", "awq", "compressed-tensors")
QUANTIZED_DIR = "quantized"  # <output>/import/quantized/: the import stage's copy of the checkpoint's own files


@dataclass(frozen=True)
class CheckpointQuantization:
    """What an already-quantized checkpoint holds, in the packing's own terms.

    packing: "gptq_v1" (zero points stored minus one, the AutoGPTQ/GPTQModel default), "gptq_v2" (stored as they
    are), "awq_gemm" (AutoAWQ's GEMM version: columns packed in its interleaved order) or "pack_quantized"
    (compressed-tensors). group_size -1 means one scale per output channel. desc_act: rows were quantized in
    activation order, so `g_idx` maps each input row to its group.
    """

    method: str
    packing: str
    bits: int
    group_size: int
    desc_act: bool
    symmetric: bool
    skipped_modules: tuple[str, ...] = ()

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        order = ", act-order" if self.desc_act else ""
        zeros = "symmetric" if self.symmetric else "asymmetric"
        return f"{self.method} int{self.bits} ({group}{order}, {zeros}; {self.packing} packing)"


@dataclass
class QuantizedLinear:
    """One linear layer's integer weights, whatever the packing: weight[o, i] = (codes[o, i] - zeros[o, g]) *
    scales[o, g] with g = g_idx[i] (or i // group_size without g_idx). `zeros` are the zero points themselves (GPTQ
    v1's stored-minus-one undone; a symmetric checkpoint's implied 2**(bits-1)); `scales` keep the checkpoint's
    dtype, so an engine can hold them bit for bit."""

    codes: np.ndarray  # uint8 [out, in], each in [0, 2**bits)
    scales: np.ndarray  # float16/bfloat16-as-float32/float32 [out, groups]
    zeros: np.ndarray  # uint8 [out, groups]
    g_idx: np.ndarray | None  # int32 [in]; None: contiguous groups
    bits: int
    group_size: int  # the rows per group; -1: one group (per output channel)
    bias: np.ndarray | None = None

    def groups(self) -> np.ndarray:
        """The group of each input row."""
        rows = self.codes.shape[1]
        if self.g_idx is not None:
            return self.g_idx.astype(np.int64)
        size = rows if self.group_size == -1 else self.group_size
        return np.arange(rows) // size

    def dequantize(self) -> np.ndarray:
        """float32 [out, in], exact: an integer below 2**bits times a float16 scale is a float32."""
        g = self.groups()
        codes = self.codes.astype(np.float32)
        return (codes - self.zeros[:, g].astype(np.float32)) * self.scales[:, g].astype(np.float32)


def detect(hf_dir: Path) -> CheckpointQuantization | None:
    """The checkpoint's quantization per its config.json, None for a float checkpoint; CheckpointError names the
    field when the block is one this pipeline cannot read."""
    config_file = hf_dir / "config.json"
    try:
        block = json.loads(config_file.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError):
        return None  # the import stage's checks name an unreadable config.json
    if not block:
        return None
    where = f"{config_file}: quantization_config"
    method = block.get("quant_method")
    if method == "gptq":
        return _gptq(block, where)
    if method == "awq":
        return _awq(block, where)
    if method == "compressed-tensors":
        return _compressed_tensors(block, where)
    raise CheckpointError(
        f"{where}.quant_method is {method!r}; the checkpoints this pipeline imports as they are: "
        f"{', '.join(METHODS)}. Use the float checkpoint instead and quantize it with quantization.weights"
    )


def _bits(block: dict, where: str, key: str = "bits", default: int | None = None) -> int:
    bits = block.get(key, default)
    if bits not in (4, 8):
        raise CheckpointError(f"{where}.{key} is {bits!r}; 4 and 8 bits can be imported")
    return bits


def _gptq(block: dict, where: str) -> CheckpointQuantization:
    # transformers' GPTQConfig lowercases checkpoint_format; GPTQModel also writes it as `format`
    packing = str(block.get("checkpoint_format", block.get("format", "gptq"))).lower()
    if packing not in ("gptq", "gptq_v2"):
        raise CheckpointError(
            f"{where}.checkpoint_format is {packing!r}; gptq (v1) and gptq_v2 packings can be imported"
        )
    if block.get("pack_dtype", "int32") != "int32":
        raise CheckpointError(f"{where}.pack_dtype is {block['pack_dtype']!r}; codes packed in int32 words only")
    return CheckpointQuantization(
        method="gptq",
        packing="gptq_v1" if packing == "gptq" else "gptq_v2",
        bits=_bits(block, where),
        group_size=int(block.get("group_size", 128)),
        desc_act=bool(block.get("desc_act", False)),
        symmetric=bool(block.get("sym", True)),
    )


def _awq(block: dict, where: str) -> CheckpointQuantization:
    version = str(block.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointError(f"{where}.version is {version!r}; AWQ's gemm packing can be imported")
    if _bits(block, where, default=4) != 4:
        raise CheckpointError(f"{where}.bits is {block['bits']!r}; AWQ's gemm packing holds 4-bit codes only")
    if not block.get("zero_point", True):
        raise CheckpointError(f"{where}.zero_point is false; AWQ's gemm packing is written with zero points only")
    return CheckpointQuantization(
        method="awq",
        packing="awq_gemm",
        bits=4,
        group_size=int(block.get("group_size", 128)),
        desc_act=False,
        symmetric=False,
        skipped_modules=tuple(block.get("modules_to_not_convert") or ()),
    )


def _compressed_tensors(block: dict, where: str) -> CheckpointQuantization:
    if block.get("format") != "pack-quantized":
        raise CheckpointError(
            f"{where}.format is {block.get('format')!r}; compressed-tensors' pack-quantized (W4A16/W8A16) can be "
            "imported"
        )
    groups = block.get("config_groups") or {}
    if len(groups) != 1:
        raise CheckpointError(f"{where}.config_groups has {len(groups)} groups; one (every linear alike) is supported")
    scheme = next(iter(groups.values()))
    weights = scheme.get("weights") or {}
    if scheme.get("input_activations"):
        raise CheckpointError(f"{where}: activations are quantized too; weight-only schemes (W4A16, W8A16) only")
    if weights.get("type", "int") != "int":
        raise CheckpointError(f"{where}: weights.type is {weights['type']!r}; integer weights only")
    group_size = weights.get("group_size")
    inferred = {None: "tensor", -1: "channel"}.get(group_size, "group")  # compressed-tensors' own inference
    strategy = weights.get("strategy") or inferred
    if strategy not in ("group", "channel"):
        raise CheckpointError(f"{where}: weights.strategy is {strategy!r}; group or channel can be imported")
    return CheckpointQuantization(
        method="compressed-tensors",
        packing="pack_quantized",
        bits=_bits(weights, f"{where}.weights", "num_bits", default=8),
        group_size=int(group_size) if strategy == "group" else -1,
        desc_act=weights.get("actorder") in (True, "group", "dynamic"),  # "weight"/"static" store no g_idx
        symmetric=bool(weights.get("symmetric", True)),
        skipped_modules=tuple(block.get("ignore") or ()),
    )


def of_config(cfg) -> CheckpointQuantization | CheckpointError | None:
    """What the configured Hugging Face checkpoint is already quantized with; None for a float one or another
    source; the CheckpointError saying why when its quantization_config cannot be read."""
    if cfg.model.source != "hf" or cfg.model.path is None:
        return None
    try:
        return detect(cfg.resolve_path(cfg.model.path))
    except CheckpointError as exc:
        return exc


def kept(cfg) -> CheckpointQuantization | None:
    """The checkpoint's quantization where the engine keeps its weights as they are (checkpoint_quantization:
    keep); None otherwise, an unreadable block included (validate names it)."""
    detected = of_config(cfg) if cfg.quantization.checkpoint_quantization == "keep" else None
    return detected if isinstance(detected, CheckpointQuantization) else None


def config_problems(cfg, detected: CheckpointQuantization | None) -> list[tuple[tuple, str]]:
    """The target-neutral rules between the quantization section and what the checkpoint already is."""
    q = cfg.quantization
    if detected is None:
        out = []
        if q.method == "compressed-tensors":
            out.append(
                (
                    ("quantization", "method"),
                    "describes an imported compressed-tensors checkpoint, but the model's "
                    "config.json has no quantization_config; use rtn, gptq or hqq",
                )
            )
        if "checkpoint_quantization" in q.model_fields_set:
            out.append(
                (
                    ("quantization", "checkpoint_quantization"),
                    "has no effect: the model's config.json has no "
                    "quantization_config (it is not quantized); remove it",
                )
            )
        return out
    if q.checkpoint_quantization == "dequantize":
        if q.method == "compressed-tensors":
            return [
                (
                    ("quantization", "method"),
                    "checkpoint_quantization is dequantize, so this pipeline quantizes "
                    "the float weights anew: pick rtn, gptq, hqq or awq (or weights: none)",
                )
            ]
        return []
    wanted = {"weights": f"int{detected.bits}", "method": detected.method, "group_size": detected.group_size}
    wrong = {key: value for key, value in wanted.items() if getattr(q, key) != value}
    out = []
    if wrong:
        setting = ", ".join(f"{key}: {value}" for key, value in wanted.items())
        out.append(
            (
                ("quantization", next(iter(wrong))),
                f"the checkpoint is already {detected.describe()} (its config.json quantization_config) and the "
                f"engine keeps those weights, so the quantization section must describe them: set {setting}; or "
                "set checkpoint_quantization: dequantize to quantize its float weights anew",
            )
        )
    if q.gptq is not None:
        out.append(
            (
                ("quantization", "gptq"),
                "applies when this pipeline runs GPTQ, but the checkpoint's weights are kept "
                "as they are; remove it (or set checkpoint_quantization: dequantize)",
            )
        )
    return out
