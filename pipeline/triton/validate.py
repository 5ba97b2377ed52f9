"""Offline checks of a Triton model repository, so a bad `config.pbtxt` fails here with its line and
field instead of in tritonserver's log as "failed to read text proto".

Used on every generated repository before it is written, and by `trtllm-pipeline validate-repo` on
any repository, hand-edited ones included. What only a backend's models need (a release's required parameters, an
LLM-API model.yaml) is checked by `ModelCheck`s its target passes in; this module knows no target.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pipeline.paths import inside, model_name_problem

PLACEHOLDER = re.compile(r"\$\{[^}]*\}")

# The parameter naming the directory the tokenizer models load a tokenizer from (AutoTokenizer.from_pretrained).
TOKENIZER_PARAMETER = "tokenizer_dir"
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


# A target's check of one model (its directory, parsed config, the report, where to report); it returns True when the
# files that serve the model are the target's to check (e.g. a model.py that NVIDIA's container supplies).
ModelCheck = Callable[[Path, model_config_pb2.ModelConfig, "RepoReport", str], bool | None]


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


def parameter(config: model_config_pb2.ModelConfig, key: str) -> str | None:
    return config.parameters[key].string_value if key in config.parameters else None


def missing_tokenizer_files(directory: Path) -> list[str]:
    """The files of TOKENIZER_NEEDS that `directory` lacks, as paths ("a or b" for alternatives)."""
    return [
        " or ".join(str(directory / name) for name in alternatives)
        for alternatives in TOKENIZER_NEEDS
        if not any((directory / name).is_file() for name in alternatives)
    ]


def check_model_files(
    name: str, config: model_config_pb2.ModelConfig, model_dir: Path, report: RepoReport, where: str, supplied: bool
) -> None:
    """What any model directory needs; `supplied`: a target's check vouches for the files that serve it."""
    if config.platform == "ensemble":
        return
    if not (model_dir / "1").is_dir():
        report.add(where, f"version directory {model_dir / '1'} is missing")
    if config.backend == "python" and not supplied and not (model_dir / "1" / "model.py").is_file():
        report.add(where, f"python backend model file {model_dir / '1' / 'model.py'} is missing")
    value = parameter(config, TOKENIZER_PARAMETER)
    if value is not None and not Path(value).is_dir():
        report.add(where, f"parameter '{TOKENIZER_PARAMETER}' points to {value}, which does not exist")
    elif value is not None:
        for missing in missing_tokenizer_files(Path(value)):
            report.add(
                where,
                f"parameter '{TOKENIZER_PARAMETER}': {missing} is missing (the model loads its tokenizer from "
                f"{value}); rebuild the engine stage (it copies the tokenizer files) or copy them there",
            )
    for key, value in config.parameters.items():
        if key.endswith("_model_name") and value.string_value:  # empty: unused (upstream's draft model name)
            check_reference(value.string_value, report, f"{where}: parameter '{key}'")


def validate_repo(repo: Path, checks: Sequence[ModelCheck] = ()) -> RepoReport:
    """Check every model of a repository, then run `checks` (its targets') on each; returns all problems found
    (empty when valid)."""
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
        by_targets = RepoReport(models=report.models)
        supplied = any([check(repo / name, config, by_targets, where) for check in checks])  # every check runs
        check_model_files(name, config, repo / name, report, where, supplied)
        report.problems += by_targets.problems
    return report
