"""Stage `engine`: the deployable engine directory, laid out like a TensorRT-LLM engine directory.

The target builds it (`Target.build_engine`): onnxruntime quantizes the ONNX graph and records
`config.json` (`version`, `pretrained_config`, `build_config`, so the Triton repository, the runner
and the benchmarks read limits from the engine); trtllm runs `trtllm-build`. When the target gates
this stage (`Target.gated_stage`), the quality gate (`pipeline.quality.gate`) scores what it built,
as the target runs it here (`Target.scored`). This stage adds the tokenizer files. Inputs: `build`,
`quantization`, `parallel`, `target`, `verify`, `runtime.cpu_threads` (scoring), the `import` and
`export` outputs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeline import quality
from pipeline.config import BuildConfig
from pipeline.models import SERVED_TOKENIZER_FILES
from pipeline.stages.quantize import calibration_file
from pipeline.targets import target_of

NAME = "engine"
READS = ("build", "quantization", "parallel", "target", "verify", "runtime.cpu_threads")
TOOLS: tuple[str, ...] = ()
SOURCES: tuple[Path, ...] = ()


def applies(cfg: BuildConfig) -> str | None:
    return target_of(cfg).skips(NAME, cfg)


def deps(cfg: BuildConfig) -> list[Path]:
    return calibration_file(cfg)  # GPTQ calibrates in this stage on the onnxruntime target


def writes(cfg: BuildConfig) -> str:
    return target_of(cfg).writes(NAME, cfg)


def run(cfg: BuildConfig, ctx) -> dict:
    target = target_of(cfg)
    metrics = target.build_engine(cfg, ctx)
    if target.gated_stage == NAME:
        metrics |= quality.gate(cfg, *target.scored(cfg, ctx.output, ctx.out_dir, ctx.log), ctx)
    hf_dir = ctx.upstream("import")
    for name in SERVED_TOKENIZER_FILES:
        if (hf_dir / name).exists():
            shutil.copy2(hf_dir / name, ctx.out_dir / name)
    return metrics
