"""Sizes the memory plans share: the GPUs users target (the config offers them), bytes per element of the float
dtypes, and the parameter counts of a checkpoint's shape. The plans themselves, with the bytes per parameter of their
weight formats, are their targets' (`pipeline.targets.trtllm.gpu_memory`: does a build fit its GPU;
`pipeline.targets.onnxruntime.serving_memory`: a CPU server's host memory; each target's `build_memory`: its stages'
part of the build's plan) and the builds' (`pipeline.host_memory`)."""

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
