"""Adding and removing LoRA adapters while serving: what the gateway's authenticated routes
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) may do, and the registry file they write for the LLM model
(`pipeline.adapter_registry.Registry`).

Only the operator adds adapters: from directories `serve --allow-lora-dir` names (a path is resolved, symbolic links
included, before it is compared, and a refusal names only the allowed directories, never whether another path
exists), up to `lora.max_cpu_loras` registered at once; past it a load is refused, or, with
`lora.evict_idle_adapters`, takes the place of the adapter loaded while serving that the gateway used least recently
and is running none of its requests. An adapter is checked whole here, its safetensors header
against the engine before any tensor is read, then its weights (finite), so a bad one is a 400 naming the tensor and
never reaches the model. Task ids are never reused: a Triton client still naming an unloaded adapter's id is refused
rather than served another adapter.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.adapter_registry import Registry
from pipeline.errors import PipelineError
from pipeline.peft_adapters import Fit, load


@dataclass
class AdapterAdmin:
    """The served adapters of one repository: the build's (`built`, name -> task id, not removable) and those added
    while serving."""

    registry: Registry
    fit: Fit
    allowed_dirs: list[Path]
    capacity: int  # lora.max_cpu_loras
    built: dict[str, int]
    evict_idle: bool = False  # lora.evict_idle_adapters
    added: dict[str, dict] = field(default_factory=dict)  # name -> {"path", "task_id"}, as the registry holds them
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _last_task_id: int = 0
    _running: Counter = field(default_factory=Counter)  # name -> the gateway's requests on it now
    _used: dict[str, float] = field(default_factory=dict)  # name -> when the gateway last started a request on it

    def __post_init__(self):
        self.allowed_dirs = [Path(os.path.realpath(d)) for d in self.allowed_dirs]
        self._last_task_id = max(self.built.values(), default=0)

    def served(self) -> dict[str, int]:
        """Every adapter served: name -> Triton lora_task_id."""
        return self.built | {name: entry["task_id"] for name, entry in self.added.items()}

    def adapter_dir(self, lora_path: str) -> Path:
        """`lora_path` resolved, when it lies in an allowed directory. Raises ValueError saying what to fix."""
        allowed = ", ".join(map(str, self.allowed_dirs))
        if not self.allowed_dirs:
            raise ValueError(
                "this server loads no adapters while serving: start serve with --allow-lora-dir DIR to allow "
                "adapters from DIR"
            )
        if not Path(lora_path).is_absolute():
            raise ValueError(f"lora_path must be an absolute path in an allowed adapter directory ({allowed})")
        resolved = Path(os.path.realpath(lora_path))
        if not any(resolved.is_relative_to(d) for d in self.allowed_dirs):
            raise ValueError(f"lora_path is not in an allowed adapter directory ({allowed})")
        if not resolved.exists():
            raise ValueError(f"lora_path {lora_path} does not exist")
        if not resolved.is_dir():
            raise ValueError(f"lora_path {lora_path} is a file; a PEFT adapter is a directory")
        return resolved

    def add(self, name: str, lora_path: str) -> int:
        """Serve the adapter in `lora_path` as `name`; returns its task id. Raises ValueError (a 400) naming what
        is wrong: the name, the path, the cap or the adapter itself (its file and tensor)."""
        if name in self.served():
            raise ValueError(f"the model '{name}' is already served")
        path = self.adapter_dir(lora_path)
        try:  # read outside the lock: requests starting meanwhile only wait for the lock's short sections
            load(path, self.fit)  # header, then every weight: the model gets only adapters that fit
        except PipelineError as exc:
            raise ValueError(f"LoRA adapter {name!r}: {exc}") from None
        with self._lock:
            if name in self.served():  # loaded by a concurrent call meanwhile
                raise ValueError(f"the model '{name}' is already served")
            if len(self.served()) >= self.capacity:
                self._evict()
            self._last_task_id += 1
            self.added[name] = {"path": str(path), "task_id": self._last_task_id}
            self.registry.write(self.added)
            return self._last_task_id

    def _evict(self) -> None:
        """Make room for one more adapter (the caller holds the lock), or say why there is none."""
        full = f"{len(self.served())} adapters are served, lora.max_cpu_loras is {self.capacity}"
        if not self.evict_idle:
            raise ValueError(
                f"{full}: unload one (/v1/unload_lora_adapter), raise lora.max_cpu_loras and rebuild, or set "
                "lora.evict_idle_adapters"
            )
        idle = [name for name in self.added if not self._running[name]]
        if not idle:
            raise ValueError(f"{full}, and every adapter loaded while serving is running requests: retry shortly")
        del self.added[min(idle, key=lambda name: self._used.get(name, 0.0))]

    @contextlib.contextmanager
    def using(self, name: str):
        """Around a request the gateway forwards to adapter `name`: it is not evicted while the request runs."""
        with self._lock:
            self._running[name] += 1
            self._used[name] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._running[name] -= 1

    def remove(self, name: str) -> None:
        """Stop serving an adapter added while serving; requests already running on it finish."""
        with self._lock:
            if name in self.built:
                raise ValueError(f"'{name}' is one of the build's adapters (lora.adapters): remove it there, rebuild")
            if name not in self.added:
                raise ValueError(f"no adapter '{name}' was loaded; served adapters: {sorted(self.served()) or 'none'}")
            del self.added[name]
            self.registry.write(self.added)
