"""Stage `quantize`: calibrate the imported model for the target's quantization (trtllm: NVIDIA ModelOpt).

Inputs: `quantization.*`, `target.name`, a local ModelOpt recipe file, the `import` output. Targets
that quantize elsewhere (onnxruntime: on the ONNX graph in `engine`) skip it, as does a config
without quantization.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import BuildConfig
from pipeline.targets import target_of

NAME = "quantize"
READS = ("quantization", "target.name")
TOOLS: tuple[str, ...] = ()
SOURCES: tuple[Path, ...] = ()


def applies(cfg: BuildConfig) -> str | None:
    return target_of(cfg).skips(NAME, cfg)


def deps(cfg: BuildConfig) -> list[Path]:
    """A local ModelOpt recipe file and a calibration text file are inputs (built-in recipes and texts change only
    with their pinned packages)."""
    recipe = cfg.quantization.modelopt_recipe
    recipes = [cfg.resolve_path(recipe)] if recipe and cfg.resolve_path(recipe).is_file() else []
    return recipes + calibration_file(cfg)


def calibration_file(cfg: BuildConfig) -> list[Path]:
    """The calibration text, where it is a file rather than a built-in text."""
    calibration = cfg.quantization.calibration
    if calibration is None or calibration.text.startswith("builtin:"):
        return []
    return [cfg.resolve_path(calibration.text)]


def writes(cfg: BuildConfig) -> str:
    return target_of(cfg).writes(NAME, cfg)


def run(cfg: BuildConfig, ctx) -> dict:
    return target_of(cfg).quantize(cfg, ctx)
