"""What the onnxruntime target knows of a Triton repository it built, for the shared serving tier: the checks of its
LLM model (`Target.repository_checks`: the engine directory it loads, with the tokenizer it streams text with) and the
LoRA adapters that model takes while serving (`Target.served_adapters`), both read from the model's parameters."""

from __future__ import annotations

from pathlib import Path

from tritonclient.grpc import model_config_pb2

from pipeline.adapter_registry import ServedAdapters, built_task_ids
from pipeline.triton.validate import RepoReport, missing_tokenizer_files, parameter

ENGINE_DIR = "engine_dir"  # the LLM model's parameter naming the engine directory


def check_llm_model(model_dir: Path, config: model_config_pb2.ModelConfig, report: RepoReport, where: str) -> None:
    """The engine directory an LLM model names exists and holds its config.json and tokenizer files (the model loads
    a tokenizer from it to hold back incomplete UTF-8 when streaming)."""
    engine = parameter(config, ENGINE_DIR)
    if engine is None:
        return
    if not Path(engine).is_dir():
        report.add(where, f"parameter '{ENGINE_DIR}' points to {engine}, which does not exist")
    for missing in missing_tokenizer_files(Path(engine)) if Path(engine).is_dir() else []:
        report.add(
            where,
            f"parameter '{ENGINE_DIR}': {missing} is missing (the model loads its tokenizer from {engine}); "
            "rebuild the engine stage (it copies the tokenizer files) or copy them there",
        )
    if not (Path(engine) / "config.json").is_file():
        report.add(where, f"engine directory {engine} has no config.json")


def served_adapters(report: RepoReport) -> ServedAdapters | None:
    """The adapters the repository's LLM model takes while serving, where its engine carries LoRA (None otherwise)."""
    from pipeline.targets.onnxruntime.runtime.lora_slots import engine_fit

    llm = next(
        (c for c in report.models.values() if ENGINE_DIR in c.parameters and "max_cpu_loras" in c.parameters), None
    )
    fit = engine_fit(Path(llm.parameters[ENGINE_DIR].string_value)) if llm is not None else None
    if fit is None:
        return None
    lora_dir = llm.parameters["lora_dir"].string_value
    return ServedAdapters(
        fit,
        built_task_ids(Path(lora_dir)) if lora_dir else {},
        int(llm.parameters["max_cpu_loras"].string_value),
        llm.parameters["evict_idle_adapters"].string_value.lower() == "true",
    )
