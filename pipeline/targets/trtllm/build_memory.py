"""The trtllm target's part of the build's memory plan (`pipeline.host_memory`): ModelOpt's calibration and unified
export (with ModelOpt's libraries), the quality gate's forward of the exported checkpoint on CPU, and trtllm-build
staging the checkpoint on the host."""

from __future__ import annotations

from pipeline.host_memory import (
    COEFFICIENTS,
    SCORED_WINDOW,
    CheckpointShape,
    Phases,
    calibration_phase,
    forward_bytes,
    reference_phase,
    streamed_bytes,
)
from pipeline.targets.trtllm.gpu_memory import weight_bytes_per_param


def build_phases(name: str, cfg, shape: CheckpointShape) -> tuple[Phases, int] | None:
    """(stage `name`'s phases; the bytes it writes), or None for a stage that writes configs and tokenizer files."""
    q = cfg.quantization
    table_copies = 1 if shape.tied else 2
    linear = shape.parameters - table_copies * shape.embedding
    checkpoint = int(
        linear * weight_bytes_per_param(q.weights, q.group_size, shape.compute_bytes)
        + table_copies * shape.embedding * shape.compute_bytes
    )
    if name == "quantize":  # writes ModelOpt's quantizer state: a float32 amax per output channel of every linear
        seq_len = q.calibration.seq_len if q.calibration else SCORED_WINDOW
        calibration = {  # modelopt.calibrate: float32 forward passes, whatever the checkpoint's dtype
            "ModelOpt calibration of the float32 model": calibration_phase(shape, 4 * shape.parameters, seq_len, "")
        }
        return _with_modelopt(calibration), linear // shape.facts.hidden_size * 4
    if name == "export":  # the unified export, tensor by tensor, of the model with its quantizers restored
        export = {
            "the export of the model in its dtype": (shape.compute_bytes * shape.parameters + streamed_bytes(shape), "")
        }
        return _with_modelopt(export | gate_phases(cfg, shape)), checkpoint
    if name == "engine" and cfg.target.trtllm_backend == "tensorrt":  # trtllm-build stages the checkpoint on the host
        return {"trtllm-build reading the checkpoint": (checkpoint, "")}, checkpoint
    if name == "lora":  # each adapter gated as the base model is: its merged reference, then the checkpoint with it
        return gate_phases(cfg, shape), COEFFICIENTS.side_files_bytes
    return None


def gate_phases(cfg, shape: CheckpointShape) -> Phases:
    """The quality gate's two models, one at a time: the reference, released, then the checkpoint dequantized for a
    float32 forward (targets/trtllm/reference.py)."""
    matmuls = shape.parameters - (0 if shape.tied else shape.embedding)
    window = forward_bytes(shape, SCORED_WINDOW)
    checkpoint_run = int(4 * shape.parameters + COEFFICIENTS.trtllm_export_unexplained * matmuls + window)
    return reference_phase(cfg, shape) | {
        "the quality gate's run of the checkpoint, dequantized to float32": (checkpoint_run, "")
    }


def _with_modelopt(phases: Phases) -> Phases:
    """Phases of a stage that imports ModelOpt, whose libraries it holds throughout."""
    return {name: (held + COEFFICIENTS.modelopt_bytes, setting) for name, (held, setting) in phases.items()}
