"""The onnxruntime target's part of the build's memory plan (`pipeline.host_memory`): its export (the fused graph, or
optimum-onnx's), its engine (quantization one weight at a time, SmoothQuant's or GPTQ's calibration) and its quality
gate, whose second model is the engine with its runtime's buffers."""

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
from pipeline.targets.onnxruntime.serving_memory import engine_weight_bytes


def build_phases(name: str, cfg, shape: CheckpointShape) -> tuple[Phases, int] | None:
    """(stage `name`'s phases; the bytes it writes), or None for a stage that writes configs and tokenizer files."""
    if name == "export":
        if cfg.target.onnx_graph == "optimum":  # it holds the traced model and its proto (validate refuses > 1B)
            whole = int(COEFFICIENTS.optimum_export_bytes_per_parameter * shape.parameters)
            return {"optimum-onnx's export of the whole model": (whole, "target.onnx_graph=auto")}, 4 * shape.parameters
        check = "the export's logits check on the float32 graph (4 B/param)"
        phases = {"one tensor at a time": (streamed_bytes(shape), "")}
        phases[check] = (4 * shape.parameters + forward_bytes(shape, COEFFICIENTS.check_tokens), "")
        # the fused graph holds the table and the lm_head apart, tied or not
        return phases, 4 * (shape.parameters + (shape.embedding if shape.tied else 0))
    if name == "engine":
        built = engine_weight_bytes(cfg.quantization, shape.facts) + COEFFICIENTS.side_files_bytes
        return _engine_phases(cfg, shape), built
    if name == "lora":  # each adapter gated as the base model is: its merged reference, then the engine with it
        return gate_phases(cfg, shape), COEFFICIENTS.side_files_bytes
    return None


def onnx_graph_bytes(shape: CheckpointShape) -> int:
    """What ONNX Runtime holds of the exported float32 graph: every matmul's weight (the graph's lm_head is a matmul
    of its own, tied or not), but not the token table, which a Gather reads where the data file is mapped (measured:
    Llama-3.1-8B's widths, an untied 0.4B-parameter table, held 4.1 B/param less the table)."""
    return 4 * (shape.parameters - (0 if shape.tied else shape.embedding))


def gate_phases(cfg, shape: CheckpointShape) -> Phases:
    """The quality gate's two models, one at a time: the float32 graph (or a bfloat16 transformers reference),
    released, then the engine with its runtime's buffers."""
    f, b = shape.facts, cfg.build
    weights = engine_weight_bytes(cfg.quantization, f)
    # the engine's runner prefills at most max_num_tokens at once, and the gate gives it at most a window
    run = forward_bytes(shape, min(b.max_num_tokens, SCORED_WINDOW))
    kv_one_row = b.max_seq_len * f.num_hidden_layers * 2 * f.num_key_value_heads * f.head_size * 4
    setting = "a smaller build.max_num_tokens" if run > weights else ""
    return reference_phase(cfg, shape, onnx_graph_bytes(shape)) | {
        "the quality gate's run of the engine": (weights + run + kv_one_row, setting)
    }


def _engine_phases(cfg, shape: CheckpointShape) -> Phases:
    q, f = cfg.quantization, shape.facts
    phases = {"quantization, one weight at a time": (streamed_bytes(shape), "")}
    if q.calibration is not None and q.method in ("smoothquant", "gptq"):
        hessian = 2 * f.intermediate_size**2 * 4 if q.method == "gptq" else 0  # the widest layer's, and its inverse
        model = onnx_graph_bytes(shape) if q.method == "smoothquant" else 4 * shape.parameters  # gptq: transformers
        held, setting = calibration_phase(shape, model, q.calibration.seq_len, "")
        phases[f"{q.method} calibration over the float32 graph"] = (held + hessian, setting)
    return phases | gate_phases(cfg, shape)
