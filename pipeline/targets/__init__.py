"""Target adapters: how each backend (onnxruntime on CPU, trtllm on GPU) performs the export and engine stages."""

from importlib import import_module
from types import ModuleType


def adapter(target: str) -> ModuleType:
    """The adapter module for a target name (`onnxruntime`, `trtllm`)."""
    return import_module(f"pipeline.targets.{target}")
