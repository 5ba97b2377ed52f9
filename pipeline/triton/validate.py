"""Offline checks of a Triton model repository, so a bad `config.pbtxt` fails here with its line and
field instead of in tritonserver's log as "failed to read text proto".

Used on every generated repository before it is written, and by `trtllm-pipeline validate-repo` on
any repository, hand-edited ones included.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pipeline.paths import inside, model_name_problem
from pipeline.targets.trtllm.guided import config_problems as guided_config_problems
from pipeline.targets.trtllm.tensorrtllm_backend import required_parameters

PLACEHOLDER = re.compile(r"\$\{[^}]*\}")

# Parameters naming a directory the model loads a tokenizer from (AutoTokenizer.from_pretrained): the tokenizer
# models' tokenizer_dir, the onnxruntime LLM model's engine_dir (to hold back incomplete UTF-8 when streaming).
TOKENIZER_PARAMETERS = ("tokenizer_dir", "engine_dir")
# What AutoTokenizer needs of such a directory, measured on our builds by deleting each file in turn: without
# tokenizer.json (or a sentencepiece tokenizer.model) it cannot load; without tokenizer_config.json it loads
# another tokenizer class with other special-token rules.
TOKENIZER_NEEDS = (("tokenizer.json", "tokenizer.model"), ("tokenizer_config.json",))


@dataclass
class RepoReport:
    problems: list[str] = field(default_factory=list)
    models: dict[str, model_config_pb2.ModelConfig] = field(default_factory=dict)

    def add(self, where: str, message: str) -> None:
        self.problems.append(f"{where}: {message}")


def parse_model_config(text: str, where: str, report: RepoReport) -> model_config_pb2.ModelConfig | None:
    """Parse one config.pbtxt; unfilled `${...}` placeholders are reported with their line and key."""
    last_key = None  # parameters span lines: key: "x" ... string_value: "${x}"
    for number, line in enumerate(text.splitlines(), 1):
        key = re.search(r'key:\s*"([^"]+)"', line)
        last_key = key.group(1) if key else last_key
        for placeholder in PLACEHOLDER.findall(line):
            field = last_key if "string_value" in line else (re.search(r"(\w+)\s*:", line) or [None, None])[1]
            report.add(f"{where}:{number}", f"unfilled placeholder {placeholder}" + (f" in '{field}'" if field else ""))
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        report.add(f"{where}:{exc.GetLine()}", str(exc).split(" : ", 1)[-1])
        return None
    return config


def _tensors(tensors) -> dict[str, model_config_pb2.ModelInput]:
    return {t.name: t for t in tensors}


def check_ensemble(name: str, config: model_config_pb2.ModelConfig, report: RepoReport, where: str) -> None:
    """Every step's inputs come from the ensemble inputs or an earlier step; names and dtypes agree."""
    available = {t.name: t.data_type for t in config.input}
    for index, step in enumerate(config.ensemble_scheduling.step):
        step_where = f"{where}: step {index} ({step.model_name})"
        if not check_reference(step.model_name, report, step_where):
            continue
        model = report.models[step.model_name]
        inputs, outputs = _tensors(model.input), _tensors(model.output)
        for model_input, tensor in step.input_map.items():
            if model_input not in inputs:
                report.add(step_where, f"input_map key '{model_input}' is not an input of {step.model_name}")
            elif tensor not in available:
                report.add(
                    step_where,
                    f"input '{model_input}' reads '{tensor}', which no ensemble input or earlier step produces",
                )
            elif available[tensor] != inputs[model_input].data_type:
                report.add(
                    step_where,
                    f"'{tensor}' is {model_config_pb2.DataType.Name(available[tensor])} but "
                    f"{step.model_name}.{model_input} "
                    f"expects {model_config_pb2.DataType.Name(inputs[model_input].data_type)}",
                )
        for model_output, tensor in step.output_map.items():
            if model_output not in outputs:
                report.add(step_where, f"output_map key '{model_output}' is not an output of {step.model_name}")
            else:
                available[tensor] = outputs[model_output].data_type
        required = {n for n, t in inputs.items() if not t.optional}
        for missing in sorted(required - set(step.input_map)):
            report.add(step_where, f"required input '{missing}' of {step.model_name} is not mapped")
    for output in config.output:
        if output.name not in available:
            report.add(where, f"ensemble output '{output.name}' is produced by no step")
        elif available[output.name] != output.data_type:
            report.add(
                where,
                f"ensemble output '{output.name}' is declared {model_config_pb2.DataType.Name(output.data_type)} "
                f"but produced as {model_config_pb2.DataType.Name(available[output.name])}",
            )


def check_reference(name: str, report: RepoReport, where: str) -> bool:
    """A model another one calls (ensemble step, BLS parameter) must be a plain name of a model in the repository."""
    problem = model_name_problem(name)
    if problem:
        report.add(where, problem)
    elif name not in report.models:
        report.add(where, f"model '{name}' is not in the repository")
    return problem is None and name in report.models


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
        value = _parameter(config, name)
        if value is None:
            report.add(
                where,
                f"parameter '{name}' is missing: TensorRT-LLM {version}'s tensorrtllm backend reads it without a "
                "fallback, so the model fails to load; add it (an empty string where it names an unused feature)",
            )
        elif cpp_type in _CPP_VALUE and not _CPP_VALUE[cpp_type].fullmatch(value):
            report.add(where, f"parameter '{name}' is {value!r}, which the backend cannot read as {cpp_type}")


def _parameter(config: model_config_pb2.ModelConfig, key: str) -> str | None:
    return config.parameters[key].string_value if key in config.parameters else None


def missing_tokenizer_files(directory: Path) -> list[str]:
    """The files of TOKENIZER_NEEDS that `directory` lacks, as paths ("a or b" for alternatives)."""
    return [
        " or ".join(str(directory / name) for name in alternatives)
        for alternatives in TOKENIZER_NEEDS
        if not any((directory / name).is_file() for name in alternatives)
    ]


def check_model_files(
    name: str,
    config: model_config_pb2.ModelConfig,
    model_dir: Path,
    report: RepoReport,
    where: str,
    trtllm_version: str | None,
) -> None:
    if config.platform == "ensemble":
        return
    if not (model_dir / "1").is_dir():
        report.add(where, f"version directory {model_dir / '1'} is missing")
    if (model_dir / "1" / "model.yaml").is_file():  # Triton's llmapi model: model.py comes from NVIDIA's container
        check_llmapi_model(model_dir / "1" / "model.yaml", report, trtllm_version)
    elif config.backend == "python" and not (model_dir / "1" / "model.py").is_file():
        report.add(where, f"python backend model file {model_dir / '1' / 'model.py'} is missing")
    for key in TOKENIZER_PARAMETERS:
        value = _parameter(config, key)
        if value is not None and not Path(value).is_dir():
            report.add(where, f"parameter '{key}' points to {value}, which does not exist")
        elif value is not None:
            for missing in missing_tokenizer_files(Path(value)):
                report.add(
                    where,
                    f"parameter '{key}': {missing} is missing (the model loads its tokenizer from {value}); "
                    "rebuild the engine stage (it copies the tokenizer files) or copy them there",
                )
    for key, parameter in config.parameters.items():
        if key.endswith("_model_name") and parameter.string_value:  # empty: unused (upstream's draft model name)
            check_reference(parameter.string_value, report, f"{where}: parameter '{key}'")
    if trtllm_version and config.backend == "tensorrtllm":
        check_required_parameters(config, trtllm_version, report, where)
        parameters = {key: value.string_value for key, value in config.parameters.items()}
        for problem in guided_config_problems(parameters, trtllm_version):
            report.add(where, problem)
    engine = (
        _parameter(config, "gpt_model_path") if config.backend == "tensorrtllm" else _parameter(config, "engine_dir")
    )
    if engine is None:
        return
    engine_config = Path(engine) / "config.json"
    if not engine_config.is_file():
        report.add(where, f"engine directory {engine} has no config.json")
    elif trtllm_version and config.backend == "tensorrtllm":
        built = json.loads(engine_config.read_text()).get("version", "")
        if not built.startswith(trtllm_version):
            report.add(
                where, f"engine {engine} was built by TensorRT-LLM {built}, but the repository targets {trtllm_version}"
            )


def check_llmapi_model(model_yaml: Path, report: RepoReport, trtllm_version: str | None) -> None:
    """model.yaml against what the release's llmapi model.py reads and its LLM API accepts, and the model directory
    it names. The release is `trtllm_version`, else the one recorded next to that directory by our build."""
    from pipeline.targets.trtllm.llm_api_args import LLM_API_RELEASES, options_problems
    from pipeline.targets.trtllm.llmapi_model import LLMAPI_RELEASES, llmapi_model, model_yaml_problems

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


def validate_repo(repo: Path, trtllm_version: str | None = None) -> RepoReport:
    """Check every model of a repository; returns all problems found (empty when valid)."""
    report = RepoReport()
    dirs = sorted(p.parent for p in repo.glob("*/config.pbtxt"))
    if not dirs:
        report.add(str(repo), "no model directories with a config.pbtxt")
    for model_dir in dirs:
        where = str(model_dir / "config.pbtxt")
        if not inside(repo, model_dir):
            report.add(where, f"model directory resolves to {model_dir.resolve()}, outside the repository {repo}")
        config = parse_model_config((model_dir / "config.pbtxt").read_text(), where, report)
        if config is None:
            continue
        if config.name and config.name != model_dir.name:
            report.add(where, f"name '{config.name}' differs from its directory '{model_dir.name}'")
        report.models[model_dir.name] = config
    for name, config in report.models.items():
        where = str(repo / name / "config.pbtxt")
        if config.platform == "ensemble":
            check_ensemble(name, config, report, where)
        check_model_files(name, config, repo / name, report, where, trtllm_version)
    return report
