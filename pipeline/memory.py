"""Sizes the memory plans share: the GPUs users target, bytes per parameter of each weight format, and the parameter
counts of a checkpoint's shape. The plans themselves are their targets' (`pipeline.targets.trtllm.gpu_memory`: does a
build fit its GPU; `pipeline.targets.onnxruntime.serving_memory`: a CPU server's host memory) and the builds'
(`pipeline.host_memory`)."""

from __future__ import annotations

GiB = 1 << 30
MiB = 1 << 20
# Usable memory of the GPUs users target (GiB as reported by nvidia-smi, rounded down).
GPUS = {
    "H100-80GB": 79,
    "H200-141GB": 139,
    "A100-80GB": 79,
    "A100-40GB": 39,
    "L40S": 44,
    "L4": 22,
    "A10G": 22,
    "RTX-4090": 23,
}
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def parameter_counts(f) -> tuple[int, int]:
    """(linear-layer parameters of all decoder layers, embedding table parameters)."""
    kv_heads = f.num_key_value_heads
    per_layer = (
        f.hidden_size * (f.num_attention_heads + 2 * kv_heads) * f.head_size  # qkv
        + f.num_attention_heads * f.head_size * f.hidden_size  # dense
        + 3 * f.hidden_size * f.intermediate_size
    )  # fc, gate, proj
    return per_layer * f.num_hidden_layers, f.vocab_size * f.hidden_size


def weight_bytes_per_param(weights: str, group_size: int, dtype_bytes: int) -> float:
    return {"none": dtype_bytes, "fp8": 1.0, "int8": 1.0, "int4": 0.5 + 4 / group_size, "nvfp4": 0.5 + 1 / 16}[
        weights
    ]  # + scales


def cpu_weight_bytes_per_param(weights: str, group_size: int) -> float:
    """MatMulNBits: packed weights plus one float32 scale per block (int4 adds a 4-bit zero point per block)."""
    return {"none": 4.0, "int8": 1 + 4 / group_size, "int4": 0.5 + 4.5 / group_size}[weights]


def cpu_engine_weight_bytes(quantization, facts) -> int:
    """The weights of an onnxruntime engine (MatMulNBits); the lm_head is a quantized linear, tied or not."""
    linear, embedding = parameter_counts(facts)
    per_param = cpu_weight_bytes_per_param(quantization.weights, quantization.group_size)
    table = embedding * (per_param if quantization.quantize_embedding else 4.0)
    return int((linear + embedding) * per_param + table)
