"""`BuildConfig`, the whole build config: one typed pydantic model of every section, which every stage reads, and the
views of it the CLI prints (the resolved YAML, the field paths, one value)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, PrivateAttr

from pipeline.config.deploy import DeploySection
from pipeline.config.lora_section import LoraSection
from pipeline.config.sections import (
    BuildSection,
    ModelSection,
    ParallelSection,
    QuantizationSection,
    RuntimeSection,
    Section,
    TargetSection,
    TritonSection,
    VerifySection,
)
from pipeline.errors import CheckpointError, PipelineError
from pipeline.models import BUILTIN_MODELS, ModelFacts, facts_from_gguf, facts_from_hf_dir


class BuildConfig(Section):
    """Everything a build needs, from checkpoint to Triton repository."""

    model: ModelSection = Field(default_factory=ModelSection)
    target: TargetSection = Field(default_factory=TargetSection)
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    build: BuildSection = Field(default_factory=BuildSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    triton: TritonSection = Field(default_factory=TritonSection)
    verify: VerifySection = Field(default_factory=VerifySection)
    deploy: DeploySection = Field(default_factory=DeploySection)
    lora: LoraSection | None = Field(
        None, description="LoRA adapters served over the base model (null: none; the engine takes no adapters)."
    )

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _source: Path | None = PrivateAttr(None)  # the YAML file it was loaded from
    _overrides: tuple[str, ...] = PrivateAttr(())  # the command line's key=value overrides merged over it

    @property
    def source(self) -> Path | None:
        return self._source

    @property
    def overrides(self) -> tuple[str, ...]:
        return self._overrides

    def resolve_path(self, path: str) -> Path:
        """Config paths are relative to the YAML file, so a config works from any working directory. A path that
        cannot be resolved (a symlink loop, an unknown ~user) is made absolute as written: its readers name why."""
        try:
            return (self._base_dir / Path(path).expanduser()).resolve()
        except (OSError, RuntimeError):
            return Path(os.path.abspath(self._base_dir / path))

    def model_facts(self) -> ModelFacts | None:
        """Hyperparameters of the configured model, read without loading weights (None if unreadable: the
        config's checkpoint rule reports why)."""
        if self.model.source == "builtin":
            builtin = BUILTIN_MODELS.get(self.model.name)
            return builtin.facts if builtin else None
        if self.model.path is None:
            return None
        path = self.resolve_path(self.model.path)
        try:
            return facts_from_hf_dir(path) if self.model.source == "hf" else facts_from_gguf(path)
        except CheckpointError:
            return None


def lora_adapters(cfg: BuildConfig) -> list:
    """The configured adapters read from their directories (`pipeline.peft_adapters.Adapter`), in order; an adapter that
    cannot be read is the PipelineError saying why."""
    from pipeline import peft_adapters

    out = []
    for section in cfg.lora.adapters if cfg.lora else []:
        try:
            out.append(peft_adapters.load(cfg.resolve_path(section.path)))
        except PipelineError as exc:
            out.append(exc)
    return out


# ---------------------------------------------------------------- display


def resolved_yaml(cfg: BuildConfig) -> str:
    """The full config with defaults filled in; keys the file did not set are marked '# default'."""
    lines: list[str] = []

    def emit(model: BaseModel, indent: int):
        for name in type(model).model_fields:
            value = getattr(model, name)
            pad = "  " * indent
            mark = "" if name in model.model_fields_set else "  # default"
            if isinstance(value, BaseModel):
                lines.append(f"{pad}{name}:{mark}")
                emit(value, indent + 1)
            else:
                plain = (
                    [v.model_dump(mode="json", exclude_none=True) if isinstance(v, BaseModel) else v for v in value]
                    if isinstance(value, list)
                    else value
                )
                dumped = yaml.safe_dump(plain, default_flow_style=True).strip().removesuffix("...").strip()
                lines.append(f"{pad}{name}: {dumped}{mark}")

    emit(cfg, 0)
    return "\n".join(lines) + "\n"


def leaf_field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every leaf field of a config model, e.g. 'runtime.streaming'."""
    paths = []
    for name, info in model.model_fields.items():
        sections = [
            a
            for a in getattr(info.annotation, "__args__", (info.annotation,))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        paths += leaf_field_paths(sections[0], f"{prefix}{name}.") if sections else [f"{prefix}{name}"]
    return paths


def dump_value(cfg: BuildConfig, dotted: str) -> Any:
    """JSON-ready value of a config path such as 'runtime' or 'model.dtype'."""
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    if isinstance(node, list):  # e.g. lora.adapters
        return [item.model_dump(mode="json") if isinstance(item, BaseModel) else item for item in node]
    return node.model_dump(mode="json") if isinstance(node, BaseModel) else node
