"""Stage `triton_repo`: a Triton model repository (preprocessing, LLM, postprocessing, ensemble, BLS).

Inputs: `runtime`, `triton`, `target`, the engine. Runtime knobs are read only here, so changing
one re-runs only this stage. The repository refers to the engine directory by absolute path, as
`gpt_model_path` does in TensorRT-LLM deployments.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import BuildConfig

NAME = "triton_repo"
READS = ("runtime", "triton", "target")
TOOLS = ("tritonclient",)
TARGETS: tuple[str, ...] = ("onnxruntime", "trtllm")


def applies(cfg: BuildConfig) -> str | None:
    return None


def deps(cfg: BuildConfig) -> list[Path]:
    return []


def writes(cfg: BuildConfig) -> str:
    return "Triton model repository (config.pbtxt per model)"


def run(cfg: BuildConfig, ctx) -> dict:
    from pipeline.triton.repo import build_repo

    return build_repo(cfg, ctx.upstream("engine"), ctx.out_dir, ctx.log)
