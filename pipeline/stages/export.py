"""Stage `export`: the imported (and, on trtllm, calibrated) checkpoint in the target's input format.

The target does the work (`Target.export`) and checks it: onnxruntime writes an ONNX decoder with KV
cache and compares its logits with transformers'; trtllm writes TensorRT-LLM and unified HF
checkpoints and checks every tensor against the release's format. When the target gates this stage
(`Target.gated_stage`: trtllm, whose engine needs a GPU), the quality gate (`pipeline.quality.gate`)
scores the checkpoint as the target runs it here (a CPU reference forward). Inputs: `model.dtype`,
`target`, `parallel`, `verify`, the `import` (and `quantize`) outputs.
"""

from __future__ import annotations

from pathlib import Path

from pipeline import quality
from pipeline.config import BuildConfig
from pipeline.targets import target_of

NAME = "export"
READS = ("model.dtype", "target", "parallel", "verify")
TOOLS: tuple[str, ...] = ()
SOURCES: tuple[Path, ...] = ()


def applies(cfg: BuildConfig) -> str | None:
    return target_of(cfg).skips(NAME, cfg)


def deps(cfg: BuildConfig) -> list[Path]:
    return []


def writes(cfg: BuildConfig) -> str:
    return target_of(cfg).writes(NAME, cfg)


def run(cfg: BuildConfig, ctx) -> dict:
    target = target_of(cfg)
    metrics = target.export(cfg, ctx)
    if target.gated_stage == NAME:
        metrics |= quality.gate(cfg, *target.scored(cfg, ctx.output, ctx.out_dir, ctx.log), ctx)
    return metrics
