"""The two files that say which LoRA adapters a server holds, and their formats: one module owns both.

- The build's index, `adapters.json` in `<output>/lora/` (the `lora` stage writes it): {name: {task_id, rank, modules,
  float32_bytes, base_model}}, each adapter's PEFT files in `<output>/lora/<name>/`.
- The serving registry (`Registry`): the adapters the gateway's authenticated route adds while serving.

Triton's ports carry no authentication, so neither file is named by a request: the model reads the index from its
build's `lora_dir` parameter and the registry from an environment variable only `serve` sets.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.peft_adapters import Fit

INDEX = "adapters.json"
# Names the server's adapter registry file (`Registry`) to the model processes: set by `serve` in tritonserver's
# environment, which the python backend's model processes inherit and no Triton client can read or change.
REGISTRY_ENV = "TRTLLM_PIPELINE_LORA_REGISTRY"


@dataclass(frozen=True)
class ServedAdapters:
    """What a served repository's LLM model takes of the adapters the gateway adds (its target reads this from the
    model's parameters: `Target.served_adapters`)."""

    fit: Fit  # what the engine takes of an adapter
    built: dict[str, int]  # the build's adapters: name -> task id
    capacity: int  # adapters registered at once, the build's included
    evict_idle: bool  # a load past capacity replaces the least recently used idle adapter the gateway added


def read_index(lora_dir: Path) -> dict[str, dict]:
    """The build's adapters, {name: entry}, from `<lora_dir>/adapters.json`."""
    return json.loads((Path(lora_dir) / INDEX).read_text())


def write_index(lora_dir: Path, index: dict[str, dict]) -> None:
    (Path(lora_dir) / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def built_task_ids(lora_dir: Path) -> dict[str, int]:
    """{name: task id} of the build's adapters."""
    return {name: entry["task_id"] for name, entry in read_index(lora_dir).items()}


class Registry:
    """The adapters added while serving: a JSON file {name: {"path", "task_id"}} that `serve` owns, in its server's
    private work directory (REGISTRY_ENV names it). The gateway's authenticated route writes it; the LLM model reads
    it before taking a request. Triton's ports carry no authentication, so no request input can load files: a
    request only names (`lora_task_id`) an adapter that is already registered."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._seen: tuple | None = None

    @classmethod
    def from_env(cls) -> "Registry | None":
        value = os.environ.get(REGISTRY_ENV)
        return cls(Path(value)) if value else None

    def read(self) -> dict[str, dict]:
        return json.loads(self.path.read_text()) if self.path.is_file() else {}

    def write(self, entries: dict[str, dict]) -> None:
        """Replace the file at once (a reader sees the old list or the new one, never half of it)."""
        partial = self.path.with_name(f".{self.path.name}.partial")
        partial.write_text(json.dumps(entries))
        os.replace(partial, self.path)

    def changed(self) -> dict[str, dict] | None:
        """The entries when the file changed since the last call (a stat otherwise), else None."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return None
        seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if seen == self._seen:
            return None
        self._seen = seen
        return self.read()
