"""Stage `engine`: the deployable engine directory, laid out like a TensorRT-LLM engine directory.

The target builds it (`Target.build_engine`): onnxruntime quantizes the ONNX graph, records
`config.json` (`version`, `pretrained_config`, `build_config`, so the Triton repository, the runner
and the benchmarks read limits from the engine) and gates perplexity; trtllm runs `trtllm-build`.
This stage adds the tokenizer files. Inputs: `build`, `quantization`, `parallel`, `target`,
`verify`, `runtime.cpu_threads` (perplexity scoring), the `import` and `export` outputs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeline.config import BuildConfig
from pipeline.targets import target_of

NAME = "engine"
READS = ("build", "quantization", "parallel", "target", "verify", "runtime.cpu_threads")
TOOLS: tuple[str, ...] = ()
SOURCES: tuple[Path, ...] = ()

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def applies(cfg: BuildConfig) -> str | None:
    return target_of(cfg).skips(NAME, cfg)


def deps(cfg: BuildConfig) -> list[Path]:
    return []


def writes(cfg: BuildConfig) -> str:
    return target_of(cfg).writes(NAME, cfg)


def run(cfg: BuildConfig, ctx) -> dict:
    metrics = target_of(cfg).build_engine(cfg, ctx)
    hf_dir = ctx.upstream("import")
    for name in TOKENIZER_FILES:
        if (hf_dir / name).exists():
            shutil.copy2(hf_dir / name, ctx.out_dir / name)
    return metrics
