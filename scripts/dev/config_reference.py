"""Write docs/configuration.md from the config schema (`pipeline.config.BuildConfig`), so the reference cannot drift.

Every field of every section with its dotted key, type, allowed values, default, the targets (and trtllm backends)
that honour it and its description; the target names, summaries and the trtllm backends' releases come from the
target registry. `--check` compares instead of writing (tests/test_docs.py runs it):

    python scripts/dev/config_reference.py           # rewrite docs/configuration.md
    python scripts/dev/config_reference.py --check   # exit 1 when it differs from the schema
"""

from __future__ import annotations

import argparse
import difflib
import sys
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.config import BuildConfig  # noqa: E402
from pipeline.targets import TARGETS, honoured  # noqa: E402

REFERENCE = REPO / "docs" / "configuration.md"
REGENERATE = "python scripts/dev/config_reference.py"

HEADER = f"""\
# Configuration reference

Every key a build config (`build_configs/*.yaml`) may set, with its type, default and the targets that read it.
Generated from the schema (`pipeline.config.BuildConfig`) and the target registry by
`{REGENERATE}`; do not edit it by hand (`tests/test_docs.py` fails when it differs from the schema).

How a config is read: unknown keys are refused with a "did you mean" suggestion; paths are relative to the config
file; `key=value` arguments after the config on the command line override the YAML (e.g.
`trtllm-pipeline validate build_configs/smollm2-135m-cpu.yaml quantization.weights=int4`), and `trtllm-pipeline
validate CONFIG` prints every field resolved, defaults marked. A field set for a target that does not honour it
(column "honoured by") is a `validate` error naming the field, the target and the option that would read it.
The rules between fields are in [the pipeline page](pipeline.md#build-configs).
"""


def targets_table() -> list[str]:
    lines = ["## Targets", "", "`target.name` picks one of the registered targets:", ""]
    lines += ["| target | what it builds |", "|---|---|"]
    lines += [f"| `{name}` | {cell(target.summary)} |" for name, target in sorted(TARGETS.items())]
    lines += ["", "Target `trtllm` deploys through one of its backends (`target.trtllm_backend`):", ""]
    lines += ["| backend | what it deploys | TensorRT-LLM releases (`target.trtllm_version`) |", "|---|---|---|"]
    lines += [
        f"| `{backend.name}` | {cell(backend.summary)} | {', '.join(backend.releases)} |"
        for backend in TARGETS["trtllm"].backends.values()
    ]
    return lines


def registry_choices() -> dict[str, list[str]]:
    """Fields whose allowed values the registry holds rather than a `Literal` of the schema."""
    backends = TARGETS["trtllm"].backends
    releases = {release for backend in backends.values() for release in backend.releases}
    return {
        "target.trtllm_backend": list(backends),
        "target.trtllm_version": sorted(releases, key=lambda release: tuple(map(int, release.split(".")))),
    }


def section_of(annotation) -> type[BaseModel] | None:
    """The section model a field holds (directly, optionally or as list items), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(section_of, typing.get_args(annotation))), None)


def type_name(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        named = [type_name(arg) for arg in args if arg is not type(None)]
        return " or ".join(named + ["null"] * (type(None) in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{value}`" for value in args)
    if origin is list:
        return "list of entries (keys below)" if section_of(args[0]) else f"list of {type_name(args[0])}"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section (keys below)"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}[annotation]


BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def bounds(field) -> str:
    said = []
    for rule in field.metadata:
        said += [f"{sign} {getattr(rule, bound)}" for bound, sign in BOUNDS.items() if hasattr(rule, bound)]
        if isinstance(rule, annotated_types.MaxLen):
            said.append(f"at most {rule.max_length} entries")
    return f" ({', '.join(said)})" if said else ""


def default(field) -> str:
    if field.default_factory is not None:
        made = field.default_factory()
        return "" if isinstance(made, BaseModel) else f"`{literal(made)}`"
    if field.default is PydanticUndefined:
        return "required"
    return f"`{literal(field.default)}`"


def literal(value) -> str:
    """A default as YAML spells it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {literal(item)}" for key, item in value.items()) + "}"
    return str(value)


def honoured_by(paths: list[str]) -> str:
    """The targets (and their backends) that honour any of the dotted `paths`."""
    readers = []
    for name, target in sorted(TARGETS.items()):
        if not any(honoured(path, target.honours) for path in paths):
            continue
        backends = getattr(target, "backends", None) or {}
        reading = [
            backend.name for backend in backends.values() if any(honoured(path, backend.honours) for path in paths)
        ]
        readers.append(f"{name} ({', '.join(reading)})" if backends else name)
    return ", ".join(readers) or "none"


def leaves(section: type[BaseModel], prefix: str) -> list[str]:
    """The dotted paths of a section's fields, nested sections' fields in place of the sections (no list markers:
    `honours` names a list's field, not its items')."""
    paths = []
    for name, field in section.model_fields.items():
        inner = section_of(field.annotation)
        is_list = typing.get_origin(field.annotation) is list
        paths += leaves(inner, f"{prefix}.{name}") if inner and not is_list else [f"{prefix}.{name}"]
    return paths


def cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def rows(section: type[BaseModel], prefix: str, choices: dict[str, list[str]], honoured_as: str) -> list[str]:
    """Table rows of a section's fields under `prefix` (`honoured_as`: the same path without list markers)."""
    lines = []
    for name, field in section.model_fields.items():
        path, lookup = f"{prefix}.{name}", f"{honoured_as}.{name}"
        inner = section_of(field.annotation)
        is_list = typing.get_origin(field.annotation) is list
        kind = (
            "one of " + ", ".join(f"`{value}`" for value in choices[path])
            if path in choices
            else type_name(field.annotation)
        )
        readers = honoured_by(leaves(inner, lookup) if inner and not is_list else [lookup])
        description = field.description or (inner.__doc__ if inner else None)
        lines.append(
            f"| `{path}` | {cell(kind + bounds(field))} | {default(field)} | {readers} | {cell(description)} |"
        )
        if inner is not None:
            lines += rows(inner, f"{path}[]" if is_list else path, choices, honoured_as=lookup)
    return lines


def render() -> str:
    choices = registry_choices()
    lines = [HEADER.rstrip("\n"), "", *targets_table()]
    for name, field in BuildConfig.model_fields.items():
        section = section_of(field.annotation)
        lines += ["", f"## `{name}`", ""]
        if section.__doc__:
            lines += [cell(section.__doc__), ""]
        lines += ["| key | type | default | honoured by | description |", "|---|---|---|---|---|"]
        lines += rows(section, name, choices, honoured_as=name)
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when docs/configuration.md differs from the schema"
    )
    args = parser.parse_args()
    text = render()
    if not args.check:
        REFERENCE.write_text(text)
        print(f"wrote {REFERENCE.relative_to(REPO)}")
        return 0
    current = REFERENCE.read_text() if REFERENCE.is_file() else ""
    if current == text:
        return 0
    diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "docs/configuration.md", "schema", lineterm="")
    print("\n".join(list(diff)[:40]))
    print(f"docs/configuration.md is out of date with pipeline.config.BuildConfig; regenerate it: {REGENERATE}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
