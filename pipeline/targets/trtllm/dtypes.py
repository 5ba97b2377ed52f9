"""The dtype the trtllm target deploys a model in: `model.dtype`, or with `auto` the checkpoint's own.

`auto` follows the imported checkpoint as TensorRT-LLM's engine workflow follows a Hugging Face checkpoint's
`torch_dtype` (its converters' `infer_dtype`; upstream/trtllm_dtype.json `engine`, one main-line reading applied to
0.21-1.2): bfloat16 stays bfloat16 (a model trained in it can overflow float16's range), float16 stays float16,
and float32 (a GGUF's dequantized weights, a float32 checkpoint) becomes float16, the GPU's half precision. The
PyTorch backend maps no dtype: its model runs in the pretrained config's `torch_dtype`, bfloat16 where that is None
(`pytorch`), so it runs in the dtype the pipeline exports the unified checkpoint in and names in its config.json
(unified_export.repair_config writes `torch_dtype` for the containers' older transformers); a float32 checkpoint
runs in float16 there too. tests/targets/test_trtllm_dtypes.py checks AUTO against every tabulated release; it stays
a constant because the releases targeted before 0.21 are not tabulated. One feature needs float16 whatever the
checkpoint: the engine workflow's LoRA, whose `tensorrt_llm` model declares its LoRA weights TYPE_FP16 and whose
.npy loader reads no bfloat16 (lora_conversion._engine_problems).
"""

from __future__ import annotations

from collections import Counter
from math import prod
from pathlib import Path

from pipeline.safetensors_files import tensor_headers

SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# a stored dtype -> the dtype `auto` deploys it in (upstream/trtllm_dtype.json: infer_dtype's `auto` of every release)
AUTO = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float16"}


def checkpoint_dtype(hf_dir: Path) -> str:
    """The torch dtype most of the checkpoint's floating-point values are stored in, read from the safetensors
    headers (config.json's dtype may name the dtype the pipeline computes in rather than the one on disk)."""
    stored = Counter()
    for dtype, shape in tensor_headers(Path(hf_dir)).values():
        stored[dtype] += prod(shape)
    floats = {dtype: count for dtype, count in stored.items() if dtype in SAFETENSORS_FLOATS}
    return SAFETENSORS_FLOATS[max(floats, key=floats.get)]


def needs_float16(cfg) -> bool:
    """Whether a feature of the config takes only float16: LoRA on the engine workflow."""
    return cfg.lora is not None and cfg.target.trtllm_backend == "tensorrt"


def deployed_dtype(cfg, checkpoint: Path | None = None) -> str:
    """The dtype of the deployed checkpoint and engine. With `model.dtype: auto` it is read from `checkpoint` (the
    imported or kept checkpoint directory), which only a config needing float16 may leave out."""
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    if needs_float16(cfg):
        return "float16"
    if checkpoint is None:
        raise ValueError("model.dtype auto follows the checkpoint: pass its directory")
    return AUTO[checkpoint_dtype(checkpoint)]
