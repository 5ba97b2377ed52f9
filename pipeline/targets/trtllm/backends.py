"""The registry of TensorRT-LLM backends, chosen by `target.trtllm_backend`; the build lock hashes it without
following it (pipeline.sources), so a stage hashes only the backend modules its target names."""

from __future__ import annotations

from pipeline.targets.trtllm.backend import TrtllmBackend
from pipeline.targets.trtllm.engine import EngineBackend
from pipeline.targets.trtllm.llmapi import LlmApiBackend

BACKENDS: dict[str, TrtllmBackend] = {backend.name: backend for backend in (LlmApiBackend(), EngineBackend())}
BACKEND_MODULES = ("pipeline.targets.trtllm.engine", "pipeline.targets.trtllm.llmapi")


def backend_of(cfg) -> TrtllmBackend:
    return BACKENDS[cfg.target.trtllm_backend]


def engine_backend(engine: dict) -> TrtllmBackend:
    """The backend that wrote an engine directory's `config.json` (trtllm-build's own has no `backend` key)."""
    return BACKENDS[engine.get("backend", "tensorrt")]
