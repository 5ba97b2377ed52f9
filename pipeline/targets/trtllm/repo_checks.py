"""The trtllm target's checks of a Triton repository (`validate-repo`, `serve`, the `triton_repo` stage): the
C++ `tensorrtllm` models against what a release's backend reads without a fallback, and the `llmapi` model's
model.yaml against what the release's model.py and LLM API accept. Passed to `pipeline.triton.validate` as
`ModelCheck`s, so the generic validator knows no target."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from tritonclient.grpc import model_config_pb2

from pipeline.targets.trtllm.guided import config_problems as guided_config_problems
from pipeline.targets.trtllm.triton_cpp_backend import required_parameters
from pipeline.triton.validate import ModelCheck, RepoReport, missing_tokenizer_files, parameter

# How the tensorrtllm backend converts a parameter's string (ModelState::GetParameter<T> specialisations in
# inflight_batcher_llm/src/model_state.cc: std::stoi/stoul/stoll/stoull/stof, and these spellings of a bool).
_CPP_VALUE = {
    "int32_t": re.compile(r"\s*[+-]?\d+.*"),
    "uint32_t": re.compile(r"\s*\+?\d+.*"),
    "int64_t": re.compile(r"\s*[+-]?\d+.*"),
    "uint64_t": re.compile(r"\s*\+?\d+.*"),
    "float": re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?.*|\s*[+-]?(inf|nan).*", re.I),
    "bool": re.compile(r"True|true|TRUE|1|False|false|FALSE|0"),
}


def check_required_parameters(config: model_config_pb2.ModelConfig, version: str, report: RepoReport, where: str):
    """Every parameter the release's tensorrtllm backend reads without a fallback is present and converts to
    the type it is read as; otherwise the model fails to load on the GPU ("Cannot find parameter with name")."""
    for name, cpp_type in required_parameters(version).items():
        value = parameter(config, name)
        if value is None:
            report.add(
                where,
                f"parameter '{name}' is missing: TensorRT-LLM {version}'s tensorrtllm backend reads it without a "
                "fallback, so the model fails to load; add it (an empty string where it names an unused feature)",
            )
        elif cpp_type in _CPP_VALUE and not _CPP_VALUE[cpp_type].fullmatch(value):
            report.add(where, f"parameter '{name}' is {value!r}, which the backend cannot read as {cpp_type}")


def check_engine_release(config: model_config_pb2.ModelConfig, version: str, report: RepoReport, where: str) -> None:
    """The engine a tensorrtllm model loads was built by the release the repository targets."""
    engine = parameter(config, "gpt_model_path")
    if engine is not None and (Path(engine) / "config.json").is_file():
        built = json.loads((Path(engine) / "config.json").read_text()).get("version", "")
        if not built.startswith(version):
            report.add(
                where, f"engine {engine} was built by TensorRT-LLM {built}, but the repository targets {version}"
            )


def check_llmapi_model(model_yaml: Path, report: RepoReport, trtllm_version: str | None) -> None:
    """model.yaml against what the release's llmapi model.py reads and its LLM API accepts, and the model directory
    it names. The release is `trtllm_version`, else the one recorded next to that directory by our build."""
    from pipeline.targets.trtllm.llm_api_options import LLM_API_RELEASES, options_problems
    from pipeline.targets.trtllm.triton_llmapi_model import LLMAPI_RELEASES, llmapi_model, model_yaml_problems

    where = str(model_yaml)
    try:
        spec = yaml.safe_load(model_yaml.read_text())
    except yaml.YAMLError as exc:
        report.add(where, f"not valid YAML: {exc}")
        return
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), str):
        report.add(where, "needs `model:`, the checkpoint directory (or Hugging Face name) LLM() loads")
        return
    model = Path(spec["model"])
    if model.is_absolute() and not (model / "config.json").is_file():
        report.add(where, f"model: {model} has no config.json (rebuild the engine stage)")
    elif model.is_absolute():
        for missing in missing_tokenizer_files(model):
            report.add(where, f"model: {missing} is missing (the LLM loads its tokenizer from {model})")
    release = trtllm_version or recorded_release(model.parent / "config.json")
    if release is None:
        report.add(
            where,
            f"no TensorRT-LLM release to check it against (none recorded in {model.parent / 'config.json'}); "
            f"pass --trtllm-version, one of {', '.join(LLM_API_RELEASES)}",
        )
        return
    if release not in LLM_API_RELEASES or release not in LLMAPI_RELEASES:
        report.add(where, f"TensorRT-LLM {release} has no LLM-API llmapi model here ({', '.join(LLM_API_RELEASES)})")
        return
    for problem in model_yaml_problems(spec, release):
        report.add(where, problem)
    excluded = set(llmapi_model(release)["llm_kwargs"]["excluded_model_yaml_keys"])
    options = {key: value for key, value in spec.items() if key not in excluded and key != "model"}
    for key, message in options_problems(options, release):
        report.add(where, f"{'.'.join(key)}: {message}")


def recorded_release(record: Path) -> str | None:
    """The release our build recorded in the engine directory's config.json (None if it recorded none)."""
    try:
        recorded = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    return recorded.get("trtllm_version") if isinstance(recorded, dict) else None


def model_checks(trtllm_version: str | None) -> list[ModelCheck]:
    """The checks of a repository's TensorRT-LLM models against `trtllm_version` (None: only llmapi models, against
    the release their build recorded)."""

    def check(model_dir: Path, config: model_config_pb2.ModelConfig, report: RepoReport, where: str) -> bool:
        llmapi = (model_dir / "1" / "model.yaml").is_file()  # Triton's llmapi model: NVIDIA's container has model.py
        if llmapi:
            check_llmapi_model(model_dir / "1" / "model.yaml", report, trtllm_version)
        engine = parameter(config, "gpt_model_path") if config.backend == "tensorrtllm" else None
        if engine is not None and not (Path(engine) / "config.json").is_file():
            report.add(where, f"engine directory {engine} has no config.json")
        if trtllm_version and config.backend == "tensorrtllm":
            check_required_parameters(config, trtllm_version, report, where)
            parameters = {key: value.string_value for key, value in config.parameters.items()}
            for problem in guided_config_problems(parameters, trtllm_version):
                report.add(where, problem)
            check_engine_release(config, trtllm_version, report, where)
        return llmapi

    return [check]
