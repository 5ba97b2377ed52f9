"""Each stage's peak host memory and the disk it writes, predicted from the config and the checkpoint's headers, so that
`plan` shows them and `build` stops before a stage this machine cannot hold (exit 4) rather than being OOM-killed in it.

The stages stream (issue #46): import, the ONNX export, quantization and ModelOpt's export hold about one tensor at a
time; only the parts that run a model hold one, and one at a time (the quality gate's reference, released before the
engine runs). A stage's peak is then its libraries, plus the largest of its phases: a few float32 copies of the
largest tensor while converting, or the one model it runs with that run's activations and logits.

What is shared lives here: the checkpoint's shape, the fitted coefficients, the import (the same for every target)
and the pieces each target's phases are made of. A target's own stages are its `build_phases` (the onnxruntime
target's `build_memory.py`, the trtllm target's), so this module branches on no target.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline import prequantized
from pipeline.errors import CheckpointError, NotEnoughMemory, PipelineError
from pipeline.memory import DTYPE_BYTES, GiB, MiB, parameter_counts
from pipeline.models import ModelFacts, path_problem, read_gguf
from pipeline.quality import WINDOW as SCORED_WINDOW  # tokens the quality gate and the export's check run at once
from pipeline.safetensors_files import read_header
from pipeline.stages import STAGES
from pipeline.targets import target_of


@dataclass(frozen=True)
class Coefficients:
    """How each stage's peak grows with the model, fitted to `make bench-scale`'s table (bench_results/scale/,
    docs/benchmarks.md "Build cost at real sizes": peak anonymous RSS per stage at 0.5B and 1.1B parameters,
    2026-11-28; the import's on 2026-11-29); the plan's target is within 20% of every measured peak (the clean-clone
    run of 2026-11-29: 0.93-1.15 at every size and stage)."""

    # python, torch, transformers and onnxruntime imported and at work, with the tokenizer: what import and export
    # held beyond their weights at both sizes (0.37-0.38 GiB)
    libraries_bytes: int = int(0.4 * GiB)
    # a stage that runs no model (the repository, the manifests): 0.23 GiB measured
    light_libraries_bytes: int = int(0.25 * GiB)
    # ModelOpt imported on top of them (0.51 against 0.31 GiB for the imports alone, measured the same way)
    modelopt_bytes: int = int(0.2 * GiB)
    # float32 copies of the largest tensor a streaming stage holds at once
    streamed_tensor_copies: float = 1.0
    # the import of a float checkpoint: bytes per element of its largest tensor (read in its dtype, checked finite,
    # written) beside light libraries; fitted to bench scale's four sizes on 2026-11-29 (peak = 0.22 GiB + 5.1 bytes
    # x the token table: 0.46 GiB at 0.5B, 1.17 GiB at 8b-2l)
    imported_tensor_bytes: float = 5.0
    # bytes per matmul parameter trtllm's export stage holds beyond its gate's float32 checkpoint forward: measured
    # 1.3 at 0.5B-3B (bench scale, 2026-11-28), not yet accounted for (the export's model is freed: tested)
    trtllm_export_unexplained: float = 1.3
    # optimum-onnx's export traces the whole float32 model and builds its ONNX proto in memory before writing it: its
    # peak per parameter, measured on a 0.23B Llama (5.12 GiB, the fused graph's export 1.22 GiB; 2026-11-29)
    optimum_export_bytes_per_parameter: float = 23.6
    # tokens of the export's logits check (a few short prompts)
    check_tokens: int = 64
    # a forward's live float32 activations per token, in hidden sizes and intermediate sizes (residual, norm,
    # attention in and out; gate, up and their product)
    hidden_copies_per_token: float = 4.0
    intermediate_copies_per_token: float = 3.0
    # float32 logits of one scored window held at once: the model's, its log-softmax, and the other model's cached
    logits_copies: float = 3.0
    # an int8/int4 engine's files and side buffers (tokenizer, configs, ONNX protobuf) beside its weights
    side_files_bytes: int = 8 * MiB


COEFFICIENTS = Coefficients()
REFERENCE_DTYPES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Prediction:
    """One stage's predicted peak host memory and the bytes it writes to disk."""

    host_bytes: int
    disk_bytes: int
    lowered_by: str  # the setting that lowers the peak, e.g. verify.reference_dtype=bfloat16; "" when none does
    peak: str = ""  # what the stage holds at its peak


@dataclass(frozen=True)
class CheckpointShape:
    """What the predictions are computed from, read without loading a weight."""

    parameters: int  # stored elements, an untied lm_head included
    largest_tensor: int  # elements of the largest tensor (usually the embedding table)
    checkpoint_bytes: int  # the weights in the checkpoint's own dtype, as import keeps them on disk
    compute_bytes: int  # bytes per parameter of the dtype the pipeline computes in (model.dtype)
    stored_bytes: int  # bytes per element of the checkpoint's floating tensors
    embedding: int  # elements of the token-embedding table
    tied: bool  # the lm_head is the embedding table
    facts: ModelFacts


def _safetensors_headers(directory: Path) -> list[tuple[str, int, int]]:
    """(dtype, elements, bytes) of every tensor in the directory's *.safetensors headers (the data is not read)."""
    tensors = []
    for file in sorted(directory.glob("*.safetensors")):
        problem = path_problem(file, "regular file")  # opening a FIFO would wait for a writer forever
        if problem:
            raise ValueError(problem)
        for info in read_header(file)[0].values():
            begin, end = info["data_offsets"]
            tensors.append((info["dtype"], math.prod(info["shape"]), end - begin))
    return tensors


def checkpoint_shape(cfg) -> CheckpointShape | None:
    """The configured checkpoint's sizes from config.json, safetensors or GGUF headers, or the built-in model's facts;
    None when they cannot be read (the config's own checks say why)."""
    facts = cfg.model_facts()
    if facts is None:
        return None
    linear, embedding = parameter_counts(facts)
    largest = max(embedding, facts.hidden_size * facts.intermediate_size)
    tied, own_bytes = True, 4  # the built-in and GGUF checkpoints are dequantized to float32 (model.dtype auto)
    parameters = linear + embedding
    stored = None  # the checkpoint's bytes, where its headers give them
    if cfg.model.source == "hf":
        path = cfg.resolve_path(cfg.model.path)
        try:
            tensors = _safetensors_headers(path)
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # the config's checkpoint rule names what is wrong with it
        tied = bool(config.get("tie_word_embeddings", False))
        floats = [(elements, size) for dtype, elements, size in tensors if dtype in ("F64", "F32", "F16", "BF16")]
        if floats:
            own_bytes = round(sum(size for _, size in floats) / sum(elements for elements, _ in floats))
        else:  # pytorch_model*.bin, or a config.json alone (planning an 8B without its weights)
            own_bytes = DTYPE_BYTES.get(config.get("torch_dtype") or config.get("dtype"), 4)
        largest = max([largest, *(elements for _, elements, _ in tensors)])
        parameters = max(sum(elements for _, elements, _ in tensors), linear + embedding * (1 if tied else 2))
        stored = sum(size for _, _, size in tensors) or None
    elif cfg.model.source == "gguf":
        try:
            names = {tensor.name for tensor in read_gguf(cfg.resolve_path(cfg.model.path)).tensors}
        except CheckpointError:
            return None
        tied = "output.weight" not in names
        parameters = linear + embedding * (1 if tied else 2)
    compute = own_bytes if cfg.model.dtype == "auto" else DTYPE_BYTES[cfg.model.dtype]
    checkpoint = stored or parameters * own_bytes
    return CheckpointShape(parameters, largest, checkpoint, compute, own_bytes, embedding, tied, facts)


def forward_bytes(shape: CheckpointShape, tokens: int) -> int:
    """Live float32 activations of one forward over `tokens` tokens: the layer's hidden states and MLP intermediates,
    one head's attention scores at a time being a fraction of these, plus the logits."""
    f, c = shape.facts, COEFFICIENTS
    per_token = c.hidden_copies_per_token * f.hidden_size + c.intermediate_copies_per_token * f.intermediate_size
    return int(tokens * (per_token + c.logits_copies * f.vocab_size) * 4)


def streamed_bytes(shape: CheckpointShape) -> int:
    return int(COEFFICIENTS.streamed_tensor_copies * shape.largest_tensor * 4)


Phases = dict[str, tuple[int, str]]  # what a stage holds at a time -> (its bytes, the setting lowering it, or "")


def reference_phase(cfg, shape: CheckpointShape, float32_held: int | None = None) -> Phases:
    """The quality gate's first model, the reference, with one scored window's forward: `float32_held` where the
    target runs a float32 reference holding less than 4 B/param (the onnxruntime target's float32 graph)."""
    reference = REFERENCE_DTYPES[cfg.verify.reference_dtype]
    held = float32_held if reference == 4 and float32_held is not None else reference * shape.parameters
    return {
        f"the quality gate's {'float32' if reference == 4 else 'bfloat16'} reference ({reference} B/param)": (
            held + forward_bytes(shape, SCORED_WINDOW),
            "verify.reference_dtype=bfloat16" if reference == 4 else "",
        )
    }


def calibration_phase(shape: CheckpointShape, model_bytes: int, seq_len: int, model_setting: str) -> tuple[int, str]:
    """A calibration's model and the forward of one calibration sequence (pipeline.fetch.calibration_windows: batches
    of one, so num_samples changes the time, not the memory), with the setting lowering the larger of the two."""
    forward = forward_bytes(shape, seq_len)
    return (
        model_bytes + forward,
        "a smaller quantization.calibration.seq_len" if forward > model_bytes else model_setting,
    )


def _import_phases(cfg, shape: CheckpointShape) -> tuple[Phases, int]:
    """(the import's phases beside its libraries; the bytes it writes): the same for every target."""
    if isinstance(prequantized.of_config(cfg), prequantized.CheckpointQuantization):
        # each tensor read in its dtype and made float32 beside it (a 0.28B GPTQ checkpoint with float16
        # tables: 0.57 GiB measured, 2026-11-29); the import writes the float32 weights it stands for
        copying = (shape.stored_bytes + 4) * shape.largest_tensor
        return {"one tensor at a time, dequantized": (copying, "")}, 4 * shape.parameters
    if cfg.model.source == "hf":
        copying = int(COEFFICIENTS.imported_tensor_bytes * shape.largest_tensor)
        return {"one tensor at a time": (copying, "")}, shape.checkpoint_bytes
    # transformers dequantizes a GGUF whole (measured: SmolLM2's import held 973 MiB, 0.4 GiB + 4.4 B/param)
    whole = shape.parameters * shape.compute_bytes
    return {"the GGUF dequantized whole by transformers": (int(1.1 * whole), "")}, whole


def _stage_phases(name: str, cfg, shape: CheckpointShape) -> tuple[Phases, int]:
    """(the stage's phases beside its libraries; the bytes it writes): the import's, or the target's own; a stage
    the target plans nothing for writes configs and tokenizer files only."""
    if name == "import":
        return _import_phases(cfg, shape)
    return target_of(cfg).build_phases(name, cfg, shape) or ({}, COEFFICIENTS.side_files_bytes)


def predict(cfg) -> dict[str, Prediction]:
    """Stage name -> its prediction, for every stage this config runs (those on request included); empty when the
    checkpoint's sizes cannot be read."""
    shape = checkpoint_shape(cfg)
    if shape is None:
        return {}
    predictions = {}
    for name, stage in STAGES.items():
        if stage.applies(cfg) is not None:
            continue
        phases, disk = _stage_phases(name, cfg, shape)
        light = not phases or (name == "import" and cfg.model.source == "hf")  # no model code runs there
        libraries = COEFFICIENTS.light_libraries_bytes if light else COEFFICIENTS.libraries_bytes
        peak, (held, lowered_by) = max(phases.items(), key=lambda item: item[1][0], default=("libraries", (0, "")))
        predictions[name] = Prediction(libraries + held, disk, lowered_by, peak)
    return predictions


def build_peak_bytes(cfg) -> int:
    """The most host memory any stage of the build is predicted to hold (a build Job's memory request); 0 when the
    checkpoint's sizes cannot be read."""
    return max((prediction.host_bytes for prediction in predict(cfg).values()), default=0)


def shown_bytes(size: int) -> str:
    return f"{size / GiB:.2f} GiB" if size >= GiB else f"{size / MiB:,.0f} MiB"


def prediction_line(name: str, prediction: Prediction) -> str:
    return (
        f"{name}: peak host memory {shown_bytes(prediction.host_bytes)} ({prediction.peak}), "
        f"disk {shown_bytes(prediction.disk_bytes)}"
    )


AVAILABLE_MEMORY_ENV = "TRTLLM_PIPELINE_AVAILABLE_MEMORY"
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1 << 10, "MIB": MiB, "GIB": GiB}


def parse_size(text: str) -> int:
    """'1MiB', '16GiB', '512 MB' or a byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"{text!r} is not a size such as 512MiB or 16GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def available_memory() -> int:
    """Memory a stage may take here: $TRTLLM_PIPELINE_AVAILABLE_MEMORY when set, else what the kernel could give
    without swapping (psutil's `available`, /proc/meminfo's MemAvailable)."""
    override = os.environ.get(AVAILABLE_MEMORY_ENV)
    if override:
        try:
            return parse_size(override)
        except ValueError as exc:
            raise PipelineError(f"{AVAILABLE_MEMORY_ENV}: {exc}") from None
    import psutil

    return psutil.virtual_memory().available


def check_fits(name: str, prediction: Prediction, available: int) -> None:
    """Stop before stage `name` when its predicted peak exceeds what this machine has available."""
    if prediction.host_bytes <= available:
        return
    lower = (
        f"{prediction.lowered_by} lowers it"
        if prediction.lowered_by
        else "no setting lowers it: use a machine with more memory"
    )
    raise NotEnoughMemory(
        f"stage '{name}' would need about {shown_bytes(prediction.host_bytes)} of host memory at its peak "
        f"({prediction.peak}), but this machine has {shown_bytes(available)} available; {lower}, or run "
        "`build --ignore-memory-check` to try anyway"
    )
