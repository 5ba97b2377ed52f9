"""The adapters this package declares as entry points (pyproject.toml), read from its installed metadata."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from pipeline.errors import PipelineError


def declared(group: str) -> list[EntryPoint]:
    """The entry points of `group`, sorted by name. None at all means the package runs from a source tree that was
    never installed (only on PYTHONPATH), whose metadata declares nothing: that is named, with the fix, rather than
    surfacing later as an empty choice of targets."""
    found = sorted(entry_points(group=group), key=lambda entry: entry.name)
    if not found:
        source = Path(__file__).resolve().parents[1]
        raise PipelineError(
            f"no adapters are declared under the entry points {group!r}: the pipeline package at {source} is not "
            f"installed, so its pyproject.toml entry points are unknown; install it (`pip install -e {source}`, "
            "which `make build-engine` does) rather than putting it on PYTHONPATH"
        )
    return found
