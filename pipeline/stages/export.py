"""Stage `export`: the imported checkpoint in the target's format.

onnxruntime: an ONNX decoder with KV cache (`model.onnx`): the fused Llama graph of
`pipeline/targets/llama_onnx.py` or optimum-onnx's export (`target.onnx_graph`), checked by
`onnx.checker` and by comparing ONNX Runtime logits with transformers' on a few prompts; the build
fails past `verify.max_export_logits_diff`. trtllm: a TensorRT-LLM checkpoint (lands with that target).
Inputs: `model.dtype`, `target`, `parallel`, the tolerance, the `import` output.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import BuildConfig
from pipeline.errors import StageError

NAME = "export"
READS = ("model.dtype", "target", "parallel", "verify")
TOOLS = ("torch", "transformers", "onnx", "onnxruntime", "optimum-onnx")
TARGETS = ("onnxruntime", "trtllm")

# Short, varied prompts: plain prose, code-like text and the chat template's special tokens.
CHECK_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
)


def applies(cfg: BuildConfig) -> str | None:
    return None


def deps(cfg: BuildConfig) -> list[Path]:
    return []


def writes(cfg: BuildConfig) -> str:
    if cfg.target.name == "onnxruntime":
        return "ONNX decoder with KV cache (model.onnx)"
    return f"TensorRT-LLM checkpoint (config.json, rank0..{cfg.parallel.tp_size * cfg.parallel.pp_size - 1}.safetensors)"


def run(cfg: BuildConfig, ctx) -> dict:
    return run_trtllm(cfg, ctx) if cfg.target.name == "trtllm" else run_onnxruntime(cfg, ctx)


def run_trtllm(cfg: BuildConfig, ctx) -> dict:
    """TensorRT-LLM + unified HF checkpoints with ModelOpt, then conformance and the quality gate."""
    from pipeline.targets import trtllm
    from pipeline.trtllm_checkpoint import check_checkpoint
    from pipeline.verify import checkpoint_gate

    quantized = ctx.upstream("quantize") if (ctx.upstream("quantize") / "modelopt_state.pth").is_file() else None
    hf_dir = ctx.upstream("import")
    dtype = trtllm.CHECKPOINT_DTYPES[cfg.model.dtype]
    p = cfg.parallel
    ctx.log(f"exporting a {dtype} TensorRT-LLM checkpoint for tp={p.tp_size} pp={p.pp_size} and a unified HF checkpoint (ModelOpt)")
    model = trtllm.load_calibrated(hf_dir, quantized)
    checkpoint, _ = trtllm.export_checkpoints(model, ctx.out_dir, dtype, p.tp_size, p.pp_size)
    del model
    problems = check_checkpoint(checkpoint, hf_dir, cfg)
    if problems:
        raise StageError(NAME, f"{checkpoint} does not conform to TensorRT-LLM {cfg.target.trtllm_version}:\n  " + "\n  ".join(problems))
    ctx.log(f"checkpoint conforms to TensorRT-LLM {cfg.target.trtllm_version}: every tensor name, dtype and shape on every rank")
    return checkpoint_gate(cfg, hf_dir, checkpoint, ctx)


def run_onnxruntime(cfg: BuildConfig, ctx) -> dict:
    from pipeline.targets import onnxruntime as ort_target

    hf_dir = ctx.upstream("import")
    graph = ort_target.choose_graph(hf_dir, cfg.target.onnx_graph)
    ctx.log("building the fused Llama graph (GroupQueryAttention, in-place KV cache)" if graph == "fused"
            else "exporting the decoder with optimum-onnx (text-generation-with-past)")
    metrics = ort_target.export_decoder(hf_dir, ctx.out_dir, graph)
    ctx.log("comparing ONNX Runtime logits with transformers")
    diff = ort_target.compare_logits(hf_dir, ctx.out_dir / "model.onnx", list(CHECK_PROMPTS))
    limit = cfg.verify.max_export_logits_diff
    if diff > limit:
        raise StageError(NAME, f"ONNX Runtime logits differ from transformers' by {diff:.2e} (> verify.max_export_logits_diff {limit:.0e}); the export is wrong")
    ctx.log(f"max |logits difference| vs transformers: {diff:.2e} (limit {limit:.0e})")
    return {**metrics, "max_abs_logits_diff": diff}
