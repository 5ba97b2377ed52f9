"""Registries of adapters this package declares as entry points (pyproject.toml): a name maps to "module:Class",
read from the installed metadata, so asking which names exist imports nothing, and the adapters load on first use.
A registry therefore sits below what it registers: a config can offer the names without importing any adapter."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Generic, TypeVar

from pipeline.errors import PipelineError

T = TypeVar("T")

# The groups (pyproject.toml's [project.entry-points]); another package adds a target by declaring in them.
TARGETS_GROUP = "trtllm_pipeline.targets"  # target name -> its Target class
TRTLLM_BACKENDS_GROUP = "trtllm_pipeline.trtllm_backends"  # target.trtllm_backend -> its TrtllmBackend class
DEPLOYMENTS_GROUP = "trtllm_pipeline.deployments"  # target name -> function(cfg) -> k8s Serving


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


def declared_names(group: str) -> list[str]:
    """The names declared under `group`, without importing any adapter."""
    return [entry.name for entry in declared(group)]


class Registry(Mapping[str, T], Generic[T]):
    """The classes declared under an entry-point group, each instantiated once, all on first lookup. Each must carry
    `required` attributes and a `name` equal to its entry point's: checked on first use, not mid-build."""

    def __init__(self, group: str, kind: str, required: tuple[str, ...]):
        self.group, self.kind, self.required = group, kind, ("name", *required)

    @functools.cached_property
    def _loaded(self) -> dict[str, T]:
        loaded = {}
        for entry in declared(self.group):
            cls = entry.load()
            missing = [attr for attr in self.required if not hasattr(cls, attr)]
            if missing:
                raise TypeError(f"{self.kind} {cls.__qualname__} lacks {', '.join(missing)}")
            if cls.name != entry.name:
                raise TypeError(
                    f"entry point {entry.name!r} names {self.kind} {cls.__qualname__}, whose name is {cls.name!r}"
                )
            loaded[entry.name] = cls()
        return loaded

    def names(self) -> list[str]:
        """The declared names, without loading any adapter."""
        return declared_names(self.group)

    def __getitem__(self, name: str) -> T:
        return self._loaded[name]

    def __iter__(self):
        return iter(self._loaded)

    def __len__(self) -> int:
        return len(self._loaded)
