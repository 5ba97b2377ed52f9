"""Facts read from upstream sources: names, types, defaults, what a consumer requires; one JSON table per subject.

`scripts/dev/tabulate_all.py` writes every table from the sources it cites by repository, path and commit; none of
them holds upstream text. A table keyed by release (`releases`) stores a block that several releases share once:
a release is then `{"same_as": R}` or `{"based_on": R, "patch": [...]}`, an RFC 6902 JSON Patch of R's facts.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jsonpatch

from pipeline.errors import PipelineError

TABLES = Path(__file__).parent
TABULATE = "scripts/dev/tabulate_all.py"  # not tabulate.py: on sys.path it would shadow the tabulate package


class NotTabulated(PipelineError):
    """A table holds no facts for the release asked for: the message names the table and the releases it has."""


@cache
def facts(name: str) -> dict:
    """Table `name` (pipeline/upstream/<name>.json), its shared release blocks resolved."""
    table = json.loads((TABLES / f"{name}.json").read_text(encoding="utf-8"))
    if "releases" in table:
        table["releases"] = resolved_releases(table["releases"])
    return table


def resolved_releases(stored: dict[str, dict]) -> dict[str, dict]:
    """Every release's whole facts from the stored blocks."""
    return {release: _resolved(stored, release) for release in stored}


def _resolved(stored: dict, release: str) -> dict:
    block = stored[release]
    if "same_as" in block:
        return _resolved(stored, block["same_as"])
    if "based_on" in block:
        return jsonpatch.apply_patch(_resolved(stored, block["based_on"]), block["patch"])
    return block


def releases(name: str) -> tuple[str, ...]:
    """The releases table `name` holds facts for, oldest first."""
    return tuple(sorted(facts(name)["releases"], key=lambda v: tuple(map(int, v.split(".")))))


def release_facts(name: str, release: str, subject: str) -> dict:
    """The facts of `release` in table `name`; `subject` says what they are about, for the error."""
    table = facts(name)["releases"]
    if release not in table:
        raise NotTabulated(
            f"{subject} is not tabulated for TensorRT-LLM {release} (tabulated: {', '.join(releases(name))}): "
            f"target one of those, or tabulate it with {TABULATE} --only {name}"
        )
    return table[release]


def compact(table: dict) -> str:
    """A table as stored: one line per top-level key (and per release), compact inside, so diffs stay readable."""

    def line(value) -> str:
        return json.dumps(value, separators=(",", ":"))

    parts = []
    for key, value in table.items():
        if key == "releases":
            inner = ",\n".join(f"  {line(release)}:{line(block)}" for release, block in value.items())
            parts.append(f' "releases":{{\n{inner}\n }}')
        else:
            parts.append(f" {line(key)}:{line(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"
