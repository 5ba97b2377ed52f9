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
from typing import Annotated, Literal, TypeVar, get_args

import numpy as np
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from pipeline.errors import CheckpointError, shown

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
        weight = self.codes.astype(np.float32)
        weight -= self.zeros[:, g]  # in place: one float32 [out, in] beside the codes, whatever the linear's size
        weight *= self.scales.astype(np.float32)[:, g]
        return weight


def detect(hf_dir: Path) -> CheckpointQuantization | None:
    """The checkpoint's quantization per its config.json, None for a float checkpoint; CheckpointError names the
    field, the value found and what can be imported when the block is one this pipeline cannot read."""
    config_file = hf_dir / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # the import stage's checks name an unreadable config.json
    block = config.get("quantization_config") if isinstance(config, dict) else None
    if block is None:
        return None
    where = f"{config_file}: quantization_config"
    if not isinstance(block, dict):
        raise CheckpointError(
            f"{where} is {shown(block)}: expected an object (quant_method, bits, group_size, ...) as the tool that "
            "quantized the checkpoint writes it; remove the key if the checkpoint is a float one"
        )
    method = block.get("quant_method")
    if method == "gptq":
        return _gptq(_validated(GptqBlock, block, config_file), where)
    if method == "awq":
        return _awq(_validated(AwqBlock, block, config_file), where)
    if method == "compressed-tensors":
        return _compressed_tensors(_validated(CompressedTensorsBlock, block, config_file), where)
    raise CheckpointError(
        f"{where}.quant_method is {shown(method)}; the checkpoints this pipeline imports as they are: "
        f"{', '.join(METHODS)}. Use the float checkpoint instead and quantize it with quantization.weights"
    )


def _lower(value):
    """Names compared case-insensitively, as transformers lowercases checkpoint_format and compressed-tensors its
    strategy, type and actorder."""
    return value.lower() if isinstance(value, str) else value


def _group_size(value: int) -> int:
    if value == 0 or value < -1:
        raise ValueError("a group size is positive, or -1")
    return value


GroupSize = Annotated[int, AfterValidator(_group_size)]
GROUP_SIZE = (
    "the input rows per group of scales, as the checkpoint was quantized: a positive integer (128 is usual), or -1 "
    "for one scale per output channel"
)
BOOLEAN = "true or false (a JSON boolean, not a string or number): "


class _Block(BaseModel):
    """Fields of a quantization_config block this pipeline reads, each in JSON's own type, with what to write as its
    description; fields it does not read (true_sequential, damp_percent, ...) are not checked. Strict, so that the
    string "false" is refused rather than guessed at: GPTQModel's QuantizeConfig takes bool(desc_act), which makes it
    true (ModelCloud/GPTQModel gptqmodel/quantization/config.py @ 007b793087646a7d9507be4e4c4411f65a274c67,
    `BaseQuantizeConfig.__post_init__`, which refuses a group_size of 0 or below -1 as this does)."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class GptqBlock(_Block):
    bits: Literal[4, 8] = Field(description="4 or 8, the bit widths this pipeline unpacks")
    group_size: GroupSize = Field(128, description=GROUP_SIZE)
    desc_act: bool = Field(False, description=BOOLEAN + "whether g_idx orders the input rows (act-order)")
    sym: bool = Field(True, description=BOOLEAN + "whether every zero point is 2**(bits-1)")
    checkpoint_format: str | None = Field(None, description="gptq (v1) or gptq_v2, a string")
    format: str | None = Field(None, description="gptq (v1) or gptq_v2 (GPTQModel's name for checkpoint_format)")
    pack_dtype: Literal["int32"] = Field("int32", description="int32: codes packed in int32 words only")


class AwqBlock(_Block):
    bits: Literal[4] = Field(4, description="4: AWQ's gemm packing holds 4-bit codes only")
    group_size: GroupSize = Field(128, description=GROUP_SIZE)
    zero_point: bool = Field(True, description=BOOLEAN + "AWQ's gemm packing is written with zero points (true)")
    version: Annotated[str, BeforeValidator(_lower)] = Field("gemm", description="gemm, AutoAWQ's packing")
    modules_to_not_convert: list[str] | None = Field(None, description="a list of module names left float, or null")


class CompressedTensorsWeights(_Block):
    num_bits: Literal[4, 8] = Field(8, description="4 or 8, the bit widths this pipeline unpacks")
    type: Annotated[str, BeforeValidator(_lower)] = Field("int", description="int: integer weights only")
    symmetric: bool = Field(True, description=BOOLEAN + "whether the zero points are left out (all the signed 0)")
    group_size: GroupSize | None = Field(None, description=GROUP_SIZE + " (null with strategy channel)")
    strategy: Annotated[str | None, BeforeValidator(_lower)] = Field(None, description="group or channel")
    actorder: Annotated[
        Literal[True, False, "group", "weight", "static", "dynamic"] | None, BeforeValidator(_lower)
    ] = Field(None, description="group, weight, static, dynamic, true, false or null (compressed-tensors' values)")


class CompressedTensorsScheme(_Block):
    weights: CompressedTensorsWeights | None = Field(
        None, description="an object (num_bits, type, symmetric, strategy, group_size, actorder)"
    )
    input_activations: dict | None = Field(None, description="null: weight-only schemes (W4A16, W8A16) only")


class CompressedTensorsBlock(_Block):
    format: Literal["pack-quantized"] = Field(
        description="pack-quantized: compressed-tensors' pack-quantized (W4A16/W8A16) can be imported"
    )
    config_groups: dict[str, CompressedTensorsScheme] = Field(
        {}, description="an object holding one scheme (an object with weights), applied to every linear"
    )
    ignore: list[str] | None = Field(None, description="a list of module names left float, or null")


B = TypeVar("B", bound=_Block)


def _validated(model: type[B], block: dict, config_file: Path) -> B:
    """`block` as `model`; CheckpointError names each field that is not, the value found and what to write."""
    try:
        return model.model_validate(block)
    except ValidationError as exc:
        problems = "; ".join(_field_problem(model, error) for error in exc.errors())
        raise CheckpointError(
            f"{config_file}: {problems}. Correct the quantization_config to what the checkpoint's tensors were "
            "quantized with (its quantizer writes it), or import the float checkpoint instead"
        ) from None


def _field_problem(model: type[BaseModel], error) -> str:
    """One pydantic error as the field, the value found and the field's description (what to write there)."""
    field, owner = None, model
    for key in error["loc"]:  # a key that names no field is a dict's (config_groups' group name)
        if owner is not None and key in owner.model_fields:
            field = owner.model_fields[key]
            owner = next((t for t in _types(field.annotation) if issubclass(t, BaseModel)), None)
    found = "missing" if error["type"] == "missing" else shown(error["input"])
    wanted = field.description if field is not None else error["msg"]
    return f"quantization_config.{'.'.join(map(str, error['loc']))} is {found}, expected {wanted}"


def _types(annotation) -> list[type]:
    """The classes an annotation names, through Optional, dict[...] and Annotated."""
    if isinstance(annotation, type) and not get_args(annotation):
        return [annotation]
    return [t for arg in get_args(annotation) for t in _types(arg)]


def _gptq(block: GptqBlock, where: str) -> CheckpointQuantization:
    # transformers' GPTQConfig lowercases checkpoint_format; GPTQModel also writes it as `format`
    packing = (block.checkpoint_format or block.format or "gptq").lower()
    if packing not in ("gptq", "gptq_v2"):
        raise CheckpointError(
            f"{where}.checkpoint_format is {packing!r}; gptq (v1) and gptq_v2 packings can be imported"
        )
    return CheckpointQuantization(
        method="gptq",
        packing="gptq_v1" if packing == "gptq" else "gptq_v2",
        bits=block.bits,
        group_size=block.group_size,
        desc_act=block.desc_act,
        symmetric=block.sym,
    )


def _awq(block: AwqBlock, where: str) -> CheckpointQuantization:
    if block.version != "gemm":
        raise CheckpointError(f"{where}.version is {block.version!r}; AWQ's gemm packing can be imported")
    if not block.zero_point:
        raise CheckpointError(f"{where}.zero_point is false; AWQ's gemm packing is written with zero points only")
    return CheckpointQuantization(
        method="awq",
        packing="awq_gemm",
        bits=4,
        group_size=block.group_size,
        desc_act=False,
        symmetric=False,
        skipped_modules=tuple(block.modules_to_not_convert or ()),
    )


def _compressed_tensors(block: CompressedTensorsBlock, where: str) -> CheckpointQuantization:
    groups = block.config_groups
    if len(groups) != 1:
        raise CheckpointError(f"{where}.config_groups has {len(groups)} groups; one (every linear alike) is supported")
    name, scheme = next(iter(groups.items()))
    weights = scheme.weights or CompressedTensorsWeights()
    where = f"{where}.config_groups.{name}"
    if scheme.input_activations:
        raise CheckpointError(f"{where}: activations are quantized too; weight-only schemes (W4A16, W8A16) only")
    if weights.type != "int":
        raise CheckpointError(f"{where}.weights.type is {weights.type!r}; integer weights only")
    inferred = {None: "tensor", -1: "channel"}.get(weights.group_size, "group")  # compressed-tensors' own inference
    strategy = weights.strategy or inferred
    if strategy not in ("group", "channel"):
        raise CheckpointError(f"{where}.weights.strategy is {strategy!r}; group or channel can be imported")
    if (strategy == "group") != (inferred == "group"):
        raise CheckpointError(
            f"{where}.weights.group_size is {shown(weights.group_size)} with strategy {strategy}; expected "
            + ("a positive group size" if strategy == "group" else "null or -1 (one scale per output channel)")
        )
    return CheckpointQuantization(
        method="compressed-tensors",
        packing="pack_quantized",
        bits=weights.num_bits,
        group_size=weights.group_size if strategy == "group" else -1,
        desc_act=weights.actorder in (True, "group", "dynamic"),  # "weight"/"static" store no g_idx
        symmetric=weights.symmetric,
        skipped_modules=tuple(block.ignore or ()),
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
