"""Generate a Triton model repository from a built engine, as `ModelConfig` protobufs.

Layout of tensorrtllm_backend's `inflight_batcher_llm`: preprocessing, the LLM model, postprocessing,
ensemble and tensorrt_llm_bls. Only the LLM model differs between targets; it comes from the target
adapter (`pipeline.targets.<target>.triton_llm_model`). Configs are protobuf messages serialized with
`text_format`, never filled string templates, and the written repository is validated as a whole.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.config import BuildConfig
from pipeline.triton import interface
from pipeline.triton.validate import validate_repo

MODELS_DIR = Path(__file__).parent / "models"


@dataclass
class ModelSpec:
    """One model directory: its config and the files of its version directory `1/`."""

    config: mc.ModelConfig
    files: dict[str, Path] = field(default_factory=dict)  # name in 1/ -> source file


def tensors(cls, table: list[interface.Tensor]) -> list:
    out = []
    for name, dtype, dims, optional in table:
        tensor = cls(name=name, data_type=mc.DataType.Value(dtype), dims=dims)
        if optional and cls is mc.ModelInput:
            tensor.optional = True
        out.append(tensor)
    return out


def model_config(name: str, *, max_batch_size: int, inputs, outputs, backend: str = "python", platform: str = "",
                 parameters: dict[str, object] | None = None, instances: int = 1, decoupled: bool = False,
                 queue_delay_us: int = 0, max_queue_size: int = 0) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, backend=backend, platform=platform, max_batch_size=max_batch_size,
                            input=tensors(mc.ModelInput, inputs), output=tensors(mc.ModelOutput, outputs))
    if platform != "ensemble":
        config.instance_group.add(count=instances, kind=mc.ModelInstanceGroup.KIND_CPU)
        config.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
        if max_queue_size:
            config.dynamic_batching.default_queue_policy.max_queue_size = max_queue_size
    if decoupled:
        config.model_transaction_policy.decoupled = True
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = str(value).lower() if isinstance(value, bool) else str(value)
    return config


def ensemble(cfg: BuildConfig, max_batch_size: int) -> mc.ModelConfig:
    t = cfg.triton
    names = {"preprocessing": t.preprocessing_name, "llm": t.llm_model_name, "postprocessing": t.postprocessing_name}
    config = model_config(t.ensemble_name, platform="ensemble", backend="", max_batch_size=max_batch_size,
                          inputs=interface.CLIENT_INPUTS, outputs=interface.CLIENT_OUTPUTS)
    for role, input_map, output_map in interface.ENSEMBLE_STEPS:
        config.ensemble_scheduling.step.add(model_name=names[role], model_version=-1, input_map=input_map, output_map=output_map)
    return config


def shared_models(cfg: BuildConfig, engine_dir: Path, max_batch_size: int) -> list[ModelSpec]:
    """Everything but the LLM model: the same for both targets."""
    t, r = cfg.triton, cfg.runtime
    common = dict(max_batch_size=max_batch_size, queue_delay_us=r.max_queue_delay_microseconds, max_queue_size=t.max_queue_size)
    return [
        ModelSpec(model_config(t.preprocessing_name, inputs=interface.PREPROCESSING_INPUTS, outputs=interface.PREPROCESSING_OUTPUTS,
                               parameters={"tokenizer_dir": engine_dir, "add_special_tokens": True},
                               instances=t.preprocessing_instance_count, **common),
                  {"model.py": MODELS_DIR / "preprocessing.py"}),
        ModelSpec(model_config(t.postprocessing_name, inputs=interface.POSTPROCESSING_INPUTS, outputs=interface.POSTPROCESSING_OUTPUTS,
                               parameters={"tokenizer_dir": engine_dir, "skip_special_tokens": True},
                               instances=t.postprocessing_instance_count, **common),
                  {"model.py": MODELS_DIR / "postprocessing.py"}),
        ModelSpec(model_config(t.bls_name, inputs=interface.CLIENT_INPUTS, outputs=interface.CLIENT_OUTPUTS, decoupled=True,
                               parameters={"tensorrt_llm_model_name": t.llm_model_name, "preprocessing_model_name": t.preprocessing_name,
                                           "postprocessing_model_name": t.postprocessing_name, "accumulate_tokens": True},
                               instances=t.bls_instance_count, **common),
                  {"model.py": MODELS_DIR / "bls.py"}),
        ModelSpec(ensemble(cfg, max_batch_size)),
    ]


def write_repo(specs: list[ModelSpec], out_dir: Path) -> None:
    for spec in specs:
        model_dir = out_dir / spec.config.name
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        (model_dir / "config.pbtxt").write_text(text_format.MessageToString(spec.config))
        for name, source in spec.files.items():
            shutil.copy2(source, model_dir / "1" / name)


def build_repo(cfg: BuildConfig, engine_dir: Path, out_dir: Path, log=print) -> dict:
    """Write and validate the repository for the engine in `engine_dir`; returns manifest metrics."""
    from pipeline.errors import StageError
    from pipeline.targets import adapter

    engine_dir = engine_dir.resolve()
    engine = json.loads((engine_dir / "config.json").read_text())
    max_batch_size = engine["build_config"]["max_batch_size"]  # the engine's own limit, not a re-typed number
    specs = [adapter(cfg.target.name).triton_llm_model(cfg, engine_dir, engine), *shared_models(cfg, engine_dir, max_batch_size)]
    write_repo(specs, out_dir)
    report = validate_repo(out_dir, cfg.target.trtllm_version if cfg.target.name == "trtllm" else None)
    if report.problems:
        raise StageError("triton_repo", "generated repository failed validation:\n  " + "\n  ".join(report.problems))
    log(f"{len(specs)} models: " + ", ".join(s.config.name for s in specs))
    return {"models": [s.config.name for s in specs], "engine_dir": str(engine_dir), "max_batch_size": max_batch_size}
