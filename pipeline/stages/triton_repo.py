"""Stage `triton_repo`: a Triton model repository (preprocessing, LLM, postprocessing, ensemble, BLS).

The target lays out its models (`Target.triton_models`); writing and validating them is the same for all.
Inputs: `runtime`, `triton`, `target`, the engine's `config.json`, the python models copied into the
repository. Runtime knobs are read here, so changing one re-runs only this stage (for trtllm's PyTorch backend,
those its LLM-API options hold re-run `engine` too, which writes them). The repository
refers to the engine directory by absolute path, as `gpt_model_path` does in TensorRT-LLM deployments.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.config import BuildConfig
from pipeline.targets import target_of
from pipeline.triton.repo import SHARED_MODEL_FILES, build_repo

NAME = "triton_repo"
READS = ("runtime", "triton", "target")
TOOLS = ("tritonclient", "protobuf")
SOURCES: tuple[Path, ...] = SHARED_MODEL_FILES


def applies(cfg: BuildConfig) -> str | None:
    return target_of(cfg).skips(NAME, cfg)


def deps(cfg: BuildConfig) -> list[Path]:
    return []


def writes(cfg: BuildConfig) -> str:
    return target_of(cfg).writes(NAME, cfg)


def run(cfg: BuildConfig, ctx) -> dict:
    return write(cfg, ctx.upstream("engine"), ctx.out_dir, ctx.log)


def write(cfg: BuildConfig, engine_dir: Path, out_dir: Path, log=print) -> dict:
    """The repository for the engine in `engine_dir`, its limits read from the engine's config.json."""
    engine_dir = engine_dir.resolve()
    engine = json.loads((engine_dir / "config.json").read_text())
    target = target_of(cfg)
    specs = target.triton_models(cfg, engine_dir, engine)
    checks = target.repository_checks(cfg.target.model_dump())
    return build_repo(cfg, specs, engine_dir, engine, out_dir, checks, log)
