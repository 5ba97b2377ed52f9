"""Stage `lora`: the configured LoRA adapters, checked against the model and copied into `<output>/lora/<name>/`
with an index (`adapters.json`: name, task id, rank, modules, bytes), so the served repository refers to files of
the build, as it does to the engine.

Its own stage, after `engine`, so adding or retraining an adapter re-runs this stage and the repository, never the
engine. The target adds what its runtime needs beyond PEFT's files (`Target.convert_adapters`). Where the target can
run its engine here (`Target.scored_adapter`), each adapter passes the quality gate as the base model did: the engine
decoding with it against PEFT's merge of it into the fp32 model, on the evaluation text (`verify`'s perplexity, KL and
top-1 thresholds; not the chat set, whose fp32 answers take minutes per adapter). Inputs: `lora`, `verify`, the
adapter files, the import and engine outputs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeline import peft_adapters, quality
from pipeline.adapter_registry import INDEX, write_index
from pipeline.config import BuildConfig
from pipeline.config.schema import lora_adapters
from pipeline.errors import BuildStepError, PipelineError
from pipeline.targets import target_of

NAME = "lora"
READS = ("lora", "verify")
TOOLS = ("safetensors",)
SOURCES: tuple[Path, ...] = ()
AFTER = ("import", "engine")  # the model the adapters are checked against, and gated on


def applies(cfg: BuildConfig) -> str | None:
    if cfg.lora is None or not cfg.lora.adapters:
        return "no LoRA adapters configured"
    return target_of(cfg).skips(NAME, cfg)


def deps(cfg: BuildConfig) -> list[Path]:
    if cfg.lora is None:
        return []
    return [
        cfg.resolve_path(a.path) / name
        for a in cfg.lora.adapters
        for name in (peft_adapters.ADAPTER_CONFIG, peft_adapters.ADAPTER_WEIGHTS)
    ]


def writes(cfg: BuildConfig) -> str:
    return f"one PEFT directory per adapter and {INDEX}" + (
        f"; {extra}" if (extra := target_of(cfg).writes(NAME, cfg)) else ""
    )


def run(cfg: BuildConfig, ctx) -> dict:
    from pipeline.models import facts_from_hf_dir

    facts = facts_from_hf_dir(ctx.upstream("import"))
    index = {}
    for section, task_id, adapter in zip(cfg.lora.adapters, cfg.lora.task_ids(), lora_adapters(cfg)):
        if isinstance(adapter, PipelineError):
            raise BuildStepError(f"lora.adapters {section.name!r}: {adapter}")
        problems = peft_adapters.problems(adapter, facts, cfg.lora.max_lora_rank, cfg.lora.target_modules)
        if problems:
            raise BuildStepError(f"lora.adapters {section.name!r} ({adapter.path}): {'; '.join(problems)}")
        (ctx.out_dir / section.name).mkdir()
        for name in (peft_adapters.ADAPTER_CONFIG, peft_adapters.ADAPTER_WEIGHTS):
            shutil.copy2(adapter.path / name, ctx.out_dir / section.name / name)
        index[section.name] = {
            "task_id": task_id,
            "rank": adapter.rank,
            "modules": adapter.modules,
            "float32_bytes": adapter.nbytes(),
            "base_model": adapter.base_model,
        }
        ctx.log(f"adapter {section.name} (task id {task_id}): rank {adapter.rank} on {', '.join(adapter.modules)}")
    write_index(ctx.out_dir, index)
    target = target_of(cfg)
    metrics = {"adapters": len(index)} | target.convert_adapters(cfg, ctx)
    text_only = cfg.model_copy(update={"verify": cfg.verify.model_copy(update={"min_chat_answer_match": None})})
    for name in index:
        scored = target.scored_adapter(cfg, ctx.output, name, ctx.out_dir / name)
        if scored is not None:
            metrics[f"gate_{name}"] = quality.gate(text_only, *scored, ctx)
    return metrics
