"""Generate a Triton model repository from a built engine, as `ModelConfig` protobufs.

The target lays the repository out (`Target.triton_models`); most use tensorrtllm_backend's
`inflight_batcher_llm` layout (`inflight_batcher_models`): preprocessing, the target's LLM model,
postprocessing, ensemble and tensorrt_llm_bls. Configs are protobuf messages serialized with `text_format`,
never filled string templates, and the written repository is validated as a whole.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from google.protobuf import text_format

from pipeline.config import BuildConfig
from pipeline.errors import BuildStepError
from pipeline.paths import inside
from pipeline.triton import interface
from pipeline.triton.model_config import MODELS_DIR, ModelSpec, mc, model_config
from pipeline.triton.validate import ModelCheck, validate_repo

# The python models every repository copies (the LLM model comes from the target).
SHARED_MODEL_FILES = tuple(MODELS_DIR / name for name in ("preprocessing.py", "postprocessing.py", "bls.py"))


# LLM inputs a release's template calls by another name: TensorRT-LLM's release/1.2 templates name them min_tokens and
# seed (both fill SamplingConfig minLength / randomSeed, tensorrtllm_backend docs/model_config.md @ 854b349).
# Clients keep the v0.19 names on every release, so one client works against every deployment.
LLM_INPUT_ALIASES = {"min_length": "min_tokens", "random_seed": "seed"}


def llm_input_names(llm: mc.ModelConfig) -> dict[str, str]:
    """Our name -> the LLM model's, for the inputs it declares under an alias."""
    declared = {tensor.name for tensor in llm.input}
    return {ours: theirs for ours, theirs in LLM_INPUT_ALIASES.items() if ours not in declared and theirs in declared}


def client_inputs(llm: mc.ModelConfig) -> list[interface.Tensor]:
    """The ensemble's and BLS's inputs: every client input but the features the LLM model does not declare."""
    declared = {tensor.name for tensor in llm.input}
    return [row for row in interface.CLIENT_INPUTS if row[0] not in interface.LLM_FEATURE_INPUTS or row[0] in declared]


def ensemble(cfg: BuildConfig, max_batch_size: int, llm: mc.ModelConfig) -> mc.ModelConfig:
    t = cfg.triton
    names = {"preprocessing": t.preprocessing_name, "llm": t.llm_model_name, "postprocessing": t.postprocessing_name}
    config = model_config(
        t.ensemble_name,
        platform="ensemble",
        backend="",
        max_batch_size=max_batch_size,
        inputs=client_inputs(llm),
        outputs=interface.CLIENT_OUTPUTS,
    )
    llm_names, declared = llm_input_names(llm), {tensor.name for tensor in llm.input}
    for role, input_map, output_map in interface.ENSEMBLE_STEPS:
        if role == "llm":
            input_map = {
                llm_names.get(name, name): tensor
                for name, tensor in input_map.items()
                if name not in interface.LLM_FEATURE_INPUTS or name in declared
            }
        config.ensemble_scheduling.step.add(
            model_name=names[role], model_version=-1, input_map=input_map, output_map=output_map
        )
    return config


def shared_models(cfg: BuildConfig, engine_dir: Path, max_batch_size: int, llm: mc.ModelConfig) -> list[ModelSpec]:
    """Everything but the LLM model: the same for both targets, calling the LLM's inputs by its names."""
    t, r = cfg.triton, cfg.runtime
    common = dict(
        max_batch_size=max_batch_size, queue_delay_us=r.max_queue_delay_microseconds, max_queue_size=t.max_queue_size
    )
    return [
        ModelSpec(
            model_config(
                t.preprocessing_name,
                inputs=interface.PREPROCESSING_INPUTS,
                outputs=interface.PREPROCESSING_OUTPUTS,
                parameters={"tokenizer_dir": engine_dir, "add_special_tokens": True},
                instances=t.preprocessing_instance_count,
                **common,
            ),
            {"model.py": MODELS_DIR / "preprocessing.py"},
        ),
        ModelSpec(
            model_config(
                t.postprocessing_name,
                inputs=interface.POSTPROCESSING_INPUTS,
                outputs=interface.POSTPROCESSING_OUTPUTS,
                parameters={"tokenizer_dir": engine_dir, "skip_special_tokens": True},
                instances=t.postprocessing_instance_count,
                **common,
            ),
            {"model.py": MODELS_DIR / "postprocessing.py"},
        ),
        ModelSpec(
            model_config(
                t.bls_name,
                inputs=client_inputs(llm),
                outputs=interface.CLIENT_OUTPUTS,
                decoupled=True,
                parameters={
                    "tensorrt_llm_model_name": t.llm_model_name,
                    "preprocessing_model_name": t.preprocessing_name,
                    "postprocessing_model_name": t.postprocessing_name,
                    "accumulate_tokens": True,
                    "llm_input_names": json.dumps(llm_input_names(llm)),
                },
                instances=t.bls_instance_count,
                **common,
            ),
            {"model.py": MODELS_DIR / "bls.py"},
        ),
        ModelSpec(ensemble(cfg, max_batch_size, llm)),
    ]


def write_repo(specs: list[ModelSpec], out_dir: Path) -> None:
    """One directory per model, named by the config; refuses before writing anything if a name would lead
    outside `out_dir` (the config's name rule should have stopped it first)."""
    outside = [spec.config.name for spec in specs if not inside(out_dir, out_dir / spec.config.name)]
    if outside:
        raise BuildStepError(
            f"model name(s) {', '.join(map(repr, outside))} would write outside {out_dir}; use plain names "
            "(triton.*_name)"
        )
    for spec in specs:
        model_dir = out_dir / spec.config.name
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        (model_dir / "config.pbtxt").write_text(text_format.MessageToString(spec.config))
        for name, source in spec.files.items():
            shutil.copy2(source, model_dir / "1" / name)
        for name, text in spec.texts.items():
            (model_dir / "1" / name).write_text(text)


def inflight_batcher_models(cfg: BuildConfig, llm_model: ModelSpec, engine_dir: Path, engine: dict) -> list[ModelSpec]:
    """tensorrtllm_backend's inflight_batcher_llm layout around the target's LLM model.

    Args:
        engine: the engine's `config.json`, whose max_batch_size every model takes (not a re-typed number).
    """
    max_batch_size = engine["build_config"]["max_batch_size"]
    return [llm_model, *shared_models(cfg, engine_dir, max_batch_size, llm_model.config)]


def build_repo(
    cfg: BuildConfig,
    specs: list[ModelSpec],
    engine_dir: Path,
    engine: dict,
    out_dir: Path,
    checks: Sequence[ModelCheck] = (),
    log=print,
) -> dict:
    """Write and validate the repository the target laid out (with its `checks`); returns manifest metrics."""
    max_batch_size = engine["build_config"]["max_batch_size"]
    write_repo(specs, out_dir)
    report = validate_repo(out_dir, checks)
    if report.problems:
        raise BuildStepError("generated repository failed validation:\n  " + "\n  ".join(report.problems))
    log(f"{len(specs)} models: " + ", ".join(s.config.name for s in specs))
    return {"models": [s.config.name for s in specs], "engine_dir": str(engine_dir), "max_batch_size": max_batch_size}
