"""Stage `quantize`: calibrate the imported model with NVIDIA ModelOpt (target trtllm).

Inputs: `quantization.*`, `parallel.*`, the `import` output. The onnxruntime target quantizes
weights on the ONNX graph in the `engine` stage instead, so this stage is skipped there.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import BuildConfig

NAME = "quantize"
READS = ("quantization", "target.name")
TOOLS = ("nvidia-modelopt", "torch", "transformers")
TARGETS: tuple[str, ...] = ("trtllm",)


def applies(cfg: BuildConfig) -> str | None:
    if cfg.target.name == "onnxruntime":
        return "the onnxruntime target quantizes in the engine stage"
    if cfg.quantization.weights == "none" and cfg.quantization.kv_cache == "none":
        return "no quantization requested"
    return None


def deps(cfg: BuildConfig) -> list[Path]:
    """A local ModelOpt recipe file is an input (built-in recipes change only with the nvidia-modelopt version)."""
    recipe = cfg.quantization.modelopt_recipe
    return [cfg.resolve_path(recipe)] if recipe and cfg.resolve_path(recipe).is_file() else []


def writes(cfg: BuildConfig) -> str:
    return f"ModelOpt-calibrated model ({cfg.quantization.weights} weights, {cfg.quantization.kv_cache} KV cache)"


def run(cfg: BuildConfig, ctx) -> dict:
    import time

    from pipeline.config import CalibrationSection
    from pipeline.fetch import load_text
    from pipeline.targets import trtllm

    q = cfg.quantization
    if q.calibration is None:  # activation and KV-cache scales need data even for round-to-nearest weights
        q = q.model_copy(update={"calibration": CalibrationSection()})
    text = load_text(q.calibration.text, cfg.resolve_path("."), ctx.cache, ctx.log)
    ctx.log(f"ModelOpt: {q.weights} weights ({q.method}), {q.kv_cache} KV cache; {q.calibration.num_samples} samples x "
            f"{q.calibration.seq_len} tokens of {q.calibration.text}")
    started = time.perf_counter()
    model = trtllm.calibrate(ctx.upstream("import"), q, text, ctx.progress)
    trtllm.save_calibrated(model, ctx.out_dir)
    return {"calibration_seconds": round(time.perf_counter() - started, 1), "recipe": q.modelopt_recipe or "preset"}
